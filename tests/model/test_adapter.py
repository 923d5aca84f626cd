"""The gathered adapter is a standard PEFT adapter: one process loads it and computes what the stages compute."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

from pipetune.generate import load_finetuned
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora
from pipetune.model.split import split_layers
from pipetune.model.stage import StageModule
from pipetune.preflight import prepare
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def trained(pipeline_run):
    """The shared 2-stage run (tests/conftest.py): its config and adapter."""
    config, run_dir = pipeline_run
    return config, run_dir / "adapter"


@pytest.mark.slow
def test_adapter_has_peft_layout_and_full_model_names(trained) -> None:
    config, adapter = trained
    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == 16 and meta["lora_alpha"] == 32
    assert meta["base_model_name_or_path"] == "tiny-qwen3"
    assert sorted(meta["target_modules"]) == sorted(config.lora.target_modules)
    names = load_file(adapter / "adapter_model.safetensors")
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in names}
    assert layers == {0, 1, 2, 3}  # both stages' layers, under their full-model indices
    assert len(names) == 4 * 7 * 2


@pytest.mark.slow
def test_peft_loaded_model_reproduces_the_stages_logits(trained) -> None:
    config, adapter = trained
    device = torch.device("cpu")
    model, prepared = load_finetuned(config, adapter, device)
    ids = torch.randint(0, len(prepared.tokenizer), (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits

    # The same stages the pipeline ran, with the saved adapter set by name on each.
    saved = load_file(adapter / "adapter_model.safetensors")
    ranges = split_layers(prepared.n_layers, 2)
    hidden = ids
    for index, layers in enumerate(ranges):
        base, _ = build_model(
            prepared.model,
            torch.float32,
            device,
            layers=layers,
            first=index == 0,
            last=index == 1,
            seed=config.train.seed,
        )
        stage_model = apply_lora(base, config.lora, config.model.name, seed=123)  # different init, then overwritten
        result = peft.set_peft_model_state_dict(stage_model, saved)
        assert not [k for k in result.missing_keys if "lora_" in k]
        with torch.no_grad():
            hidden = StageModule(stage_model).eval()(hidden)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)

    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=ids).logits
    assert (base_logits - expected).abs().max() > 1e-3  # the adapter changes the output: the check can fail


def test_prepare_builds_nothing_heavy(tmp_path: Path) -> None:
    prepared = prepare(tiny_config(tmp_path))
    assert prepared.n_layers == 4 and prepared.pad_id is not None
