"""The speed switches must not change the math: fast LoRA path, fused loss and torch.compile against the plain
float32 run."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from pipetune.config import Config
from pipetune.parallel.memory import plan_checkpointing
from tests.conftest import TWO_EPOCHS, tiny_config
from tests.parity import COMPILED_TYPICAL, assert_same_training
from tests.parity import adapter as _adapter
from tests.parity import losses as _losses
from tests.parity import max_relative as _max_relative

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


CKPT_GB = 0.635
"""The "ckpt" run's train.memory_gb: between the CPU plans' predictions above."""

SWITCH_RUNS = {
    "fast": ["lora.fast_path=true"],
    # each LoRA term inside its base matmul, lora_B copied in after each optimizer step
    "in-matmul": ["lora.fast_path=true", "lora.adapter_in_matmul=true"],
    # loss_chunk 7: chunk boundaries fall inside sequences and microbatches
    "fused": ["train.fused_loss=true", "train.loss_chunk=7"],
    # "auto" checkpoints where memory is short: under 1F1B stage 0 holds two microbatches' activations, stage 1 one,
    # so with the same budget only stage 0 recomputes layers. With dropout on (TWO_EPOCHS), 8 steps long. A CPU plan
    # counts the process's resident memory, which the shared runs' workers read as 0.5 GB (tests/conftest.py): then
    # stage 0 predicts 0.637 GB keeping its layers and 0.633 recomputing one, stage 1 0.632 keeping its own.
    "ckpt": [*TWO_EPOCHS, 'train.activation_checkpointing="auto"', f"train.memory_gb={CKPT_GB}"],
    # Compiled, with train.layers_per_graph = 0: each stage's layers traced as one graph. Trained after every other
    # run of its start of the workers (tests/conftest.py: two_process_runs), which must not find anything compiled.
    "compiled": ["lora.fast_path=true", "train.compile=true", "train.layers_per_graph=0"],
}
"""The 2-stage runs of this file (tiny_config's pp = 2), each with one speed switch on."""


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """SWITCH_RUNS, which tests/conftest.py trains with the other 2-process runs (its workers log the compiler's
    recompilations into output.log, with what all those runs printed)."""
    return {name: tiny_config(tmp / name, *overrides) for name, overrides in SWITCH_RUNS.items()}


def _val_loss(run_dir: Path) -> float:
    with open(run_dir / "metrics.csv") as f:
        return float(list(csv.DictReader(f))[-1]["val_loss"])


def test_fast_path_pipeline_matches_plain_single_process(reference: Path, two_process_runs: Path) -> None:
    assert_same_training(two_process_runs / "fast", reference)


def test_adapter_in_matmul_pipeline_matches_plain_single_process(reference: Path, two_process_runs: Path) -> None:
    """lora.adapter_in_matmul over 3 optimizer steps in a 2-stage pipeline: each stage copies the updated lora_B
    into its extended weights before each forward. (Compiled, on a CPU, it ran the same by hand: a compiled run
    here costs the suite ~90 s of inductor's CPU compilation.)"""
    assert_same_training(two_process_runs / "in-matmul", reference)


def test_fused_loss_pipeline_matches_plain_single_process(reference: Path, two_process_runs: Path) -> None:
    # Gradients agree to ~1e-6 (float32 sums in another order: tests/model/test_loss.py): the same training as
    # every parity test defines it (tests/parity.py: losses, gradient norms, the adapter within Adam's rounding).
    assert_same_training(two_process_runs / "fused", reference)


def test_compiled_fast_path_matches_plain(reference: Path, two_process_runs: Path) -> None:
    """Compiled, in a 2-stage pipeline, with train.layers_per_graph = 0: each stage's layers traced as one graph."""
    compiled = two_process_runs / "compiled"
    # Inductor fuses and reassociates float32 work: the same training to its rounding (tests/parity.py).
    assert_same_training(compiled, reference, typical_share=COMPILED_TYPICAL)
    # Validation runs the compiled layers eagerly: the same loss, and no second compilation for no_grad.
    assert _val_loss(compiled) == pytest.approx(_val_loss(reference), rel=1e-4)
    assert "grad_mode" not in (two_process_runs / "output.log").read_text()


def test_activation_checkpointing_changes_nothing_but_memory(two_epoch_run: Path, two_process_runs: Path) -> None:
    """ "auto" checkpoints where memory is short: under 1F1B stage 0 holds two microbatches' activations, stage 1
    one, so with the same budget only stage 0 recomputes layers. With dropout on (TWO_EPOCHS): the recomputation
    must draw the same masks as the first forward, 8 steps long, as the same run without it (tests/conftest.py)."""
    recomputed = two_process_runs / "ckpt"
    # Each rank's plan, one line per rank; only this run of its start of the workers plans for CKPT_GB.
    log = (two_process_runs / "output.log").read_text()
    plan = rf"rank \d: activation checkpointing \(auto\): stage (\d): (\d) of 2 layers; .* of {CKPT_GB} GB"
    plans = re.findall(plan, log)
    planned = {int(stage): int(k) for stage, k in plans}
    assert len(plans) == 2 and planned[0] >= 1 and planned[1] == 0, log
    expected = _losses(two_epoch_run)
    assert len(expected) == 8
    torch.testing.assert_close(torch.tensor(_losses(recomputed)), torch.tensor(expected), rtol=1e-6, atol=0)
    assert _max_relative(_adapter(recomputed), _adapter(two_epoch_run)) < 1e-6


def test_checkpointing_plan_recomputes_first_where_most_microbatches_wait() -> None:
    # 1F1B over 4 stages, as rank 0 sees it: stage 0 of 4 holds 4 microbatches, 12 layers of 1 GB each.
    plan = plan_checkpointing([12], [[4]], layer_bytes=1e9, input_bytes=0.1e9, fixed_bytes=10e9, budget_bytes=40e9)
    # 4 x (k x 0.1 + (12 - k) x 1) + 1 (one layer recomputed) + 10 <= 40  ->  k >= 5.3
    assert plan.layers == [6] and plan.fits
    assert plan_checkpointing([12], [[1]], 1e9, 0.1e9, 10e9, 40e9).layers == [0]  # the last stage: one in flight
    # Two stages on one rank (interleaved): the one holding more microbatches at the peak goes first.
    two = plan_checkpointing([6, 6], [[1, 0], [3, 1], [2, 2]], 1e9, 0.1e9, 0.0, 20e9)
    assert two.layers[0] > two.layers[1] and two.fits
    hopeless = plan_checkpointing([2], [[2]], 1e9, 0.5e9, 10e9, 5e9)
    assert hopeless.layers == [2] and not hopeless.fits
