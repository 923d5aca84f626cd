"""The speed switches: every "auto" resolved in one place, from the hardware, the model, the data and the layout.

A speed switch changes how fast a run goes and how much memory it takes, never its math: lora.fast_path,
lora.adapter_in_matmul, train.compile, train.cuda_graphs, train.layers_per_graph, train.fused_loss,
train.head_rows, train.packed_attention, train.activation_checkpointing, train.mlp_chunk and
parallel.n_microbatches. Each defaults to "auto"; a value (true / false, a number, a kernel) forces it, and
validation refuses a forced value that cannot work, as before. "auto" never produces a refused combination: where
a switch cannot work (tensor parallelism, FSDP, a quantized base, the CPU) it resolves off.

`resolve` is what `pipetune train`, `bench` and `plan` call (through preflight and the planner's layouts) and
nothing else decides a switch; the thresholds its rules share with the code that runs them (LONG_DOCUMENT, the
attention kernel's; MLP_CHUNK_AUTO and `mlp_chunk_tokens`, the MLP chunks') live here too. Two decisions stay
with the rank that runs, from what only it measures: activation_checkpointing = "auto" (parallel/memory.py plans
the layers to recompute from a layer measured on its device) and whether CUDA graphs pay off (model/graphs.py).
The rules and the measurements behind them (benchmarks/journal, one H200 or H100):

- GPU: the fast LoRA path, the adapters inside the base matmuls (plain base, no tp, no FSDP), torch.compile with
  6 decoder layers a graph, the fused loss, CUDA graphs where the host is the bound. Whole meetings, Qwen3-4B in
  rows of 16,384 on one H100: 20,098 real tokens/s with them against 6,450 without (2026-12-06); the seed's job's
  16 x 512 rows 24,808 against 9,380. Resolved by these rules (second round, one H100, same call): the
  whole-meeting config 1.01x that tuned setting over its epoch's rows, the seed's job 1.06x the tuned 16 x 512.
- The last layer on the loss's rows (train.head_rows), with the fused loss where the loss reads at most
  HEAD_ROWS_SHARE of a row: whole meetings on one H200, 1.52% more real tokens/s, every step 1.3-1.8% shorter
  (2026-12-07-head-rows-and-pad32-one-h200.md); the seed's job reads up to half a row, so there the whole layer.
- Packed rows of long samples (>= 4,096 tokens on average) on one GPU or data-parallel ranks: the "documents"
  attention kernel, 1.13x flex's tokens/s on whole meetings; 6-7x slower than flex a layer on ~550-token samples
  (2026-12-02-documents-streams-and-plans-one-h200.md), and not measured under a GPU pipeline: flex there, and
  with train.cuda_graphs forced on (the documents kernel reads the host at every call).
- Microbatches: without a pipeline, the fewest that still hold MICROBATCH_TOKENS tokens each (packed 4,096-token
  rows two to a microbatch: 1.23x Unsloth, one to a microbatch: 1.09x; 2026-12-02-packed-attention-one-h200.md);
  in a pipeline, microbatches of PIPELINE_MICROBATCH_TOKENS, at least one per stage (Qwen3-4B at 512 tokens on 2x
  H200: 4 microbatches of 4 rows fastest, wave 8).
- GPUs before Ampere (compute capability below BFLOAT16_CAPABILITY, 8.0: T4, V100): compile off for a bfloat16
  model (inductor traces each graph, then skips it: no bfloat16 in their hardware), and flex for packed rows (the
  documents kernel runs flash or cuDNN attention, which need 8.0); below TRITON_CAPABILITY, compile off for any
  dtype. From torch's own limits, checked on the CPU with such GPUs described; none was measured.
- CPU: the plain path (PEFT's adapters, eager layers, the plain loss); checkpointing planned, as on a GPU, for each
  rank's memory: train.memory_gb, else its share of what the machine has available (parallel/memory.py:
  cpu_budget), so that a run fits the machine it starts on without a setting. The fused loss where a microbatch's
  float32 logits reach CPU_FUSED_LOSS_BYTES: SmolLM2's whole meetings (one 8,192-token row, 49,152 entries) held
  ~6.4 GB on the last worker for the plain loss's logits, their gradient and log-softmax (2026-12-06).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pipetune.config import Config, TrainConfig

AUTO = "auto"
LAYERS_PER_GRAPH = 6
"""Decoder layers traced as one compiled graph: 1% faster than one a graph on an H200 (Qwen3-4B, 512 tokens)."""
MICROBATCH_TOKENS = 8192
"""Tokens a microbatch holds at least, without a pipeline, where the batch allows: matmuls that fill the GPU."""
PIPELINE_MICROBATCH_TOKENS = 2048
"""Tokens a pipeline's microbatch holds at least, where the batch allows one microbatch per stage."""
LONG_DOCUMENT = 4096
"""Tokens from which a document's kernels outrun its host calls: on an H200 a 4,096-token document's take ~1 ms,
forward and backward, against ~0.29 ms of host calls a document (windows, copies, the two operators); a
~550-token one's ~0.1 ms, so there the GPU waits: the documents kernel ran 6-7x slower than flex's a layer, and
two streams made it 20-30% slower still, where on whole meetings (~7,400 tokens) they made it 4.5% faster
(2026-12-02-documents-streams-and-plans-one-h200.md). Shorter documents run on the current stream
(`_on_streams`), and a run whose samples are shorter on average hears that flex is likely faster
(`documents_advice`)."""
CPU_FUSED_LOSS_BYTES = 1e9
"""On a CPU, the fused loss from a microbatch's float32 logits of this size (the plain loss holds ~3x them)."""
HEAD_ROWS_SHARE = 1 / 3
"""train.head_rows = "auto": the most of a row the loss may read for the last layer to run on those rows alone."""
MLP_CHUNK_AUTO = (32768, 8192)
"""train.mlp_chunk = "auto": rows of at least this many tokens run their MLPs in chunks of this many."""
SWITCHES = (
    ("lora", "fast_path"),
    ("lora", "adapter_in_matmul"),
    ("train", "compile"),
    ("train", "cuda_graphs"),
    ("train", "layers_per_graph"),
    ("train", "fused_loss"),
    ("train", "head_rows"),
    ("train", "packed_attention"),
    ("train", "activation_checkpointing"),
    ("train", "mlp_chunk"),
    ("parallel", "n_microbatches"),
)
"""Every speed switch, as (section, key)."""


