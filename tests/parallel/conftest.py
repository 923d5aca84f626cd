"""Fixtures shared by the parallel tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.test_data_parallel import _train


@pytest.fixture(scope="session")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # batch 8 x grad_accum 2 = 16 sequences a step, in microbatches of 2.
    tmp = tmp_path_factory.mktemp("single")
    return _train(tmp, "single", 'parallel.strategy="single"', "parallel.pp=1", "train.batch_size=8", nproc=1)
