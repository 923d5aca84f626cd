"""Activation memory of this rank's stages, and how many layers `train.activation_checkpointing = "auto"` recomputes.

A stage keeps one set of a layer's activations per microbatch whose backward has not run yet. How many are
in flight depends on the schedule and the stage: under 1F1B stage s of p holds up to p - s, so the first
stages need checkpointing first. A checkpointed layer keeps only its input. The plan checkpoints layers one
at a time, always on the stage that holds the most microbatches at the rank's peak, until the predicted peak
fits the budget:

    peak = fixed + max over the schedule of sum_s inflight_s x (k_s x input + (L_s - k_s) x layer) + layer
           + BACKWARD_INPUTS x input

(`fixed`: weights, adapters with their gradients and AdamW moments, the loss's workspace and a margin; the last
`layer`: the activations of the one layer being recomputed in backward; then the backward's own working set). An
offloaded layer (checkpointed, its input in pinned host memory: model/offload.py) holds nothing on the GPU between
its forward and backward; while any is, two inputs are staged (the one in use, the one fetched ahead), and the host
holds sum_s inflight_s x o_s x input. Offloading costs host bandwidth, not compute: "auto" offloads a checkpointed
layer before recomputing another when copying its input takes less time than the layer's forward (then the copy
hides behind it), else only once every layer is recomputed (docs/long-context.md). The microbatches in flight come
from the schedule's own actions (`schedule_actions`); a layer's activations are measured on a throwaway copy, on
the run's device or, for `pipetune plan`, on the meta device, which needs no memory.

On a CPU (`cpu_plan`) the peak planned is the process's resident memory, which is what a host runs out of: what
the rank holds before its first step (measured: Python and the libraries, the data, the stages' weights), then what
the step adds (its tensors, as above, CPU_HEAP times, and the free heap heap.py's trimmer allows), or validation's
forward-only step where that holds more. The budget is train.memory_gb, else the rank's share of the memory the
machine has available, or its cgroup's limit leaves where less (`cpu_budget`). There is no host memory apart to
offload to.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from pipetune.config import Config, ConfigError, ParallelConfig
from pipetune.heap import TRIM_SLACK, resident_bytes, trim_heap
from pipetune.host_memory import read_host_memory, total_host_memory
from pipetune.model.families import family_of
from pipetune.model.load import DTYPES
from pipetune.model.quantize import linear_shapes, stored_bytes
from pipetune.model.shapes import ResolvedModel, one_layer_model
from pipetune.model.split import estimate_costs
from pipetune.model.stage import StageModule, local_part
from pipetune.parallel.assemble import Parallelism, StagePart, build_stage_modules
from pipetune.parallel.pipeline import Action, schedule_actions
from pipetune.switches import MLP_CHUNK_AUTO, mlp_chunk_tokens

GB = 1e9
MARGIN = 0.07
"""Share of a rank's memory a plan leaves free: allocator slack, NCCL buffers, the CUDA context."""
COMPILED_ACTIVATIONS = 0.85
"""Share of a layer's eagerly measured activations that the compiled layer keeps: inductor recomputes cheap
elementwise work in backward (the norms' float32 copies among it) rather than saving it. On 2x H200 compiled runs
peaked 5-8% under the eager measurement's prediction, eager runs within 5% of it (benchmarks/journal/plan-check.md):
those ran 512-token rows."""
COMPILED_ACTIVATIONS_LONG = 0.73
"""The same for rows of LONG_ROW tokens or more: twelve compiled one-GPU runs without LoRA dropout (Qwen3-4B and
8B, rows of 4,096 to 16,384; plan-check.md, 2026-12-02) kept 0.71-0.74 of the eager measurement's activations
(peaks 12-15% under the prediction with 0.85), and Qwen3-4B in rows of 16,384 with dropout 0.15 0.735 (one H100,
2026-12-06: 68.8 GB measured against 82.8 predicted with 14 layers recomputed). The 512-token runs above stay
within 4% with 0.85: what inductor saves at short rows differs by a share of the row that is not measured apart."""
LONG_ROW = 4096
"""Tokens a row from which compiled layers are planned with COMPILED_ACTIVATIONS_LONG."""
OPTIMIZER_BYTES = 12
"""Per trainable parameter besides the parameter itself: its float32 gradient and two AdamW moments."""
OFFLOAD_STAGING = 2
"""Layer inputs on the GPU at once while offloading: the one backward uses, the one fetched ahead."""
BACKWARD_INPUTS = 8
"""Layer inputs' worth of memory a layer's backward needs beside what the layer keeps: the gradients of its output
and input, the norms' float32 gradients, attention's gradients. Negligible at short rows; at long ones the largest
term after the kept inputs. Measured on one H200 (Qwen3-8B, one row: 131,072 and 262,144 tokens every layer
offloaded, 400,000 with an NF4 base under "auto"): the runs peaked 8.1, 8.4 and 7.5 inputs above the rest of
this model (benchmarks/journal/2026-12-01-late-400k-and-fact-recall-one-h200.md)."""
ROW_REMEDY = (
    "lower data.max_length or the microbatch (train.batch_size / parallel.n_microbatches), or spread the layers "
    "over more GPUs (parallel.pp)"
)
"""What a row that does not fit can change: the end of check_row_fits' and check_plans_fit's errors."""
HOST_BANDWIDTH = 20e9
"""Bytes per second of a pinned copy in one direction, as planned for (PCIe gen5 x16 measures ~50, shared by the
node's GPUs)."""
LAYER_FLOPS_PER_SECOND = 400e12
"""A decoder layer's forward on an H200 in bf16 (~40% of its dense peak): what an offload's copy hides behind."""
WEIGHTS_SHARE = 0.9
"""The most of a rank's memory its frozen weights may take before any activation (check_weights_fit; the plan's
layouts too)."""
HOST_SHARE = 0.5
"""Share of the host's memory a rank's offloaded inputs may take, split over the node's GPUs."""
CPU_HEAP = 1.1
"""On a CPU, bytes of resident memory planned per byte of the tensors a step holds at its peak. With the heap
trimmed as it grows (pipetune/heap.py), a rank's peak RSS less what it held before step 1 and heap.TRIM_SLACK was
0.57-1.15 of the tensors this model counts, over 13 ranks on a 2-core CPU: the tiny demo at 384 and 1,024 tokens
(2 stages) and at 384 in one process, SmolLM2-135M at 2 x 512 tokens keeping or recomputing layers, whole
meetings in 8,192-token rows (2 stages, fused loss, 13 and 11 of 15 layers recomputed), a 6-layer SmolLM2 at
2,048 and 4,096 tokens; the one over 1.0 is the tiny demo's last stage, 14 MB over (CPU_STEP_FIXED's)."""
CPU_STEP_FIXED = 0.05
"""On a CPU, resident memory (GB) a rank's first step adds whatever its shape: autograd's and the pipeline's
bookkeeping, the communication threads."""
CPU_LOSS_BYTES = 12
"""On a CPU, bytes the plain loss holds per logit at its peak, in backward: log-softmax's output, its gradient and
the logits' gradient, [rows, vocab] in float32 each; 4 more where a pipeline stage keeps its output (the logits)
until its backward, or where the logits are not float32 (their float32 copy's gradient beside theirs). SmolLM2's
plain loss over 2 x 512 tokens on a pipeline's last stage peaked at 16.7 bytes a logit (mallinfo2). The GPU's
count, 10, is what its caching allocator keeps there."""
CPU_PROBE_TOKENS = 256
"""On a CPU a layer's activations are measured on a microbatch of one sequence this long (and of twice that) and
scaled to the run's: what a CPU layer keeps grows in proportion to the tokens (SmolLM2's and the tiny Qwen3's
layers: the same bytes a token from 128 to 8,192 tokens, their attention keeps no [seq, seq] matrix), where a
forward at the run's shape would cost its time and, before the heap was trimmed, left its memory in the heap
(SmolLM2 at 2 x 512 tokens: 0.5 GB more peak RSS)."""
HOST_MARGIN = 0.1
"""On a CPU without train.memory_gb, share of the memory available on the machine that a plan leaves free."""


