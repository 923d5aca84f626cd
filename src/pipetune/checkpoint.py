"""Resumable training state: each rank writes its own part, rank 0 commits it last with a marker.

    <output.dir>/checkpoints/step-<N>/
      adapter.rank<k>.safetensors   rank k's adapter tensors under PEFT's full-model names
      state.rank<k>.safetensors     rank k's AdamW moments keyed "<full parameter name>/<field>", its torch RNG states
      state.rank<k>.json            data position, scheduler, optimizer hyper-parameters, python/numpy RNG, file hashes
      COMMITTED                     JSON written last by rank 0, after every rank wrote its part: the step, the
                                    resolved config, the data files' SHA-256, the hash of every rank's state JSON

Every file is covered by a hash: the marker holds those of the JSON files, which hold those of the
safetensors files. A directory without COMMITTED is never loaded. Optimizer state is keyed by full-model parameter
name, not by position, so a checkpoint written with pp=2 loads under pp=4: every rank reads all
parts and takes the names it holds. Tensors are saved whole, also those FSDP shards over dp
(parallel.dp_shard) or tensor parallelism splits over tp, and each rank cuts its own shard on load, so
sharded and plain layouts resume each other's checkpoints. Nothing here goes through pickle.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
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
from pipetune.files import fsync_dir, write_atomic
from pipetune.run_lock import LAUNCH_FILE, LOCK_FILE

if TYPE_CHECKING:  # peft (2 s to import) only where adapters are read or written: the launcher finds
    import peft  # and checks checkpoints without it

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMMITTED"
PART_NAME = re.compile(r"(adapter|state)\.rank\d+\.safetensors")
"""The only file names a rank's state JSON may list: plain names inside the checkpoint directory."""
RESUME_REFUSED = {
    "model": ("name", "init", "tokenizer", "dtype", "quantize"),
    "data": (
        "source",
        "max_length",
        "max_summary_tokens",
        "buckets",
        "transcript_column",
        "summary_column",
        "synthetic_train",
        "synthetic_validation",
        "validation_fraction",
        "system_prompt",
        "synthetic_lengths",
        "packing",
        "max_samples_per_row",
    ),
    "lora": ("r", "alpha", "target_modules"),
    "train": ("seed", "batch_size", "grad_accum"),
    "parallel": ("dp",),
}
"""Keys a resumed run must keep: they shape the base model (its weights as the adapters see them: dtype and
quantization included), the adapters, the samples (the prompt's system turn included) or the data order and
position (seed, batch_size x dp, grad_accum; packing and the samples a packed row may hold decide which samples
share a row). A key the run never reads may change (`_unread`): max_samples_per_row without packing, the
synthetic_* keys with another data source. Every other key may change on resume and is applied: lr, weight
decay and the schedule (warmup_steps, min_lr_ratio, epochs, max_steps) included. The data's content must not
change either: COMMITTED records a digest of every data file (`data_content`). Nor the validation meetings
(synthetic_validation): metrics.csv's val_loss compares the losses of one set."""
SANE_ADAPTER_MAX = 1e4
"""The largest adapter weight magnitude a checkpoint is resumed from or recommended with. LoRA weights start at
about 1/sqrt(hidden size) (A) and 0 (B) and AdamW moves each by about lr a step: a value beyond this is a run
that diverged (lr far too high), not one that learned."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


@dataclass(frozen=True)
class CheckpointSettings:
    """What checkpoints take from a run's config (`CheckpointSettings.of`): where they go, how many stay, whether
    a run resumes, and what each one records for a resume to be checked against."""

    run_dir: Path
    """output.dir: checkpoints go to <run_dir>/checkpoints."""
    keep: int
    """train.keep_checkpoints: committed checkpoints kept (the newest is never deleted)."""
    resume: bool
    """train.resume = "auto": continue from the newest committed checkpoint."""
    recorded: dict[str, Any]
    """What COMMITTED records besides the step and the world size: the layout (pp, dp, tp), the model, the LoRA
    shape, the resolved config, whose RESUME_REFUSED keys a resumed run must keep, and the data's content
    (`data_content`: each data file's name and SHA-256, as the token cache keys it; a hub dataset's fingerprints)."""

    @classmethod
    def of(cls, config: Config) -> CheckpointSettings:
        """The settings of `config`'s run; reads (hashes) its data files, as the token cache does for its key."""
        from pipetune.data import sources
        from pipetune.data.cache import source_identity

        synthetic = config.data.source == sources.SYNTHETIC  # its settings are refused keys: nothing to hash
        recorded = {
            "data_content": None if synthetic else source_identity(config.data),
            "pp": config.parallel.pp,
            "dp": config.parallel.dp,
            "tp": config.parallel.tp,
            "model": config.model.name,
            "lora": {
                "r": config.lora.r,
                "alpha": config.lora.alpha,
                "target_modules": sorted(config.lora.target_modules),
            },
            "config": config.to_dict(),
        }
        return cls(Path(config.output.dir), config.train.keep_checkpoints, config.train.resume == "auto", recorded)


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
class TrainState:
    """One rank's resumable state: what a checkpoint writes, and restores in place."""

    adapters: dict[str, torch.Tensor]
    """The adapter parameters themselves (DTensor shards under FSDP) under PEFT's saved, full-model names."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    param_names: dict[torch.Tensor, str]
    """Each trained parameter's full-model name: optimizer state is saved by name, so another layout can load it."""

    @classmethod
    def of(
        cls,
        peft_model: peft.PeftModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> TrainState:
        """The state of a LoRA-wrapped model (a stage, or the whole model) trained by `optimizer`."""
        from pipetune.model import lora

        names = {param: name for name, param in peft_model.named_parameters() if param.requires_grad}
        return cls(lora.adapter_parameters(peft_model), optimizer, scheduler, names)


@dataclass
class Checkpoint:
    path: Path
    marker: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.marker["step"])

    @property
    def weights_step(self) -> int:
        """The step whose update the adapter weights hold: steps skipped as non-finite just before changed none."""
        position = self.marker.get("position")
        skipped = position.get("skipped_in_row", 0) if isinstance(position, dict) else 0
        return self.step - skipped if isinstance(skipped, int) else self.step


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
    """Committed checkpoints of a run, oldest first; a directory whose marker is damaged is not one."""
    return [c for c in _marked(run_dir) if isinstance(c, Checkpoint)]


