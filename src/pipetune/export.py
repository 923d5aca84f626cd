"""`pipetune export`: a run as a directory that plain transformers + PEFT (and vLLM's LoRA loading) use as is.

    pipetune export --run runs/demo --out exported [--merge] [--gguf [TYPE]]

    exported/
      README.md      model card: the run, the exact prompt, and code that builds it and generates
      prompt.json    the prompt settings (also in the run directory): template token ids, cleaning and cut rules, caps
      config.toml    the run's settings (dtype, lengths, prompt): `pipetune summarize --adapter exported/adapter`
      adapter/       the PEFT adapter, base_model_name_or_path pointing at the base, with the tokenizer
      base/          a base that exists nowhere else as a checkpoint: a random-init one (config.json, weights,
                     tokenizer), or a GGUF file's (the de-quantized weights pipetune trained on, and its tokenizer)
      merged/        with --merge: the base with the adapter merged in, with the tokenizer
      model-f16.gguf with --gguf [TYPE]: the merged model as one GGUF file, and a Modelfile for Ollama
                     (export_gguf.py)

A hub or local checkpoint base is referenced by its id or absolute path, not copied; config.toml names the
tokenizer saved in adapter/ when the run set model.tokenizer. A quantized run's base (model.quantize) is read and
written unquantized, so an export needs no FP8 GPU or torchao; config.toml keeps the setting. The prompt is the chat
template rendered around the transcript, cleaned as training cleans it (stripped, cut by characters) and
with its middle cut to fit, as pipetune builds it in training and inference; prompt.json carries its token
ids, so code without pipetune builds the very same prompt. The export is written whole or not at all, after
the adapter was checked against the tensors its adapter_config.json names.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from pipetune.config import Config, ConfigError, save_config
from pipetune.data.prompt import PROMPT_FILE, prompt_settings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # model/lora.py's name, which PEFT reads


def check_export_paths(run_dir: Path, out: Path) -> None:
    """A finished run, and an --out that is new (or empty) and outside the run directory."""
    if not (run_dir / "adapter" / ADAPTER_CONFIG).is_file() or not (run_dir / "config.toml").is_file():
        raise ConfigError(
            f"--run {str(run_dir)!r} has no adapter/ or config.toml; give the directory of a finished training run"
        )
    run_abs, out_abs = run_dir.resolve(), out.resolve()
    if out_abs == run_abs or run_abs in out_abs.parents:
        raise ConfigError(
            f"--out {str(out)!r} ({out_abs}) is {'' if out_abs == run_abs else 'inside '}--run {str(run_dir)!r} "
            f"({run_abs}); an export copies the "
            f"run's files, so it goes outside the run: choose e.g. --out {run_abs.parent / (run_abs.name + '-export')}"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty directory; choose a new directory")


def check_adapter(adapter_dir: Path, model_config: Any, what: str) -> None:
    """The adapter's safetensors file parses and holds exactly the LoRA tensors (names and shapes) that its
    adapter_config.json names for the base model `model_config`; a ConfigError naming the file otherwise."""
    import peft
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pipetune.generate import read_adapter_config

    weights = adapter_dir / ADAPTER_WEIGHTS
    fix = f"restore {adapter_dir} as training wrote it, or train the run again"
    read_adapter_config(adapter_dir)
    if not weights.is_file():
        raise ConfigError(f"{what}: {weights} is missing, so the export would have no weights; {fix}")
    try:
        with safe_open(weights, "pt") as f:
            saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # SafetensorError for a cut or damaged file, OSError for an unreadable one
        raise ConfigError(f"{what}: {weights} is damaged or cut short ({type(e).__name__}: {e}); {fix}") from None
    try:
        lora = peft.LoraConfig.from_pretrained(str(adapter_dir))
        shape = model_config.__class__.from_dict(model_config.to_dict())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape)
            model.name_or_path = lora.base_model_name_or_path  # else PEFT warns that it renames it
            model = peft.get_peft_model(model, lora)
        expected = {
            name: tuple(tensor.shape)
            for name, tensor in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()
        }
    except Exception as e:  # PEFT's errors for a config that names modules the model lacks, and the like
        raise ConfigError(
            f"{what}: {adapter_dir / ADAPTER_CONFIG} does not describe an adapter of this base model "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); {fix}"
        ) from None
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    wrong = sorted(name for name in expected.keys() & saved.keys() if saved[name] != expected[name])
    if missing or unexpected or wrong:
        problems = [
            f"{len(found)} {kind} (first: {found[0]}{detail(found[0])})"
            for kind, found, detail in (
                ("missing", missing, lambda _: ""),
                ("not named by it", unexpected, lambda _: ""),
                ("of the wrong shape", wrong, lambda n: f" {list(saved[n])}, expected {list(expected[n])}"),
            )
            if found
        ]
        raise ConfigError(
            f"{what}: {weights} does not hold the {len(expected)} LoRA tensors its {ADAPTER_CONFIG} names: "
            f"{'; '.join(problems)}; {fix}"
        )


def export_run(run_dir: Path, out: Path, merge: bool = False, gguf_type: str | None = None) -> Path:
    """Write the export directory for a finished run, whole or not at all; return its path. `gguf_type` (f16, ...):
    also the merged model as one GGUF file and an Ollama Modelfile (export_gguf.py)."""
    import torch
    from peft import PeftModel
    from transformers import GenerationConfig
    from transformers.utils import logging as transformers_logging

    from pipetune.files import write_atomic_dir
    from pipetune.generate import inference_config, stop_ids
    from pipetune.model.gguf import gguf_source
    from pipetune.model.load import DTYPES, build_model
    from pipetune.preflight import prepare

    check_export_paths(run_dir, out)
    adapter_dir = run_dir / "adapter"
    transformers_logging.disable_progress_bar()  # save_pretrained's bars, per shard
    config = inference_config(adapter_dir).config
    # The export reads and writes the base unquantized: no quantization hardware or library needed, whatever
    # model.quantize the run trained with (its config.toml keeps it, for `pipetune summarize`).
    prepared = prepare(dataclasses.replace(config, model=dataclasses.replace(config.model, quantize="none")))
    if gguf_type is not None:
        from pipetune.export_gguf import check_gguf_export

        check_gguf_export(config, prepared.model.config, prepared.tokenizer, gguf_type)
    check_adapter(adapter_dir, prepared.model.config, f"--run {str(run_dir)!r}")
    settings = prompt_settings(prepared.prompts, config)
    final = out.resolve()
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=config.data.max_summary_tokens,
        eos_token_id=stop_ids(settings["stop_ids"][0], prepared.tokenizer),
        pad_token_id=prepared.pad_id,
    )
    gguf = gguf_source(config.model.name)
    # A random-init base and a GGUF file's are checkpoints nowhere else that transformers reads: written to base/.
    writes_base = prepared.model.weights_dir is None or gguf is not None
    if writes_base:
        base_ref = str(final / "base")
    else:  # a hub id stays one; a local directory (~ expanded) becomes an absolute path
        local = Path(config.model.name).expanduser()
        base_ref = str(local.resolve()) if local.is_dir() else config.model.name
    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    adapter_config["base_model_name_or_path"] = base_ref
    run = _read_json(run_dir / "run.json")

    def build(staging: Path) -> None:
        base = None
        if writes_base or merge or gguf_type:
            dtype = DTYPES[config.model.dtype]
            base, _ = build_model(prepared.model, dtype, torch.device("cpu"), seed=config.train.seed)
            base.config.use_cache = True  # pipetune trains without a KV cache; generation wants one
        if writes_base:
            _save_model(base, staging / "base", prepared.tokenizer, generation)
        shutil.copytree(adapter_dir, staging / "adapter")
        (staging / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
        prepared.tokenizer.save_pretrained(staging / "adapter")
        (staging / PROMPT_FILE).write_text(json.dumps(settings, indent=1, ensure_ascii=False) + "\n")
        save_config(export_config(config, base_ref, writes_base, final), staging / "config.toml")
        if merge or gguf_type:
            merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        if merge:
            _save_model(merged, staging / "merged", prepared.tokenizer, generation)
        external = None if writes_base else base_ref
        card = model_card(config, settings, external, gguf, run, merge, adapter_config["r"])
        if gguf_type:
            from pipetune.export_gguf import write_gguf_files

            card += write_gguf_files(staging, merged, prepared.tokenizer, settings, config, gguf_type)
        (staging / "README.md").write_text(card)

    write_atomic_dir(final, build, complete="README.md")
    return final


def export_config(config: Config, base_ref: str, writes_base: bool, final: Path) -> Config:
    """The run's config as the export's config.toml: its data, prompt, dtype, seed and quantization, with the
    export's base and tokenizer (`final`: the export directory), not paths of the machine or directory it ran in."""
    from copy import deepcopy

    exported = deepcopy(config)
    exported.model.name = base_ref
    if writes_base:  # base/ holds the weights and the tokenizer the run trained with
        exported.model.init = "pretrained"
        exported.model.tokenizer = ""
    elif exported.model.tokenizer:  # the run's own tokenizer, saved in adapter/ (a relative path held elsewhere)
        exported.model.tokenizer = str(final / "adapter")
    return exported


