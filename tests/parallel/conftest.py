"""Fixtures shared by the parallel tests: the single-process references.

Multi-process runs that tests only read are trained together: a test file lists its own in a function
`two_process_configs(tmp) -> {name: Config}` (or `four_process_configs`), and the fixture `two_process_runs`
(`four_process_runs`) of tests/conftest.py trains them with the other selected files' in turn by one start of the
workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_config, write_config
from tests.parallel.test_data_parallel import _train


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