@dataclass
class CheckpointPlan:
    layers: list[int]
    """Layers to checkpoint, per stage of this rank (the first ones of each stage)."""
    peak_bytes: float
    """Predicted peak memory of the rank with that many checkpointed."""
    budget_bytes: float
    offloaded: list[int] | None = None
    """Of the checkpointed layers, how many (the first ones) keep their input in host memory, per stage."""
    host_bytes: float = 0.0
    """Predicted peak of the offloaded inputs in host memory."""
    fixed_bytes: float = 0.0
    """The part of `peak_bytes` that does not grow with the row: weights, optimizer, workspaces, the margin."""
    budget_note: str = ""
    """Where `budget_bytes` came from, where the startup line says it (a CPU's: the host's memory)."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def longest_row(self, tokens: int) -> int:
        """About the longest row that would fit, from this plan for rows of `tokens`: what grows with the row
        scaled down to the budget, with the same layers recomputed and offloaded (`tokens` when it fits)."""
        if self.fits:
            return tokens
        grows = self.peak_bytes - self.fixed_bytes
        return max(0, int(tokens * (self.budget_bytes - self.fixed_bytes) / grows)) if grows > 0 else 0

    def offloaded_layers(self) -> list[int]:
        return list(self.offloaded) if self.offloaded is not None else [0] * len(self.layers)

    def describe(self, stage_ids: Sequence[int], stage_layers: Sequence[int], why: bool = True) -> str:
        """The rank's plan in one line; `why`: with the budget's note (where its figure came from), which the
        rank's own line says and the speed line, after it, leaves out."""
        parts = [
            f"stage {stage}: {k} of {n} layers" + (f" ({o} offloaded)" if o else "")
            for stage, k, o, n in zip(stage_ids, self.layers, self.offloaded_layers(), stage_layers, strict=True)
        ]
        if self.budget_bytes == float("inf"):
            budget = "no memory limit to plan for"
        else:
            budget = f"predicted peak {self.peak_bytes / GB:.3g} of {self.budget_bytes / GB:.3g} GB"
            budget += f" ({self.budget_note})" if self.budget_note and why else ""
        fits = "" if self.fits else " (does not fit even so: lower the microbatch or data.max_length)"
        host = f", {self.host_bytes / GB:.3g} GB in host memory" if self.host_bytes else ""
        return f"activation checkpointing (auto): {', '.join(parts)}; {budget}{host}{fits}"


def inflight_timeline(actions: Sequence[Action], stage_ids: Sequence[int]) -> list[list[int]]:
    """For each moment after a forward, the microbatches whose activations each of `stage_ids` holds, from one
    rank's actions in order (`schedule_actions`)."""
    index = {stage: i for i, stage in enumerate(stage_ids)}
    held, timeline = [0] * len(stage_ids), []
    for kind, stage, _ in actions:
        if stage not in index:
            continue
        if kind == "F":
            held[index[stage]] += 1
            timeline.append(list(held))
        elif kind in ("B", "I"):
            held[index[stage]] -= 1
    return timeline or [[0] * len(stage_ids)]