@dataclass(frozen=True)
class Hardware:
    """What a run's switches are resolved for: a GPU (its name and CUDA compute capability, where known) or the CPU."""

    gpu: bool
    name: str = ""
    capability: tuple[int, int] | None = None

    @classmethod
    def here(cls) -> Hardware:
        """This process's: its first GPU where there is one (a worker's: the one it runs on), else the CPU."""
        import torch

        if torch.cuda.is_available():
            return cls.of(torch.device("cuda", torch.cuda.current_device()))
        return cls(False)

    @classmethod
    def of(cls, device: torch.device) -> Hardware:
        """The hardware of a rank's device."""
        import torch

        if device.type == "cuda":
            return cls(True, torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))
        return cls(False)

    def below(self, capability: tuple[int, int]) -> str:
        """Its name and compute capability where this is a GPU known to be below `capability`; else empty."""
        if not self.gpu or self.capability is None or self.capability >= capability:
            return ""
        return f"{self.name}, compute capability {self.capability[0]}.{self.capability[1]}"


PLANNED_GPU = Hardware(True, "the planned GPU")
"""What `pipetune plan` resolves switches for: the GPUs it plans, whatever this machine has."""


@dataclass
class Choice:
    """One switch's resolved value and why (`forced`: the config set it, "auto" did not choose it)."""

    key: str
    value: Any
    why: str
    forced: bool = False


@dataclass
class Resolution:
    """A config with every switch resolved (but the rank-by-rank two), and each choice with its reason."""

    config: Config
    choices: list[Choice] = field(default_factory=list)

    def values(self) -> dict[str, Any]:
        """{"section.key": value} of every switch, as the run has it (bench.json, speed.json)."""
        return {c.key: c.value for c in self.choices}

    def line(self, *after: str) -> str:
        """The startup line: what each switch is and why, then `after` (the ranks' own decisions)."""
        parts = [_phrase(c) for c in self.choices if _phrase(c)]
        return "speed: " + ", ".join([*parts, *(a for a in after if a)])

    def save(self, path: Path, *after: str) -> None:
        """speed.json in the run directory: the switches as resolved, the reasons, and the line."""
        from pipetune.files import write_atomic

        reasons = {c.key: ("set in the config" if c.forced else c.why) for c in self.choices}
        record = {"switches": self.values(), "reasons": reasons, "line": self.line(*after)}
        write_atomic(path, json.dumps(record, indent=1) + "\n")