def _save_model(model: Any, directory: Path, tokenizer: Any, generation: Any) -> None:
    model.generation_config = generation
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _read_json(path: Path) -> dict[str, Any]:
    """The run's facts for the card; {} when the file is missing or damaged (the card then leaves them out)."""
    try:
        loaded = json.loads(path.read_bytes()) if path.is_file() else {}
    except (ValueError, RecursionError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


PROMPT_CODE = """\
import json

from tokenizers import Tokenizer
from transformers import AutoTokenizer

EXPORT = "."  # this directory: run from it, or set its path here
settings = json.load(open(f"{EXPORT}/prompt.json"))
tokenizer = AutoTokenizer.from_pretrained(f"{EXPORT}/adapter")
# Text is data: an added token's text inside it ("<think>", "<|im_end|>") is encoded as ordinary tokens, never as
# the control token (Qwen3 does not flag <think> special, so split_special_tokens alone leaves it whole).
spec = json.loads(tokenizer.backend_tokenizer.to_str())
for token in spec.get("added_tokens", []):
    token["special"] = True
text_tokenizer = Tokenizer.from_str(json.dumps(spec))
text_tokenizer.no_truncation()
text_tokenizer.no_padding()
text_tokenizer.encode_special_tokens = True


def prompt_ids(transcript: str) -> list[int]:
    text = transcript.strip()  # cleaned as training read it: stripped, a very long text cut by characters
    chars = settings["transcript_max_chars"]
    if len(text) > chars:
        text = text[: chars // 2] + "\\n" + text[-(chars // 2) :]
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    budget = settings["transcript_budget"]
    if len(ids) > budget:  # keep the head and the tail, elide the middle
        keep = budget - len(settings["elision_ids"])
        if keep >= 1:
            head = (keep + 1) // 2
            ids = ids[:head] + settings["elision_ids"] + ids[len(ids) - (keep - head) :]
        else:
            ids = ids[:budget]
    return settings["prefix_ids"] + ids + settings["suffix_ids"]
"""
"""The model card's prompt code: pipetune's prompt for a transcript with data.system_prompt (generate.read_transcripts'
cleaning, then PromptBuilder.prompt_ids) from prompt.json and the exported tokenizer alone; tests check it token for
token."""


def model_card(
    config: Config,
    settings: dict[str, Any],
    external_base: str | None,
    gguf: Path | None,
    run: dict[str, Any],
    merged: bool,
    rank: int,
) -> str:
    """README.md of the export: what was trained, the exact prompt, and how to build it without pipetune.

    `external_base` is the hub id or local directory of a base the export references; None: it wrote base/ (a
    random-init base, or `gguf`'s weights de-quantized). Paths inside the export are relative to it."""
    if external_base is not None:
        base_code, base_cli = f'"{external_base}"', external_base
    else:
        base_code, base_cli = 'f"{EXPORT}/base"', "./base"
    files = [
        "`adapter/` (the PEFT adapter, and the tokenizer with its chat template)",
        "`prompt.json` (the prompt)",
        "`config.toml` (the run's settings)",
    ]
    if external_base is None:
        files.append("`base/` (the base model)")
    if merged:
        files.append("`merged/` (the base with the adapter merged in)")
    facts = _card_facts(config, settings, external_base, gguf, run)
    return f"""# Meeting summarizer: a LoRA adapter fine-tuned with pipetune

{chr(10).join(facts)}

Files: {", ".join(files)}. Paths below are relative to this directory.

{_card_prompt(settings)}{_card_loading(config, base_code, base_cli, merged, rank)}"""


def _card_facts(
    config: Config, settings: dict[str, Any], external_base: str | None, gguf: Path | None, run: dict[str, Any]
) -> list[str]:
    """The card's opening list: the base, the data, LoRA, dtype and seed, quantization, the run's losses."""
    lora = config.lora
    if external_base is not None:
        base_fact = f"- base: `{external_base}`"
    elif gguf is not None:
        base_fact = (
            f"- base: `{config.model.name}`, the GGUF file `{gguf.name}`, de-quantized and saved in `base/` "
            f"(config.json, safetensors weights in {config.model.dtype}, tokenizer): the weights pipetune trained "
            'on, loaded by plain `AutoModelForCausalLM.from_pretrained("base")`. transformers\' own GGUF reader '
            f'(`from_pretrained(DIR, gguf_file="{gguf.name}")`) gives the same weights but may split text into '
            "other tokens: build prompts with the tokenizer in `adapter/` (or `base/`), as below"
        )
    else:
        base_fact = f"- base: `{config.model.name}`, a built-in shape with random weights, saved in `base/`"
    facts = [
        base_fact,
        f"- data: `{config.data.source}`, {settings['max_length']} tokens per sample, summaries capped at "
        f"{settings['max_summary_tokens']} tokens",
        f"- LoRA: r {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, on {', '.join(lora.target_modules)}",
        f"- dtype `{config.model.dtype}`, seed {config.train.seed}",
    ]
    if config.model.quantize != "none":
        facts.append(
            f"- trained on a base quantized as `{config.model.quantize}` (model.quantize); the code below loads it "
            "unquantized, `pipetune summarize` quantizes it as in training"
        )
    if run:
        losses = ", ".join(
            f"{name} {run[key]:.4f}"
            for name, key in (("train loss", "final_loss"), ("validation loss", "final_val_loss"))
            if run.get(key) is not None
        )
        facts.append(f"- {run.get('steps', '?')} optimizer steps in {run.get('wall_time_s', '?')} s; {losses}")
    return facts


def _card_prompt(settings: dict[str, Any]) -> str:
    """The card's prompt section: the template's prefix and suffix, the cleaning and cut, and PROMPT_CODE."""
    return f"""## The prompt

The model was trained on the tokenizer's chat template rendered around three turns: the system prompt, the
transcript (user) and the summary (assistant). A prompt for a new transcript is the template's tokens up to
the assistant's turn, with the transcript between them:

    prefix_ids + transcript_ids + suffix_ids

where `prefix_ids` and `suffix_ids` are in `prompt.json`; as text, the prefix is

```text
{settings["prefix"]}
```

and the suffix is

```text
{settings["suffix"]}
```

The transcript is first cleaned as training read its rows: stripped of leading and trailing whitespace, and one
of more than {settings["transcript_max_chars"]} characters (`transcript_max_chars`) keeps its first and last
half of those with a newline between. A transcript of more than {settings["transcript_budget"]} tokens
(`transcript_budget`) is then cut in the middle: with k = transcript_budget - len(elision_ids), it keeps its
first ceil(k / 2) and last floor(k / 2) tokens with the `elision_ids` ({settings["elision"]!r}) between.
Generation is greedy and ends at token {settings["stop_ids"][0]} (`stop_ids[0]`, which closes the assistant's
turn) or at the tokenizer's end of text, after at most {settings["max_summary_tokens"]} new tokens. Built this
way the prompt is, token for token, the one `pipetune summarize` builds from the same text file or JSONL row
with the system prompt in the prefix above (a chat row's own system message, which summarize may keep in its
place, is not built here), and the output is its output:

```python
{PROMPT_CODE}```

"""


def _card_loading(config: Config, base_code: str, base_cli: str, merged: bool, rank: int) -> str:
    """The card's sections on loading the export: transformers + PEFT (or the merged model), pipetune, vLLM."""
    dtype = f"torch.{config.model.dtype}"
    merged_note = (
        f"\nThe merged model in `merged/` needs no PEFT: "
        f'`AutoModelForCausalLM.from_pretrained(f"{{EXPORT}}/merged", dtype={dtype})` in place of the two lines '
        f"that load `base` and `model`, same prompt.\n"
        if merged
        else ""
    )
    return f"""## transformers + PEFT

After the code above:

```python
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained({base_code}, dtype={dtype})
model = PeftModel.from_pretrained(base, f"{{EXPORT}}/adapter").eval()


@torch.no_grad()
def summarize(transcript: str, max_new_tokens: int = settings["max_summary_tokens"]) -> str:
    ids = torch.tensor([prompt_ids(transcript)], device=model.device)
    stops = [i for i in dict.fromkeys((settings["stop_ids"][0], tokenizer.eos_token_id)) if i is not None]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    new = out[0, ids.shape[1] :].tolist()
    new = new[: min((new.index(stop) for stop in stops if stop in new), default=len(new))]
    return tokenizer.decode(new, skip_special_tokens=True).strip()
```
{merged_note}
## pipetune

`pipetune summarize --adapter adapter meeting.txt` (from this directory) reads `config.toml` beside the
adapter: the run's dtype, lengths and prompt settings, with the base in `adapter/adapter_config.json`.

## vLLM

The adapter loads as a LoRA module (pass the prompt as token ids, so it is exactly the one above):

```python
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

llm = LLM(model={base_code}, enable_lora=True, max_lora_rank={max(rank, 8)}, dtype="{config.model.dtype}")
params = SamplingParams(
    temperature=0, max_tokens=settings["max_summary_tokens"], stop_token_ids=settings["stop_ids"][:1]
)
lora = LoRARequest("summarizer", 1, f"{{EXPORT}}/adapter")
outputs = llm.generate([{{"prompt_token_ids": prompt_ids(transcript)}}], params, lora_request=lora)
```

or as a server, from this directory:

    vllm serve {base_cli} --enable-lora --lora-modules summarizer=./adapter --max-lora-rank {max(rank, 8)}
"""
