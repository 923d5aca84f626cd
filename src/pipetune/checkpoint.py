"""Resumable training state: each rank writes its own part, rank 0 commits it last with a marker.

    <output.dir>/checkpoints/step-<N>/
      adapter.rank<k>.safetensors   rank k's adapter tensors under PEFT's full-model names
      state.rank<k>.safetensors     rank k's AdamW moments keyed "<full parameter name>/<field>", its torch RNG states
      state.rank<k>.json            data position, scheduler, optimizer hyper-parameters, python/numpy RNG, file hashes
      COMMITTED                     JSON written last by rank 0, after every rank wrote its part

A directory without COMMITTED is never loaded. Optimizer state is keyed by full-model parameter
name, not by position, so a checkpoint written with pp=2 loads under pp=4: every rank reads all
parts and takes the names it holds. Tensors are saved whole, also those FSDP shards over dp
(parallel.dp_shard), and each rank cuts its own shard on load, so sharded and plain replicas resume
each other's checkpoints. Nothing here goes through pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch.distributed.tensor import DTensor, distribute_tensor

from pipetune.config import Config, ConfigError

if TYPE_CHECKING:  # peft (2 s to import) only where adapters are read or written: the launcher finds
    import peft  # and checks checkpoints without it

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMMITTED"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


@dataclass
class Position:
    """Where the loop stands: the data order is a function of (seed, epoch), so this is enough to continue it."""

    step: int = 0
    """Optimizer steps done (skipped ones included: their batches were consumed)."""
    epoch: int = 0
    """Epoch of the next optimizer step."""
    batch: int = 0
    """Index of the next optimizer step within `epoch`."""
    skipped_in_row: int = 0
    """Consecutive steps skipped for non-finite values just before this point."""


@dataclass
class Checkpoint:
    path: Path
    marker: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.marker["step"])


# --------------------------------------------------------------------------- finding checkpoints


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step}"


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        number = path.name.removeprefix("step-")
        if path.is_dir() and path.name.startswith("step-") and number.isdigit():
            found.append((int(number), path))
    return sorted(found)


def committed_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Committed checkpoints of a run, oldest first."""
    found = []
    for _, path in _step_dirs(run_dir):
        marker = path / MARKER
        if not marker.is_file():
            continue
        try:
            found.append(Checkpoint(path, json.loads(marker.read_text())))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"checkpoint marker {marker} is damaged ({e}); delete {path} to resume from the checkpoint before it"
            ) from None
    return found


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = committed_checkpoints(run_dir)
    return found[-1] if found else None


def find_resume_checkpoint(config: Config, restarted: bool = False) -> Checkpoint | None:
    """The checkpoint this run continues from: the newest committed one when resuming, else None.

    A fresh start (train.resume = "never", not a restarted worker group) in a run directory that
    already holds committed checkpoints is refused, so an earlier run's state is never overwritten
    by accident. The chosen checkpoint is checked against the config and its files' hashes here,
    before any training starts.
    """
    run_dir = Path(config.output.dir)
    latest = latest_checkpoint(run_dir)
    if config.train.resume != "auto" and not restarted:
        if latest is not None:
            raise ConfigError(
                f"output.dir = {str(run_dir)!r} already holds checkpoints of an earlier run "
                f"(newest: {latest.path.name}); "
                "pass --resume (train.resume = 'auto') to continue it, or choose another output.dir "
                f"(or delete {run_dir / CHECKPOINTS_DIR}) to start over"
            )
        return None
    if latest is None:
        return None
    check_compatible(latest, config)
    verify_files(latest)
    return latest


def commit_metadata(config: Config, step: int, world_size: int) -> dict[str, Any]:
    """What COMMITTED records: the step, the layout it was written with, and what must match to resume."""
    return {
        "step": step,
        "world_size": world_size,
        "pp": config.parallel.pp,
        "dp": config.parallel.dp,
        "model": config.model.name,
        "lora": {
            "r": config.lora.r,
            "alpha": config.lora.alpha,
            "target_modules": sorted(config.lora.target_modules),
        },
    }


def check_compatible(checkpoint: Checkpoint, config: Config) -> None:
    """Refuse a checkpoint of another model or LoRA shape; a different pipeline layout is fine."""
    expected = commit_metadata(config, checkpoint.step, 0)
    problems = []
    if checkpoint.marker.get("model") != expected["model"]:
        problems.append(f"model.name {checkpoint.marker.get('model')!r} (config: {expected['model']!r})")
    saved_lora = checkpoint.marker.get("lora", {})
    for key in ("r", "alpha", "target_modules"):
        if saved_lora.get(key) != expected["lora"][key]:
            problems.append(f"lora.{key} {saved_lora.get(key)!r} (config: {expected['lora'][key]!r})")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written with {'; '.join(problems)}; resume with the settings it "
            f"was written with, or start a new run in another output.dir"
        )


