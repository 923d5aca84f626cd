"""Command line: `pipetune demo`, `train`, `eval`, `summarize`, `report`, `export`, `config`, `data`, `bench`, `plan`.

One module per command (cli/<command>.py: `add_parser(subparsers)`, `run(args) -> int`), registered in COMMANDS;
the options they share are cli/options.py's. `train` is launch.py's (local workers, torchrun, restarts). torch and
transformers are imported inside the commands that need them, so `--help`, `--version` and `config` answer at once.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import select
import sys
import warnings
from types import ModuleType

from pipetune.cli import bench, config, data, demo, export, plan, report, summarize, train
from pipetune.cli import eval as evaluate
from pipetune.cli.data import run_data_inspect
from pipetune.cli.demo import DEMOS, demo_config, demo_dir
from pipetune.config import ConfigError

__all__ = [
    "COMMANDS",
    "DEMOS",
    "demo_config",
    "demo_dir",
    "main",
    "run",
    "run_data_inspect",
    "silence_library_warnings",
    "version",
]

COMMANDS: dict[str, ModuleType] = {
    "demo": demo,
    "train": train,
    "data": data,
    "bench": bench,
    "plan": plan,
    "summarize": summarize,
    "eval": evaluate,
    "report": report,
    "export": export,
    "config": config,
}
"""`pipetune COMMAND` -> its module, in the order `pipetune --help` lists them."""

EXAMPLES = """\
examples:
  pipetune demo                                    tiny model, synthetic meetings, CPU, ~2 min
  pipetune config list                             the shipped configs
  pipetune config show --config qwen3-4b-ami       every key with its value and documentation
  pipetune train --config qwen3-4b-ami --set train.lr=1e-4
  pipetune plan --config bench-qwen3-4b --gpus 2   memory and speed of every layout, the pick
  pipetune eval --run runs/demo                    ROUGE and loss, base vs fine-tuned
  pipetune report runs/demo                        charts and one HTML page
  pipetune summarize --adapter runs/demo/adapter meeting.txt
  pipetune export --run runs/demo --out exported   a directory for plain transformers + PEFT (and vLLM)

`pipetune COMMAND --help` describes each command.
"""


LIBRARY_WARNINGS = [
    # peft 0.21 calls a transformers 5 method deprecated in favour of another: nothing a user can change
    (FutureWarning, r".*is_gradient_checkpointing"),
]
LIBRARY_LOGGERS = [
    # torchao (model.quantize; PEFT imports it whenever it is installed) logs at import when its optional CUDA
    # kernels do not match the local torch build, and torch >= 2.13 about torchao's pytree registrations.
    "torchao",
    "torch.utils._pytree",
]


def silence_library_warnings() -> None:
    """Hide the libraries' warnings that a pipetune user cannot act on (workers start through main too)."""
    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("pipetune")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The `pipetune` parser: one subparser per entry of COMMANDS, added by the command's own module."""
    parser = argparse.ArgumentParser(
        prog="pipetune",
        description="LoRA fine-tuning of open LLMs with pipeline and data parallelism, on torch.distributed.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipetune {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    silence_library_warnings()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        meant = set_without_equals(argv, unknown)
        if meant is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"pipetune: error: --set takes section.key=value: did you mean {meant}?", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except ConfigError as e:
        print(f"pipetune: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        from pipetune.worker import disk_full_message

        message = disk_full_message(e)
        if message is None:
            raise
        print(f"pipetune: error: {message}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        from pipetune.out_of_memory import command_memory_failure

        line = command_memory_failure(e, args.command)
        if line is None:
            raise
        print(f"pipetune: error: {line}", file=sys.stderr)
        return 1


def set_without_equals(argv: list[str], unknown: list[str]) -> str | None:
    """`--set train.lr 1e-4` (or `train.lr = 1e-4`, `train.lr= 1e-4`) leaves words to argparse as unknown
    arguments: the `--set train.lr=1e-4` meant, or None when the unknown arguments follow no --set."""
    for i, flag in enumerate(argv[:-2]):
        words = list(itertools.takewhile(lambda word: word in unknown, argv[i + 2 : i + 4]))
        if flag != "--set" or not words:
            continue
        key, sep, value = " ".join([argv[i + 1], *words]).partition("=")
        return f"--set {key.strip()}={value.strip()}" if sep else f"--set {argv[i + 1]}={words[0]}"
    return None


def run() -> None:
    """The `pipetune` command and `python -m pipetune`, the local workers included: main(), then the exit
    handlers (loggers, temporary directories, child processes), then out without the interpreter's teardown.
    That teardown frees every module a process imported, ~1.2 s on a 2-core CPU once torch, transformers and
    PEFT are in, paid once per command and once per worker for nothing: each file pipetune writes is closed by
    its writer before main returns. An exception leaves the usual way, with its traceback."""
    try:
        code = main()
        sys.stdout.flush()  # a reader that left early fails here, inside the try, not in the interpreter's exit
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        code = quiet_broken_pipe()
    if "torch" not in sys.modules:  # --help, --version, config: little to free
        sys.exit(code)
    from pipetune.parallel.process_group import exit_finished

    exit_finished(code)


def stdout_reader_gone() -> bool:
    """stdout is a pipe whose reader has closed it (`pipetune config list | head -3`): poll says POLLERR."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), stdout replaced or closed
        return False


def quiet_broken_pipe() -> int:
    """End as a Unix command does when its reader has gone: no traceback, exit status 128 + SIGPIPE. stdout then
    points at /dev/null, so that the flush at exit does not fail again (the Python docs' recipe, signal module)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
