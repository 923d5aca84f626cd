"""A QLoRA run (model.quantize = "nf4"): the pipeline computes what one process computes, a resumed run continues
exactly, and the adapter is a plain PEFT adapter that a bfloat16 base loads.

Every layout holds the same NF4 weights (each matrix is quantized whole, then split: tests/model/test_quantize.py)
and dequantizing them is element-wise, so in float32 the pipeline computes the same function as one process: it
may differ only by the order of float32 sums, as unquantized runs do (tests/parallel/test_parity.py), hence the
same tolerance, 1e-5 relative.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

from pipetune.config import Config
from pipetune.model.load import build_model
from pipetune.parallel.process_group import DistEnv
from pipetune.preflight import prepare
from pipetune.train import train
from tests.conftest import tiny_config
from tests.parallel.test_fsdp import ADAPTER, _metrics
from tests.parity import assert_same_training

NF4 = ['model.quantize="nf4"', "train.save_every=1", "train.max_steps=2"]


def _train_in_process(config: Config) -> Path:
    train(config, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), quiet=True)
    return Path(config.output.dir)


@pytest.fixture(scope="module")
def single_nf4(tmp_path_factory: pytest.TempPathFactory) -> Config:
    config = tiny_config(tmp_path_factory.mktemp("nf4") / "single", *NF4, "parallel.pp=1")
    _train_in_process(config)
    return config


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs: NF4 under the V
    schedule, 2 ranks x 2 stages of one layer, backward split into input and weight parts."""
    return {"nf4-zbv": tiny_config(tmp / "nf4-zbv", *NF4, 'parallel.schedule="zbv"', "parallel.stages_per_rank=2")}


@pytest.mark.slow  # a multi-process end-to-end run
def test_nf4_pipeline_matches_nf4_single_process(single_nf4: Config, two_process_runs: Path) -> None:
    reference = Path(single_nf4.output.dir)
    assert_same_training(two_process_runs / "nf4-zbv", reference, steps=2)


def test_nf4_run_resumes_exactly(single_nf4: Config, tmp_path: Path) -> None:
    run = Path(single_nf4.output.dir)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "metrics.csv", resumed / "metrics.csv")
    shutil.copytree(run / "checkpoints" / "step-1", resumed / "checkpoints" / "step-1")
    _train_in_process(tiny_config(resumed, *NF4, "parallel.pp=1", 'train.resume="auto"'))
    assert _metrics(resumed) == _metrics(run)  # step 2 bit for bit, on NF4 weights built again
    assert (resumed / ADAPTER).read_bytes() == (run / ADAPTER).read_bytes()


def test_nf4_adapter_loads_into_a_plain_bfloat16_peft_model(single_nf4: Config) -> None:
    saved = load_file(Path(single_nf4.output.dir) / ADAPTER)
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    prepared = prepare(single_nf4)
    base, _ = build_model(prepared.model, torch.bfloat16, torch.device("cpu"), seed=single_nf4.train.seed)
    model = peft.PeftModel.from_pretrained(base, str(Path(single_nf4.output.dir) / "adapter")).eval()
    loaded = peft.get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name].float(), tensor, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, len(prepared.tokenizer), (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 1e-2  # the adapter is applied: the check can fail
