"""The thread that runs the documents kernel's forwards (model/forward_thread.py): a caller gets what the call
would have given it, computed in that thread without autograd, an exception included."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from pipetune.model.forward_thread import ForwardThread


def test_a_call_runs_in_the_thread_without_autograd_and_gives_its_result_or_error() -> None:
    worker = ForwardThread(torch.device("cpu"))
    try:
        x = torch.randn(3, requires_grad=True)
        seen = []

        def double(t: torch.Tensor) -> torch.Tensor:
            seen.append((threading.current_thread(), torch.is_grad_enabled()))
            return t * 2

        out = worker.run(double, x)
        assert seen == [(worker.thread, False)] and torch.is_grad_enabled()
        assert torch.equal(out, x.detach() * 2) and out.grad_fn is None
        assert worker.run(lambda: worker.run(double, x)) is not None  # from the thread itself: in place
        assert seen[-1][0] is worker.thread

        def fail() -> None:
            raise torch.OutOfMemoryError("no room")

        with pytest.raises(torch.OutOfMemoryError, match="no room"):  # the caller's handlers see its own type
            worker.run(fail)
        queued = [worker.submit(lambda i=i: i) for i in range(5)]  # in order, each its own result
        assert [job.result() for job in queued] == list(range(5))
    finally:
        worker.close()
    assert not worker.thread.is_alive()


def test_plan_builds_shorten_the_switch_interval_until_the_last_ends() -> None:
    from pipetune.model.attention import BUILD_SWITCH_INTERVAL, FastSwitching

    before, switching = sys.getswitchinterval(), FastSwitching()
    try:
        switching.enter()
        switching.enter()  # a second build beside the first: the interval it finds is already short
        assert sys.getswitchinterval() == pytest.approx(BUILD_SWITCH_INTERVAL)
        switching.leave()
        assert sys.getswitchinterval() == pytest.approx(BUILD_SWITCH_INTERVAL)  # one still runs
        switching.leave()
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
