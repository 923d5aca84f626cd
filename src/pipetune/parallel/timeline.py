"""When each stage computed what: forward/backward actions of one schedule step, and the measured bubble.

The stage's `forward_one_chunk` / `backward_one_chunk` and the schedule's loss function are wrapped
to record start and end of each action (CUDA events on GPU, so kernels are timed, not launches; wall
clock on CPU). The loss runs on the last stage between a microbatch's forward and backward: it is
work, not waiting (with train.fused_loss it holds lm_head too). Time a rank spends outside those
actions within the step is its bubble: waiting for its neighbours.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipetune.config import Config
from pipetune.parallel.process_group import DistEnv
from pipetune.schedules import ideal_bubble


@dataclass
class Action:
    rank: int
    stage: int
    kind: str
    """"F" (forward), "L" (loss, last stage) or "B" (backward)."""
    microbatch: int
    start_ms: float
    end_ms: float


class _Clock:
    """A point in time: a recorded CUDA event on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: object, end: object) -> float:
        if self.device.type == "cuda":
            return start.elapsed_time(end)
        return (end - start) * 1000.0


class StageTimeline:
    """Records the actions of one rank's pipeline stages (and its schedule's loss) while `recording` is True."""

    def __init__(self, stages: list, schedule: object, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.clock = _Clock(device)
        self.recording = False
        self._marks: list[tuple[int, str, int, object, object]] = []
        self._origin: object = None
        for stage in stages:
            for kind, method in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                setattr(stage, method, self._wrap(stage.stage_index, kind, getattr(stage, method)))
        last = [stage for stage in stages if stage.is_last]
        if last and getattr(schedule, "_loss_fn", None) is not None:  # the schedule calls self._loss_fn(out, target)
            schedule._loss_fn = self._wrap_loss(last[0].stage_index, schedule._loss_fn)

    def _wrap(self, stage_index: int, kind: str, fn):
        def timed(chunk_id, *args, **kwargs):
            if not self.recording:
                return fn(chunk_id, *args, **kwargs)
            start = self.clock.now()
            out = fn(chunk_id, *args, **kwargs)
            self._marks.append((stage_index, kind, chunk_id, start, self.clock.now()))
            return out

        return timed

    def _wrap_loss(self, stage_index: int, fn):
        def timed(*args, **kwargs):
            if not self.recording:
                return fn(*args, **kwargs)
            microbatch = sum(1 for mark in self._marks if mark[1] == "L")  # losses come in microbatch order
            start = self.clock.now()
            out = fn(*args, **kwargs)
            self._marks.append((stage_index, "L", microbatch, start, self.clock.now()))
            return out

        return timed

    def start(self) -> None:
        self._marks.clear()
        self._origin = self.clock.now()
        self.recording = True

    def stop(self) -> tuple[list[Action], float]:
        """This rank's actions (ms since start) and the step's duration on this rank."""
        end = self.clock.now()
        self.recording = False
        if self.clock.device.type == "cuda":
            torch.cuda.synchronize(self.clock.device)
        actions = [
            Action(
                self.rank,
                stage,
                kind,
                mb,
                self.clock.elapsed_ms(self._origin, s),
                self.clock.elapsed_ms(self._origin, e),
            )
            for stage, kind, mb, s, e in self._marks
        ]
        return actions, self.clock.elapsed_ms(self._origin, end)


def gather_timeline(actions: list[Action], duration_ms: float, world_size: int) -> dict | None:
    """All ranks' actions on rank 0, with each rank's busy fraction and the measured bubble."""
    mine = {"actions": [asdict(a) for a in actions], "duration_ms": duration_ms}
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * world_size if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
    step_ms = max(part["duration_ms"] for part in parts)
    busy = [sum(a["end_ms"] - a["start_ms"] for a in part["actions"]) for part in parts]
    return {
        "step_ms": step_ms,
        "busy_ms": busy,
        "bubble": [1 - b / step_ms for b in busy],
        "actions": [a for part in parts for a in part["actions"]],
    }


def plot_timeline(timeline: dict, path: Path, title: str = "") -> Path:
    """A Gantt chart: one row per rank, forward blue, loss green, backward orange; gaps are the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_ranks = len(timeline["busy_ms"])
    fig, ax = plt.subplots(figsize=(12, 1.3 + 0.6 * n_ranks))
    colors = {"F": "#4C72B0", "L": "#55A868", "B": "#DD8452"}
    for a in timeline["actions"]:
        width = a["end_ms"] - a["start_ms"]
        ax.barh(a["rank"], width, left=a["start_ms"], color=colors[a["kind"]], edgecolor="white", linewidth=0.5)
        ax.text(
            (a["start_ms"] + a["end_ms"]) / 2,
            a["rank"],
            f"{a['kind']}{a['microbatch']}" if a["kind"] != "L" else "",
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(n_ranks), [f"rank {r}\nbubble {b:.0%}" for r, b in enumerate(timeline["bubble"])])
    ax.set_ylim(n_ranks - 0.5, -1.2)  # rank 0 on top, a free band above it for the legend
    names = {"F": "forward", "L": "loss", "B": "backward"}
    kinds = {a["kind"] for a in timeline["actions"]}
    handles = [Patch(color=colors[k], label=name) for k, name in names.items() if k in kinds]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncols=len(handles))
    ax.set_xlabel("ms since step start")
    ax.set_title(title or f"one schedule step: {timeline['step_ms']:.1f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_timeline(timeline: StageTimeline, env: DistEnv, run_dir: Path, config: Config) -> None:
    """Gather one schedule step's actions to rank 0 and write timeline.json (plot_saved_timeline draws it)."""
    summary = gather_timeline(*timeline.stop(), env.world_size)
    if summary is None:
        return
    p = config.parallel
    summary["expected_bubble"] = ideal_bubble(p.pp, p.stages_per_rank, p.n_microbatches)
    (run_dir / "timeline.json").write_text(json.dumps(summary, indent=1))


def plot_saved_timeline(run_dir: Path, config: Config) -> None:
    """timeline.png from timeline.json, after the last step: drawing it takes longer than a step."""
    path = run_dir / "timeline.json"
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    p = config.parallel
    m = p.n_microbatches
    title = (
        f"{p.schedule}, pp={p.pp}, {m} microbatches: step {summary['step_ms']:.1f} ms, bubble "
        + ", ".join(f"{b:.0%}" for b in summary["bubble"])
        + f" (ideal {summary['expected_bubble']:.0%})"
    )
    plot_timeline(summary, run_dir / "timeline.png", title)
