"""Starting a training run: checks and the run directory's lock first, then the data tokenized into the token cache
(a stop signal or a full disk there: one line saying the run had not started), then training in this process
(under torchrun, or alone) or in local workers started through torch's elastic launcher; and how a worker's run
ends when a peer, the disk or a signal ends it (one line, not a traceback per rank).

    pipetune train --config FILE [--nproc N] [--max-restarts K]     # N local workers
    torchrun --nproc-per-node N -m pipetune train --config FILE    # under torchrun: this process is one rank

Multi-node runs use torchrun's c10d rendezvous directly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipetune.checkpoint import (
    CheckpointError,
    CheckpointSettings,
    check_compatible,
    find_resume_checkpoint,
    latest_checkpoint,
)
from pipetune.config import Config, ConfigError, save_config
from pipetune.heap import HeapTrimmer
from pipetune.host_memory import oom_kills
from pipetune.out_of_memory import (
    PROGRESS_ENV,
    ProgressFile,
    killed_line,
    memory_failure,
    read_progress,
)
from pipetune.parallel.process_group import close_distributed, exit_skipping_teardown, init_distributed, under_launcher
from pipetune.preflight import epoch_steps, preflight
from pipetune.run_lock import lock_for_worker, lock_run_dir
from pipetune.run_log import STARTED_ENV, RunLog, finish_run, run_started
from pipetune.worker import (
    LAUNCHER_ENV,
    Ending,
    Stopped,
    disk_full_message,
    end_with_launcher,
    end_worker,
    has_launcher,
    named_cache_error,
    no_space_message,
    raise_on_stop_signals,
    ranks_label,
    restore_signals,
)

if TYPE_CHECKING:  # pipetune.train (peft: 2 s to import) only in a process that trains, never in the launcher
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from pipetune.data.cache import TokenizedData
    from pipetune.data.prompt import PromptBuilder
    from pipetune.train import LoopStatus, RunResult


def run_train(
    config: Config, nproc: int | None = None, quiet: bool = False, max_restarts: int = 0, explicit: bool = False
) -> int:
    """Validate, then train here (under torchrun, or one process) or start nproc local workers. `explicit`: the
    layout was asked for on the command line (planner/plan.fit_to_gpus keeps it on fewer GPUs)."""
    started = time.time()
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts} must be >= 0")
    if config.parallel.strategy == "auto":
        from pipetune.planner.plan import available_gpus, resolve_auto

        processes = available_gpus(config, nproc)
        config = resolve_auto(config, processes)
        check_auto_resume(config, processes)
        nproc = None  # the pick's own process count
    elif not nproc and not under_launcher() and torch.cuda.is_available():
        from pipetune.planner.plan import fit_to_gpus

        config = fit_to_gpus(config, torch.cuda.device_count(), explicit)
    if under_launcher():
        if max_restarts:
            print("pipetune: note: --max-restarts is the launcher's job under torchrun; use torchrun --max-restarts")
        run_training(config, quiet)  # a restarted group continues what its own launch started (train.py)
        return 0  # cli.run ends the worker (process_group.exit_finished)
    world_size = nproc or config.parallel.world_size
    # Until training starts, a stop signal ends the launcher with one line (and no half-written token cache).
    previous_handlers = raise_on_stop_signals()
    try:
        prepared = preflight(config, world_size)  # fail here, once, before any process starts
        with lock_run_dir(config.output.dir):  # held until the workers are done; they run inside it
            # A checkpoint that cannot be resumed, or a run a fresh start would clobber:
            settings = CheckpointSettings.of(config)
            if find_resume_checkpoint(settings) is None and settings.resume:
                print(
                    f"pipetune: note: {settings.run_dir} holds no committed checkpoint to continue from: "
                    "training starts at step 0",
                    file=sys.stderr,
                )
            # A data error once, here, not once per worker; and the workers find the data tokenized.
            data = tokenize(config, prepared.prompts)
            train_split = data.splits.get("train")
            lengths = train_split.lengths if train_split is not None else torch.zeros(0, dtype=torch.long)
            epoch_steps(config, lengths, data.skipped_line())  # as the workers count them (packed rows included)
            restore_signals(previous_handlers)  # run_training, or the elastic agent, handles them from here on
            previous_handlers = {}
            if world_size == 1 and max_restarts == 0:
                run_training(config, quiet)
                return 0
            return launch_local(config, world_size, quiet, max_restarts, started)
    except Stopped as e:
        print(f"pipetune: error: {stopped_before_training(e.signum, Path(config.output.dir))}", file=sys.stderr)
        return 128 + e.signum
    finally:
        restore_signals(previous_handlers)


AUTO_CHOSEN = (("train", "batch_size"), ("train", "grad_accum"), ("parallel", "dp"))
"""Keys of RESUME_REFUSED that parallel.strategy = "auto" chooses (with the layout), not the user."""


def check_auto_resume(config: Config, processes: int) -> None:
    """A resume of a run whose checkpoint differs from what "auto" chose here only in AUTO_CHOSEN: one line naming
    the processes it was written on, not keys the user never set."""
    settings = CheckpointSettings.of(config)
    newest = latest_checkpoint(settings.run_dir)
    if not settings.resume or newest is None:
        return
    saved = newest.marker.get("config", {})
    now = copy.deepcopy(settings.recorded)
    for section, key in AUTO_CHOSEN:
        now["config"][section][key] = saved.get(section, {}).get(key, now["config"][section][key])
    try:
        check_compatible(newest, settings)
        return
    except CheckpointError as refused:
        try:
            check_compatible(newest, dataclasses.replace(settings, recorded=now))
        except CheckpointError:
            raise refused from None  # other keys differ too: its message names them
    was, here = newest.marker.get("world_size"), settings.recorded["config"]
    chosen = ", ".join(f"{s}.{k} {saved[s][k]}" for s, k in AUTO_CHOSEN if s in saved and k in saved[s])
    picks = ", ".join(f"{s}.{k} {here[s][k]}" for s, k in AUTO_CHOSEN)
    raise CheckpointError(
        f"checkpoint {newest.path} was written on {was} processes, where parallel.strategy = 'auto' chose {chosen}; "
        f"on {processes} it chooses {picks}, and these set the data position: resume on {was} processes "
        f"(--nproc {was}), or start a new run in another output.dir"
    )


def tokenize(config: Config, prompts: PromptBuilder) -> TokenizedData:
    """The config's data from the token cache (built if missing); a write that fails names the cache's path."""
    from pipetune.data.cache import tokenized_data

    try:
        return tokenized_data(config.data, prompts, config.train.seed)
    except OSError as e:
        raise named_cache_error(e) from None


def stopped_before_training(signum: int, run_dir: Path, where: str = "") -> str:
    """The line for a stop signal that came before the first optimizer step of this attempt (`where`: in what)."""
    newest = latest_checkpoint(run_dir)
    kept = (
        f"the newest committed checkpoint, {newest.path}, is kept: continue with --resume"
        if newest
        else "there is nothing to resume: run the same command again to start"
    )
    return f"stopped by {signal.Signals(signum).name}{where} before training started; {kept}"


WORKER_MODULE = "pipetune"
"""What local workers run (`python -m WORKER_MODULE train ...`); the tests' entry names itself, so that its hooks
are installed in the workers too."""


def launch_local(
    config: Config, nproc: int, quiet: bool = False, max_restarts: int = 0, started: float | None = None
) -> int:
    """Start nproc workers on this machine through torch's elastic launcher (torchrun --standalone)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    started = time.time() if started is None else started
    run_dir = Path(config.output.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    save_config(config, config_path)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,  # torchrun's default: a finished or failed worker seen within 0.1 s
    )
    argv = ["-m", WORKER_MODULE, "train", "--config", str(config_path)] + (["--quiet"] if quiet else [])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers die with this process and leave stops to it
    os.environ[STARTED_ENV] = f"{started:.3f}"  # the workers' wall time counts from here
    os.environ[PROGRESS_ENV] = progress = tempfile.mkdtemp(prefix="pipetune-progress-")  # for a SIGKILL's line
    kills = oom_kills()
    try:
        elastic_launch(launch, sys.executable)(*argv)
    except ChildFailedError as e:
        after = oom_kills()
        killed = after - kills if after is not None and kills is not None else None
        lines, code = failure_report(e.failures, run_dir, progress, killed)
        for line in lines:
            print(line, file=sys.stderr)
        return code
    except Exception as e:  # a stop signal may surface as another exception (signal_exception_in)
        stop = signal_exception_in(e, SignalException)
        if stop is None:
            raise
        # the elastic agent stopped the workers (SIGTERM first) before raising this
        print(f"pipetune: error: {stopped_message(stop.sigval.name, run_dir)}", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        del os.environ[LAUNCHER_ENV], os.environ[PROGRESS_ENV]
        shutil.rmtree(progress, ignore_errors=True)
    return 0


def signal_exception_in(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The stop signal's exception in error's chain. A signal that lands on the first line of torch's metrics
    wrapper (`start = time.time()` inside its try) ends in an UnboundLocalError raised while handling it."""
    seen = error
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def stopped_message(signal_name: str, run_dir: Path, ranks: list[int] | None = None) -> str:
    newest = latest_checkpoint(run_dir)
    kept = f"the newest committed checkpoint, {newest.path}, is kept" if newest else "no checkpoint was committed"
    who = f"{ranks_label(ranks)}: " if ranks else ""
    return f"{who}stopped by {signal_name}; {kept}: continue with --resume"


def failure_report(
    failures: dict[int, ProcessFailure], run_dir: Path, progress: str | None = None, oom_kills: int | None = None
) -> tuple[list[str], int]:
    """The launcher's line for failed workers, and its exit code: the cause once, for all the ranks it ended (a
    full disk, a stop signal to the workers, memory), not its consequences (peers lost, workers the agent then
    stopped). `progress`: where the workers recorded their progress; `oom_kills`: processes the OOM killer ended
    during the run (None: unknown), for a worker killed with SIGKILL."""
    endings: dict[str, list[Ending]] = {}
    unexplained = []  # a crash (its traceback is above) or a kill
    for rank in sorted(failures):
        ending = Ending.read(failures[rank].error_file_data)
        if ending is None:
            unexplained.append(rank)
        else:
            endings.setdefault(ending.kind, []).append(ending)
    if "disk full" in endings:
        full = endings["disk full"]
        return [f"pipetune: error: {no_space_message([e.rank for e in full], [e.file for e in full if e.file])}"], 1
    if "out of memory" in endings:
        return [f"pipetune: error: {min(endings['out of memory'], key=lambda e: e.rank).line}"], 1
    if "timeout" in endings:  # the rank that stopped responding was stopped by the agent
        return [f"pipetune: error: {endings['timeout'][0].line}"], 1
    said = 0 in failures and failures[0].exitcode == 2  # rank 0 said its own ConfigError
    if "config" in endings and not said:  # a verdict that other ranks reached and rank 0 did not
        return [f"pipetune: error: {min(endings['config'], key=lambda e: e.rank).line}"], 2
    if unexplained:
        rank = min(unexplained, key=lambda r: failures[r].timestamp)
        if failures[rank].exitcode == -signal.SIGKILL:  # the kernel's kill says nothing: say what the rank recorded
            line = killed_line(rank, failures[rank].exitcode, read_progress(progress, rank), oom_kills)
            return [f"pipetune: error: {line}; {checkpoints_kept(run_dir)}"], 1
        lost = [f"pipetune: error: {e.line}" for e in endings.get("peer lost", [])[:1]]
        return [*lost, f"pipetune: worker {rank} failed (exit code {failures[rank].exitcode}); its output is above"], 1
    if "stopped" in endings:  # the signal went to the workers, not to this launcher
        stopped = endings["stopped"]
        signum = min(e.signum or signal.SIGTERM for e in stopped)
        message = stopped_message(signal.Signals(signum).name, run_dir, [e.rank for e in stopped])
        return [f"pipetune: error: {message}"], 128 + signum
    return [f"pipetune: error: {e.line}" for e in endings.get("peer lost", [])[:1]], 1


def checkpoints_kept(run_dir: Path) -> str:
    """What a failed run leaves to continue from."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return "no checkpoint was committed yet: run the same command again to start over"
    return f"the newest committed checkpoint, {newest.path}, is kept: continue with --resume"


def run_training(config: Config, quiet: bool = False) -> RunResult:
    """Train in this process (one rank). A TrainingError, a lost peer, a full disk or a stop signal ends it with
    one line (none from a worker whose pipetune launcher reports the stop) and a non-zero exit code.

    Rank 0's output also goes to <run>/train.log, and a finished run ends with its summary (run_log.py)."""
    from pipetune.train import LoopStatus, TrainingError, train

    started = run_started()
    if under_launcher():
        end_with_launcher()  # a worker never trains on after its launcher died
    previous_handlers = raise_on_stop_signals()
    env = init_distributed(config.parallel.timeout_s, config.parallel.p2p_channels)
    status = LoopStatus()
    progress = ProgressFile(env.rank, status.where)  # under pipetune's launcher: for its line should a kill come
    heap = HeapTrimmer() if env.device.type == "cpu" else None  # the heap's free pages given back as it grows
    lock = None
    with contextlib.ExitStack() as log:  # closed after the messages below: they go to train.log too
        try:
            try:
                lock = lock_for_worker(config.output.dir, env.rank)
                log.enter_context(RunLog(Path(config.output.dir) / "train.log", enabled=env.is_main))
                result = train(config, env, quiet, status)
                if env.is_main:
                    print(finish_run(result.run_dir, started, result.resumed_from, full=not quiet), flush=True)
                return result
            except TrainingError as e:  # every rank reached the same verdict: one of them says it
                if env.is_main:
                    print(f"pipetune: error: {e}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            except ConfigError as e:  # likewise (a checkpoint a restarted group cannot resume: the same files)
                if env.is_main:
                    print(f"pipetune: error: {e}", file=sys.stderr, flush=True)
                elif has_launcher():  # said by the launcher where rank 0 did not reach the same verdict
                    end_worker(Ending("config", env.rank, f"rank {env.rank}: {e}"))
                raise SystemExit(2) from None
            except Exception as e:
                ending = None
                if (line := memory_failure(e, env.rank, status.where())) is not None:
                    ending = Ending("out of memory", env.rank, f"{line}; {checkpoints_kept(Path(config.output.dir))}")
                elif isinstance(e, RuntimeError):
                    ending = peer_failure(e, env.rank, status, config.parallel.timeout_s)
                elif isinstance(e, OSError) and (message := disk_full_message(e, env.rank)) is not None:
                    ending = Ending("disk full", env.rank, message, file=e.filename)
                if ending is not None:
                    end_worker(ending)
                    raise SystemExit(1) from None
                if not env.distributed:
                    raise
                # A crash on one rank of several: its traceback now, then out without the process group's teardown,
                # which can wait forever on a peer blocked in a transfer with this rank (NCCL); the launcher sees
                # the exit and stops the peers.
                print(f"pipetune: rank {env.rank} failed in {status.where()}:", file=sys.stderr, flush=True)
                traceback.print_exc()
                if lock is not None:
                    lock.release()
                log.close()
                exit_skipping_teardown(1)
        except Stopped as e:  # the files being written were removed on the way here; committed ones stay
            where = status.where()
            message = f"stopped by {e} in {where}; committed checkpoints are kept: continue with --resume"
            if status.step == 0 and status.phase == "setup":  # no step ran in this attempt
                message = stopped_before_training(e.signum, Path(config.output.dir), f" in {where}")
            end_worker(Ending("stopped", env.rank, message, signum=e.signum))
            if env.distributed:  # a peer blocked in a collective with this rank returns only once this process is gone
                if lock is not None:
                    lock.release()
                exit_skipping_teardown(128 + e.signum)
            raise SystemExit(128 + e.signum) from None
        finally:
            progress.close()
            if heap is not None:
                heap.close()
            if lock is not None:
                lock.release()
            close_distributed()
            restore_signals(previous_handlers)


def peer_failure(error: RuntimeError, rank: int, status: LoopStatus, timeout_s: float) -> Ending | None:
    """One line for a collective that failed because a peer timed out or died (gloo raises both), else None."""
    text = str(error)
    detail = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
    where = status.where()
    if "Timed out" in text or "timed out" in text:
        return Ending(
            "timeout",
            rank,
            f"rank {rank} waited {timeout_s:g} s for a peer in {where} and gave up ({detail}). A peer stopped "
            "responding: check the other ranks' output for a crash or hang, or raise parallel.timeout_s if a "
            "step legitimately takes longer",
        )
    if "Connection closed by peer" in text or "Connection reset by peer" in text or "Broken pipe" in text:
        return Ending(
            "peer lost",
            rank,
            f"rank {rank} lost a peer in {where}: another rank exited; its output says why ({detail})",
        )
    return None