def resolve(
    config: Config,
    hardware: Hardware,
    lengths: torch.Tensor | None = None,
    vocab: int = 0,
    pre_norm: bool = True,
) -> Resolution:
    """`config` with every "auto" switch replaced for `hardware` (a copy), in dependency order. `lengths`: the
    training samples' tokens where known (the packed attention kernel is chosen by them; unknown: "flex");
    `vocab`: the model's vocabulary where known (on a CPU the loss is chosen by its logits' size; unknown: plain);
    `pre_norm`: the model's family norms only its layers' inputs (`Family.pre_norm_layers`; train.head_rows)."""
    config = copy.deepcopy(config)
    t, lora, p = config.train, config.lora, config.parallel
    choices: list[Choice] = []

    def decide(section: Any, key: str, name: str, rule: tuple[Any, str]) -> Any:
        value = getattr(section, key)
        if value == AUTO and not isinstance(value, bool):
            value, why = rule
            setattr(section, key, value)
            choices.append(Choice(name, value, why))
        else:
            choices.append(Choice(name, value, "", forced=True))
        return value

    gpu = hardware.gpu
    fast = decide(lora, "fast_path", "lora.fast_path", _fast_path(config, gpu))
    decide(lora, "adapter_in_matmul", "lora.adapter_in_matmul", _in_matmul(config, gpu, fast is True))
    compiled = decide(t, "compile", "train.compile", _compile(config, hardware))
    decide(t, "layers_per_graph", "train.layers_per_graph", _per_graph(config, compiled is True))
    m = decide(p, "n_microbatches", "parallel.n_microbatches", _microbatches(config))
    fused = decide(t, "fused_loss", "train.fused_loss", _fused_loss(config, gpu, m, vocab))
    decide(t, "head_rows", "train.head_rows", _head_rows(config, fused is True, pre_norm))
    kernel = decide(t, "packed_attention", "train.packed_attention", _kernel(config, hardware, lengths))
    decide(t, "activation_checkpointing", "train.activation_checkpointing", _checkpointing(config, gpu))
    decide(t, "cuda_graphs", "train.cuda_graphs", _graphs(config, gpu, compiled is True, kernel))
    decide(t, "mlp_chunk", "train.mlp_chunk", (AUTO, "8,192-token chunks at rows of 32,768 or more"))
    return Resolution(config, choices)


def unresolved(config: Config) -> list[str]:
    """The switches still "auto" in `config` (for tests and checks: a resolved config has only the two that a rank
    decides itself, checkpointing and mlp_chunk, which read "auto" as a rule)."""
    return [f"{s}.{k}" for s, k in SWITCHES if getattr(getattr(config, s), k) == AUTO]


# --------------------------------------------------------------------------- the rules, one a switch


def _fast_path(config: Config, gpu: bool) -> tuple[bool, str]:
    lora = config.lora
    if lora.adapter_in_matmul is True or lora.shared_dropout:
        return True, "lora.adapter_in_matmul / shared_dropout run on it"
    return (True, "GPU") if gpu else (False, "CPU: PEFT's own path")


def _in_matmul(config: Config, gpu: bool, fast: bool) -> tuple[bool, str]:
    p, quantize = config.parallel, config.model.quantize
    if not gpu:
        return False, "CPU"
    if not fast:
        return False, "lora.fast_path is off"
    if p.tensor_parallel:
        return False, f"parallel.tp = {p.tp}"
    if p.sharded:
        return False, "FSDP"
    if quantize != "none":
        return False, f"{quantize} base"
    return True, f"plain {config.model.dtype} base, no tp/FSDP"


TRITON_CAPABILITY = (7, 0)
"""The oldest GPUs Triton (inductor's GPU code) compiles for."""
BFLOAT16_CAPABILITY = (8, 0)
"""The oldest GPUs with bfloat16 in hardware (Ampere): below it inductor skips bfloat16 graphs, running them eagerly
after tracing them (torch/_inductor/compile_fx.py), and SDPA has neither flash nor cuDNN attention, the two kernels
the documents kernel runs."""