def _marked(run_dir: Path) -> list[Checkpoint | tuple[Path, str]]:
    """Every checkpoint directory with a marker, oldest first: a Checkpoint, or (path, why the marker is damaged)."""
    found: list[Checkpoint | tuple[Path, str]] = []
    for number, path in _step_dirs(run_dir):
        marker = path / MARKER
        if not marker.is_file():
            continue
        try:
            found.append(Checkpoint(path, _parse_marker(marker.read_bytes(), number)))
        except (OSError, ValueError, RecursionError) as e:
            found.append((path, str(e)))
    return found


def _parse_marker(data: bytes, number: int) -> dict[str, Any]:
    """The marker's JSON, if it has the shape save_checkpoint writes (ValueError saying what is wrong otherwise)."""
    marker = json.loads(data.decode("utf-8"))
    if not isinstance(marker, dict):
        raise ValueError(f"a JSON {type(marker).__name__}, not an object")
    if type(marker.get("step")) is not int or marker["step"] != number:
        raise ValueError(f"step {marker.get('step')!r} is not the directory's {number}")
    if type(marker.get("world_size")) is not int or marker["world_size"] < 1:
        raise ValueError(f"world_size {marker.get('world_size')!r} is not a positive integer")
    files = marker.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError("its file hashes are not a name -> hash object")
    if not isinstance(marker.get("config", {}), dict) or not isinstance(marker.get("lora", {}), dict):
        raise ValueError("its config is not an object")
    return marker


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = committed_checkpoints(run_dir)
    return found[-1] if found else None


