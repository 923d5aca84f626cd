"""Which decoder layers each pipeline stage runs: balanced by estimated compute, or as the user says.

Cost model, in FLOPs per token of LoRA training (frozen base: forward + input-gradient backward,
the adapters' weight gradients are negligible): a matmul with P weights costs 4P; causal attention
over a sequence of s tokens adds about 6 * s * heads * head_dim per layer. The last stage also runs
lm_head (4 * vocab * hidden: for Qwen3-4B 151,936 x 2,560, about 3.9 decoder layers) and the loss;
the embedding lookup on the first stage is a gather, nearly free.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class StageCosts:
    layer: float
    """FLOPs per token of one decoder layer."""
    head: float
    """FLOPs per token of norm + lm_head + loss (last stage)."""


def estimate_costs(config: PretrainedConfig, seq_len: int) -> StageCosts:
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attn_params = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o + k, v
    mlp_params = 3 * hidden * inter
    layer = 4 * (attn_params + mlp_params) + 6 * seq_len * heads * head_dim
    return StageCosts(layer=float(layer), head=float(4 * config.vocab_size * hidden))


def split_layers(
    n_layers: int,
    n_stages: int,
    layers_per_stage: list[int] | None = None,
    costs: StageCosts | None = None,
) -> list[range]:
    """Contiguous layer ranges, one per stage: `layers_per_stage` when given, else balanced by `costs`.

    Without costs the split is even, the remainder going to the first stages.
    """
    if layers_per_stage:
        counts = list(layers_per_stage)
    elif costs is not None:
        counts = _balanced_counts(n_layers, n_stages, costs)
    else:
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"cannot split {n_layers} layers over {n_stages} stages as {counts}")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_costs(ranges: list[range], costs: StageCosts) -> list[float]:
    """Estimated FLOPs per token of each stage."""
    return [len(r) * costs.layer + (costs.head if i == len(ranges) - 1 else 0.0) for i, r in enumerate(ranges)]


def _balanced_counts(n_layers: int, n_stages: int, costs: StageCosts) -> list[int]:
    """Layer counts minimizing the most expensive stage (ties: the earliest stages take more layers)."""
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(stage: int, first_layer: int) -> tuple[float, list[int]]:
        # Cheapest bottleneck for stages stage..n_stages-1 over layers first_layer..n_layers-1.
        key = (stage, first_layer)
        if key in best:
            return best[key]
        remaining_stages = n_stages - stage
        if remaining_stages == 1:
            count = n_layers - first_layer
            result = (count * costs.layer + costs.head, [count])
        else:
            result = (float("inf"), [])
            max_count = n_layers - first_layer - (remaining_stages - 1)
            for count in range(max_count, 0, -1):
                rest_cost, rest = solve(stage + 1, first_layer + count)
                cost = max(count * costs.layer, rest_cost)
                if cost < result[0]:
                    result = (cost, [count, *rest])
        best[key] = result
        return result

    return solve(0, 0)[1]
