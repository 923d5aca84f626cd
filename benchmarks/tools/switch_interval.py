"""How long a thread of operator calls waits for the interpreter's lock beside a thread that holds it, by switch
interval: the reading of why cuDNN's plan builds ran ~1.5x slower beside the model's load and compile than in a
step (2026-12-07-forward-thread-and-a-ninth-machine-one-h100.md), which `attention.BUILD_SWITCH_INTERVAL` acts on.

A "length" stands for one plan build: `--long` calls that give the lock up for `--long-ms` each (a matmul sized
to take that long here, as cuDNN's build gives it up) and `--small` small operator calls. A torch operator gives
the lock up for its call; a thread that takes it back while another holds it waits until that one yields, at the
latest one switch interval later. The "busy" thread is a pure-Python loop, as dynamo's tracing nearly is. Each
interval is timed alone and beside the busy thread, `--repeats` times; medians are printed, per length.

    python3 benchmarks/tools/switch_interval.py [--lengths 40] [--long 3] [--long-ms 10] [--small 10] \
        [--intervals 5,0.5] [--repeats 3] [--out probe.json]

Only the direction transfers to a GPU host: the OS's wake-up times, the number of cores and what the other
thread does there differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def sized_matmul(ms: float) -> torch.Tensor:
    """A square matrix whose product with itself takes about `ms` milliseconds here (one thread)."""
    n = 64
    while True:
        a = torch.randn(n, n)
        started = time.perf_counter()
        a @ a
        took = (time.perf_counter() - started) * 1e3
        if took >= ms or n >= 4096:
            return a
        n = int(n * max(1.1, min(2.0, (ms / max(took, 1e-3)) ** (1 / 3))))


def one_length(big: torch.Tensor, small: torch.Tensor, long_calls: int, small_calls: int) -> float:
    """Milliseconds of one stand-in plan build."""
    started = time.perf_counter()
    for _ in range(long_calls):
        big @ big
    for _ in range(small_calls):
        (small @ small)[:32].clone()
    return (time.perf_counter() - started) * 1e3


def timed(args: argparse.Namespace, big: torch.Tensor, small: torch.Tensor, beside: bool) -> list[float]:
    """Each length's milliseconds, the builds in a thread of their own, beside a busy one or alone."""
    times: list[float] = []
    stop = threading.Event()

    def busy() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    def builds() -> None:
        times.extend(one_length(big, small, args.long, args.small) for _ in range(args.lengths))

    other = threading.Thread(target=busy) if beside else None
    builder = threading.Thread(target=builds)
    if other is not None:
        other.start()
    builder.start()
    builder.join()
    stop.set()
    if other is not None:
        other.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=40, help="stand-in plan builds a run")
    parser.add_argument("--long", type=int, default=3, help="calls a length that give the lock up for long")
    parser.add_argument("--long-ms", type=float, default=10.0, help="milliseconds each long call takes")
    parser.add_argument("--small", type=int, default=10, help="small operator calls a length")
    parser.add_argument("--intervals", default="5,0.5", help="switch intervals to try, milliseconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the runs as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    big, small = sized_matmul(args.long_ms), torch.randn(64, 64)
    before, rows = sys.getswitchinterval(), []
    try:
        for repeat in range(args.repeats):
            for interval in (float(ms) for ms in args.intervals.split(",")):
                sys.setswitchinterval(interval / 1e3)
                alone, beside = (statistics.median(timed(args, big, small, b)) for b in (False, True))
                rows.append({"repeat": repeat, "interval_ms": interval, "alone_ms": alone, "beside_ms": beside})
                print(f"interval {interval:g} ms: a length {alone:.1f} ms alone, {beside:.1f} beside a busy thread")
    finally:
        sys.setswitchinterval(before)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
