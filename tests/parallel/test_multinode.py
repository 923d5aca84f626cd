"""Two "nodes" x 2 processes on loopback through torchrun's c10d rendezvous (two launcher invocations sharing
one endpoint), running dp=2 replicas x tp=2 (each node one replica, its tensor-parallel ranks on one node, as on
real machines): the same result as the single process at the same effective batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_config, write_config
from tests.parallel.test_data_parallel import EFFECTIVE_16
from tests.parallel.test_tensor_parallel import TP2, assert_matches_single

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_single_process(tmp_path: Path, single: Path) -> None:
    # Each replica's batch of 4 in one microbatch (train.grad_accum = 2 still sums two backward passes): a tp step
    # pays the DTensor dispatch and all-reduces once a microbatch: the run took 8.5 s so, 18 s in microbatches of 1
    # (4 processes on 2 cores).
    one_microbatch = ["parallel.dp=2", "train.batch_size=4", "parallel.n_microbatches=1"]
    config = tiny_config(tmp_path / "run", *EFFECTIVE_16, *TP2, *one_microbatch)
    path = write_config(config, tmp_path / "c.toml")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "loopback-job",
                "--node-rank",
                str(node),
                "-m",
                "pipetune",
                "train",
                "--config",
                str(path),
                "--quiet",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)

    assert_matches_single(tmp_path / "run", single)
