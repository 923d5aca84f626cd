"""Fixtures shared by the parallel tests.

Multi-process runs that tests only read are trained together: a test file lists its own in a function
`two_process_configs(tmp) -> {name: Config}` (or `four_process_configs`), and the fixture of that name,
`two_process_runs` (`four_process_runs`), trains the runs of every selected test file that asks for it in turn by
one start of the workers (tests/conftest.py: train_in_turn). Each run after the first saves a start of the
workers: ~6 s of imports on 2 cores for 2 workers, ~11 s for 4. Run names are unique over the files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetune.config import Config
from tests.conftest import run_cli, tiny_config, train_in_turn, write_config
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


@pytest.fixture(scope="session")
def two_process_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of the selected test files' `two_process_configs`, trained in turn by one start of 2 workers: the
    directory holding their run directories."""
    return _train_listed(request, tmp_path_factory.mktemp("two-processes"), "two_process")


@pytest.fixture(scope="session")
def four_process_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of the selected test files' `four_process_configs`, trained in turn by one start of 4 workers."""
    return _train_listed(request, tmp_path_factory.mktemp("four-processes"), "four_process")


def _train_listed(request: pytest.FixtureRequest, tmp: Path, kind: str) -> Path:
    """Train, in tmp, the runs that the test files of this session's tests using the `{kind}_runs` fixture list in
    their `{kind}_configs(tmp)`, file by file in name order."""
    users = {item.module for item in request.session.items if f"{kind}_runs" in getattr(item, "fixturenames", ())}
    configs: dict[str, Config] = {}
    for module in sorted(users, key=lambda module: module.__name__):
        for name, config in getattr(module, f"{kind}_configs")(tmp).items():
            assert name not in configs and Path(config.output.dir) == tmp / name, (module.__name__, name)
            configs[name] = config
    train_in_turn(*(write_config(config, tmp / f"{name}.toml") for name, config in configs.items()))
    return tmp