def find_resume_checkpoint(settings: CheckpointSettings, restarted: bool = False) -> Checkpoint | None:
    """The checkpoint this run continues from: the newest committed one when resuming, else None.

    A fresh start (train.resume = "never", not `restarted`) in a run directory that already holds
    committed checkpoints is refused, so an earlier run's state is never overwritten by accident.
    `restarted`: a restarted attempt of the launch that wrote what is there (run_lock.restarted_launch),
    which continues it; a restart of a launch refused here is not one. The chosen checkpoint is checked
    against the config and its files' hashes here, before any training starts.
    """
    run_dir = settings.run_dir
    marked = _marked(run_dir)
    valid = [c for c in marked if isinstance(c, Checkpoint)]
    latest = valid[-1] if valid else None
    finished = [name for name in ("adapter", "metrics.csv") if (run_dir / name).exists()]
    if not settings.resume and not restarted:
        if marked:
            newest = marked[-1].path if isinstance(marked[-1], Checkpoint) else marked[-1][0]
            raise ConfigError(
                f"output.dir = {str(run_dir)!r} already holds checkpoints of an earlier run "
                f"(newest: {newest.name}); "
                "pass --resume (train.resume = 'auto') to continue it, or choose another output.dir "
                f"(or delete {run_dir / CHECKPOINTS_DIR}) to start over"
            )
        if finished:
            raise ConfigError(
                f"output.dir = {str(run_dir)!r} holds an earlier run ({' and '.join(finished)}) without checkpoints "
                "to continue from; choose another output.dir, or delete them to start over there"
            )
        return None
    if marked and not isinstance(marked[-1], Checkpoint):  # the newest marker is damaged: say so, never skip it
        path, why = marked[-1]
        fallback = f"resume from {latest.path.name}" if latest else "start over"
        raise CheckpointError(f"checkpoint marker {path / MARKER} is damaged ({why}); delete {path} to {fallback}")
    if latest is None:
        if not restarted and (run_dir / "adapter").exists():
            raise ConfigError(
                f"output.dir = {str(run_dir)!r} holds a finished run's adapter/ but no checkpoint to continue from; "
                "choose another output.dir, or delete it to start over there"
            )
        return None
    check_compatible(latest, settings)
    verify_files(latest)
    problem = adapter_problem(latest)
    if problem is not None:  # resumed, it would stop again with non-finite steps: name one that would not
        raise CheckpointError(f"checkpoint {latest.path} cannot be resumed: {problem}; {diverged_advice(run_dir)}")
    return latest


