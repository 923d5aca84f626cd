"""Run configuration: dataclasses with one docstring per key, TOML in and out, `--set` overrides.

`validate()` checks everything that can be checked without a process group, so that a bad
value fails once, on the launching process, with a message that names it and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pipetune.errors import ConfigError
from pipetune.schedules import SCHEDULES
from pipetune.strategies import STRATEGY_SPECS

SYSTEM_PROMPT = (
    "You are a meeting assistant. Given a meeting transcript, write a concise summary that covers "
    "the key discussion points, decisions made, and action items with owners and deadlines where "
    "mentioned."
)
"""data.system_prompt's default: the system turn of the demo tokenizer's corpus, the prompt builder and evaluation."""
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "nf4", "fp8")
RUN_STRATEGIES = tuple(STRATEGY_SPECS)
"""What a run (and `pipetune bench --strategies`) can be (what each fixes: pipetune/strategies.py)."""
STRATEGIES = RUN_STRATEGIES + ("auto",)
"""parallel.strategy's values: a run's, or "auto" (pipetune plan picks one before the run starts)."""
RESUME_MODES = ("never", "auto")
SYNTHETIC_LENGTHS = ("short", "whole")
"""data.synthetic_lengths' values: short meetings (data/synthetic.py) or whole ones (data/synthetic_whole.py)."""
MAX_LENGTH = 2**20
"""The longest sample pipetune accepts (tokens); far beyond what any model here can attend to."""
MAX_TIMEOUT_S = 86400 * 7
"""parallel.timeout_s at most a week: longer (or infinite) cannot be a collective's timeout."""


@dataclass
class ModelConfig:
    name: str = "Qwen/Qwen3-4B"
    """Hub id, local directory, a built-in shape (qwen3-0.6b ... qwen3-32b) or "tiny-qwen3"."""
    dtype: str = "bfloat16"
    """Weights and compute dtype of the frozen base; "float32" for numerics tests."""
    init: str = "pretrained"
    """"pretrained" loads weights; "random" builds the model from its config alone (benchmarks)."""
    tokenizer: str = ""
    """Tokenizer to use; empty = the model's own, or the built-in demo tokenizer for built-in shapes."""
    trust_remote_code: bool = False
    """Allow model code from the hub. Off: only architectures transformers ships are built."""
    quantize: str = "none"
    """Store the frozen decoder layers' linear weights quantized (model/quantize.py): "nf4" (QLoRA: 4-bit
    NormalFloat, ~0.52 bytes a weight, dequantized for each matmul; needs torchao), "fp8" (float8 with a scale
    per row, FP8 matmuls forward and backward; a GPU with FP8, model.dtype = "bfloat16") or "none". Embeddings,
    norms, lm_head and the adapters keep their dtype; the adapter is saved as plain PEFT either way."""


@dataclass
class DataConfig:
    source: str = "knkarthick/AMI"
    """Hub dataset, local JSONL/JSON/CSV/Parquet file, or "synthetic" (the demo meetings)."""
    max_length: int = 512
    """Tokens per sample; every batch is padded to exactly this length (static shapes)."""
    max_summary_tokens: int = 256
    """Cap on the summary's tokens; the transcript is cut in the middle to fit the rest."""
    buckets: list[int] = field(default_factory=list)
    """Padded lengths of length buckets, ascending, ending at max_length (e.g. [2048, 4096, 8192]): each sample
    is padded to the smallest that holds it and each batch holds one bucket, one static shape per bucket.
    [] = every sample padded to max_length."""
    packing: bool = False
    """Pack several whole samples into each row of max_length (best fit, longest first, over windows of the epoch's
    shuffled order; the rows then shuffled: data/packing.py), each attending only to itself, with positions
    restarting per sample: train.batch_size then counts rows, not samples. Far less padding where samples vary in
    length (whole meetings); not with data.buckets."""
    max_samples_per_row: int = 16
    """With data.packing: at most this many samples in one row (a fixed bound, for static shapes)."""
    transcript_column: str = "dialogue"
    """Column holding the meeting transcript."""
    summary_column: str = "summary"
    """Column holding the reference summary."""
    synthetic_train: int = 256
    """Number of synthetic training meetings (source = "synthetic")."""
    synthetic_validation: int = 32
    """Number of synthetic validation meetings (source = "synthetic")."""
    synthetic_lengths: str = "short"
    """Synthetic meetings' length (source = "synthetic"): "short" (12-40 turns, a few hundred tokens: the demo's) or
    "whole" (log-normal lengths around 6,000 tokens, up to 30,000, as real meetings run; their decisions, action
    items and figures spread over the whole meeting, each one checked by `pipetune eval`'s fact recall)."""
    validation_fraction: float = 0.0
    """Share of train held out as validation when the source has none (chosen by train.seed); 0 = none."""
    system_prompt: str = SYSTEM_PROMPT
    """System turn of every prompt, in training and inference (saved with the run in prompt.json)."""


