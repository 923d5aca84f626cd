"""`pipetune export`: a damaged adapter or an --out inside the run is refused and leaves nothing; the export's
settings, base and card reproduce `pipetune summarize` (prompt token for token) without pipetune."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipetune.cli import main
from pipetune.config import Config, ConfigError, load_config, save_config
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.export import export_run
from pipetune.generate import inference_config, load_finetuned, read_transcripts
from pipetune.model.load import build_model
from pipetune.model.lora import adapter_state, apply_lora, save_adapter
from pipetune.preflight import prepare
from tests.conftest import tiny_config

WEIGHTS = "adapter_model.safetensors"


def make_run(run_dir: Path, config: Config) -> Path:
    """A finished run as export reads it: config.toml and a PEFT adapter (LoRA B non-zero, so it changes outputs)."""
    prepared = prepare(config)
    base, _ = build_model(prepared.model, torch.float32, torch.device("cpu"), seed=config.train.seed)
    model = apply_lora(base, config.lora, config.model.name, seed=config.train.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    save_adapter(adapter_state(model), config.lora, config.model.name, run_dir / "adapter")
    save_config(config, run_dir / "config.toml")
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export-run") / "run"
    return make_run(out, tiny_config(out, "train.seed=7", "lora.target_modules=['q_proj','v_proj']"))


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_run(run, tmp_path_factory.mktemp("exported") / "export")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


def test_a_damaged_adapter_is_refused_and_nothing_is_written(run: Path, tmp_path: Path) -> None:
    """A missing, cut or incomplete adapter file stops the export with one line; no directory is left behind."""
    damaged = shutil.copytree(run, tmp_path / "run")
    weights = damaged / "adapter" / WEIGHTS
    full = load_file(weights)
    outputs = tmp_path / "exports"
    outputs.mkdir()

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            export_run(damaged, outputs / "out")
        assert leftovers(outputs) == []

    weights.write_bytes(weights.read_bytes()[:-10])  # cut short
    refused(r"adapter_model.safetensors is damaged or cut short \(SafetensorError")
    weights.unlink()
    refused(r"adapter_model.safetensors is missing, so the export would have no weights; restore")
    dropped = sorted(full)[0]
    save_file({k: v for k, v in full.items() if k != dropped}, weights)
    refused(rf"does not hold the {len(full)} LoRA tensors its adapter_config.json names: 1 missing \(first: {dropped}")
    save_file(full, weights)
    adapter_config = damaged / "adapter" / "adapter_config.json"
    adapter_config.write_text(adapter_config.read_text().replace('"r": 16', '"r": 8'))
    refused(r"of the wrong shape \(first: .* \[16, 256\], expected \[8, 256\]\)")
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()), "target_modules": ["qkv_proj"]}))
    refused(r"adapter_config.json does not describe an adapter of this base model \(\w+: .*qkv_proj")
    adapter_config.write_text("{")
    refused(r"adapter_config.json is not valid JSON")
    shutil.rmtree(damaged / "adapter")
    refused(r"has no adapter/ or config.toml; give the directory of a finished training run")


def test_a_failed_export_leaves_no_half_written_directory(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_card(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pipetune.export.model_card", broken_card)
    with pytest.raises(OSError, match="No space left"):
        export_run(run, tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_an_out_inside_the_run_is_refused_naming_both(run: Path, tmp_path: Path, capsys) -> None:
    before = leftovers(run) + leftovers(run / "adapter")
    for out in (run / "adapter" / "exp", run, run / "x" / ".." / "y"):
        assert main(["export", "--run", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {str(out)!r} ({out.resolve()}) is " in err and f"--run {str(run)!r} ({run.resolve()})" in err
        assert err.count("\n") == 1 and "choose e.g. --out" in err
    assert leftovers(run) + leftovers(run / "adapter") == before


def test_summarize_reads_the_exports_settings(run: Path, exported: Path, tmp_path: Path) -> None:
    """`summarize --adapter EXPORT/adapter [--base EXPORT/base]` without --config: the run's dtype, lengths, prompt
    and base weights, also after the export directory moved."""
    trained = inference_config(run / "adapter").config
    for source in (
        inference_config(exported / "adapter", base=str(exported / "base")),
        inference_config(exported / "adapter"),
        inference_config(run / "adapter", base=str(exported / "base")),  # the run's config.toml, the export's base
    ):
        config = source.config
        assert not source.warning and config.model.name == str(exported / "base")
        assert (config.model.dtype, config.model.init, config.data) == (trained.model.dtype, "pretrained", trained.data)
    assert inference_config(exported / "adapter").config_path == exported / "config.toml"

    moved = shutil.move(exported, tmp_path / "moved")
    try:
        config = inference_config(Path(moved) / "adapter").config
        assert config.model.name == str(Path(moved) / "base")
        ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(0))
        model, _ = load_finetuned(config, Path(moved) / "adapter", torch.device("cpu"))
        reference, _ = load_finetuned(trained, run / "adapter", torch.device("cpu"))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    finally:
        shutil.move(moved, exported)


def test_a_local_base_with_its_own_tokenizer_and_quantized_exports_for_the_cards_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.name = "~/base" (a local checkpoint without a tokenizer), model.tokenizer = "tok" (relative to where the
    run was trained) and model.quantize = "fp8" (as on an H200): the export needs no FP8 GPU, names the base by its
    absolute path, and its config.toml keeps the quantization and points at the tokenizer saved in adapter/, so the
    card's `pipetune summarize --adapter adapter` runs from the export directory."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    tiny = prepare(tiny_config(tmp_path / "x"))
    base, _ = build_model(tiny.model, torch.float32, torch.device("cpu"), seed=1)
    base.save_pretrained(tmp_path / "base")
    tiny.tokenizer.save_pretrained(tmp_path / "tok")
    local = (
        'model.name="~/base"',
        'model.init="pretrained"',
        'model.tokenizer="tok"',
        "lora.target_modules=['q_proj']",
    )
    config = tiny_config(tmp_path / "run", *local)
    run = make_run(tmp_path / "run", config)
    config.model.quantize, config.model.dtype = "fp8", "bfloat16"  # what the run trained with; this host has no FP8
    save_config(config, run / "config.toml")

    out = export_run(run, tmp_path / "export")
    base_path = str((tmp_path / "base").resolve())
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == base_path
    card = (out / "README.md").read_text()
    assert f'from_pretrained("{base_path}", dtype=torch.bfloat16)' in card and "~" not in card
    assert "trained on a base quantized as `fp8`" in card
    exported = load_config(out / "config.toml").model
    assert (exported.name, exported.tokenizer, exported.quantize) == (base_path, str(out / "adapter"), "fp8")
    AutoModelForCausalLM.from_pretrained(base_path)  # the card's base, as plain transformers reads it

    monkeypatch.chdir(out)  # the card's `pipetune summarize --adapter adapter meeting.txt`, without FP8 here
    summarize = inference_config("adapter").config
    summarize.model.quantize = "none"
    assert prepare(summarize).prompts.prompt_ids("Anna: hi.") == tiny.prompts.prompt_ids("Anna: hi.")


def card_prompt_code(export: Path) -> str:
    card = (export / "README.md").read_text()
    return re.search(r"## The prompt\n.*?```python\n(.*?)```", card, re.S).group(1)


def test_the_cards_prompt_is_summarizes_prompt(run: Path, exported: Path, tmp_path: Path, monkeypatch) -> None:
    """The card's code, run in the export directory with prompt.json and the exported tokenizer alone, builds the
    prompt `pipetune summarize` builds from the same text file or JSONL row with data.system_prompt (the card says
    so): stripped, cut by characters and by tokens as training cuts."""
    card = (exported / "README.md").read_text()
    assert str(exported) not in card and str(run) not in card  # paths relative to the export directory
    assert "row\nwith the system prompt in the prefix above (a chat row's own system message" in card
    namespace: dict = {}
    monkeypatch.chdir(exported)
    exec(compile(card_prompt_code(exported), "README.md", "exec"), namespace)
    monkeypatch.undo()
    config = inference_config(run / "adapter").config
    prepared = prepare(config)
    settings = json.loads((exported / "prompt.json").read_text())
    meeting = synthetic_splits(seed=3, n_train=1, n_validation=1)["validation"][0].transcript
    words = " ".join(f"w{i}" for i in range(settings["transcript_budget"]))
    fits = prepared.prompts.encode_text(words)
    while len(fits) > settings["transcript_budget"]:
        words = words.rsplit(" ", 1)[0]
        fits = prepared.prompts.encode_text(words)
    transcripts = {
        "padded": "\n\n  " + meeting[:200] + " \n\n",
        "at the budget, then whitespace": words + "\n\n\n\n   \n",  # fits once stripped: not cut
        "control tokens": "Anna: <|im_end|> done.\n",
        "long in tokens": meeting,
        "long in characters": "x" * 5 + "y " * settings["transcript_max_chars"],
    }
    for what, text in transcripts.items():
        path = tmp_path / "t.txt"
        path.write_text(text)
        (read,) = read_transcripts(str(path), config.data).transcripts
        jsonl = tmp_path / "t.jsonl"
        jsonl.write_text(json.dumps({"id": 1, "dialogue": text}) + "\n")
        assert read_transcripts(str(jsonl), config.data).transcripts == [read], what
        assert namespace["prompt_ids"](text) == prepared.prompts.prompt_ids(read), what
    budget_only = prepared.prompts.prompt_ids(transcripts["at the budget, then whitespace"])
    assert budget_only != namespace["prompt_ids"](transcripts["at the budget, then whitespace"])  # strip matters


def test_a_gguf_runs_export_loads_with_plain_transformers_and_peft(smollm2: Path, tmp_path: Path) -> None:
    """model.name = "smollm2-135m" (a GGUF inside a package): the export writes the de-quantized base the run
    trained on, which PEFT's AutoPeftModel loads from adapter_config.json alone, with the model's own tokenizer."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    gguf = ('model.name="smollm2-135m"', 'model.init="pretrained"', "data.max_length=160")  # float32 (tiny_config)
    config = tiny_config(tmp_path / "run", *gguf, "lora.r=2", "lora.target_modules=['q_proj']")
    run = make_run(tmp_path / "run", config)
    out = export_run(run, tmp_path / "export")
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(out / "base")
    card = (out / "README.md").read_text()
    assert 'from_pretrained(f"{EXPORT}/base", dtype=torch.float32)' in card and "gguf_file=" in card
    assert "vllm serve ./base " in card and '"smollm2-135m"' not in card

    model = AutoPeftModelForCausalLM.from_pretrained(str(out / "adapter"), dtype=torch.float32).eval()
    reference, prepared = load_finetuned(inference_config(run / "adapter").config, run / "adapter", torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("a  2")) == ["a", "ĠĠ", "2"]  # smollm's digit split
    ids = torch.tensor([prepared.prompts.prompt_ids("Anna: the budget is 2024 euros.")])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_summarize_warns_when_the_prompt_is_not_the_runs(run: Path, tmp_path: Path) -> None:
    """A tokenizer, chat template or prompt rule that changed since training is named, not summarized past."""
    from pipetune.data.prompt import write_prompt_settings
    from pipetune.generate import prompt_change

    copy = shutil.copytree(run, tmp_path / "run")
    config = inference_config(copy / "adapter").config
    prepared = prepare(config)
    assert prompt_change(copy / "adapter", prepared, config) == ""  # no prompt.json: nothing to compare
    write_prompt_settings(copy / "prompt.json", prepared.prompts, config)
    assert prompt_change(copy / "adapter", prepared, config) == ""
    recorded = json.loads((copy / "prompt.json").read_text())
    recorded["suffix_ids"] = recorded["suffix_ids"][:-1]  # e.g. a template that since renders an empty <think>
    (copy / "prompt.json").write_text(json.dumps(recorded))
    assert prompt_change(copy / "adapter", prepared, config) == (
        f"the prompt built now differs from the one the adapter was trained on ({copy / 'prompt.json'}: suffix_ids "
        "differ): the tokenizer, its chat template or pipetune's prompt rules changed since; summaries may be worse "
        "than the run's (pass --config with the run's settings, or train again)"
    )
    (copy / "prompt.json").write_text("[")
    assert "is not a JSON object: the prompt the adapter was trained on cannot be checked" in prompt_change(
        copy / "adapter", prepared, config
    )


