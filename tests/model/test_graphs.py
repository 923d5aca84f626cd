"""When CUDA graphs are used, and the memory rule their replays impose (the replays themselves need a GPU)."""

from __future__ import annotations

import torch

from pipetune.model.graphs import choose_cuda_graphs, give_gradients_own_memory, graphs_untried
from pipetune.model.shapes import builtin_config
from pipetune.model.split import estimate_costs


def test_graphs_stay_off_where_a_layer_outlasts_its_launch_or_recording_takes_minutes() -> None:
    big = estimate_costs(builtin_config("qwen2.5-72b"), 512)
    on, note = choose_cuda_graphs(big, 40, False, n_microbatches=8, microbatch=2, seq_len=512)
    assert not on and "takes at least 2.3 ms on the GPU" in note  # 1.8 TFLOP per layer forward
    small = estimate_costs(builtin_config("qwen3-4b"), 512)
    assert choose_cuda_graphs(small, 19, False, 4, 4, 512) == (True, "")  # 152 recordings: ~46 s, no note
    on, note = choose_cuda_graphs(small, 18, False, 8, 2, 512)
    assert on and "18 layers x 8 microbatches x 2 on this rank, ~86 s" in note
    on, note = choose_cuda_graphs(small, 36, False, 8, 2, 512)  # over MAX_RECORDING_SECONDS: not recorded
    assert not on and "36 layers x 8 microbatches x 2 on this rank, ~173 s" in note and "without graphs" in note
    half = estimate_costs(builtin_config("qwen2.5-72b"), 512)  # tp=2 at the 72B shape: half a layer per rank
    on, note = choose_cuda_graphs(half, 80, False, 8, 2, 512, split=2)
    assert not on and "~384 s" in note  # measured: the runs that recorded these ran out of their limits
    assert choose_cuda_graphs(small, 19, True, 4, 4, 512)[0] is False  # a rank that checkpoints layers
    untried = graphs_untried("nf4")  # not yet measured with NF4
    on, note = choose_cuda_graphs(small, 19, False, 4, 4, 512, untried=untried)
    assert not on and 'model.quantize = "nf4"' in note
    assert graphs_untried("fp8") == "" and graphs_untried("none") == ""
    assert choose_cuda_graphs(small, 19, False, 4, 4, 512, untried=graphs_untried("fp8")) == (True, "")


def test_preallocated_gradients_are_added_into_not_replaced() -> None:
    """A gradient computed by a replayed graph lives in the graphs' pool; with .grad allocated up front,
    backward adds into the parameter's own memory instead of keeping the pool's tensor."""
    weight = torch.nn.Parameter(torch.ones(3))
    give_gradients_own_memory([weight])
    own = weight.grad.data_ptr()
    for _ in range(2):  # two accumulation steps
        produced = torch.full((3,), 2.0)  # stands for a replayed graph's output
        (weight * produced).sum().backward()
    assert weight.grad.data_ptr() == own and weight.grad.tolist() == [4.0, 4.0, 4.0]
