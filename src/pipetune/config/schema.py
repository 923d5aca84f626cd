"""The run configuration's schema: one dataclass a section, one docstring a key (what `config show` prints).

Read it first: every key of a TOML config, its default and what it does. The rules a value must follow are in
`validation.py`, reading and writing TOML (and `--set`) in `toml_io.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
    head_rows: bool | str = field(default="auto", metadata={"also": ("auto",)})
    """"auto" (with train.fused_loss, where the loss reads at most a third of a row: data.max_summary_tokens + 1 of
    data.max_length; not with parallel.tp > 1 or FSDP, nor on a family whose layers norm their outputs, Gemma 3),
    or true / false. The last decoder layer computes its keys and values on every row, but attention's queries,
    the residual and the MLP only on the rows the loss reads (the summary): the same output there, where a
    whole-meeting row of 16,384 tokens holds ~500 such rows. Whole meetings on one H200: 1.5% more tokens/s
    (model/head_rows.py)."""
    activation_checkpointing: bool | str = field(default="auto", metadata={"also": ("auto", "offload")})
    """Keep only a decoder layer's input during forward and recompute the layer in backward: less activation
    memory (long contexts) for about one more forward of the layer. true: every layer; "offload": every layer, its
    input kept in pinned host memory (copied on a side stream, back one layer ahead of backward: no layer input
    stays on the GPU; docs/long-context.md); "auto": per layer keep, recompute or recompute-and-offload, only as
    much as each stage's memory needs (measured per layer, with the microbatches the schedule keeps in flight
    on that stage: the first stages of 1F1B hold more), planned for the GPU's memory or train.memory_gb (on a CPU,
    of the process's resident memory, for its share of the host's memory or train.memory_gb)."""
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
    """Memory per rank that activation_checkpointing = "auto" plans for, in GB; 0: the GPU's total memory, or on a
    CPU what the process holds before its first step and 90% of its share of the memory the machine has available
    then (MemAvailable, or what a container's cgroup limit leaves where less, split over the run's processes on it);
    the startup line says which. On a CPU the plan is of the process's peak resident memory."""
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