def rank_timeline(p: ParallelConfig, pp_rank: int) -> list[list[int]]:
    """`inflight_timeline` of pipeline rank `pp_rank` under `p`'s schedule; one microbatch at a time for pp = 1
    (the microbatches of a step run one after another, each forward followed by its backward)."""
    if not p.pipelined:
        return [[1]]
    actions = schedule_actions(p.schedule, p.pp, p.stages_per_rank, p.n_microbatches)[pp_rank]
    return inflight_timeline(actions, p.stage_ids(pp_rank))


def activation_bytes(
    stage_layers: Sequence[int],
    checkpointed: Sequence[int],
    moment: Sequence[int],
    layer_bytes: float,
    input_bytes: float,
    offloaded: Sequence[int] | None = None,
) -> float:
    """Activations a rank holds at one moment: a checkpointed layer keeps its input (an offloaded one nothing:
    the host holds it), the others everything."""
    offloaded = offloaded or [0] * len(stage_layers)
    return sum(
        held * ((k - o) * input_bytes + (n - k) * layer_bytes)
        for held, k, o, n in zip(moment, checkpointed, offloaded, stage_layers, strict=True)
    )


def activation_peak(
    stage_layers: Sequence[int],
    checkpointed: Sequence[int],
    timeline: Sequence[Sequence[int]],
    layer_bytes: float,
    input_bytes: float,
    offloaded: Sequence[int] | None = None,
) -> tuple[float, Sequence[int]]:
    """The peak of `activation_bytes` over the schedule (plus one layer's activations while a checkpointed layer
    is recomputed in backward, the staged inputs while any is offloaded, and the backward's working set), and the
    moment it happens."""

    def held(m: Sequence[int]) -> float:
        return activation_bytes(stage_layers, checkpointed, m, layer_bytes, input_bytes, offloaded)

    moment = max(timeline, key=held)
    recompute = layer_bytes if any(checkpointed) else 0.0
    staging = OFFLOAD_STAGING * input_bytes if offloaded and any(offloaded) else 0.0
    return held(moment) + recompute + staging + BACKWARD_INPUTS * input_bytes, moment


def host_bytes(timeline: Sequence[Sequence[int]], offloaded: Sequence[int], input_bytes: float) -> float:
    """The peak of the offloaded inputs in host memory over the schedule."""
    return max(sum(held * o for held, o in zip(moment, offloaded, strict=True)) for moment in timeline) * input_bytes


def plan_checkpointing(
    stage_layers: Sequence[int],
    timeline: Sequence[Sequence[int]],
    layer_bytes: float,
    input_bytes: float,
    fixed_bytes: float,
    budget_bytes: float,
    host_budget: float = 0.0,
    offload_first: bool = False,
    row_bytes: float = 0.0,
) -> CheckpointPlan:
    """The fewest checkpointed (then offloaded) layers per stage whose predicted peak fits `budget_bytes` (all, if
    none does). Layers are offloaded while their inputs fit `host_budget` (0: never); `offload_first`: offload a
    checkpointed layer before recomputing another (its copy hides behind the layer's compute). `fixed_bytes`: what
    does not grow with the row; `row_bytes`: what does besides the layers' activations (a plain loss's logits, an
    unchunked MLP's workspace)."""
    checkpointed, offloaded = [0] * len(stage_layers), [0] * len(stage_layers)

    def peak() -> tuple[float, Sequence[int]]:
        activations, moment = activation_peak(stage_layers, checkpointed, timeline, layer_bytes, input_bytes, offloaded)
        return fixed_bytes + row_bytes + activations, moment

    def can_offload(i: int) -> bool:
        more = [o + (j == i) for j, o in enumerate(offloaded)]
        return offloaded[i] < checkpointed[i] and host_bytes(timeline, more, input_bytes) <= host_budget

    total, moment = peak()
    while total > budget_bytes:
        to_offload = [i for i in range(len(stage_layers)) if can_offload(i)]
        to_checkpoint = [i for i, (k, n) in enumerate(zip(checkpointed, stage_layers, strict=True)) if k < n]
        # The stage that holds the most microbatches at the peak saves the most per layer.
        if to_offload and (offload_first or not to_checkpoint):
            offloaded[max(to_offload, key=lambda i: (moment[i], -i))] += 1
        elif to_checkpoint:
            checkpointed[max(to_checkpoint, key=lambda i: (moment[i], -i))] += 1
        else:
            break
        total, moment = peak()
    host = host_bytes(timeline, offloaded, input_bytes)
    return CheckpointPlan(checkpointed, total, budget_bytes, offloaded if any(offloaded) else None, host, fixed_bytes)


def offload_hides(input_bytes: float, layer_flops: float) -> bool:
    """Whether copying a layer's input to the host takes less time than the layer's forward (`layer_flops` for
    the microbatch), so that the copy overlaps it."""
    return input_bytes / HOST_BANDWIDTH <= layer_flops / LAYER_FLOPS_PER_SECOND


def host_budget(gpus: int | None = None, physical: float | None = None) -> float:
    """Host memory a rank may fill with offloaded inputs: HOST_SHARE of the machine's (`physical` bytes, else what
    this process may use here: `total_host_memory`), split over its GPUs (`gpus`, else the ones here)."""
    physical = total_host_memory() if physical is None else physical
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return HOST_SHARE * physical / max(1, gpus)


