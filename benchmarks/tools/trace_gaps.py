"""Where a GPU waits in a profiled step: its idle gaps, and what the host was doing in each.

Reads a Chrome trace that PIPETUNE_PROFILE_STEP with PIPETUNE_PROFILE_TRACE=DIR wrote (DIR/trace-rank<R>.json.gz),
merges the GPU's kernels and copies into busy intervals, and prints the GPU's busy and idle time over the step,
then the longest gaps with the host operators that cover each gap's start (outermost first) and the host's
calls during it. With --launchers, it prints instead where the GPU's time goes by what launched it: each kernel,
copy and fill's time summed by its kind and the host operators around its launch (the innermost non-aten operator,
e.g. a custom operator or a compiled graph, then the innermost aten one), which tells, say, whose copies the
"Memcpy DtoD" rows are. With --between, it sums the idle time by the gaps' widths (how much lies in launch-sized
gaps, how much in long ones) and the gaps of at least --min-us by the GPU events on their two sides (the kernel that
ended, the one that started), which tells which boundaries of a step the GPU waits at.

    python3 benchmarks/tools/trace_gaps.py DIR/trace-rank0.json.gz [--top 12] [--min-us 50] [--launchers | --between]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The GPU's kernels and copies (all streams) merged into disjoint busy intervals, in µs."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def launchers(events: list[dict]) -> Counter:
    """GPU µs by (kind: kernel, gpu_memcpy or gpu_memset with the kernel's name cut; the host operators around
    the runtime call that launched it: innermost non-aten > innermost aten), matched by correlation id."""
    launched: dict[int, str] = {}
    by_thread: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime"):
            by_thread.setdefault(e.get("tid"), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e["cat"] == "cpu_op":
                stack.append(e)
                continue
            aten = next((o["name"] for o in reversed(stack) if o["name"].startswith("aten::")), "")
            outer = next((o["name"][:48] for o in reversed(stack) if not o["name"].startswith("aten::")), "")
            launched[e.get("args", {}).get("correlation")] = " > ".join(n for n in (outer, aten) if n) or "?"
    totals: Counter = Counter()
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            kind = e["name"][:40] if e["cat"] == "kernel" else e["cat"]
            totals[(kind, launched.get(e.get("args", {}).get("correlation"), "?"))] += e["dur"]
    return totals


WIDTHS_US = (5, 20, 50, 200, 1000)
"""--between's buckets of gap widths (µs): under 5, 5-20, ..., 1,000 and over."""


def between(events: list[dict], min_us: float) -> tuple[Counter, Counter, Counter]:
    """The idle µs and count of gaps between the GPU's busy intervals by width bucket, and the gaps of at least
    `min_us` summed by (the GPU event that ended last before the gap, the one that started it), names cut."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"][:44]) for e in events if e.get("cat") in GPU_CATEGORIES)
    idle, count, pairs = Counter(), Counter(), Counter()
    last_end, last_name = None, ""
    for start, end, name in spans:
        if last_end is not None and start > last_end:
            width = start - last_end
            bucket = next((f"< {w} us" for w in WIDTHS_US if width < w), f">= {WIDTHS_US[-1]} us")
            idle[bucket] += width
            count[bucket] += 1
            if width >= min_us:
                pairs[(last_name, name)] += width
        if last_end is None or end > last_end:
            last_end, last_name = end, name
    return idle, count, pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--min-us", type=float, default=50.0, help="gaps shorter than this are counted, not listed")
    parser.add_argument("--launchers", action="store_true", help="GPU time by what launched it, not the gaps")
    parser.add_argument("--between", action="store_true", help="idle time by gap width and by the events around")
    args = parser.parse_args()
    events = load(args.trace)
    if args.between:
        idle, count, pairs = between(events, args.min_us)
        buckets = [f"< {w} us" for w in WIDTHS_US] + [f">= {WIDTHS_US[-1]} us"]  # narrowest first
        widths = [f"{k} {idle[k] / 1e3:.2f} ms ({count[k]})" for k in buckets if k in idle]
        print("idle time by gap width: " + ", ".join(widths))
        print(f"gaps >= {args.min_us:.0f} us by the GPU events around them (ended | started):")
        for (before, after), us in pairs.most_common(args.top):
            print(f"{us / 1e3:10.2f} ms  {before:<44} | {after}")
        return
    if args.launchers:
        totals = launchers(events)
        whole = sum(totals.values()) or 1
        print(f"GPU time {whole / 1e3:.2f} ms (all streams, summed) by kind and launcher:")
        for (kind, launcher), us in totals.most_common(args.top):
            print(f"{us / 1e3:10.2f} ms {us / whole:6.1%}  {kind:<40}  {launcher}")
        return
    busy = busy_intervals(events)
    if not busy:
        print(f"{args.trace}: no GPU kernels in the trace (a CPU run?)")
        return
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")]
    start = min(e["ts"] for e in host) if host else busy[0][0]
    end = max(busy[-1][1], max((e["ts"] + e["dur"] for e in host), default=0))
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)]
    gaps.append((busy[0][0] - start, start, busy[0][0]))  # the step's start until its first kernel
    gaps.append((end - busy[-1][1], busy[-1][1], end))  # its last kernel until the step's end
    span, on = end - start, sum(b - a for a, b in busy)
    listed = [g for g in gaps if g[0] >= args.min_us]
    print(
        f"step span {span / 1e3:.2f} ms: GPU busy {on / 1e3:.2f} ms ({on / span:.1%}), idle {(span - on) / 1e3:.2f} ms "
        f"in {len(gaps)} gaps, {len(listed)} of them >= {args.min_us:.0f} us ({sum(g[0] for g in listed) / 1e3:.2f} ms)"
    )
    for width, a, b in sorted(listed, reverse=True)[: args.top]:
        covering = sorted(
            (e for e in host if e["ts"] <= a < e["ts"] + e["dur"] and e.get("cat") != "cuda_runtime"),
            key=lambda e: -e["dur"],
        )
        inside = Counter(e["name"][:60] for e in host if a <= e["ts"] < b and e.get("cat") == "cuda_runtime")
        print(f"\n{width / 1e3:7.2f} ms idle at +{(a - start) / 1e3:.2f} ms")
        print("   host in: " + " > ".join(e["name"][:50] for e in covering[:5]))
        if inside:
            print("   runtime calls: " + ", ".join(f"{n} x{c}" for n, c in inside.most_common(6)))


if __name__ == "__main__":
    main()