@dataclass
class LoraConfig:
    r: int = 16
    """Rank of the adapters."""
    alpha: float = 32.0
    """Scaling numerator: adapter output is multiplied by alpha / r."""
    dropout: float = 0.15
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get adapters."""
    fast_path: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (pipetune/switches.py: on a GPU, off on the CPU), or true / false. Run adapters in the base dtype, the
    scaling applied to the rank-r intermediate (fewer, cheaper kernels than PEFT's float32 path; same math). The
    adapters' master weights and optimizer state stay float32. Without LoRA dropout, the adapters that read one input
    (q/k/v; gate/up) also compute their down-projections as one matmul (PEFT's math; not under parallel.tp > 1)."""
    shared_dropout: bool = False
    """With lora.fast_path: one LoRA dropout mask per input that several adapters read (q/k/v share one, gate/up
    another; o and down keep their own), and those adapters' down-projections as one matmul. Not PEFT's draws:
    each element is dropped with probability lora.dropout and scaled by 1 / (1 - lora.dropout) as before, but
    q, k and v drop the same ones. Fewer random numbers and kernels, one dropped input kept for backward per
    shared input instead of one per adapter; not with parallel.tp > 1."""
    adapter_in_matmul: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (on a GPU with a plain base, no tp / FSDP), or true / false. With lora.fast_path: each adapted linear
    computes its LoRA term inside its base matmul. The frozen weight is stored as [W | lora_B] (lora_B's bf16 copy
    refreshed before each forward) and the input as [x | the scaled down-projections], so the up-projection's output is
    never written and read on its own, and backward's one matmul gives the input's gradient and the down-projections'.
    Same math, summed in another order. Plain (unquantized) base weights only, not with parallel.tp > 1 or FSDP.
    Measured on one H200: Qwen3-8B at 4,096-token rows 3.1-3.4% faster (75.0-75.1% MFU against 72.6-72.8%), packed
    Qwen3-4B rows 2.2% faster (benchmarks/journal/2026-12-02-in-matmul-one-h200.md)."""


@dataclass
class TrainConfig:
    epochs: int = 3
    """Passes over the training split."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: run all epochs)."""
    batch_size: int = 8
    """Samples per schedule step, split into parallel.n_microbatches microbatches."""
    grad_accum: int = 2
    """Schedule steps per optimizer step."""
    lr: float = 2e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """AdamW weight decay on the adapters."""
    warmup_steps: int = 0
    """Linear warmup steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (all stages together) to this; 0 disables clipping."""
    seed: int = 42
    """Seeds data order, random initialisation and adapter initialisation."""
    compile: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (on a GPU, where the schedule allows), or true / false. torch.compile each decoder layer (one graph shared
    by all layers; the first steps compile)."""
    layers_per_graph: int | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (6 compiled, 1 under FSDP / tp) or a count. With train.compile (without it there is nothing to group),
    trace this many consecutive decoder layers as one compiled graph (0: all of a stage's layers): one call, and one
    CUDA graph replay with train.cuda_graphs, per group instead of per layer; fewer graph boundaries for the GPU (6 ran
    1% faster than 1 on an H200). The first steps compile one graph per group size, longer than one layer's.
    Checkpointed layers stay one per graph, and so do all under FSDP or parallel.tp > 1 (not run there yet: the run says
    so and goes on)."""
    cuda_graphs: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (compiled on a GPU, not with the documents kernel or every layer checkpointed; each rank keeps them only
    where they pay off), or true / false. With train.compile, replay each compiled layer's forward and backward as CUDA
    graphs (torch.compile's "reduce-overhead" mode): one launch per layer call instead of ~60 kernels and ~20 GEMM
    calls, for when the host, not the GPU, is the limit (small microbatches). CUDA only; the first steps record the
    graphs."""
    fused_loss: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (on a GPU), or true / false. Compute lm_head and the cross-entropy together, on the supervised tokens only
    (the summary, not the transcript), a chunk of train.loss_chunk rows at a time, writing the hidden states' gradient
    in the forward: the [tokens, vocab] float32 logits and their gradient are never whole in memory (Qwen3: 151,936
    columns). Same math as the plain loss; the supervised rows are found on the host, where a training batch's labels
    are made, so the loss never waits for the GPU (validation's, on the device, sync once a batch)."""
    loss_chunk: int = 2048
    """Rows (tokens) per chunk of train.fused_loss: peak extra memory ~ loss_chunk x vocab x 12 bytes."""
    activation_checkpointing: bool | str = field(default="auto", metadata={"also": ("auto", "offload")})
    """Keep only a decoder layer's input during forward and recompute the layer in backward: less activation
    memory (long contexts) for about one more forward of the layer. true: every layer; "offload": every layer, its
    input kept in pinned host memory (copied on a side stream, back one layer ahead of backward: no layer input
    stays on the GPU; docs/long-context.md); "auto": per layer keep, recompute or recompute-and-offload, only as
    much as each stage's memory needs (measured per layer, with the microbatches the schedule keeps in flight
    on that stage: the first stages of 1F1B hold more), planned for the GPU's memory or train.memory_gb."""
    keep_attention: bool = False
    """A checkpointed layer keeps its attention's output and log-sum-exp (as many bytes as its input, and 4 a
    token and head), so its recomputation skips attention, most of a layer's forward at long rows (Qwen3-8B at
    131,072 tokens: 1.07 of 1.46 GFLOP a token); offloaded layers keep them in host memory too. Causal,
    unmasked attention in eager layers: not with train.compile or data.packing (model/kept_attention.py)."""
    packed_attention: str = "auto"
    """With data.packing on a GPU, the kernel of each row's document attention: "auto" ("documents" for samples of
    4,096 tokens or more on average on one GPU or data-parallel ranks, else "flex"), "flex" (flex attention over a
    block mask of 128 x 128 tiles, compiled) or "documents" (SDPA's fused kernel on each sample alone, cuDNN's on
    an H200, over a window of the row of a padded length, cuDNN's plans for the run's lengths built in its first
    step: model/attention.py). On whole meetings in rows of 16,384 (one H200, a whole epoch) "documents" made
    1.34x Unsloth's tokens/s (flex 1.18-1.19x); on ~550-token samples its attention ran 6-7x slower than flex's;
    not measured under a GPU pipeline (docs/packing.md). It reads each row's samples on the host at every call:
    not with train.cuda_graphs. CPU runs take each sample alone."""
    mlp_chunk: int | str = field(default="auto", metadata={"also": ("auto",)})
    """Tokens per chunk of each decoder layer's MLP: its [tokens, 3 x intermediate_size] gate/up/activation
    workspace is computed (and recomputed in backward) a chunk of the sequence at a time, so it stops growing
    with the row. 0: off; "auto": 8192 when data.max_length >= 32768 (one more MLP forward per layer: under 10%
    of a layer's time at those lengths, where attention dominates), else off."""
    memory_gb: float = 0.0
    """Memory per rank that activation_checkpointing = "auto" plans for, in GB; 0: the GPU's total memory
    (on a CPU, 0 plans no checkpointing)."""
    timeline_step: int = 0
    """Record when each stage ran each forward/backward during this optimizer step's first schedule step
    (timeline.json and timeline.png in the run directory, with the measured bubble); 0 = never."""
    log_every: int = 1
    """Optimizer steps between metrics rows. Each row waits for the GPUs (its loss and peak memory), which then
    start the next step empty: on one H200, a row every 5 steps ran Qwen3-4B 0.4% faster than one every step."""
    eval_every: int = 0
    """Optimizer steps between validation-loss evaluations (forward only, through the pipeline); they also
    run at each epoch's end and at the last step. 0: only those. Needs a validation split."""
    save_every: int = 0
    """Optimizer steps between checkpoints; one is also written at each epoch end and at the end (0: only those)."""
    keep_checkpoints: int = 2
    """Committed checkpoints kept under <output.dir>/checkpoints; older ones are deleted, the newest never."""
    resume: str = "never"
    """"auto": continue from the newest committed checkpoint in output.dir (fresh if none); "never": start over."""
    max_skipped_steps: int = 3
    """Stop the run after this many consecutive optimizer steps skipped for a non-finite loss or gradient norm."""


@dataclass
class ParallelConfig:
    strategy: str = "pp"
    """"pp": pp pipeline stages x dp replicas (x tp tensor shards); "ddp": data parallel only (pp = 1, dp replicas,
    LoRA gradients all-reduced); "fsdp": like ddp with the model sharded over the replicas (implies dp_shard);
    "tp": tensor parallel (pp = 1, tp >= 2, x dp replicas); "single": one process (pp = dp = tp = 1). The same
    trainer, data, loss and outputs for all."""
    pp: int = 2
    """Pipeline stages (one per rank); 1 runs the same loop in one process."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    tp: int = 1
    """Tensor-parallel ranks per stage: each decoder layer's attention heads and MLP columns (and the embedding's
    and lm_head's vocabulary) split over tp neighbouring ranks, with torch's DTensor plans (parallel/tp.py); LoRA
    adapters split with their base layers. World size = pp x dp x tp. Must divide the attention and key-value
    head counts."""
    sequence_parallel: bool = False
    """With tp >= 2, split the hidden states between attention and MLP blocks by sequence position over the tp
    ranks (norms, residuals and pipeline transfers at 1/tp of the memory; all-gather + reduce-scatter instead of
    all-reduce). data.max_length and data.buckets must be multiples of tp."""
    dp_shard: bool = False
    """Shard each stage over its dp replicas with FSDP2: the frozen base weights are stored 1/dp per replica and
    gathered layer by layer, the LoRA gradients reduce-scattered instead of all-reduced. Needs dp >= 2."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b (one stage per rank); interleaved_1f1b, looped_bfs, interleaved_zero_bubble
    (stages_per_rank >= 2, looped); zbv, dualpipev (2 stages per rank, V order)."""
    n_microbatches: int | str = field(default="auto", metadata={"also": ("auto",)})
    """Microbatches per schedule step; batch_size must be a multiple of it. "auto": without a pipeline the fewest
    whose rows hold 8,192 tokens, in a pipeline rows of 2,048 tokens and at least one microbatch per stage
    (pipetune/switches.py)."""
    stages_per_rank: int = 1
    """Virtual stages per rank (interleaved schedules)."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Decoder layers of each stage; [] = split evenly."""
    overlap_gradient_sum: bool = True
    """Whole-model replicas (pp = 1, no tp, not sharded): all-reduce the LoRA gradients in buckets while the
    step's last backward runs, each as soon as its parameters are done (parallel/gradients.py). false: one all-reduce
    after the backward."""
    timeout_s: float = 600.0
    """Seconds a rank waits for a peer in a collective or pipeline send/recv before the run fails."""
    p2p_channels: int = 0
    """NCCL channels for the pipeline's sends and receives (NCCL_MAX_P2P_NCHANNELS, set in each worker before
    its first communicator); 0 = NCCL's choice (32 between two H200s). A waiting receive holds one SM per
    channel: the interleaved, looped and V schedules post receives ahead of use, so they wait beside the
    stage's compute and slow it. 1 made interleaved 1F1B (v=3) 7% faster on 2x H200."""

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pp ranks x stages_per_rank."""
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        """Processes in all: pp x dp x tp."""
        return self.pp * self.dp * self.tp

    @property
    def sharded(self) -> bool:
        """FSDP over the dp replicas: dp_shard, or a strategy that always shards ("fsdp")."""
        return self.dp_shard or (self.strategy in STRATEGY_SPECS and STRATEGY_SPECS[self.strategy].sharded is True)

    @property
    def pipelined(self) -> bool:
        """The model runs as a pipeline of stages over pp >= 2 ranks (validation refuses several stages per rank
        without them, so this is also n_stages > 1); pp = 1 runs whole-model replicas."""
        return self.pp > 1

    @property
    def tensor_parallel(self) -> bool:
        """Each stage (or replica) split over tp >= 2 ranks."""
        return self.tp > 1

    @property
    def overlapped_gradient_sum(self) -> bool:
        """The replicas' gradients are all-reduced during the backward (parallel/gradients.GradientSync): asked for, and
        whole-model replicas (no pipeline, no tp; sharded ones reduce-scatter inside FSDP instead)."""
        return self.overlap_gradient_sum and not self.pipelined and not self.tensor_parallel

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages pipeline rank `pp_rank` holds, in order (the schedule's placement; [0] without a
        pipeline): the one stage -> rank map of training, the memory plan and the planner."""
        if not self.pipelined:
            return [0]
        return SCHEDULES[self.schedule].stage_ids(pp_rank, self.pp, self.stages_per_rank)

    def stage_ranks(self) -> dict[int, int]:
        """The pipeline rank of each stage."""
        return {stage: rank for rank in range(self.pp) for stage in self.stage_ids(rank)}


@dataclass
class OutputConfig:
    dir: str = "runs/qwen3-4b-ami"
    """Run directory: config.toml, metrics.csv, adapter/, checkpoints/."""
    loggers: list[str] = field(default_factory=lambda: ["csv"])
    """Where each metrics row goes: "csv" (<dir>/metrics.csv, always written: report, resume and the end-of-run
    summary read it), "tensorboard" (<dir>/tensorboard), "mlflow" (<dir>/mlruns, or $MLFLOW_TRACKING_URI),
    "wandb" (offline under <dir>/wandb unless $WANDB_MODE says otherwise). Each needs its pip extra."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @property
    def microbatch_size(self) -> int:
        return self.train.batch_size // self.parallel.n_microbatches

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- TOML and --set


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys by name."""
    config = Config()
    for section_name, values in raw.items():
        sections = [f.name for f in dataclasses.fields(Config)]
        if section_name not in sections:
            raise ConfigError(
                f"unknown config section [{section_name}]{_did_you_mean(section_name, sections, '[{}]')}; "
                f"sections are: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(
                f"{section_name} = {_toml_value_or_repr(values)} is a value, but [{section_name}] is a section: write "
                f"[{section_name}] on a line of its own and its keys below it (keys of [{section_name}] are: "
                f"{', '.join(_keys(section_name))})"
            )
        # output.tensorboard last: it adds to the output.loggers the table gives, before or after it
        for key in sorted(values, key=lambda k: (section_name, k) == ("output", "tensorboard")):
            _set_key(config, section_name, key, values[key])
    return config


def _set_key(config: Config, section_name: str, key: str, value: Any) -> None:
    if (section_name, key) == ("output", "tensorboard"):
        _migrate_tensorboard(config, value)
    else:
        _set_field(getattr(config, section_name), section_name, key, value)


def _migrate_tensorboard(config: Config, value: Any) -> None:
    """output.tensorboard (a bool) became output.loggers: older configs and run directories still load."""
    if value is True:
        if "tensorboard" not in config.output.loggers:
            config.output.loggers = [*config.output.loggers, "tensorboard"]
        print(
            "pipetune: note: output.tensorboard = true is read as output.loggers = "
            f"{_toml_value(config.output.loggers)}; write that instead (output.tensorboard will go)",
            file=sys.stderr,
        )
    elif value is not False:
        raise ConfigError(f'output.tensorboard = {value!r}: use output.loggers = ["csv", "tensorboard"] instead')


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with pipetune, by name (file name without .toml)."""
    with resources.as_file(resources.files("pipetune") / "configs") as directory:
        return {path.stem: path for path in sorted(Path(directory).glob("*.toml"))}


def config_path(name: str | Path) -> Path:
    """A TOML file's path, or the path of the shipped config of that name (`qwen3-4b-ami` or `demo.toml`). Any
    path that exists and is not a directory is read: /dev/null, a named pipe, `<(...)`'s /dev/fd/N."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        return path
    shipped = shipped_configs()
    stem = path.name.removesuffix(".toml")
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    raise ConfigError(f"config file {str(name)!r} does not exist; {_CONFIG_HINT.format(', '.join(shipped))}")


_CONFIG_HINT = "pass --config with a TOML file or the name of a shipped config: {} (pipetune config list)"


def load_config(path: str | Path | None, overrides: list[str] = (), command: str = "pipetune train") -> Config:
    """Read a TOML file or shipped config (defaults when path is None; an empty file is the defaults too) and apply
    `section.key=value` overrides. `command` is the one a data file given as the config is shown with."""
    raw: dict[str, Any] = {}
    if path is not None:
        if str(path) == "":  # Path("") is ".", a directory the user never named
            raise ConfigError(f"config file '' is an empty name; {_CONFIG_HINT.format(', '.join(shipped_configs()))}")
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a directory; pass --config with a TOML file")
        path = config_path(path)
        if path.suffix.lower() in DATA_SUFFIXES:
            raise ConfigError(_data_as_config(path, DATA_SUFFIXES[path.suffix.lower()], command))
        try:
            content = path.read_bytes()  # once: a pipe (/dev/fd/N) cannot be read twice
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror})") from None
        try:
            raw = tomllib.loads(content.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            kind = _data_kind(content)
            if kind is not None:
                raise ConfigError(_data_as_config(path, kind, command)) from None
            if isinstance(e, UnicodeDecodeError):
                raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e}); save it as UTF-8") from None
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    config = from_dict(raw)
    for item in overrides:
        apply_override(config, item)
    return config