def _compile(config: Config, hardware: Hardware) -> tuple[bool, str]:
    if not hardware.gpu:
        return False, "CPU"
    if old := hardware.below(TRITON_CAPABILITY):
        return False, f"{old}: Triton needs 7.0 or higher"
    if config.model.dtype == "bfloat16" and (old := hardware.below(BFLOAT16_CAPABILITY)):
        return False, f"{old}: inductor compiles bfloat16 from 8.0"
    if _splits_backward(config):
        return False, f"{config.parallel.schedule} splits each backward"
    if config.train.keep_attention:
        return False, "train.keep_attention runs eager layers"
    return True, "GPU"


def _splits_backward(config: Config) -> bool:
    """The layout's schedule splits each backward in two, which compiled and checkpointed layers do not support
    (schedules.py's record; validation refuses either forced there)."""
    from pipetune.schedules import SCHEDULES

    schedule = SCHEDULES.get(config.parallel.schedule)
    return config.parallel.pipelined and schedule is not None and schedule.splits_backward


def _per_graph(config: Config, compiled: bool) -> tuple[int, str]:
    p = config.parallel
    if not compiled:
        return 1, "not compiled"
    if p.sharded or p.tensor_parallel:
        return 1, "one layer a graph under FSDP / tp"
    return LAYERS_PER_GRAPH, f"{LAYERS_PER_GRAPH} layers a graph"