def require_run_to_resume(run_dir: str | Path) -> None:
    """`--resume` names a run to continue: refuse an output.dir that does not exist or is empty, where it would
    silently start a new run (train.resume = "auto" in a config may: it means "continue if there is a run")."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        state = "does not exist"
    elif run_dir.is_dir() and not any(p.name not in (LOCK_FILE, LAUNCH_FILE) for p in run_dir.iterdir()):
        state = "is empty"
    else:
        return
    raise ConfigError(
        f"--resume: output.dir = {str(run_dir)!r} {state}, so there is no run to continue; point output.dir at "
        "the run to continue, or drop --resume to start a new run there"
    )


def adapter_problem(checkpoint: Checkpoint) -> str | None:
    """Why `checkpoint`'s adapter weights are not worth resuming (non-finite values, or values beyond
    SANE_ADAPTER_MAX: a run that diverged), or None; a damaged part raises CheckpointError."""
    largest, where = 0.0, ""
    for rank in range(checkpoint.marker["world_size"]):
        for name, digest in _rank_files(checkpoint, _read_rank_meta(checkpoint, rank)).items():
            if not name.startswith("adapter."):
                continue
            for key, tensor in _read_verified(checkpoint, name, digest).items():
                if not torch.isfinite(tensor).all():
                    return f"its adapter holds non-finite values ({key})"
                peak = float(tensor.abs().max()) if tensor.numel() else 0.0
                if peak > largest:
                    largest, where = peak, key
    if largest > SANE_ADAPTER_MAX:
        return (
            f"its adapter holds values up to {largest:.1e} ({where}), beyond {SANE_ADAPTER_MAX:g}: the run had "
            "diverged (train.lr too high) before it was written"
        )
    return None


def sane_checkpoint(run_dir: Path, before_step: int | None = None) -> tuple[Checkpoint | None, list[str]]:
    """The newest committed checkpoint whose adapter weights are finite and sane (`adapter_problem`) and, with
    `before_step`, date from before that step (its `weights_step`: skipped steps change no weight); and why each
    newer one is not."""
    rejected = []
    for checkpoint in reversed(committed_checkpoints(run_dir)):
        if before_step is not None and checkpoint.weights_step >= before_step:
            rejected.append(
                f"{checkpoint.path.name} holds the weights of step {checkpoint.weights_step}, not from before step "
                f"{before_step}"
            )
            continue
        try:
            problem = adapter_problem(checkpoint)
        except CheckpointError as e:
            problem = str(e)
        if problem is None:
            return checkpoint, rejected
        rejected.append(f"{checkpoint.path.name}: {problem}")
    return None, rejected


def diverged_advice(run_dir: Path, before_step: int | None = None) -> str:
    """What to resume from when the newest checkpoint is not worth it: the newest sane one (the newer ones moved
    aside, since --resume takes the newest), else a new start with a lower lr."""
    good, _ = sane_checkpoint(run_dir, before_step)
    newer = [c.path.name for c in committed_checkpoints(run_dir) if good is not None and c.step > good.step]
    if good is None:
        return (
            "no committed checkpoint holds finite, sane weights: start over with a lower train.lr in another "
            f"output.dir (or after deleting {Path(run_dir) / CHECKPOINTS_DIR}), and check the data"
        )
    if not newer:
        return f"{good.path} holds finite weights (those of step {good.weights_step}): continue from it with --resume"
    return (
        f"{good.path} holds finite weights (those of step {good.weights_step}): move {', '.join(newer)} out of "
        f"{Path(run_dir) / CHECKPOINTS_DIR} (--resume takes the newest), lower train.lr (applied on resume, like "
        "the schedule), then continue with --resume"
    )


def commit_metadata(settings: CheckpointSettings, step: int, world_size: int) -> dict[str, Any]:
    """What COMMITTED records: the step, the layout it was written with, and what must match to resume."""
    return {"step": step, "world_size": world_size, **settings.recorded}


def check_compatible(checkpoint: Checkpoint, settings: CheckpointSettings) -> None:
    """Refuse a checkpoint whose RESUME_REFUSED keys differ from the config's; every other key may change."""
    expected = settings.recorded
    problems = []
    if checkpoint.marker.get("model") != expected["model"]:
        problems.append(f"model.name {checkpoint.marker.get('model')!r} (config: {expected['model']!r})")
    saved_lora = checkpoint.marker.get("lora", {})
    for key in ("r", "alpha", "target_modules"):
        if saved_lora.get(key) != expected["lora"][key]:
            problems.append(f"lora.{key} {saved_lora.get(key)!r} (config: {expected['lora'][key]!r})")
    saved = checkpoint.marker.get("config", {})  # absent in checkpoints of older versions: model and LoRA only
    defaults = Config().to_dict()  # a key an older version did not record had its default value
    for section, keys in RESUME_REFUSED.items() if saved else ():
        was_section = {**defaults[section], **saved[section]} if isinstance(saved.get(section), dict) else {}
        now_section = expected["config"][section]
        for key in keys:
            name = f"{section}.{key}"
            if name in ("model.name", "lora.r", "lora.alpha", "lora.target_modules"):
                continue  # compared above
            was, now = was_section.get(key), now_section[key]
            if was != now and not (was_section and _unread(name, was_section) and _unread(name, now_section)):
                problems.append(f"{name} {_shown(was)} (config: {_shown(now)})")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written with {'; '.join(problems)}; resume with the settings it "
            f"was written with, or start a new run in another output.dir"
        )
    source = Path(expected["config"]["data"]["source"]).expanduser()
    changed = _changed_data(checkpoint.marker.get("data_content"), expected.get("data_content"), source)
    if changed:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was trained on other data: {changed}; a resume would train the rest of "
            "the run on other samples than its first part. Restore the data it was trained on, or start a new run "
            "in another output.dir"
        )


def _unread(name: str, section: dict[str, Any]) -> bool:
    """A refused key that a run with these settings (its config section) never reads, so that it may change:
    data.max_samples_per_row without packing, data.synthetic_* with a data source that is not synthetic."""
    if name == "data.max_samples_per_row":
        return not section.get("packing")
    if name.startswith("data.synthetic_"):
        from pipetune.data import sources

        return section.get("source") != sources.SYNTHETIC
    return False


