"""Every layout a config allows on N GPUs, at the config's effective batch: what `pipetune plan` compares.

A layout is how the work is spread (strategy, pp x dp x tp, schedule, stages per rank, microbatches, gradient
accumulation, activation checkpointing); the model, data, adapters and switches stay the config's. Every
candidate is checked by the config's own validation, so no layout the trainer would refuse is ever listed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PretrainedConfig

from pipetune.config import (
    Config,
    ConfigError,
    validate,
    validate_against_model,
)
from pipetune.schedules import SCHEDULES
from pipetune.strategies import STRATEGY_SPECS, strategies_of_grid

STAGES_PER_RANK = (2, 3, 4)
"""Virtual stages per rank tried for the looped schedules (measured: v = 6 no faster than 3 at Qwen3-4B)."""
MICROBATCH_ROUNDS = (1, 2, 4, 8)
"""Microbatches per schedule step tried, in multiples of pp."""
CHECKPOINTING: tuple[bool | str, ...] = (False, True, "auto")


@dataclass(frozen=True)
class Layout:
    strategy: str
    pp: int = 1
    dp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    n_microbatches: int = 1
    microbatch: int = 1
    grad_accum: int = 1
    checkpointing: bool | str = False
    dp_shard: bool = False

    @classmethod
    def of(cls, config: Config) -> Layout:
        """The layout `config` asks for."""
        p, t = config.parallel, config.train
        return cls(
            p.strategy,
            p.pp,
            p.dp,
            p.tp,
            p.schedule,
            p.stages_per_rank,
            p.n_microbatches,
            config.microbatch_size,
            t.grad_accum,
            t.activation_checkpointing,
            p.dp_shard,
        )

    @classmethod
    def for_strategy(cls, config: Config, strategy: str) -> Layout:
        """`config`'s run as `strategy`, on as many ranks and at the same effective batch (`pipetune bench`), on
        the strategy's grid (strategies.py): "ddp" spreads each schedule step's batch over one whole-model replica
        per rank (one forward per replica), "fsdp" likewise with the replicas sharded; "tp" splits each replica
        over tp ranks (the config's tp, else its pipeline's pp ranks, else all ranks), keeping its microbatch
        size; "single" runs it in one process, microbatch by microbatch; "pp" is the config's own layout."""
        p, t = config.parallel, config.train
        spec = STRATEGY_SPECS[strategy]
        if spec.pipeline:
            return dataclasses.replace(cls.of(config), strategy=strategy)
        ranks, global_batch = p.world_size, t.batch_size * p.dp
        _, replicas, tp = spec.grid(ranks, p.tp if p.tensor_parallel else p.pp if p.pipelined else ranks)
        if spec.max_replicas == 1:
            n_microbatches = p.n_microbatches * p.dp
            return cls(
                strategy,
                n_microbatches=n_microbatches,
                microbatch=global_batch // n_microbatches,
                grad_accum=t.grad_accum,
                checkpointing=t.activation_checkpointing,
            )
        if spec.tensor_parallel and tp < 2:
            raise ConfigError("--strategies tp splits replicas over ranks: the config needs parallel.pp x dp x tp >= 2")
        if global_batch % replicas:
            raise ConfigError(f"--strategies {strategy}: batch {global_batch} does not split over {replicas} replicas")
        if replicas < spec.min_replicas:
            raise ConfigError(
                f"--strategies {strategy} shards over replicas: the config needs parallel.pp x dp >= "
                f"{spec.min_replicas} ranks"
            )
        batch, n_microbatches = global_batch // replicas, 1
        if spec.tensor_parallel and batch % config.microbatch_size == 0:
            n_microbatches = batch // config.microbatch_size
        return cls(
            strategy,
            1,
            replicas,
            tp,
            "1f1b",
            1,
            n_microbatches,
            batch // n_microbatches,
            t.grad_accum,
            t.activation_checkpointing,
        )

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    def apply(self, config: Config) -> Config:
        """`config` run this way (a copy); a given layers_per_stage is kept where the stage count still matches."""
        variant = copy.deepcopy(config)
        p, t = variant.parallel, variant.train
        p.strategy, p.pp, p.dp, p.tp, p.dp_shard = self.strategy, self.pp, self.dp, self.tp, self.dp_shard
        p.sequence_parallel = p.sequence_parallel and self.tp > 1  # a tp setting: layouts without tp drop it
        p.schedule, p.stages_per_rank, p.n_microbatches = self.schedule, self.stages_per_rank, self.n_microbatches
        if len(p.layers_per_stage) != p.n_stages:
            p.layers_per_stage = []
        t.batch_size, t.grad_accum = self.n_microbatches * self.microbatch, self.grad_accum
        t.activation_checkpointing = self.checkpointing
        return variant

    def planned(self, config: Config) -> Config:
        """`config` run this way on the GPUs a plan is for, its speed switches resolved as "auto" would there."""
        from pipetune.switches import PLANNED_GPU, resolve

        return resolve(self.apply(config), PLANNED_GPU).config

    def describe(self) -> str:
        """E.g. "pp=2 interleaved_1f1b v=3", "ddp dp=2", "pp=2 x tp=2 1f1b", "fsdp dp=2"."""
        grid = [f"{name}={value}" for name, value in (("pp", self.pp), ("tp", self.tp), ("dp", self.dp)) if value > 1]
        if self.strategy == "pp":
            schedule = self.schedule + (f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else "")
            shard = " (dp sharded)" if self.dp_shard else ""
            return f"{' x '.join(grid)} {schedule}{shard}"
        return f"{self.strategy} {' x '.join(grid)}".strip()

    def batching(self) -> str:
        """Microbatches x sequences each, x accumulation steps."""
        accumulation = f" x {self.grad_accum} accum" if self.grad_accum > 1 else ""
        return f"{self.n_microbatches} x {self.microbatch}{accumulation}"


