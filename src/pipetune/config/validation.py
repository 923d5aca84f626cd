"""Every rule a config value must follow, checked before any process group: `validate()` raises ConfigError naming
the value and the fix, once, on the launching process; `validate_against_model` adds the rules that need the
model's shape."""

from __future__ import annotations

import math
from pathlib import Path

from pipetune.config.schema import (
    DTYPES,
    MAX_LENGTH,
    MAX_TIMEOUT_S,
    QUANTIZE,
    RESUME_MODES,
    STRATEGIES,
    SYNTHETIC_LENGTHS,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    TrainConfig,
)
from pipetune.config.toml_io import _toml_value
from pipetune.errors import ConfigError
from pipetune.schedules import SCHEDULES
from pipetune.strategies import STRATEGY_SPECS


def validate(config: Config, world_size: int) -> None:
    """Check the values that need no model: raise ConfigError naming the value and the fix.

    One checker per section, in the sections' order; a check that spans sections lives with the section its
    message names first, or (microbatches, sequence lengths) with the parallel layout that needs it."""
    _check_model(config.model, config.parallel)
    _check_data(config.data)
    _check_lora(config.lora, config.parallel, config.model.quantize)
    _check_train(config.train, config.data, config.parallel)
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


def _check_train(t: TrainConfig, d: DataConfig, p: ParallelConfig) -> None:
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
    _check_head_rows(t, p)
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
    _check(t.save_every >= 0, f"train.save_every = {t.save_every} must be >= 0 (0: checkpoints at epoch ends only)")
    _check(t.resume in RESUME_MODES, f"train.resume = {t.resume!r} is unknown; use one of {', '.join(RESUME_MODES)}")
    _check(t.eval_every >= 0, f"train.eval_every = {t.eval_every} must be >= 0 (0: at epoch ends only)")
    _check_train_numbers(t)


def _check_head_rows(t: TrainConfig, p: ParallelConfig) -> None:
    """train.head_rows forced on: the fused loss's rows, the last layer whole on its rank (Gemma 3's norms are
    checked with the model: preflight.check_head_rows)."""
    if t.head_rows is not True:
        return
    where = "set train.head_rows = false"
    _check(
        t.fused_loss is not False,
        "train.head_rows = true runs the last layer on the rows the fused loss reads: set train.fused_loss = "
        f"true, or {where}",
    )
    _check(
        not p.tensor_parallel,
        f"train.head_rows = true with parallel.tp = {p.tp}: tensor parallelism splits the last layer's modules; "
        f"set parallel.tp = 1, or {where}",
    )
    _check(
        not p.sharded,
        'train.head_rows = true with FSDP (parallel.dp_shard or strategy "fsdp"): FSDP gathers the last '
        f"layer's weights around its own call; use ddp, or {where}",
    )


def _check_train_numbers(t: TrainConfig) -> None:
    """train's real-valued keys: the optimizer's, the memory plan's, the schedule's floor."""
    _check(t.lr > 0 and math.isfinite(t.lr), f"train.lr = {t.lr} must be positive and finite")
    _check(
        t.weight_decay >= 0 and math.isfinite(t.weight_decay),
        f"train.weight_decay = {t.weight_decay} must be >= 0 and finite (e.g. 0.01)",
    )
    _check(math.isfinite(t.memory_gb), f"train.memory_gb = {t.memory_gb} must be a finite number of GB (e.g. 80)")
    _check(
        t.memory_gb >= 0,
        f"train.memory_gb = {t.memory_gb} must be >= 0 (0: the GPU's total memory; on a CPU, this process's share of "
        "the memory available on the machine)",
    )
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
    _check(bool(value.strip()), f"{name} is empty; set it (see the defaults in src/pipetune/config/schema.py)")