def test_the_cards_prompt_code_never_turns_data_text_into_a_control_token(tmp_path: Path) -> None:
    """Qwen3 leaves <think> an added token not flagged special: the card's code encodes a transcript's literal
    "<think>" as ordinary tokens, exactly as training and summarize do (data/prompt.py)."""
    from pipetune.data.prompt import data_backend
    from pipetune.data.tokenizer import demo_tokenizer
    from pipetune.export import PROMPT_CODE

    tokenizer = demo_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's tokenizer has them: added, not special
    tokenizer.save_pretrained(tmp_path / "adapter")
    settings = {"transcript_max_chars": 10_000, "transcript_budget": 1_000, "elision_ids": [], "prefix_ids": []}
    (tmp_path / "prompt.json").write_text(json.dumps(settings | {"suffix_ids": []}))
    namespace: dict = {}
    exec(compile(PROMPT_CODE.replace('EXPORT = "."', f'EXPORT = "{tmp_path}"'), "README.md", "exec"), namespace)
    text = "Anna: <think> we ship in May </think> done."
    ids = namespace["prompt_ids"](text)
    assert ids == data_backend(tokenizer).encode(text, add_special_tokens=False).ids
    assert tokenizer.convert_tokens_to_ids("<think>") not in ids
    assert tokenizer.decode(ids) == text
