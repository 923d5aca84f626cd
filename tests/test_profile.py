"""The compile line: what torch.compile spent between two steps, from torch's own record, and nothing where it
compiled nothing; a profiled step's tables, one write each."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from pipetune.profile import PROFILE_ENV, CompileLog, profiled


def test_the_compile_line_says_where_the_first_steps_time_went(monkeypatch: pytest.MonkeyPatch) -> None:
    zero = {key: 0.0 for key in CompileLog.KEYS} | {f"{a}.{b}": 0.0 for a, b in CompileLog.COUNTS}
    first = zero | {
        "bytecode_tracing": 6.0,
        "_compile.compile_inner": 30.0,
        "OutputGraph.call_user_compiler": 20.0,
        "backward._backward_impl": 11.5,
        "stats.unique_graphs": 2,
        "aot_autograd.autograd_cache_hit": 2,
        "inductor.fxgraph_cache_hit": 4,
    }
    records = iter([zero, first, first])
    monkeypatch.setattr(CompileLog, "_read", classmethod(lambda cls: next(records)))
    log = CompileLog()
    assert log.line() == (
        "compile: 2 graphs in 41.5 s (dynamo's tracing 6.0 s, the compilers 31.5 s, guards and the rest 4.0 s); "
        "caches: AOTAutograd 2 hits / 0 missed / 0 bypassed, inductor's FX graphs 4 hits / 0 missed"
    )
    assert log.line() == ""  # the next step compiled nothing


def test_without_torchs_record_the_line_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.utils

    monkeypatch.delattr(torch._dynamo.utils, "compile_times")
    assert CompileLog._read() == {} and CompileLog().line() == ""


def test_a_ranks_profile_table_is_written_in_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """PIPETUNE_PROFILE_STEP's tables, one write each (a rank's text and its newline together: under
    PYTHONUNBUFFERED print writes them apart, and two ranks' tables ran into each other)."""
    writes = []
    monkeypatch.setenv(PROFILE_ENV, "3")
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(write=writes.append, flush=lambda: None))
    with profiled(3, 1, torch.device("cpu")):
        torch.ones(4).sum()
    assert len(writes) == 1 and writes[0].startswith("rank 1 profile of step 3 by self_cpu_time_total:\n")
    assert writes[0].endswith("\n") and "aten::" in writes[0]
