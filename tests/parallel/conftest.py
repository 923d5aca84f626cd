"""Fixtures shared by the parallel tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_config, train_in_turn, write_config
from tests.parallel.test_data_parallel import EFFECTIVE_16, _train
from tests.parallel.test_fsdp import DDP2, FSDP2
from tests.parallel.test_tensor_parallel import TP2_RUN

REPLICA_RUNS = {
    "ddp2": DDP2,
    "tp2": TP2_RUN,
    "fsdp2": [*FSDP2, "train.save_every=1"],  # tests/parallel/test_fsdp.py resumes its step-2 checkpoint
}
"""Whole-model replicas in 2 processes at `single`'s effective batch (EFFECTIVE_16), which they must match: data
parallel (tests/parallel/test_data_parallel.py), FSDP (test_fsdp.py), tensor parallel (test_tensor_parallel.py)."""

FOUR_RANK_RUNS = {
    # pp=2 x tp=2 with tensor parallelism's own switches on: sequence parallelism, the vocabulary-parallel fused
    # loss, the fast LoRA path on split adapters. tiny_config's batch: `reference` (test_parity.py).
    "pp2xtp2": [
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.fused_loss=true",
        "lora.fast_path=true",
    ],
    # pp=2 x dp=2, the replicas sharded (FSDP), on the fast LoRA path, whose grouped down-projections read each
    # layer's gathered adapters (without dropout, lora.shared_dropout changes no value). EFFECTIVE_16: `single`
    # (test_fsdp.py).
    "pp2xdp2": [
        *EFFECTIVE_16,
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.dp_shard=true",
        "lora.fast_path=true",
        "lora.shared_dropout=true",
    ],
}
"""The 4-process runs that tests only read: a pipeline of tensor-parallel stages, a pipeline of sharded replicas."""


@pytest.fixture(scope="session")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # batch 8 x grad_accum 2 = 16 sequences a step, in microbatches of 2.
    tmp = tmp_path_factory.mktemp("single")
    return _train(tmp, "single", 'parallel.strategy="single"', "parallel.pp=1", "train.batch_size=8", nproc=1)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_config in one process (parallel.pp = 1): the float32 reference of the pipeline and speed-switch runs."""
    tmp = tmp_path_factory.mktemp("reference")
    config = tiny_config(tmp / "single", "parallel.pp=1")
    run_cli("train", "--config", str(write_config(config, tmp / "single.toml")), "--quiet")
    return tmp / "single"


@pytest.fixture(scope="session")
def replica_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """REPLICA_RUNS trained in turn by one start of 2 workers (tests/conftest.py: train_in_turn): the directory
    holding their run directories."""
    tmp = tmp_path_factory.mktemp("replicas")
    files = [
        write_config(tiny_config(tmp / name, *EFFECTIVE_16, *overrides), tmp / f"{name}.toml")
        for name, overrides in REPLICA_RUNS.items()
    ]
    train_in_turn(*files)
    return tmp


@pytest.fixture(scope="session")
def four_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FOUR_RANK_RUNS trained in turn by one start of 4 workers: the directory holding their run directories."""
    tmp = tmp_path_factory.mktemp("four-ranks")
    files = [
        write_config(tiny_config(tmp / name, *overrides), tmp / f"{name}.toml")
        for name, overrides in FOUR_RANK_RUNS.items()
    ]
    train_in_turn(*files)
    return tmp