def verify_files(checkpoint: Checkpoint) -> None:
    """Every rank's part exists and has the hash recorded when it was written."""
    for rank in range(int(checkpoint.marker["world_size"])):
        meta = _read_rank_meta(checkpoint, rank)
        for name, digest in meta["files"].items():
            _read_verified(checkpoint, name, digest)


def _damaged(checkpoint: Checkpoint, what: str) -> CheckpointError:
    older = [c for c in committed_checkpoints(checkpoint.path.parent.parent) if c.step < checkpoint.step]
    fallback = f"resume from {older[-1].path.name}" if older else "start over"
    return CheckpointError(f"checkpoint {checkpoint.path} is damaged: {what}; delete {checkpoint.path} to {fallback}")


def _read_rank_meta(checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
    path = checkpoint.path / f"state.rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise _damaged(checkpoint, f"{path.name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _damaged(checkpoint, f"{path.name} is not valid JSON ({e})") from None


def _read_verified(checkpoint: Checkpoint, name: str, digest: str) -> dict[str, torch.Tensor]:
    path = checkpoint.path / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _damaged(checkpoint, f"{name} is missing") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise _damaged(checkpoint, f"{name} does not match the hash recorded when it was written")
    try:
        return load_tensors(data)
    except SafetensorError as e:
        raise _damaged(checkpoint, f"{name} cannot be read ({e})") from None


# --------------------------------------------------------------------------- saving


def save_checkpoint(
    config: Config,
    position: Position,
    rank: int,
    world_size: int,
    peft_model: peft.PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    param_names: dict[torch.Tensor, str],
) -> Path:
    """Write this rank's part of step `position.step`; rank 0 commits after all parts are on disk.

    Collective: every rank must call it. Returns once the checkpoint is committed.
    """
    from pipetune.model import lora

    run_dir = Path(config.output.dir)
    path = checkpoint_dir(run_dir, position.step)
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (path / MARKER).unlink(missing_ok=True)

    tensors, extra = _optimizer_tensors(optimizer, param_names)
    tensors.update(_torch_rng_tensors())
    files = {
        f"adapter.rank{rank}.safetensors": _write_safetensors(
            path / f"adapter.rank{rank}.safetensors", lora.adapter_state(peft_model)
        ),
        f"state.rank{rank}.safetensors": _write_safetensors(path / f"state.rank{rank}.safetensors", tensors),
    }
    scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    meta = {
        "rank": rank,
        "position": asdict(position),
        "scheduler": scheduler_state,
        "optimizer_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "optimizer_extra": extra,
        "rng": _python_rng_state(),
        "files": files,
    }
    _write_atomic(path / f"state.rank{rank}.json", json.dumps(meta).encode())

    _barrier()  # every part is on disk before the marker
    if rank == 0:
        marker = dict(commit_metadata(config, position.step, world_size), position=asdict(position))
        _write_atomic(path / MARKER, json.dumps(marker, indent=1).encode())
        prune_checkpoints(run_dir, config.train.keep_checkpoints)
    _barrier()  # nobody runs ahead of (or is killed before) the commit
    return path


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` committed checkpoints; drop older ones and uncommitted leftovers older than the newest."""
    dirs = _step_dirs(run_dir)
    committed = [(step, path) for step, path in dirs if (path / MARKER).is_file()]
    if not committed:
        return []
    newest = committed[-1][0]
    keep_steps = {step for step, _ in committed[-max(1, keep) :]}
    doomed = [path for step, path in dirs if step not in keep_steps and step < newest]
    for path in doomed:
        (path / MARKER).unlink(missing_ok=True)  # first: a half-deleted directory must never look committed
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, param_names: dict[torch.Tensor, str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """AdamW state under "optim/<full parameter name>/<field>" (tensors, whole) and non-tensor fields by name.

    A collective over dp under FSDP: each sharded moment is gathered (same order on every replica)."""
    from pipetune.model import lora

    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = param_names[param]
            for field, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    whole = lora.full_tensor(value.detach())
                    tensors[f"optim/{name}/{field}"] = whole.to("cpu", copy=True).contiguous()
                else:
                    extra.setdefault(name, {})[field] = value
    return tensors, extra


def _torch_rng_tensors() -> dict[str, torch.Tensor]:
    states = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["rng/cuda"] = torch.cuda.get_rng_state()
    return states


def _python_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    return state


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    data = save_tensors(dict(sorted(tensors.items())), metadata={"format": "pt"})
    _write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Through a temporary file, fsync and a rename: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------- loading


def load_checkpoint(
    checkpoint: Checkpoint,
    rank: int,
    peft_model: peft.PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    param_names: dict[torch.Tensor, str],
) -> Position:
    """Restore this rank's adapters, optimizer, scheduler and RNG from every rank's part; returns the position."""
    adapters: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    rng: dict[str, torch.Tensor] = {}
    metas = []
    for saved_rank in range(int(checkpoint.marker["world_size"])):
        meta = _read_rank_meta(checkpoint, saved_rank)
        metas.append(meta)
        for name, digest in meta["files"].items():
            for key, tensor in _read_verified(checkpoint, name, digest).items():
                if name.startswith("adapter."):
                    adapters[key] = tensor
                elif key.startswith("optim/"):
                    optim[key] = tensor
                elif saved_rank == rank:  # RNG states are per rank
                    rng[key] = tensor

    _load_adapter(checkpoint, peft_model, adapters)
    _load_optimizer(checkpoint, optimizer, param_names, optim, metas)
    scheduler.load_state_dict(dict(metas[0]["scheduler"], lr_lambdas=[None] * len(optimizer.param_groups)))
    if rank < len(metas):  # a rank the saved layout did not have keeps its fresh seed
        _set_rng(rng, metas[rank]["rng"])
    return Position(**metas[0]["position"])


def _load_adapter(checkpoint: Checkpoint, peft_model: peft.PeftModel, adapters: dict[str, torch.Tensor]) -> None:
    import peft

    from pipetune.model import lora

    wanted = lora.adapter_parameters(peft_model)
    missing = sorted(name for name in wanted if name not in adapters)
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} has no adapter tensor {missing[0]} ({len(missing)} missing); "
            "it was written for another model or LoRA layout: start a new run in another output.dir"
        )
    mismatched = [name for name in wanted if adapters[name].shape != wanted[name].shape]
    if mismatched:
        raise CheckpointError(
            f"checkpoint {checkpoint.path}: {mismatched[0]} has shape {tuple(adapters[mismatched[0]].shape)}, "
            f"the model's is {tuple(wanted[mismatched[0]].shape)}; resume with the LoRA settings it was written with"
        )
    peft.set_peft_model_state_dict(peft_model, {name: shard_like(adapters[name], wanted[name]) for name in wanted})


def _load_optimizer(
    checkpoint: Checkpoint,
    optimizer: torch.optim.Optimizer,
    param_names: dict[torch.Tensor, str],
    states: dict[str, torch.Tensor],
    metas: list[dict[str, Any]],
) -> None:
    """Build a positional optimizer state_dict for this rank's parameters from the name-keyed state."""
    extra: dict[str, dict[str, Any]] = {}
    for meta in metas:
        extra.update(meta["optimizer_extra"])
    by_name: dict[str, dict[str, Any]] = {}
    for key, tensor in states.items():
        name, _, field = key.removeprefix("optim/").rpartition("/")
        by_name.setdefault(name, {})[field] = tensor
    for name, fields in extra.items():
        by_name.setdefault(name, {}).update(fields)

    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    saved_groups = metas[0]["optimizer_groups"]
    for group_index, group in enumerate(optimizer.param_groups):
        saved = saved_groups[min(group_index, len(saved_groups) - 1)]
        hyper = {
            k: (tuple(saved[k]) if isinstance(v, tuple) else saved[k]) if k in saved else v for k, v in group.items()
        }
        hyper["params"] = []
        for param in group["params"]:
            name = param_names[param]
            if name in by_name:
                state[index] = {
                    field: shard_like(value, param) if _is_moment(value, param) else value
                    for field, value in by_name[name].items()
                }
            elif by_name:  # some state saved, none for this parameter: not the same model
                raise CheckpointError(
                    f"checkpoint {checkpoint.path} has no optimizer state for {name}; it was written for another "
                    "model or LoRA layout: start a new run in another output.dir"
                )
            hyper["params"].append(index)
            index += 1
        groups.append(hyper)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` cut like `like` when that is a DTensor (this rank's shard, no communication), else `whole`."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def _is_moment(value: Any, param: torch.Tensor) -> bool:
    """A per-element optimizer state (exp_avg, exp_avg_sq), as opposed to the scalar step count."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _set_rng(tensors: dict[str, torch.Tensor], rng: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