def element_bytes(config: Config) -> int:
    """Bytes of one element of the model's dtype (model.dtype): the one place the planners read it."""
    return DTYPES[config.model.dtype].itemsize


def local_processes() -> int:
    """The run's processes on this machine (the launcher's LOCAL_WORLD_SIZE; 1 in a process of its own)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))


def cpu_budget() -> tuple[float, str]:
    """A CPU rank's memory without train.memory_gb, and how it was found: what the process holds now and its
    share of what the machine has available (or its cgroup's limit leaves, where less: host_memory.py), split over
    the run's local processes, less HOST_MARGIN. Read once every rank has loaded its stages (what the others hold
    is no longer available)."""
    held, host, n = resident_bytes(), read_host_memory(), local_processes()
    budget = held + (1 - HOST_MARGIN) * host.available / n
    over = f" over {n} processes" if n > 1 else ""
    source = "the cgroup leaves" if host.cgroup_bound else "available"
    note = (
        f"the host's: this process's {held / GB:.2g} GB and {1 - HOST_MARGIN:.0%} of the {host.available / GB:.3g} "
        f"GB {source}{over}; train.memory_gb sets another"
    )
    return budget, note


def auto_checkpointing(
    modules: Sequence[StageModule],
    stage_ids: Sequence[int],
    pp_rank: int,
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    tp_mesh: DeviceMesh | None = None,
) -> CheckpointPlan:
    """Plan this rank's checkpointed layers for `config`'s microbatch shape and the device's memory (or
    train.memory_gb); measures one layer's activations on a throwaway copy of it (random weights), split over
    `tp_mesh` as the run's layers are (every rank of it measures). A CPU's plan is `cpu_checkpointing`'s."""
    if device.type != "cuda":
        return cpu_checkpointing(modules, pp_rank, config, resolved, device, tp_mesh)
    microbatch, seq = config.microbatch_size, config.data.max_length
    layer_bytes, input_bytes = measure_layer_memory(config, resolved, device, microbatch, seq, tp_mesh)
    budget = memory_budget(config, device)
    trainable, vocab = _rank_parameters(modules)
    fixed = _allocated_bytes(modules, device) + OPTIMIZER_BYTES * trainable
    fixed += MARGIN * budget if budget != float("inf") else 0.0
    same, grows = row_extras(config, resolved.config, seq, vocab > 0, vocab)  # grows: scaled with the layers'
    fixed += same
    timeline = rank_timeline(config.parallel, pp_rank)
    stage_layers = [len(module.layers) for module in modules]
    # estimate_costs counts a LoRA layer's forward and input gradient (4 x weights a token): half is the forward.
    hides = offload_hides(input_bytes, estimate_costs(resolved.config, seq).layer / 2 * microbatch * seq)
    return plan_checkpointing(
        stage_layers, timeline, layer_bytes, input_bytes, fixed, budget, host_budget(), hides, grows
    )


def cpu_checkpointing(
    modules: Sequence[StageModule],
    pp_rank: int,
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    tp_mesh: DeviceMesh | None = None,
) -> CheckpointPlan:
    """`auto_checkpointing` on a CPU (`cpu_plan`), from what this process holds now (its heap trimmed: what loading
    freed is not held) and a layer measured on the CPU; the budget is train.memory_gb, else `cpu_budget`, read once
    every rank has loaded its stages."""
    if config.train.memory_gb <= 0 and dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's stages loaded: what they hold is gone from what is available
    trim_heap()
    held = resident_bytes()
    budget, note = (config.train.memory_gb * GB, "") if config.train.memory_gb > 0 else cpu_budget()
    measured = measure_layer_memory(config, resolved, device, config.microbatch_size, config.data.max_length, tp_mesh)
    trainable, vocab = _rank_parameters(modules)
    stage_layers = [len(module.layers) for module in modules]
    plan = cpu_plan(config, resolved.config, pp_rank, stage_layers, trainable, vocab, measured, held, budget)
    plan.budget_note = note
    return plan


def _rank_parameters(modules: Sequence[StageModule]) -> tuple[int, int]:
    """This rank's trainable parameters (its part of each) and the vocabulary of the loss it holds (0: none)."""
    trainable = sum(
        local_part(param).numel() for module in modules for param in module.parameters() if param.requires_grad
    )
    last = next((module for module in modules if module.is_last), None)
    return trainable, (last.lm_head.weight.shape[0] if last is not None else 0)


def cpu_plan(
    config: Config,
    model_config: PretrainedConfig,
    pp_rank: int,
    stage_layers: Sequence[int],
    trainable: int,
    vocab: int,
    measured: tuple[float, float],
    held: float,
    budget: float,
) -> CheckpointPlan:
    """A CPU rank's plan, where the peak to plan is the process's resident memory (what train.memory_gb and the
    host's memory bound): what it `held` before its first step (Python, torch and the other libraries, the data,
    the tokenizer, the stages' weights), CPU_STEP_FIXED, the free heap the trimmer allows (heap.TRIM_SLACK) and what
    the step adds, counted CPU_HEAP times: the `trainable` adapter parameters' gradients and AdamW moments, the
    layers' activations as the schedule holds them (`measured`: one layer's activation and input bytes), the
    backward's working set and, on the rank with the loss (`vocab` > 0), its workspace (the plain loss:
    `cpu_loss_bytes` a logit). Validation's forward-only steps peak apart: each microbatch's output of the step
    held (on the last stage the logits), one layer's forward and the loss of one microbatch. A CPU has no host
    memory apart to offload to."""
    layer_bytes, input_bytes = measured
    last = vocab > 0
    same, grows = row_extras(config, model_config, config.data.max_length, last, vocab, cpu=True)
    start = held + CPU_STEP_FIXED * GB + TRIM_SLACK
    fixed = start + CPU_HEAP * (OPTIMIZER_BYTES * trainable + same)
    timeline = rank_timeline(config.parallel, pp_rank)
    heap = CPU_HEAP
    plan = plan_checkpointing(
        stage_layers, timeline, heap * layer_bytes, heap * input_bytes, fixed, budget, 0.0, False, heap * grows
    )
    validation = start + heap * validation_bytes(config, model_config, last, vocab, layer_bytes)
    plan.peak_bytes = max(plan.peak_bytes, validation)
    return plan


