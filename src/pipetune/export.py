"""`pipetune export`: a run as a directory that plain transformers + PEFT (and vLLM's LoRA loading) use as is.

    pipetune export --run runs/demo --out exported [--merge]

    exported/
      README.md      model card: the run, the exact prompt, and code that builds it and generates
      prompt.json    the prompt settings (also in the run directory): template token ids, cut rule, caps
      adapter/       the PEFT adapter, base_model_name_or_path pointing at the base, with the tokenizer
      base/          built-in shapes only: the (random-init) base's config.json, weights and tokenizer
      merged/        with --merge: the base with the adapter merged in, with the tokenizer

A hub or local base is referenced by its id or absolute path, not copied. The prompt is the chat template
rendered around the transcript, whose middle is cut to fit, as pipetune builds it in training and
inference; prompt.json carries its token ids, so code without pipetune builds the very same prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipetune.config import Config, ConfigError
from pipetune.data.prompt import PromptBuilder

PROMPT_FILE = "prompt.json"


def prompt_settings(prompts: PromptBuilder, config: Config) -> dict[str, Any]:
    """What builds an inference prompt: template ids around the transcript, the transcript's budget and cut rule."""
    tokenizer = prompts.tokenizer
    return {
        "system_prompt": config.data.system_prompt,
        "max_length": prompts.max_length,
        "max_summary_tokens": prompts.max_summary_tokens,
        "transcript_budget": prompts.transcript_room,
        "cut_rule": (
            "a transcript of more than transcript_budget tokens keeps its first ceil(k / 2) and last floor(k / 2) "
            "tokens with elision_ids between, k = transcript_budget - len(elision_ids) (if k < 1: its first "
            "transcript_budget tokens), in training and inference alike; the transcript is encoded with "
            "split_special_tokens=True (control-token text in it is plain text)"
        ),
        "prefix": tokenizer.decode(prompts.head_ids),
        "prefix_ids": list(prompts.head_ids),
        "suffix": tokenizer.decode(prompts.middle_ids),
        "suffix_ids": list(prompts.middle_ids),
        "stop_ids": list(prompts.end_ids),
        "elision": tokenizer.decode(prompts.elision_ids),
        "elision_ids": list(prompts.elision_ids),
    }


def write_prompt_settings(path: Path, prompts: PromptBuilder, config: Config) -> None:
    path.write_text(json.dumps(prompt_settings(prompts, config), indent=1, ensure_ascii=False) + "\n")


def export_run(run_dir: Path, out: Path, merge: bool = False) -> Path:
    """Write the export directory for a finished run; return its path."""
    import torch
    from peft import PeftModel
    from transformers import GenerationConfig
    from transformers.utils import logging as transformers_logging

    from pipetune.generate import inference_config
    from pipetune.model.load import DTYPES, build_model
    from pipetune.preflight import prepare

    adapter_dir = run_dir / "adapter"
    if not (adapter_dir / "adapter_config.json").is_file() or not (run_dir / "config.toml").is_file():
        raise ConfigError(
            f"--run {str(run_dir)!r} has no adapter/ or config.toml; give the directory of a finished training run"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty directory; choose a new directory")
    transformers_logging.disable_progress_bar()  # save_pretrained's bars, per shard
    config = inference_config(adapter_dir).config
    prepared = prepare(config)
    settings = prompt_settings(prepared.prompts, config)
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=config.data.max_summary_tokens,
        eos_token_id=settings["stop_ids"][0],
        pad_token_id=prepared.pad_id,
    )

    base = None
    if prepared.model.is_builtin or merge:
        base, _ = build_model(prepared.model, DTYPES[config.model.dtype], torch.device("cpu"), seed=config.train.seed)
        base.config.use_cache = True  # pipetune trains without a KV cache; generation wants one
    if prepared.model.is_builtin:  # random weights that exist nowhere else: write them
        base_ref = str(out / "base")
        _save_model(base, out / "base", prepared.tokenizer, generation)
    else:  # a hub id stays one; a local directory becomes an absolute path
        base_ref = str(Path(config.model.name).resolve()) if Path(config.model.name).is_dir() else config.model.name

    shutil.copytree(adapter_dir, out / "adapter")
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = base_ref
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    prepared.tokenizer.save_pretrained(out / "adapter")
    (out / PROMPT_FILE).write_text(json.dumps(settings, indent=1, ensure_ascii=False) + "\n")

    if merge:
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        _save_model(merged, out / "merged", prepared.tokenizer, generation)
    run = _read_json(run_dir / "run.json")
    (out / "README.md").write_text(model_card(config, settings, out, base_ref, run, merge, adapter_config["r"]))
    return out