def candidate_layouts(
    config: Config, model_config: PretrainedConfig, module_names: set[str], gpus: int, refused: list[str] | None = None
) -> list[Layout]:
    """Every layout on `gpus` GPUs at the config's sequences per optimizer step that validation accepts, in a
    fixed order. `refused`, when given, gets why each process grid runs none (what "auto" says when none runs)."""
    sequences = config.train.batch_size * config.parallel.dp * config.train.grad_accum
    refused = [] if refused is None else refused
    layouts = []
    for pp, tp, dp in process_grids(gpus, model_config):
        grid = f"pp={pp} tp={tp} dp={dp}"
        if sequences % dp:
            refused.append(f"{grid}: {sequences} sequences a step do not split over {dp} replicas")
            continue
        per_replica = sequences // dp
        found, errors = len(layouts), []
        for shape in _shapes(model_config, pp, tp, dp, per_replica):
            for checkpointing in CHECKPOINTING:
                layout = dataclasses.replace(shape, checkpointing=checkpointing)
                error = _refusal(layout.planned(config), model_config, module_names)
                if error is None:
                    layouts.append(layout)
                errors += [error] if error and not errors else []
        if len(layouts) == found:
            no_split = f"no multiple of {pp} microbatches divides the {per_replica} sequences a step"
            refused.append(f"{grid}: {errors[0] if errors else no_split}")
    return layouts


def process_grids(gpus: int, model_config: PretrainedConfig) -> list[tuple[int, int, int]]:
    """(pp, tp, dp) with pp x tp x dp = gpus. Tensor parallelism takes the degrees that divide the attention and
    key-value heads; the pipeline at most one stage per layer."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    grids = []
    for pp in _divisors(gpus):
        if pp > model_config.num_hidden_layers:
            continue
        for tp in _divisors(gpus // pp):
            if tp > 1 and not (heads % tp == 0 and kv_heads % tp == 0):
                continue
            grids.append((pp, tp, gpus // pp // tp))
    return grids


def _shapes(model_config: PretrainedConfig, pp: int, tp: int, dp: int, per_replica: int) -> Iterator[Layout]:
    """Layouts of one process grid without checkpointing: strategies, schedules, microbatching."""
    if pp == 1:
        for strategy in strategies_of_grid(pp, dp, tp):
            for microbatch in _divisors(per_replica):
                yield Layout(strategy, 1, dp, tp, microbatch=microbatch, grad_accum=per_replica // microbatch)
        return
    (pipeline,) = strategies_of_grid(pp, dp, tp)
    for dp_shard in (False, True) if dp > 1 else (False,):
        for schedule, spec in SCHEDULES.items():
            if spec.max_stages_per_rank is not None:
                virtual = range(spec.min_stages_per_rank, spec.max_stages_per_rank + 1)
            else:
                virtual = [v for v in STAGES_PER_RANK if v >= spec.min_stages_per_rank]
            for v in virtual:
                if pp * v > model_config.num_hidden_layers:
                    continue
                for rounds in MICROBATCH_ROUNDS:
                    m = pp * rounds
                    if per_replica % m:
                        continue
                    for microbatch in _divisors(per_replica // m):
                        accumulation = per_replica // (m * microbatch)
                        yield Layout(pipeline, pp, dp, tp, schedule, v, m, microbatch, accumulation, dp_shard=dp_shard)


def _refusal(variant: Config, model_config: PretrainedConfig, module_names: set[str]) -> str | None:
    """Why validation refuses `variant`, or None when it runs."""
    p = variant.parallel
    try:
        validate(variant, p.world_size)
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        validate_against_model(variant, model_config.num_hidden_layers, module_names, heads, kv_heads)
    except ConfigError as e:
        return str(e)
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