def predict_cpu_plans(config: Config, resolved: ResolvedModel, held: float, budget: float) -> list[CheckpointPlan]:
    """Each pipeline rank's `cpu_plan` for `config` without running it: the layers split as the run splits them by
    default (before its data's lengths are known), the adapters counted per layer, a layer measured on this CPU,
    each rank holding `held` bytes before its first step."""
    from pipetune.model.split import run_split

    p = config.parallel
    ranges = run_split(config, resolved.config)[1]
    per_layer = _trainable_per_layer(config, resolved)
    cpu, microbatch, seq = torch.device("cpu"), config.microbatch_size, config.data.max_length
    measured = measure_layer_memory(config, resolved, cpu, microbatch, seq)
    plans = []
    for rank in range(p.pp):
        stages = p.stage_ids(rank)
        stage_layers = [len(ranges[s]) for s in stages]
        vocab = resolved.config.vocab_size if len(ranges) - 1 in stages else 0
        trainable = per_layer * sum(stage_layers)
        plans.append(cpu_plan(config, resolved.config, rank, stage_layers, trainable, vocab, measured, held, budget))
    return plans


def cpu_loss_bytes(config: Config) -> float:
    """The plain loss's bytes a logit on a CPU (CPU_LOSS_BYTES)."""
    element = element_bytes(config)
    return CPU_LOSS_BYTES + (4 if config.parallel.pipelined or element != 4 else 0)


def validation_bytes(config: Config, model_config: PretrainedConfig, last: bool, vocab: int, layer: float) -> float:
    """What a CPU rank's validation step holds at its peak beside what it held before: the outputs of the step's
    microbatches (a pipeline's forward-only step keeps each until the step ends; on the last stage the logits, or
    with train.fused_loss the final hidden states), one layer's forward (`layer`: at most what the layer keeps
    for backward) and the loss of one microbatch (the plain loss: its log-softmax in float32, and a float32 copy
    of logits of another dtype)."""
    d, p, microbatch = config.data, config.parallel, config.microbatch_size
    element = element_bytes(config)
    plain = last and config.train.fused_loss is not True
    width = vocab if plain else model_config.hidden_size
    outputs = (p.n_microbatches if p.pipelined else 1) * microbatch * d.max_length * width * element
    loss = 0.0
    if plain:
        loss = microbatch * d.max_length * vocab * (4 + (4 if element != 4 else 0))
    elif last:
        loss = loss_bytes(config, vocab)
    return outputs + layer + loss