def _fused_loss(config: Config, gpu: bool, microbatches: Any, vocab: int) -> tuple[bool, str]:
    if config.train.head_rows is True:
        return True, "train.head_rows runs on it"
    if gpu:
        return True, "GPU"
    if not vocab or not isinstance(microbatches, int) or microbatches < 1:
        return False, "CPU"
    logits = max(1, config.train.batch_size // microbatches) * config.data.max_length * vocab * 4
    big, limit = logits >= CPU_FUSED_LOSS_BYTES, f"{CPU_FUSED_LOSS_BYTES / 1e9:.0f} GB"
    return big, f"CPU, {logits / 1e9:.2g} GB of logits a microbatch {'>=' if big else '<'} {limit}"


def head_rows_share(config: Config) -> float:
    """The most of a row the loss reads: a sample's supervised tokens, data.max_summary_tokens + 1, of
    data.max_length (a packed row's samples share it)."""
    return min(1.0, (config.data.max_summary_tokens + 1) / config.data.max_length)


def _head_rows(config: Config, fused: bool, pre_norm: bool) -> tuple[bool, str]:
    p, d = config.parallel, config.data
    if not fused:
        return False, "no fused loss"
    if p.tensor_parallel:
        return False, f"parallel.tp = {p.tp} splits the layer"
    if p.sharded:
        return False, "FSDP gathers the layer's weights around its call"
    if not pre_norm:
        return False, "the model's layers norm their outputs too"
    reads = f"the loss reads up to {min(d.max_length, d.max_summary_tokens + 1):,} of {d.max_length:,} tokens a row"
    if head_rows_share(config) > HEAD_ROWS_SHARE:
        return False, f"{reads}, over a third"
    return True, reads


def _kernel(config: Config, hardware: Hardware, lengths: torch.Tensor | None) -> tuple[str, str]:
    if not config.data.packing:
        return "flex", "no packing"
    if not hardware.gpu:
        return "flex", "CPU: each sample alone either way"
    if old := hardware.below(BFLOAT16_CAPABILITY):
        return "flex", f"{old}: no flash or cuDNN attention for the documents kernel"
    if config.parallel.pipelined:
        return "flex", "documents kernel not measured under a GPU pipeline"
    if config.train.cuda_graphs is True:
        return "flex", "train.cuda_graphs = true: the documents kernel reads the host, which a graph cannot replay"
    if config.model.dtype == "float32":
        return "flex", "float32: no fused SDPA kernel"
    if lengths is None or not len(lengths):
        return "flex", "sample lengths not known yet"
    mean = float(lengths.double().mean())
    if mean >= LONG_DOCUMENT:
        return "documents", f"samples {mean:,.0f} tokens on average >= {LONG_DOCUMENT:,}"
    return "flex", f"samples {mean:,.0f} tokens on average < {LONG_DOCUMENT:,}"


def _checkpointing(config: Config, gpu: bool) -> tuple[bool | str, str]:
    if _splits_backward(config):
        return False, f"{config.parallel.schedule} splits each backward"
    if config.train.keep_attention:
        return AUTO, "train.keep_attention keeps attention through it"
    if not gpu and config.train.memory_gb <= 0:
        return AUTO, "as each rank's memory needs: on a CPU, its share of the host's"
    return AUTO, "as each rank's memory needs"


def _graphs(config: Config, gpu: bool, compiled: bool, kernel: str) -> tuple[bool, str]:
    t = config.train
    if not gpu:
        return False, "CPU"
    if not compiled:
        return False, "not compiled"
    if config.data.packing and kernel == "documents":
        return False, "the documents kernel reads the host"
    if t.activation_checkpointing in (True, "offload"):
        return False, "every layer checkpointed"
    return True, "where they pay off: each rank decides"


def _microbatches(config: Config) -> tuple[int, str]:
    """The fewest microbatches whose rows hold the target tokens (MICROBATCH_TOKENS; in a pipeline
    PIPELINE_MICROBATCH_TOKENS and one microbatch per stage at least), among the counts the schedule accepts."""
    p, batch, length = config.parallel, config.train.batch_size, max(1, config.data.max_length)
    if batch < 1:
        return 1, "no batch"  # validation names train.batch_size
    target = PIPELINE_MICROBATCH_TOKENS if p.pipelined else MICROBATCH_TOKENS
    counts = [m for m in range(1, batch + 1) if batch % m == 0 and _schedule_accepts(config, m)]
    if not counts:
        return batch, "the schedule's rules"  # validation says which
    rows = -(-target // length)  # rows a microbatch needs to hold the target
    enough = [m for m in counts if batch // m >= rows]
    m = max(enough) if enough else min(counts)
    tokens = batch // m * length
    return m, f"{batch // m} row{'s' if batch // m > 1 else ''} of {length:,} = {tokens:,} tokens a microbatch"


def _schedule_accepts(config: Config, m: int) -> bool:
    """Whether the layout's schedule runs `m` microbatches (its rules: config._check_schedule)."""
    from pipetune.config import ConfigError, _check_schedule

    p = dataclasses.replace(config.parallel, n_microbatches=m)
    try:
        _check_schedule(p, False, False)
    except ConfigError:
        return False
    return True


_NAMES = {
    "lora.fast_path": "fast LoRA path",
    "lora.adapter_in_matmul": "adapters in the matmuls",
    "train.compile": "compile",
    "train.cuda_graphs": "CUDA graphs",
    "train.fused_loss": "fused loss",
}


def _phrase(c: Choice) -> str:
    """One switch's part of the startup line ("" where it says nothing new)."""
    why = "set" if c.forced else c.why
    if c.key == "train.head_rows":
        rows = "the loss's rows" if c.value is True else "every row"
        return "" if why == "no fused loss" else f"last layer on {rows} ({why})"
    if c.key in _NAMES:
        return f"{_NAMES[c.key]} {'on' if c.value is True else 'off' if c.value is False else c.value} ({why})"
    if c.key == "train.layers_per_graph":
        return f"{c.value} layers a graph" if c.value not in (1, AUTO) else ""
    if c.key == "train.packed_attention":
        return f"{c.value} attention kernel ({why})" if why != "no packing" else ""
    if c.key == "parallel.n_microbatches":
        return f"{c.value} microbatch{'es' if c.value != 1 else ''} ({why})"
    if c.key == "train.activation_checkpointing":
        value = {True: "every layer", False: "off"}.get(c.value, c.value)
        return "" if c.value == AUTO else f"checkpointing {value} ({why})"
    return ""


def mlp_chunk_tokens(t: TrainConfig, max_length: int, tp: int = 1) -> int:
    """Tokens per MLP chunk that train.mlp_chunk asks for at rows of `max_length` (0: not chunked). Never under
    tensor parallelism (`tp` > 1): a chunk needs whole sequences, and a tp rank holds a share of each token."""
    if tp > 1:
        return 0
    if t.mlp_chunk == "auto":
        threshold, chunk = MLP_CHUNK_AUTO
        return chunk if max_length >= threshold else 0
    return int(t.mlp_chunk)