def _save_model(model: Any, directory: Path, tokenizer: Any, generation: Any) -> None:
    model.generation_config = generation
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def model_card(
    config: Config,
    settings: dict[str, Any],
    out: Path,
    base_ref: str,
    run: dict[str, Any],
    merged: bool,
    rank: int,
) -> str:
    """README.md of the export: what was trained, the exact prompt, and how to build it without pipetune."""
    lora = config.lora
    facts = [
        f"- base: `{config.model.name}`"
        + (" (a built-in shape with random weights, saved in `base/`)" if base_ref == str(out / "base") else ""),
        f"- data: `{config.data.source}`, {settings['max_length']} tokens per sample, summaries capped at "
        f"{settings['max_summary_tokens']} tokens",
        f"- LoRA: r {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, on {', '.join(lora.target_modules)}",
        f"- dtype `{config.model.dtype}`, seed {config.train.seed}",
    ]
    if run:
        losses = ", ".join(
            f"{name} {run[key]:.4f}"
            for name, key in (("train loss", "final_loss"), ("validation loss", "final_val_loss"))
            if run.get(key) is not None
        )
        facts.append(f"- {run.get('steps', '?')} optimizer steps in {run.get('wall_time_s', '?')} s; {losses}")
    dtype = f"torch.{config.model.dtype}"
    files = ["`adapter/` (the PEFT adapter, and the tokenizer with its chat template)", "`prompt.json` (the prompt)"]
    if base_ref == str(out / "base"):
        files.append("`base/` (the base model)")
    if merged:
        files.append("`merged/` (the base with the adapter merged in)")
    merged_note = (
        f"\nThe merged model in `merged/` needs no PEFT: "
        f'`AutoModelForCausalLM.from_pretrained("{out}/merged", dtype={dtype})` in place of the two lines that '
        f"load `base` and `model`, same prompt.\n"
        if merged
        else ""
    )
    return f"""# Meeting summarizer: a LoRA adapter fine-tuned with pipetune

{chr(10).join(facts)}

Files: {", ".join(files)}.

## The prompt

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

A transcript of more than {settings["transcript_budget"]} tokens (`transcript_budget`) is cut in the middle: with
k = transcript_budget - len(elision_ids), it keeps its first ceil(k / 2) and last floor(k / 2) tokens with the
`elision_ids` ({settings["elision"]!r}) between. Generation is greedy and ends at token {settings["stop_ids"][0]}
(`stop_ids[0]`, which closes the assistant's turn), after at most {settings["max_summary_tokens"]} new tokens.
Built this way the prompt is, token for token, the one pipetune builds, and the output is `pipetune summarize`'s.

## transformers + PEFT

```python
import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

EXPORT = "{out}"  # this directory
settings = json.load(open(f"{{EXPORT}}/prompt.json"))
tokenizer = AutoTokenizer.from_pretrained(f"{{EXPORT}}/adapter")
base = AutoModelForCausalLM.from_pretrained("{base_ref}", dtype={dtype})
model = PeftModel.from_pretrained(base, f"{{EXPORT}}/adapter").eval()


def prompt_ids(transcript: str) -> list[int]:
    ids = tokenizer.encode(transcript, add_special_tokens=False, split_special_tokens=True)
    budget = settings["transcript_budget"]
    if len(ids) > budget:  # keep the head and the tail, elide the middle
        keep = budget - len(settings["elision_ids"])
        if keep >= 1:
            head = (keep + 1) // 2
            ids = ids[:head] + settings["elision_ids"] + ids[len(ids) - (keep - head) :]
        else:
            ids = ids[:budget]
    return settings["prefix_ids"] + ids + settings["suffix_ids"]


@torch.no_grad()
def summarize(transcript: str, max_new_tokens: int = settings["max_summary_tokens"]) -> str:
    ids = torch.tensor([prompt_ids(transcript)], device=model.device)
    stop = settings["stop_ids"][0]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    new = out[0, ids.shape[1] :].tolist()
    new = new[: new.index(stop)] if stop in new else new
    return tokenizer.decode(new, skip_special_tokens=True).strip()
```
{merged_note}
## vLLM

The adapter loads as a LoRA module (pass the prompt as token ids, so it is exactly the one above):

```python
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

llm = LLM(model="{base_ref}", enable_lora=True, max_lora_rank={max(rank, 8)}, dtype="{config.model.dtype}")
params = SamplingParams(
    temperature=0, max_tokens=settings["max_summary_tokens"], stop_token_ids=settings["stop_ids"][:1]
)
lora = LoRARequest("summarizer", 1, f"{{EXPORT}}/adapter")
outputs = llm.generate([{{"prompt_token_ids": prompt_ids(transcript)}}], params, lora_request=lora)
```

or as a server:

    vllm serve {base_ref} --enable-lora --lora-modules summarizer={out}/adapter --max-lora-rank {max(rank, 8)}
"""