def check_plans_fit(plan: CheckpointPlan, config: Config, device: torch.device) -> None:
    """Stop every rank before step 1 when any rank's "auto" plan, made from a layer measured on its own device,
    predicts more than its budget even with every layer recomputed and offloaded as far as the host holds: each
    rank's verdict is gathered (a ConfigError is said by rank 0 alone, and every rank must stop), and the message
    names the rank with the shortest row that fits. Preflight's check (`check_row_fits`, on the meta device)
    refuses most such rows before any process starts; this one catches what only the device shows."""
    mine = torch.tensor(
        [plan.peak_bytes, plan.budget_bytes, plan.longest_row(config.data.max_length)], dtype=torch.float64
    )
    verdicts = [mine]
    if dist.is_available() and dist.is_initialized():
        verdicts = [torch.empty(3, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(verdicts, mine.to(device))
    refuse_unfit([v.tolist() for v in verdicts], config, cpu=device.type != "cuda")


def refuse_unfit(verdicts: Sequence[Sequence[float]], config: Config, cpu: bool = False) -> None:
    """`check_plans_fit`'s decision from each rank's (predicted peak bytes, budget bytes, tokens of the longest row
    that fits); `cpu`: the ranks' plans are CPU plans (`cpu_checkpointing`)."""
    unfit = [(rank, v) for rank, v in enumerate(verdicts) if v[0] > v[1]]
    if not unfit:
        return
    rank, (peak, budget, longest) = min(unfit, key=lambda item: item[1][2])
    if cpu:
        budget_of = "train.memory_gb, else its share of the memory available on this machine"
        predicts = "predicts a peak resident memory of"
        modes = "with every layer recomputed"
    else:
        budget_of = "train.memory_gb, else the GPU's"
        predicts = "predicts"
        modes = "with the margin even with every layer recomputed and as many inputs in host memory as it holds"
    raise ConfigError(
        f"data.max_length = {config.data.max_length} does not fit rank {rank}'s {budget / GB:.3g} GB "
        f'({budget_of}): "auto", with a layer measured on the device, {predicts} {peak / GB:.3g} GB '
        f"{'even ' if cpu else ''}{modes}; the longest row that would fit is about {int(longest)} tokens with "
        f"{config.microbatch_size} sequence(s) a microbatch; {ROW_REMEDY}"
    )


def mlp_workspace_bytes(config: Config, model_config: PretrainedConfig, microbatch: int, seq: int) -> float:
    """What a layer's MLP briefly needs on top of what it keeps: [microbatch x seq, 3 x intermediate_size] (gate,
    up and their product), or, chunked, of train.mlp_chunk positions of each sequence of the microbatch (a chunk
    is [microbatch, chunk]); split over parallel.tp."""
    chunk = mlp_chunk_tokens(config.train, config.data.max_length, config.parallel.tp)
    element = element_bytes(config)
    rows = microbatch * (min(seq, chunk) if chunk else seq)
    return 3 * model_config.intermediate_size * rows * element / config.parallel.tp


def memory_budget(config: Config, device: torch.device | None = None) -> float:
    """Memory per rank to plan for: train.memory_gb, else the GPU's (the first one's when no device is named),
    else, for a rank on a CPU (`device`), the host's (`cpu_budget`), else unlimited (the checks before any process
    starts, on a machine without a GPU)."""
    if config.train.memory_gb > 0:
        return config.train.memory_gb * GB
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    if device is not None and device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device is not None:
        return cpu_budget()[0]
    return float("inf")


def loss_bytes(config: Config, vocab: int, per_logit: float = 10) -> float:
    """The last stage's loss workspace: [rows, vocab] logits in float32 and their gradient, for a whole microbatch
    (`per_logit` bytes each: on a CPU CPU_LOSS_BYTES), or (train.fused_loss) for its supervised rows (at most
    max_summary_tokens + 1 per sequence) a chunk of train.loss_chunk rows at a time."""
    t, d, microbatch = config.train, config.data, config.microbatch_size
    if t.fused_loss is True:
        rows = min(t.loss_chunk, microbatch * min(d.max_length, d.max_summary_tokens + 1))
        return rows * vocab * 12
    return microbatch * d.max_length * vocab * per_logit


def measure_layer_memory(
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    batch: int,
    seq: int,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[float, int]:
    """(activation bytes one decoder layer keeps for backward, bytes of its input) for a microbatch of
    [batch, seq], with the run's dtype, adapters and LoRA path, on a fresh random copy of one layer (this rank's
    part of it when split over `tp_mesh`; on the meta device: a shape-only copy, no memory, what a CUDA run would
    keep). Measured eagerly; a compiled layer keeps COMPILED_ACTIVATIONS of that. On a CPU, measured on one
    sequence of CPU_PROBE_TOKENS and of twice that, and scaled to [batch, seq] (a term in the tokens' square
    where the second keeps more than twice the first: a layer whose attention keeps its [seq, seq] weights)."""
    probe = CPU_PROBE_TOKENS
    if device.type == "cpu" and tp_mesh is None and batch * seq > 2 * probe:
        short, inputs = _measure_layer(config, resolved, device, 1, probe, None)
        long = _measure_layer(config, resolved, device, 1, 2 * probe, None)[0]
        square = max(0.0, long - 2 * short) / (2 * probe * probe)  # short = a p + b p², long = 2 a p + 4 b p²
        linear = (short - square * probe * probe) / probe
        return batch * (linear * seq + square * seq * seq), batch * seq * inputs // probe
    return _measure_layer(config, resolved, device, batch, seq, tp_mesh)


def _measure_layer(
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    batch: int,
    seq: int,
    tp_mesh: DeviceMesh | None,
) -> tuple[float, int]:
    """`measure_layer_memory` at [batch, seq] itself."""
    shape_only = dataclasses.replace(resolved, weights_dir=None)  # values do not matter: no checkpoint read
    # MLPs in chunks as the run's layers.
    chunk = mlp_chunk_tokens(config.train, config.data.max_length, config.parallel.tp)
    # PEFT draws its own adapter initialisation from the global generator: the run's streams stay untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        built = build_stage_modules(
            shape_only,
            DTYPES[config.model.dtype],
            config.lora,
            [StagePart([0])],
            device,
            Parallelism(
                tp_mesh, config.parallel.sequence_parallel, keep_attention=config.train.keep_attention, mlp_chunk=chunk
            ),
            # A quantized weight is saved as itself, never as activations: on the meta device the same count.
            quantize=config.model.quantize if device.type != "meta" else "none",
            tp=config.parallel.tp,
        )
        model, (stage,) = built.peft_model, built.modules
        activations, inputs = stage.layer_memory(batch, seq)
    del built, model, stage
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return activations * compiled_share(config), inputs


def compiled_share(config: Config) -> float:
    """Share of the eagerly measured activations a layer of this run keeps (1 eager)."""
    if config.train.compile is not True:
        return 1.0
    return COMPILED_ACTIVATIONS_LONG if config.data.max_length >= LONG_ROW else COMPILED_ACTIVATIONS


def _allocated_bytes(modules: Sequence[StageModule], device: torch.device) -> float:
    """What the rank holds now: the allocator's count on a GPU, the stages' tensors on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    tensors = {id(t): local_part(t) for module in modules for t in [*module.parameters(), *module.buffers()]}
    return float(sum(t.numel() * t.element_size() for t in tensors.values()))


def check_weights_fit(config: Config, model_config: PretrainedConfig, ranges: Sequence[range]) -> None:
    """Refuse, before any process starts, a layout whose frozen weights alone exceed a rank's memory (the GPU's,
    or train.memory_gb); the message names the settings that would make it fit."""
    budget = memory_budget(config)
    if budget == float("inf"):
        return
    p, quantize = config.parallel, config.model.quantize
    shards = (p.dp if p.sharded else 1) * p.tp  # tensor parallelism splits (nearly) every weight tp ways
    for rank, (layers, root) in enumerate(rank_weight_bytes(config, model_config, ranges)):
        weights = (layers + root) / shards
        if weights > WEIGHTS_SHARE * budget:
            sharded = f", sharded over parallel.dp = {p.dp}" if p.sharded else ""
            sharded += f", split over parallel.tp = {p.tp}" if p.tensor_parallel else ""
            stored = config.model.dtype + (f" and {quantize}" if quantize != "none" else "")
            smaller = ', or store the base quantized: model.quantize = "nf4" (~0.52 bytes a weight)'
            raise ConfigError(
                f"{config.model.name!r}: the stage(s) of pipeline rank {rank} hold {weights / GB:.0f} GB of frozen "
                f"{stored} weights (parallel.pp = {p.pp}{sharded}), more than 90% of the "
                f"{budget / GB:.0f} GB of memory per rank, before any activation. Raise parallel.pp (more GPUs, "
                "fewer layers each) or parallel.tp (each layer split over more GPUs), or shard replicas with "
                "parallel.dp_shard = true (strategy 'fsdp' for pp = 1) over more GPUs"
                + (smaller if quantize == "none" else "")
            )


def rank_weight_bytes(
    config: Config, model_config: PretrainedConfig, ranges: Sequence[range]
) -> list[tuple[float, float]]:
    """Frozen weights of each pipeline rank's stages, unsharded: (decoder layers, embedding + norm + lm_head).
    Every stage owns its embedding or lm_head outright (a copy where the checkpoint ties them)."""
    p = config.parallel
    layer, embedding, head = parameter_counts(model_config)
    element = element_bytes(config)
    linears = linear_shapes(model_config)  # model.quantize stores these smaller
    quantized = sum(rows * columns for _, rows, columns in linears)
    layer_bytes = (layer - quantized) * element
    layer_bytes += sum(stored_bytes(rows, columns, config.model.quantize, element) for _, rows, columns in linears)
    weights = []
    for rank in range(p.pp):
        stages = p.stage_ids(rank)
        root = (embedding if 0 in stages else 0) + (head if len(ranges) - 1 in stages else 0)
        weights.append((sum(len(ranges[s]) for s in stages) * layer_bytes, root * element))
    return weights


def parameter_counts(model_config: PretrainedConfig) -> tuple[int, int, int]:
    """Parameters of one decoder layer, of the token embedding, and of the final norm + lm_head, counted on a
    meta-device model of one layer, of the modules the family keeps on the first / last stage (exact)."""
    known = _PARAMETER_COUNTS.get(id(model_config))
    if known is not None and known[0] is model_config:  # a plan asks once per layout
        return known[1]
    counts = family_of(model_config).layer_counts(one_layer_model(model_config))
    _PARAMETER_COUNTS[id(model_config)] = (model_config, counts)
    return counts


_PARAMETER_COUNTS: dict[int, tuple[PretrainedConfig, tuple[int, int, int]]] = {}


# --------------------------------------------------------------------------- the longest row a layout trains

LAYER_MODES = ("keep", "recompute", "offload")
"""What every decoder layer does with its activations in `longest_rows`."""
ROW_PROBE = 65536
"""The row length a layer's activations per token are measured at (on the meta device: free); with
flash attention everything a layer keeps grows in proportion to the tokens."""


@dataclass(frozen=True)
class RowCosts:
    """A rank's memory for rows of L tokens: `fixed` + L x (what its layers keep + `transient`), per token."""

    layer: float
    """Bytes a kept layer holds a token (the microbatch's sequences together)."""
    input: float
    """Bytes of a layer's input a token: all a recomputed layer keeps."""
    transient: float
    """Bytes a token while a layer runs, beside what it keeps: an unchunked MLP's workspace, the plain loss's logits."""
    fixed: float
    """Bytes whatever the length: weights, adapters and optimizer, the fused loss's chunk, a chunked MLP's chunk."""


def row_costs(
    config: Config, model_config: PretrainedConfig, measured: tuple[float, float], fixed: float, last: bool, vocab: int
) -> RowCosts:
    """`RowCosts` of `config`'s microbatch from one layer's (activation, input) bytes `measured` for one sequence of
    ROW_PROBE tokens (`long_row_memory`), with train.mlp_chunk as it applies to rows that long; `fixed`: the rank's
    weights, adapters and optimizer; `last`: the rank holds the loss."""
    microbatch = config.microbatch_size
    same, grows = row_extras(config, model_config, ROW_PROBE, last, vocab)
    layer, inputs = measured
    return RowCosts(microbatch * layer / ROW_PROBE, microbatch * inputs / ROW_PROBE, grows / ROW_PROBE, fixed + same)


def row_extras(
    config: Config, model_config: PretrainedConfig, seq: int, last: bool, vocab: int, cpu: bool = False
) -> tuple[float, float]:
    """Besides the layers' activations, the bytes of a microbatch of `seq`-token rows that do not grow with the row
    (first) and those that do (second), the one rule of the run's "auto" plan and of the longest row: the MLP's
    workspace (a chunk's where train.mlp_chunk cuts rows this long, else the whole row's) and, on the rank that
    holds the loss (`last`, `vocab` columns), the loss's (train.fused_loss: a chunk of supervised rows; else the
    whole microbatch's logits, CPU_LOSS_BYTES each on a `cpu`)."""
    long = _with_rows(config, seq)
    workspace = mlp_workspace_bytes(long, model_config, config.microbatch_size, seq)
    chunked = mlp_chunk_tokens(config.train, seq, config.parallel.tp) > 0
    same, grows = (workspace, 0.0) if chunked else (0.0, workspace)
    if last:
        loss = loss_bytes(long, vocab, cpu_loss_bytes(config) if cpu else 10)
        same, grows = (same + loss, grows) if config.train.fused_loss is True else (same, grows + loss)
    return same, grows


def long_row_memory(config: Config, resolved: ResolvedModel) -> tuple[float, float]:
    """One layer's (activation, input) bytes for one sequence of ROW_PROBE tokens, on the meta device."""
    return measure_layer_memory(_with_rows(config, ROW_PROBE), resolved, torch.device("meta"), 1, ROW_PROBE)


def _with_rows(config: Config, seq: int) -> Config:
    """`config` with rows of `seq` tokens (what train.mlp_chunk = "auto" and the loss's workspace decide by)."""
    return dataclasses.replace(config, data=dataclasses.replace(config.data, max_length=seq))


def longest_rows(
    stage_layers: Sequence[int], timeline: Sequence[Sequence[int]], row: RowCosts, budget: float, host: float
) -> dict[str, int]:
    """The longest row (tokens) each of LAYER_MODES fits in `budget` bytes: every layer kept,
    every layer recomputed, or every layer recomputed with its input in host memory as far as `host` bytes hold
    them (the rest stay on the GPU, as "auto" plans)."""
    layers_held = max(sum(held * n for held, n in zip(moment, stage_layers, strict=True)) for moment in timeline)
    free = max(0.0, budget - row.fixed)
    during = row.transient + BACKWARD_INPUTS * row.input  # while a layer runs, beside what the layers keep
    recompute = layers_held * row.input + row.layer + during
    offloaded = OFFLOAD_STAGING * row.input + row.layer + during
    tokens = {
        "keep": free / (layers_held * row.layer + during),
        "recompute": free / recompute,
        # All on the host, or the host full and the rest on the GPU: the first bound that binds.
        "offload": min(free / offloaded, (free + host) / (recompute + OFFLOAD_STAGING * row.input)),
    }
    return {mode: int(n) for mode, n in tokens.items()}


def check_row_fits(config: Config, resolved: ResolvedModel, ranges: Sequence[range]) -> None:
    """Refuse, before any process starts, data.max_length beyond what the busiest pipeline rank could train with
    every layer recomputed and its input in host memory: the message names the longest that would fit. MLPs run
    chunked as rows of that length run them (train.mlp_chunk = "auto" decides by the row)."""
    budget = memory_budget(config)
    if budget == float("inf"):
        return
    p, d = config.parallel, config.data
    budget *= 1 - MARGIN
    host = host_budget()
    chunk = mlp_chunk_tokens(config.train, d.max_length, p.tp)
    for rank, (longest, unlimited) in enumerate(_longest_by_rank(config, resolved, ranges, chunk, budget, host)):
        if d.max_length <= longest:
            continue
        threshold = MLP_CHUNK_AUTO[0]
        if config.train.mlp_chunk == "auto" and chunk and longest < threshold:  # such rows run their MLPs whole
            longest, unlimited = _longest_by_rank(config, resolved, ranges, 0, budget, host)[rank]
            longest, unlimited = min(longest, threshold - 1), min(unlimited, threshold - 1)
        host_note = f", {host / GB:.0f} GB of host memory for the inputs" if unlimited > longest else ""
        raise ConfigError(
            f"data.max_length = {d.max_length} does not fit pipeline rank {rank}'s {budget / GB:.0f} GB "
            f"(train.memory_gb, else the GPU's, less {MARGIN:.0%}){host_note} even with every layer recomputed "
            'and its input in host memory (train.activation_checkpointing = "offload"): the longest row that '
            f"would is {longest} tokens with {config.microbatch_size} sequence(s) a microbatch; {ROW_REMEDY}"
        )


def _longest_by_rank(
    config: Config, resolved: ResolvedModel, ranges: Sequence[range], chunk: int, budget: float, host: float
) -> list[tuple[int, int]]:
    """Each pipeline rank's longest row with every layer offloaded, within `host` bytes of host memory and without
    a limit there, its MLPs in chunks of `chunk` tokens (0: whole)."""
    p = config.parallel
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, mlp_chunk=chunk))
    weights = rank_weight_bytes(config, resolved.config, ranges)
    trainable = _trainable_per_layer(config, resolved)
    shards = (p.dp if p.sharded else 1) * p.tp
    measured = long_row_memory(config, resolved)
    longest = []
    for rank, (layer_weights, root) in enumerate(weights):
        stages = p.stage_ids(rank)
        stage_layers = [len(ranges[s]) for s in stages]
        fixed = (layer_weights + root) / shards + (4 + OPTIMIZER_BYTES) * trainable * sum(stage_layers) / shards
        row = row_costs(config, resolved.config, measured, fixed, len(ranges) - 1 in stages, resolved.config.vocab_size)
        timeline = rank_timeline(p, rank)
        longest.append(
            (
                longest_rows(stage_layers, timeline, row, budget, host)["offload"],
                longest_rows(stage_layers, timeline, row, budget, float("inf"))["offload"],
            )
        )
    return longest


def _trainable_per_layer(config: Config, resolved: ResolvedModel) -> int:
    """LoRA parameters of one decoder layer: r x (in + out) of each targeted linear layer."""
    from torch import nn

    layer = one_layer_model(resolved.config).model.layers[0]
    targets = set(config.lora.target_modules)
    return sum(
        config.lora.r * (module.in_features + module.out_features)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