DATA_SUFFIXES = {".jsonl": "JSONL", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet", ".txt": "text"}
"""File types that hold data or a transcript, never a config (a TOML file), and what they hold."""


def _data_kind(content: bytes) -> str | None:
    """What a config file that is not TOML holds, when it looks like data: "Parquet", "JSON", "JSONL", "CSV"."""
    if content.startswith(b"PAR1"):
        return "Parquet"
    text = content.decode("utf-8", errors="replace").strip()
    first = text.splitlines()[0] if text else ""
    for kind, candidate in (("JSON", text), ("JSONL", first)):
        try:
            if isinstance(json.loads(candidate), (dict, list)):
                return kind
        except ValueError:
            pass
    if "," in first and "=" not in first and not first.startswith(("[", "#")):
        return "CSV"
    return None


def _data_as_config(path: Path, kind: str, command: str) -> str:
    """The message for data given as --config: which option takes it, and the command with it there."""
    if kind == "text":
        return (
            f"--config {str(path)!r} is a text file, not a TOML config: a transcript to summarize goes to "
            f"`pipetune summarize --adapter RUN/adapter {path}`; training data is a JSONL, JSON, CSV or Parquet file "
            "given with --set data.source=FILE"
        )
    suffix = f".{kind.lower()}"
    named = "" if path.suffix.lower() == suffix else f" (a file named *{suffix})"
    source = path if not named else path.with_suffix(suffix)
    return (
        f"--config {str(path)!r} holds {kind} data, not a TOML config: give data with --set data.source=FILE"
        f"{named} and the settings with --config, e.g. `{command} --config qwen3-4b-ami --set data.source={source}`"
    )


def _did_you_mean(name: str, names: list[str], form: str = "{}") -> str:
    """The hint ' (did you mean X?)' with the closest of `names` to a misspelt `name` (`form` shapes X), or ""."""
    close = difflib.get_close_matches(name, [n for n in names if n != name], n=1, cutoff=0.6)
    return f" (did you mean {form.format(close[0])}?)" if close else ""


def apply_override(config: Config, item: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as TOML, else taken as a string (as it is for a
    string key that TOML would read as a number, bool or date: output.dir=2024-01-01)."""
    key_path, sep, text = item.partition("=")
    section_name, dot, key = key_path.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"--set {item!r} is not of the form section.key=value (e.g. train.lr=1e-4)")
    sections = [f.name for f in dataclasses.fields(Config)]
    if section_name not in sections:  # not hasattr: Config has methods and properties too
        close = difflib.get_close_matches(section_name, sections, n=1, cutoff=0.6)
        hint = f" (did you mean --set {close[0]}.{key}{sep}{text}?)" if close else ""
        raise ConfigError(f"--set {item!r}: unknown section {section_name!r}{hint}; sections: {', '.join(sections)}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if not isinstance(value, (str, list, dict)) and _declared_type(section_name, key) is str:
        value = text  # output.dir=2024-01-01 or model.name=123: a string key takes the text as written
    _set_key(config, section_name, key, value)


def _set_field(section: Any, section_name: str, key: str, value: Any) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        elsewhere = [f"{f.name}.{key}" for f in dataclasses.fields(Config) if key in _keys(f.name)]
        hint = _did_you_mean(key, list(fields), f"{section_name}.{{}}") or (
            f" (did you mean {elsewhere[0]}?)" if elsewhere else ""
        )
        raise ConfigError(f"unknown key {section_name}.{key}{hint}; keys of [{section_name}] are: {', '.join(fields)}")
    declared = fields[key]
    default = declared.default if declared.default is not dataclasses.MISSING else declared.default_factory()
    expected = _declared_type(section_name, key)
    if isinstance(value, str) and value in declared.metadata.get("also", ()):
        ok = True  # a named alternative to the declared type, e.g. activation_checkpointing = "auto"
    elif expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is list:
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, str)
    if not ok:
        quote = ""
        if expected is str and not isinstance(value, (list, dict)):  # e.g. dir = 2024-01-01, read as a date
            written = _toml_value(value) if isinstance(value, (bool, int, float)) else str(value)
            quote = f' (a string: write it in quotes, {key} = "{written}")'
        raise ConfigError(
            f"{section_name}.{key} = {value!r} has type {type(value).__name__}; "
            f"expected {expected.__name__}"
            + (f" like {default!r}" if isinstance(default, expected) else "")
            + "".join(f" or {alt!r}" for alt in declared.metadata.get("also", ()))
            + quote
        )
    setattr(section, key, value)


def _section_class(section_name: str) -> type:
    return next(f for f in dataclasses.fields(Config) if f.name == section_name).default_factory


def _keys(section_name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_section_class(section_name))]


@cache
def _declared_type(section_name: str, key: str) -> type | None:
    """The type a key is annotated with (bool, int, float, str or list), not its default's, which may be narrower
    (an int default of a float key). Of a union (`bool | str`), the first member: its strings are metadata["also"]."""
    hint = typing.get_type_hints(_section_class(section_name)).get(key)  # None: not a key
    if isinstance(hint, types.UnionType):
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) or hint


def to_toml(config: Config) -> str:
    """The resolved config as TOML (every key, defaults included)."""
    lines = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config through a temporary file and a rename: readers never see half a file."""
    from pipetune.files import write_atomic

    write_atomic(path, to_toml(config))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(c) or _escape_control(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
"""The short escapes of a TOML basic string (one line, in double quotes)."""


def _escape_control(c: str) -> str:
    """Any other control character (U+0000-U+001F, DEL) as \\uXXXX, which TOML allows; the rest as is."""
    return f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c


def _toml_value_or_repr(value: Any) -> str:
    """`value` as TOML, or Python's repr where _toml_value cannot write it (a date, a table)."""
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)


# --------------------------------------------------------------------------- validation


def validate(config: Config, world_size: int) -> None:
    """Check the values that need no model: raise ConfigError naming the value and the fix.

    One checker per section, in the sections' order; a check that spans sections lives with the section its
    message names first, or (microbatches, sequence lengths) with the parallel layout that needs it."""
    _check_model(config.model, config.parallel)
    _check_data(config.data)
    _check_lora(config.lora, config.parallel, config.model.quantize)
    _check_train(config.train, config.data)
    _check_parallel(config.parallel, config.train, config.data, world_size)
    _check_output(config.output)


def _check_model(m: ModelConfig, p: ParallelConfig) -> None:
    _check(m.dtype in DTYPES, f"model.dtype = {m.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    _check(m.quantize in QUANTIZE, f"model.quantize = {m.quantize!r} is unknown; use one of {', '.join(QUANTIZE)}")
    _check(
        m.quantize != "fp8" or m.dtype == "bfloat16",
        f'model.quantize = "fp8" runs FP8 matmuls that write bfloat16, but model.dtype = {m.dtype!r}: '
        'set model.dtype = "bfloat16", or use model.quantize = "nf4"',
    )
    _check(
        m.quantize == "none" or not p.tensor_parallel,
        f"model.quantize = {m.quantize!r} with parallel.tp = {p.tp}: quantized weights are not split over "
        "tensor-parallel ranks; set parallel.tp = 1 (pp, ddp or fsdp carry a quantized base) or "
        "model.quantize = 'none'",
    )
    _check(
        m.init in ("pretrained", "random"),
        f"model.init = {m.init!r} is unknown; use 'pretrained' or 'random'",
    )
    _check_set("model.name", m.name)


def _check_data(d: DataConfig) -> None:
    _at_least_one(
        ("data.max_length", d.max_length),
        ("data.max_summary_tokens", d.max_summary_tokens),
        ("data.synthetic_train", d.synthetic_train),
        ("data.max_samples_per_row", d.max_samples_per_row),
    )
    _non_negative(("data.synthetic_validation", d.synthetic_validation))
    _check(
        d.synthetic_lengths in SYNTHETIC_LENGTHS,
        f"data.synthetic_lengths = {d.synthetic_lengths!r} is unknown; use one of {', '.join(SYNTHETIC_LENGTHS)}",
    )
    _check(d.max_length <= MAX_LENGTH, f"data.max_length = {d.max_length} is beyond {MAX_LENGTH} tokens; lower it")
    _check_set("data.source", d.source)
    for name, value in [("data.transcript_column", d.transcript_column), ("data.summary_column", d.summary_column)]:
        _check(bool(value), f"{name} is empty; name the column of your data that holds it")
    if d.buckets:
        _check(
            all(type(b) is int and b >= 1 for b in d.buckets)
            and d.buckets == sorted(set(d.buckets))
            and d.buckets[-1] == d.max_length,
            f"data.buckets = {d.buckets} must be distinct ascending lengths ending at data.max_length = "
            f"{d.max_length}, e.g. [{d.max_length // 4}, {d.max_length // 2}, {d.max_length}]",
        )
    most = d.max_length // 2  # a sample is a prompt token and a summary token at least (the template: more)
    _check(
        not d.packing or d.max_samples_per_row <= most,
        f"data.max_samples_per_row = {d.max_samples_per_row} is more samples than a row of data.max_length = "
        f"{d.max_length} tokens holds (each takes 2 tokens at least, the chat template more); set at most {most}, "
        f"e.g. {min(16, most)}",
    )
    _check(
        not (d.packing and d.buckets),
        f"data.packing = true fills rows of data.max_length, but data.buckets = {d.buckets} pads each sample to a "
        "bucket: use one of them (data.buckets = [] with packing)",
    )
    _check(
        0 <= d.validation_fraction < 1,
        f"data.validation_fraction = {d.validation_fraction} must be within [0, 1) (0 = no hold-out); e.g. 0.1",
    )


def _check_lora(lora: LoraConfig, p: ParallelConfig, quantize: str = "none") -> None:
    _at_least_one(("lora.r", lora.r))
    _check(
        lora.alpha > 0 and math.isfinite(lora.alpha),
        f"lora.alpha = {lora.alpha} must be positive and finite (e.g. 2 x lora.r)",
    )
    _check(0 <= lora.dropout < 1, f"lora.dropout = {lora.dropout} must be within [0, 1)")
    _check(bool(lora.target_modules), "lora.target_modules is empty; name at least one linear layer")
    _check(
        all(isinstance(name, str) and name for name in lora.target_modules),
        f"lora.target_modules = {lora.target_modules} must be names of linear layers, e.g. ['q_proj', 'v_proj']",
    )
    _check(
        not lora.shared_dropout or lora.fast_path,
        "lora.shared_dropout = true shares dropout masks on the fast LoRA path, but lora.fast_path = false: "
        "set lora.fast_path = true, or lora.shared_dropout = false",
    )
    _check(
        not lora.shared_dropout or not p.tensor_parallel,
        f"lora.shared_dropout = true with parallel.tp = {p.tp}: tensor parallelism splits each adapter on its own "
        "and draws its masks per adapter; set lora.shared_dropout = false, or parallel.tp = 1",
    )
    if lora.adapter_in_matmul is True:
        where = "set lora.adapter_in_matmul = false"
        _check(
            lora.fast_path,
            f"lora.adapter_in_matmul = true is part of the fast LoRA path: set lora.fast_path = true, or {where}",
        )
        _check(
            not p.tensor_parallel,
            f"lora.adapter_in_matmul = true with parallel.tp = {p.tp}: the extended weights are not split; set "
            f"parallel.tp = 1, or {where}",
        )
        _check(
            not p.sharded,
            'lora.adapter_in_matmul = true with FSDP (parallel.dp_shard or strategy "fsdp"): the extended weights '
            f"are not sharded; use ddp, or {where}",
        )
        _check(
            quantize == "none",
            f"lora.adapter_in_matmul = true with model.quantize = {quantize!r}: an extended weight holds plain "
            f'values; set model.quantize = "none", or {where}',
        )


def _check_train(t: TrainConfig, d: DataConfig) -> None:
    _at_least_one(
        ("train.batch_size", t.batch_size),
        ("train.grad_accum", t.grad_accum),
        ("train.epochs", t.epochs),
        ("train.log_every", t.log_every),
        ("train.keep_checkpoints", t.keep_checkpoints),
        ("train.max_skipped_steps", t.max_skipped_steps),
        ("train.loss_chunk", t.loss_chunk),
    )
    _non_negative(
        ("train.warmup_steps", t.warmup_steps),
        ("train.timeline_step", t.timeline_step),
    )
    if t.layers_per_graph != "auto":  # "auto": pipetune/switches.py
        _non_negative(("train.layers_per_graph", t.layers_per_graph))
    _check(0 <= t.seed < 2**32, f"train.seed = {t.seed} must be within [0, 2**32) (e.g. 42)")
    if t.cuda_graphs is True:
        _check(t.compile is True, "train.cuda_graphs = true replays compiled layers: set train.compile = true as well")
        _check(
            t.activation_checkpointing not in (True, "offload"),
            "train.cuda_graphs = true does not combine with train.activation_checkpointing = "
            f"{_toml_value(t.activation_checkpointing)} (a recomputed "
            "layer would replay its graph inside another's backward); set one of them to false, or checkpointing "
            'to "auto" (ranks that checkpoint then run without graphs)',
        )
    _check(
        t.activation_checkpointing in (True, False, "auto", "offload"),
        f"train.activation_checkpointing = {t.activation_checkpointing!r} is unknown; "
        'use true, false, "offload" or "auto"',
    )
    if t.keep_attention:
        _check(
            t.activation_checkpointing is not False,
            "train.keep_attention = true keeps attention's output through a checkpointed layer's recomputation: "
            'set train.activation_checkpointing to true, "offload" or "auto" as well',
        )
        _check(
            t.compile is not True,
            "train.keep_attention = true runs the attention kernels' own operators in eager layers: set "
            "train.compile = false (or train.keep_attention = false)",
        )
        _check(
            not d.packing,
            "train.keep_attention = true keeps causal, unmasked attention, but data.packing = true masks each "
            "row's samples (flex attention): set one of them to false",
        )
    _check(
        t.packed_attention in ("flex", "documents", "auto"),
        f'train.packed_attention = {t.packed_attention!r} is unknown; use "flex", "documents" or "auto"',
    )
    _check(
        not (t.packed_attention == "documents" and t.cuda_graphs is True),
        'train.packed_attention = "documents" reads each row\'s samples on the host at every call, which a CUDA '
        'graph cannot replay: set train.cuda_graphs = false (or train.packed_attention = "flex")',
    )
    _check(
        t.mlp_chunk == "auto" or (isinstance(t.mlp_chunk, int) and t.mlp_chunk >= 0),
        f'train.mlp_chunk = {t.mlp_chunk!r} must be "auto" or a number of tokens >= 0 (0: off; e.g. 8192)',
    )
    _check(
        t.max_steps == -1 or t.max_steps >= 1,
        f"train.max_steps = {t.max_steps} must be -1 (no cap) or at least 1",
    )
    _check(t.lr > 0 and math.isfinite(t.lr), f"train.lr = {t.lr} must be positive and finite")
    _check(
        t.weight_decay >= 0 and math.isfinite(t.weight_decay),
        f"train.weight_decay = {t.weight_decay} must be >= 0 and finite (e.g. 0.01)",
    )
    _check(t.save_every >= 0, f"train.save_every = {t.save_every} must be >= 0 (0: checkpoints at epoch ends only)")
    _check(t.resume in RESUME_MODES, f"train.resume = {t.resume!r} is unknown; use one of {', '.join(RESUME_MODES)}")
    _check(t.eval_every >= 0, f"train.eval_every = {t.eval_every} must be >= 0 (0: at epoch ends only)")
    _check(math.isfinite(t.memory_gb), f"train.memory_gb = {t.memory_gb} must be a finite number of GB (e.g. 80)")
    _check(t.memory_gb >= 0, f"train.memory_gb = {t.memory_gb} must be >= 0 (0: the GPU's total memory)")
    _check(
        t.max_grad_norm >= 0 and math.isfinite(t.max_grad_norm),
        f"train.max_grad_norm = {t.max_grad_norm} must be >= 0 and finite (0 disables clipping)",
    )
    _check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio = {t.min_lr_ratio} must be within [0, 1]")


def _check_parallel(p: ParallelConfig, t: TrainConfig, d: DataConfig, world_size: int) -> None:
    """The layout, and what it needs of the other sections: the schedule of train.compile and checkpointing,
    train.batch_size of microbatches, data lengths of sequence parallelism; last, the world size it makes."""
    _check(
        p.strategy in STRATEGIES,
        f"parallel.strategy = {p.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}",
    )
    _check(
        p.strategy != "auto",
        "parallel.strategy = 'auto' is chosen by pipetune train and pipetune bench before a run starts; "
        "pipetune plan --config FILE shows what it would pick",
    )
    _check(
        p.schedule in SCHEDULES,
        f"parallel.schedule = {p.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}",
    )
    _at_least_one(
        ("parallel.pp", p.pp),
        ("parallel.dp", p.dp),
        ("parallel.tp", p.tp),
        ("parallel.stages_per_rank", p.stages_per_rank),
    )
    if p.n_microbatches != "auto":  # "auto": the switches' rule picks a count the schedule accepts
        _at_least_one(("parallel.n_microbatches", p.n_microbatches))
    _check_schedule(p, t.compile is True, t.activation_checkpointing not in (False, "auto"))
    _check_strategy(p)
    _check_tensor_parallel(p, d)
    _check(
        0 < p.timeout_s <= MAX_TIMEOUT_S,
        f"parallel.timeout_s = {p.timeout_s} must be positive (seconds, e.g. 600) and at most {MAX_TIMEOUT_S:g}",
    )
    _check(p.p2p_channels >= 0, f"parallel.p2p_channels = {p.p2p_channels} must be >= 0 (0: NCCL's choice; e.g. 1)")
    _check(
        p.n_microbatches == "auto" or t.batch_size % p.n_microbatches == 0,
        f"train.batch_size = {t.batch_size} is not divisible by parallel.n_microbatches = {p.n_microbatches}; "
        f"use a batch_size that is a multiple of {p.n_microbatches}",
    )
    _check(
        world_size == p.world_size,
        f"world size {world_size} does not match parallel.pp x parallel.dp x parallel.tp = {p.pp} x {p.dp} x {p.tp}; "
        f"start {p.world_size} processes (--nproc {p.world_size}) or change parallel.pp, dp or tp",
    )
    if p.layers_per_stage:
        _check(
            all(type(n) is int for n in p.layers_per_stage),
            f"parallel.layers_per_stage = {p.layers_per_stage} must be whole numbers of layers, e.g. [18, 18]",
        )
        _check(
            len(p.layers_per_stage) == p.n_stages,
            f"parallel.layers_per_stage = {p.layers_per_stage} has {len(p.layers_per_stage)} entries "
            f"for {p.n_stages} stages (parallel.pp = {p.pp} x stages_per_rank = {p.stages_per_rank}); "
            "give one count per stage or [] for a balanced split",
        )
        _check(
            all(n >= 1 for n in p.layers_per_stage),
            f"parallel.layers_per_stage = {p.layers_per_stage}: every stage needs at least one layer",
        )


def _check_output(o: OutputConfig) -> None:
    _check_set("output.dir", o.dir)
    _check_output_dir(o.dir)


def validate_against_model(
    config: Config, n_layers: int, module_names: set[str], heads: int = 1, kv_heads: int = 1
) -> None:
    """Checks that need the model's shape: layer counts, LoRA target names, attention heads for parallel.tp."""
    p = config.parallel
    _check(
        heads % p.tp == 0 and kv_heads % p.tp == 0,
        f"parallel.tp = {p.tp} does not divide the {heads} attention heads and {kv_heads} key-value heads of "
        f"{config.model.name!r}: each tensor-parallel rank runs whole heads; use a tp that divides both "
        f"({', '.join(str(n) for n in range(2, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0) or 'none > 1'})",
    )
    check_stage_count(config, n_layers)
    if p.layers_per_stage:
        _check(
            sum(p.layers_per_stage) == n_layers,
            f"parallel.layers_per_stage = {p.layers_per_stage} sums to {sum(p.layers_per_stage)}, "
            f"but {config.model.name!r} has {n_layers} decoder layers",
        )
    unknown = [t for t in config.lora.target_modules if t not in module_names]
    _check(
        not unknown,
        f"lora.target_modules {unknown} match no linear layer of {config.model.name!r}; "
        f"its linear layers are: {', '.join(sorted(module_names))}",
    )


def check_stage_count(config: Config, n_layers: int) -> None:
    """Every pipeline stage runs at least one decoder layer: at most n_layers stages."""
    p = config.parallel
    stages = f"parallel.pp = {p.pp}" + (
        f" x stages_per_rank = {p.stages_per_rank} = {p.n_stages} stages" if p.stages_per_rank > 1 else ""
    )
    _check(
        p.n_stages <= n_layers,
        f"{stages} > {n_layers} decoder layers of {config.model.name!r}; use at most {n_layers} stages",
    )


def _check_schedule(p: ParallelConfig, compiled: bool, checkpointed: bool) -> None:
    """Each schedule's constraints on stages per rank and microbatches (torch's own, stated up front; the rules
    of each schedule are in pipetune/schedules.py)."""
    s, v, m = p.schedule, p.stages_per_rank, p.n_microbatches
    spec = SCHEDULES[s]
    if not spec.multi_stage:
        _check(
            v == 1,
            f"parallel.stages_per_rank = {v}: schedule {s!r} runs one stage per rank; set stages_per_rank = 1 "
            "or use interleaved_1f1b",
        )
    else:
        _check(p.pp >= 2, f"parallel.schedule = {s!r} needs parallel.pp >= 2; use 1f1b with pp = {p.pp}")
        if spec.max_stages_per_rank is None:
            _check(
                v >= spec.min_stages_per_rank,
                f"parallel.schedule = {s!r} needs parallel.stages_per_rank >= {spec.min_stages_per_rank} (got {v}); "
                f"e.g. {spec.min_stages_per_rank}",
            )
        else:
            _check(
                v == spec.max_stages_per_rank,
                f"parallel.schedule = {s!r} runs exactly {spec.max_stages_per_rank} stages per rank; set "
                f"parallel.stages_per_rank = {spec.max_stages_per_rank}",
            )
    if m == "auto":  # the switches' rule picks a count these rules accept
        pass
    elif spec.one_microbatch_per_stage:
        n_stages = p.pp * v
        _check(
            m >= n_stages,
            f"parallel.n_microbatches = {m} < {f'parallel.pp = {p.pp}' if v == 1 else f'{n_stages} stages'}: {s} "
            f"needs at least one microbatch per stage; raise n_microbatches to {n_stages} or more",
        )
    if spec.microbatch_rounds and m != "auto":
        rounds = max(1, m // p.pp)
        _check(
            m % rounds == 0,
            f"parallel.n_microbatches = {m}: {s} runs microbatches in rounds of parallel.pp = {p.pp}; "
            f"use a multiple of {p.pp}",
        )
    if spec.splits_backward:
        _check(
            not checkpointed,
            f"parallel.schedule = {s!r} splits each backward in two, which recomputed (checkpointed) layers do not "
            "support; set train.activation_checkpointing = false or use 1f1b / interleaved_1f1b",
        )
        _check(
            not compiled,
            f"parallel.schedule = {s!r} splits each backward into input- and weight-gradient parts, which "
            "torch.compile'd layers do not support; set train.compile = false or use 1f1b / interleaved_1f1b",
        )


def _check_output_dir(value: str) -> None:
    """output.dir must be a directory or creatable as one: not a file, not below one."""
    path = Path(value).expanduser()
    for existing in (path, *path.parents):
        if existing.exists():
            _check(
                existing.is_dir(),
                f"output.dir = {value!r}: {str(existing)!r} is a file, not a directory; choose another output.dir",
            )
            return


def _check_strategy(p: ParallelConfig) -> None:
    """What the strategy fixes of the layout (its record in pipetune/strategies.py; tp's: _check_tensor_parallel)."""
    s = STRATEGY_SPECS[p.strategy]
    if not s.pipeline and s.sharded is False:  # ddp
        _check(
            not p.pipelined, f"parallel.strategy = 'ddp' runs whole-model replicas: set parallel.pp = 1 (got {p.pp})"
        )
        _check(
            not p.dp_shard,
            "parallel.strategy = 'ddp' all-reduces whole replicas' gradients; for replicas sharded with FSDP "
            "(parallel.dp_shard = true) use parallel.strategy = 'fsdp'",
        )
    if not s.pipeline and s.sharded:  # fsdp
        _check(
            not p.pipelined,
            f"parallel.strategy = 'fsdp' shards whole-model replicas: set parallel.pp = 1 (got {p.pp}), "
            "or keep the pipeline with parallel.strategy = 'pp' and parallel.dp_shard = true",
        )
        _check(
            p.dp >= s.min_replicas,
            f"parallel.strategy = 'fsdp' shards the model over dp replicas: set parallel.dp >= {s.min_replicas} "
            f"(got {p.dp}), or use parallel.strategy = 'single' for one process",
        )
    if p.dp_shard:
        _check(
            p.dp >= 2,
            f"parallel.dp_shard = true shards each stage over its dp replicas, but parallel.dp = {p.dp}: "
            "set parallel.dp >= 2 or parallel.dp_shard = false",
        )
    if s.max_replicas == 1:  # single
        _check(
            p.pp == 1 and p.dp == 1 and p.tp == 1,
            f"parallel.strategy = 'single' runs one process: set parallel.pp = 1, parallel.dp = 1 and parallel.tp = 1 "
            f"(got {p.pp} x {p.dp} x {p.tp})",
        )


def _check_tensor_parallel(p: ParallelConfig, d: DataConfig) -> None:
    """The "tp" strategy's shape, and what tensor parallelism does not combine with."""
    s = STRATEGY_SPECS[p.strategy]
    if s.tensor_parallel and not s.pipeline:  # tp
        _check(
            not p.pipelined and p.tensor_parallel,
            f"parallel.strategy = 'tp' splits whole-model replicas over tensor-parallel ranks: set parallel.pp = 1 "
            f"and parallel.tp >= 2 (got pp = {p.pp}, tp = {p.tp}), or keep the pipeline with parallel.strategy = 'pp' "
            "and parallel.tp",
        )
    if p.sequence_parallel:
        _check(
            p.tp >= 2,
            f"parallel.sequence_parallel = true splits sequences over tensor-parallel ranks, but parallel.tp = {p.tp}: "
            "set parallel.tp >= 2 or parallel.sequence_parallel = false",
        )
        uneven = [n for n in d.buckets or [d.max_length] if n % p.tp]
        _check(
            not uneven,
            f"parallel.sequence_parallel = true splits each sequence over parallel.tp = {p.tp} ranks, but the padded "
            f"length{'s' if len(uneven) > 1 else ''} {', '.join(map(str, uneven))} (data.max_length / data.buckets) "
            f"{'are' if len(uneven) > 1 else 'is'} not a multiple of {p.tp}; use multiples of {p.tp}",
        )
    _check(  # "single": its own message (_check_strategy)
        not p.tensor_parallel or s.tensor_parallel is not False or s.max_replicas == 1,
        f"parallel.tp = {p.tp} with parallel.strategy = 'ddp', which replicates whole models: for replicas split over "
        "tensor-parallel ranks use parallel.strategy = 'tp' with parallel.dp replicas, or set parallel.tp = 1",
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _at_least_one(*named: tuple[str, int]) -> None:
    for name, value in named:
        _check(value >= 1, f"{name} = {value} must be at least 1")


def _non_negative(*named: tuple[str, int]) -> None:
    for name, value in named:
        _check(value >= 0, f"{name} = {value} must be >= 0")


def _check_set(name: str, value: str) -> None:
    _check(bool(value.strip()), f"{name} is empty; set it (see the defaults in src/pipetune/config.py)")


MLP_CHUNK_AUTO = (32768, 8192)
"""train.mlp_chunk = "auto": rows of at least this many tokens run their MLPs in chunks of this many."""


def mlp_chunk_tokens(t: TrainConfig, max_length: int, tp: int = 1) -> int:
    """Tokens per MLP chunk that train.mlp_chunk asks for at rows of `max_length` (0: not chunked). Never under
    tensor parallelism (`tp` > 1): a chunk needs whole sequences, and a tp rank holds a share of each token."""
    if tp > 1:
        return 0
    if t.mlp_chunk == "auto":
        threshold, chunk = MLP_CHUNK_AUTO
        return chunk if max_length >= threshold else 0
    return int(t.mlp_chunk)
