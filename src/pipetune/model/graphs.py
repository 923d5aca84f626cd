"""CUDA graphs for compiled layers (train.cuda_graphs): where they pay off, what recording them costs, and the
memory rules their replays impose.

torch.compile's "reduce-overhead" mode records each compiled layer call as a CUDA graph (one per layer,
microbatch and direction in a schedule step: torch's CUDA-graph trees) and replays it afterwards, which removes
the host's launch cost. Replays write their outputs into the graphs' memory pool, reused from one schedule step
to the next (`torch.compiler.cudagraph_mark_step_begin`): whatever outlives a step must not live there.
"""

from __future__ import annotations

import torch

from pipetune.model.split import StageCosts

GPU_FLOPS = 790e12
"""bf16 matmul rate measured on an H200 (the benchmarks' peak)."""
HOST_SECONDS_PER_LAYER_CALL = 1.85e-3
"""Host time to launch one compiled decoder layer's call without CUDA graphs, measured on 2x H200 (Qwen3-4B,
benchmarks/journal/NOTES.md): what replaying it as a graph saves."""
SECONDS_PER_GRAPH_RECORDING = 0.3
"""Time torch's CUDA-graph trees take to record one compiled layer call, measured on 2x H200 (Qwen3-4B): the
step that records them took 30-48 s for 144-152 layer calls per rank (benchmarks/journal/2026-11-29-speed-h200.md)."""
MAX_RECORDING_SECONDS = 120
"""The longest recording a run accepts: beyond it graphs stay off. At the 72B shape with tensor parallelism or
microbatches of one sequence a rank would record 1,280 graphs (~6.4 minutes in its second step, measured: the
bench's limits ended those runs while they recorded); a run that long must not hide in a step that looks stalled."""


def mark_graph_step(device: torch.device) -> None:
    """A new step for the CUDA-graph trees (`torch.compiler.cudagraph_mark_step_begin`): their replays' outputs of
    the previous step may be overwritten from here on. Only CUDA devices have graph trees; elsewhere the call would
    do nothing but import torch's inductor (1.6 s on 2 CPU cores, in every process)."""
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


def graph_recording_seconds(layers_on_rank: int, n_microbatches: int) -> float:
    """Predicted time of the step that records the graphs: one graph per layer, microbatch and direction."""
    return layers_on_rank * n_microbatches * 2 * SECONDS_PER_GRAPH_RECORDING


def cuda_graphs_pay_off(costs: StageCosts, microbatch: int, seq_len: int, split: int = 1) -> tuple[bool, str]:
    """Whether replaying layers as CUDA graphs can speed a run up, and why not when it cannot.

    Graphs remove launch cost, which only matters while the host needs longer to launch a layer than the
    GPU needs to run it: once the GPU's time is the longer, the host runs ahead and the GPU never waits. A
    layer's forward costs half its training FLOPs (forward + input-gradient backward), timed at GPU_FLOPS:
    a lower bound, so graphs stay on wherever they might help. `split`: ranks a layer's work is split over
    (parallel.tp), each running its share."""
    seconds = costs.layer / 2 * microbatch * seq_len / GPU_FLOPS / split
    if seconds < HOST_SECONDS_PER_LAYER_CALL:
        return True, ""
    return False, (
        f"a layer's forward at microbatch {microbatch} x {seq_len} tokens"
        + (f", split over {split} ranks," if split > 1 else "")
        + f" takes at least {seconds * 1e3:.1f} ms on "
        f"the GPU, longer than the ~{HOST_SECONDS_PER_LAYER_CALL * 1e3:.2f} ms the host needs to launch it, so "
        "replaying it as a CUDA graph cannot make the run faster; it runs compiled without graphs"
    )


def graphs_untried(quantize: str) -> str:
    """Why CUDA graphs stay off for a run with this base although they might pay ("": none): what has not run
    with them on a GPU yet."""
    if quantize == "nf4":
        return (
            'with model.quantize = "nf4" they have not been measured yet (each NF4 linear launches its own '
            "compiled dequantization inside the layer)"
        )
    return ""


def choose_cuda_graphs(
    costs: StageCosts,
    layers_on_rank: int,
    checkpointed: bool,
    n_microbatches: int,
    microbatch: int,
    seq_len: int,
    split: int = 1,
    untried: str = "",
) -> tuple[bool, str]:
    """Whether this rank replays its compiled layers as CUDA graphs (train.cuda_graphs asked for them), and a
    note for the user: why not, or what recording them will cost when that is over a minute (more than
    MAX_RECORDING_SECONDS: not recorded). `split`: parallel.tp; `untried`: graphs_untried's reason, if any."""
    if untried:
        return False, f"train.cuda_graphs off for this run: {untried}; it runs compiled without graphs"
    pays, why = cuda_graphs_pay_off(costs, microbatch, seq_len, split)
    if not pays:
        return False, f"train.cuda_graphs off for this run: {why}"
    if checkpointed:  # a recomputed layer would replay its graph inside another's backward
        return False, "train.cuda_graphs off on this rank: it checkpoints layers (activation_checkpointing)"
    recording = graph_recording_seconds(layers_on_rank, n_microbatches)
    if recording <= 60:
        return True, ""
    cost = (
        f"one graph per layer, microbatch and direction: {layers_on_rank} layers x {n_microbatches} microbatches "
        f"x 2 on this rank, ~{recording:.0f} s in the second step"
    )
    fewer = "fewer microbatches (parallel.n_microbatches), or more pipeline ranks, record fewer"
    if recording > MAX_RECORDING_SECONDS:
        return False, (
            f"train.cuda_graphs off for this run: recording them would take {cost}, over the "
            f"{MAX_RECORDING_SECONDS} s a run accepts; it runs compiled without graphs ({fewer})"
        )
    return True, f"train.cuda_graphs records {cost}; {fewer}"


def give_gradients_own_memory(params: list[torch.Tensor]) -> None:
    """Allocate every gradient before the first backward, so that backward adds into it.

    Without a gradient, autograd keeps the first one computed as the parameter's .grad; computed by a replayed
    graph, it lives in the graphs' pool, which the next schedule step reuses: with gradient accumulation (several
    schedule steps per optimizer step) the next step overwrote it (torch raises "accessing tensor output of
    CUDAGraphs that has been overwritten", seen at Qwen3-32B ddp with 4 accumulation steps). Zero these in place
    (`zero_grad(set_to_none=False)`) rather than freeing them."""
    for param in params:
        param.grad = torch.zeros_like(param)
