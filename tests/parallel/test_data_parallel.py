"""PP x DP on a 2-D DeviceMesh, and pure data parallelism, against the single process at the same effective batch.

Each optimizer step sees the same samples whatever the layout (the global batch of a schedule step is
cut into dp column blocks) and the loss is normalized by the step's global supervised-token count, so
every layout computes the same function.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetune.cli import main
from pipetune.config import Config
from tests.conftest import run_cli, tiny_config, write_config
from tests.parity import assert_same_training

EFFECTIVE_16 = ["data.synthetic_train=48", "train.grad_accum=2"]


def _train(tmp: Path, name: str, *overrides: str, nproc: int) -> Path:
    config = tiny_config(tmp / name, *EFFECTIVE_16, *overrides)
    run_cli("train", "--config", str(write_config(config, tmp / f"{name}.toml")), "--nproc", str(nproc), "--quiet")
    return tmp / name


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs."""
    ddp2 = ['parallel.strategy="ddp"', "parallel.pp=1", "parallel.dp=2", "train.batch_size=4"]
    return {"ddp2": tiny_config(tmp / "ddp2", *EFFECTIVE_16, *ddp2)}


# pp=2 x dp=2 runs (sharded) in tests/parallel/test_fsdp.py, dp=2 x tp=2 in tests/parallel/test_multinode.py (4
# processes as two torchrun nodes, same check).
@pytest.mark.slow
def test_data_parallel_replicas_match_single_process(single: Path, two_process_runs: Path) -> None:
    """2 replicas of batch 4 at single's effective batch."""
    assert_same_training(two_process_runs / "ddp2", single, steps=3)


def test_ddp_strategy_refuses_pipeline_stages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tiny_config(tmp_path / "run", 'parallel.strategy="ddp"', "parallel.pp=2", "parallel.dp=2")
    assert main(["train", "--config", str(write_config(config, tmp_path / "c.toml"))]) == 2  # before any worker
    assert "parallel.strategy = 'ddp' runs whole-model replicas: set parallel.pp = 1 (got 2)" in capsys.readouterr().err


def test_the_gradient_all_reduce_starts_during_the_last_backward(tmp_path: Path) -> None:
    """Overlapped buckets: each starts once every parameter in it has had the step's last accumulation (so not
    during the first of two backwards), all start before the backward ends, in bucket order, and the sums land in
    the gradients (one rank: the sum is the gradient itself); a parameter accumulated once too often is an error."""
    import torch.distributed as dist

    from pipetune.parallel.gradients import MIN_BUCKETS, GradientSync

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(6)))
        params = list(model.parameters())
        sync = GradientSync(params, dist.group.WORLD, accumulations=2, overlap=True)
        assert len(sync.buckets) >= MIN_BUCKETS and sync.buckets[0][0] is params[-1]  # the last layer's first
        x = torch.randn(4, 8)
        model(x).square().sum().backward()
        assert sync._started == []
        model(2 * x).square().sum().backward()
        assert len(sync._started) == len(sync.buckets)
        expected = [param.grad.clone() for param in params]
        for param in params:  # what the all-reduce must overwrite
            param.grad.zero_()
        sync.finish()
        for got, want in zip((param.grad for param in params), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for _ in range(3):
            model(x).sum().backward()
        with pytest.raises(RuntimeError, match="accumulated more than 2 times in one step"):
            sync.finish()
        serial = GradientSync(params, dist.group.WORLD, accumulations=2, overlap=False)  # one all-reduce in finish
        expected = [param.grad.clone() for param in params]
        serial.finish()
        serial.finish()
        for got, want in zip((param.grad for param in params), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