def _shown(value: Any) -> str:
    """A recorded value for a message: long text (a system prompt) cut to its start."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _changed_data(was: Any, now: Any, source: Path) -> str | None:
    """What differs between the data content a checkpoint recorded and the config's (None: the same, or nothing
    recorded: a synthetic source, or a checkpoint of an older version); `source`: data.source, whose files the
    records name (a file by its name, a directory's by their path inside it)."""
    if was is None or now is None or was == now:
        return None
    if isinstance(was, list) and isinstance(now, list) and all(isinstance(f, list) for f in was + now):
        before = {name: digest for name, digest in was}
        after = {name: digest for name, digest in now}
        for name in sorted(before.keys() | after.keys()):
            path = source if source.is_file() and name == source.name else source / name
            if name not in after:
                return f"its data file {str(path)!r} is gone"
            if name not in before:
                return f"the data file {str(path)!r} was added since"
            if before[name] != after[name]:
                return (
                    f"the content of {str(path)!r} has changed since (SHA-256 {before[name][:12]}... then, "
                    f"{after[name][:12]}... now)"
                )
    return f"the data source's fingerprint has changed since ({_shown(was)}, now {_shown(now)})"


def verify_files(checkpoint: Checkpoint) -> None:
    """Every rank's part exists and has the hash recorded when it was written."""
    for rank in range(checkpoint.marker["world_size"]):
        for name, digest in _rank_files(checkpoint, _read_rank_meta(checkpoint, rank)).items():
            _read_verified(checkpoint, name, digest)


def _damaged(checkpoint: Checkpoint, what: str) -> CheckpointError:
    older = [c for c in committed_checkpoints(checkpoint.path.parent.parent) if c.step < checkpoint.step]
    fallback = f"resume from {older[-1].path.name}" if older else "start over"
    return CheckpointError(f"checkpoint {checkpoint.path} is damaged: {what}; delete {checkpoint.path} to {fallback}")


def _read_rank_meta(checkpoint: Checkpoint, rank: int) -> dict[str, Any]:
    """Rank `rank`'s state JSON, checked against the marker's hash (markers of older versions have none)."""
    name = f"state.rank{rank}.json"
    try:
        data = (checkpoint.path / name).read_bytes()
    except FileNotFoundError:
        raise _damaged(checkpoint, f"{name} is missing") from None
    digest = checkpoint.marker.get("files", {}).get(name)
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise _damaged(checkpoint, f"{name} does not match the hash recorded when it was written")
    try:
        meta = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise _damaged(checkpoint, f"{name} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise _damaged(checkpoint, f"{name} does not list its rank's files")
    return meta


def _rank_files(checkpoint: Checkpoint, meta: dict[str, Any]) -> dict[str, str]:
    """The files a rank's state JSON lists, by name and hash; only plain part names inside the checkpoint."""
    for name, digest in meta["files"].items():
        if not isinstance(name, str) or not PART_NAME.fullmatch(name) or not isinstance(digest, str):
            raise _damaged(checkpoint, f"it lists a file {name!r} that is not one of its parts")
    return meta["files"]


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
    settings: CheckpointSettings, state: TrainState, position: Position, rank: int, world_size: int
) -> Path:
    """Write this rank's part of step `position.step` under settings.run_dir; rank 0 commits after all parts are
    on disk, recording the config it must be resumed with.

    Collective: every rank must call it. Returns once the checkpoint is committed; older ones are pruned only
    after it is durable (its files and their directory entries fsynced), so a power loss never leaves none.
    """
    from pipetune.model import lora

    run_dir = settings.run_dir
    path = checkpoint_dir(run_dir, position.step)
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (path / MARKER).unlink(missing_ok=True)

    tensors, extra = _optimizer_tensors(state.optimizer, state.param_names)
    tensors.update(_torch_rng_tensors())
    files = {
        f"adapter.rank{rank}.safetensors": _write_safetensors(
            path / f"adapter.rank{rank}.safetensors", lora.whole_on_cpu(state.adapters)
        ),
        f"state.rank{rank}.safetensors": _write_safetensors(path / f"state.rank{rank}.safetensors", tensors),
    }
    scheduler_state = {k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"}
    meta = {
        "rank": rank,
        "position": asdict(position),
        "scheduler": scheduler_state,
        "optimizer_groups": [
            {k: v for k, v in group.items() if k != "params"} for group in state.optimizer.param_groups
        ],
        "optimizer_extra": extra,
        "rng": _python_rng_state(),
        "files": files,
    }
    write_atomic(path / f"state.rank{rank}.json", json.dumps(meta).encode(), sync=True)

    _barrier()  # every part is on disk before the marker
    if rank == 0:
        marker = dict(commit_metadata(settings, position.step, world_size), position=asdict(position))
        marker["files"] = {
            name: hashlib.sha256((path / name).read_bytes()).hexdigest()
            for name in (f"state.rank{k}.json" for k in range(world_size))
        }
        write_atomic(path / MARKER, json.dumps(marker, indent=1).encode(), sync=True)  # fsyncs step-N too
        for directory in (path.parent, run_dir):  # step-N's entry, and checkpoints/'s (new at the first commit)
            fsync_dir(directory)
        prune_checkpoints(run_dir, settings.keep)  # only once the new checkpoint is durable
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
    write_atomic(path, data, sync=True)
    return hashlib.sha256(data).hexdigest()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------- loading


def load_checkpoint(checkpoint: Checkpoint, state: TrainState, rank: int, rng_seed: int | None = None) -> Position:
    """Restore this rank's adapters, optimizer, scheduler and RNG from every rank's part; returns the position.

    The optimizer's and scheduler's hyper-parameters are the config's (the optimizer and scheduler passed in are
    built from it): a changed lr, weight decay or schedule applies from the first resumed step on. `rng_seed`
    (under another layout than the checkpoint's, `layout_change`): torch's RNG is seeded with it instead of
    restored from the saved rank of the same number, which held other layers or another tp group."""
    adapters: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    rng: dict[str, torch.Tensor] = {}
    metas = []
    for saved_rank in range(checkpoint.marker["world_size"]):
        meta = _read_rank_meta(checkpoint, saved_rank)
        metas.append(meta)
        for name, digest in _rank_files(checkpoint, meta).items():
            for key, tensor in _read_verified(checkpoint, name, digest).items():
                if name.startswith("adapter."):
                    adapters[key] = tensor
                elif key.startswith("optim/"):
                    optim[key] = tensor
                elif saved_rank == rank:  # RNG states are per rank
                    rng[key] = tensor

    optimizer, scheduler = state.optimizer, state.scheduler
    _load_adapter(checkpoint, state.adapters, adapters)
    try:
        _load_optimizer(checkpoint, optimizer, state.param_names, optim, metas)
        scheduler.last_epoch = int(metas[0]["scheduler"]["last_epoch"])
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        elif rank < len(metas):  # a rank the saved layout did not have keeps its fresh seed
            _set_rng(rng, metas[rank]["rng"])
        position = Position(**metas[0]["position"])
        if not all(type(value) is int for value in asdict(position).values()):
            raise TypeError(f"position {metas[0]['position']} is not whole numbers")
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:  # a file rewritten with its hashes
        raise _damaged(checkpoint, f"its state has an unexpected shape ({type(e).__name__}: {e})") from None
    # Where the (possibly new) schedule stands at the saved step, as LambdaLR computes it.
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return position


RNG_LAYOUT = ("pp", "dp", "tp", "stages_per_rank", "layers_per_stage")
"""The parallel keys that decide which layers, replica and tp shard each rank holds: the ranks' RNG states are
restored only when none changed."""


def layout_change(checkpoint: Checkpoint, settings: CheckpointSettings) -> str | None:
    """How the layout `checkpoint` was written under differs from the config's ("parallel.pp 2 -> 1, parallel.tp
    1 -> 2"), or None when it is the same. RNG states belong to ranks: under another layout the saved rank of the
    same number held other layers, or another tp group, whose ranks must draw equal dropout masks (parallel/tp.py)."""
    saved = checkpoint.marker.get("config", {}).get("parallel")
    saved = saved if isinstance(saved, dict) else {}  # older markers: pp, dp and tp beside the config
    defaults = Config().to_dict()["parallel"]
    now = settings.recorded["config"]["parallel"]
    changes = []
    for key in RNG_LAYOUT:
        was = saved.get(key, checkpoint.marker.get(key, defaults[key]))
        if was != now[key]:
            changes.append(f"parallel.{key} {_shown(was)} -> {_shown(now[key])}")
    return ", ".join(changes) or None


def resumed_seed(seed: int, replica_rank: int, step: int) -> int:
    """The torch seed of a rank resumed under another layout: like a fresh run's (train.seed and the replica
    rank: equal within a tp group, one stream per stage and dp replica), and the step, so that the resumed steps
    draw other masks than the run's first steps did."""
    digest = hashlib.sha256(f"{seed}:{replica_rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _load_adapter(checkpoint: Checkpoint, wanted: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> None:
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
    with torch.no_grad():
        for name, param in wanted.items():
            param.copy_(shard_like(adapters[name], param))


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
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}  # the config's: lr and weight decay may change
        hyper["params"] = []
        for param in group["params"]:
            name = param_names[param]
            for field, value in by_name.get(name, {}).items():  # a moment has the parameter's shape, a step one value
                if isinstance(value, torch.Tensor) and not _is_moment(value, param) and value.numel() != 1:
                    shape, like = tuple(value.shape), tuple(param.shape)
                    raise _damaged(checkpoint, f"its optimizer state {field} of {name} is {shape}, the model's {like}")
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
