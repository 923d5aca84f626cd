"""Which decoder layers each pipeline stage runs: balanced by estimated compute, or as the user says.

Cost model, in FLOPs per token of LoRA training (frozen base: forward + input-gradient backward,
the adapters' weight gradients are negligible): a matmul with P weights costs 4P; causal attention
over a sequence of s tokens adds about 6 * s * heads * head_dim per layer. The last stage also runs
lm_head (4 * vocab * hidden: for Qwen3-4B 151,936 x 2,560, the FLOPs of 3.7 decoder layers) and the
loss; the embedding lookup on the first stage is a gather, nearly free.

lm_head is one large matmul that runs much nearer the GPU's peak than a decoder layer's many small
kernels, so its time is weighted by HEAD_TIME_PER_FLOP: on an H200 (Qwen3-4B, compiled layers) the head
takes the time of about 2 decoder layers, half its FLOP share (benchmarks/journal/2026-11-29-perf-h200.md has the
splits that show it).

With train.fused_loss only the supervised rows (the summary) reach the head, at most
max_summary_tokens + 1 of max_length: the head's FLOPs scale by that share (`fused_loss_share`), and
their time by FUSED_HEAD_TIME_PER_FLOP, measured on 2x H200 (seq 512, summary <= 256, compiled layers
with CUDA graphs, benchmarks/journal/2026-11-29-speed-h200.md): per microbatch the last stage's head and loss
take the time of ~1.3-1.4 decoder layers: the loss is chunked, and (then) a host sync picked the supervised
rows, so it costs more than its FLOPs. The slower stage sets the pace, so the split that balances these times is
the fastest (the benchmark has the stage cycles of the splits around it).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from pipetune.config import Config
from pipetune.model.shapes import head_dim as head_size

HEAD_TIME_PER_FLOP = 0.5
"""Time of lm_head + loss per FLOP, relative to a decoder layer's (see the module docstring)."""
FUSED_HEAD_TIME_PER_FLOP = 0.75
"""The same for the fused loss, per FLOP of the head over its share of rows."""


@dataclass(frozen=True)
class StageCosts:
    layer: float
    """FLOPs per token of one decoder layer."""
    head: float
    """FLOPs per token of norm + lm_head + loss (last stage)."""
    head_time_per_flop: float = HEAD_TIME_PER_FLOP
    attention: float = 0.0
    """The part of `layer` that is attention's own matmuls (scores and their product with the values)."""

    @property
    def head_time(self) -> float:
        """The head's cost in layer-FLOP units, for balancing time rather than FLOPs."""
        return self.head * self.head_time_per_flop


def estimate_costs(
    config: PretrainedConfig, seq_len: int, fused_loss_share: float | None = None, attention_share: float = 1.0
) -> StageCosts:
    """Per-token FLOPs of a layer and of the head.

    `fused_loss_share`: with the fused loss, the share of tokens that reach the head; None: all do.
    `attention_share`: attention's work against causal attention over the whole row (packed rows: their samples'
    own, data/inspect.training_attention_share).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = head_size(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attn_params = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o + k, v
    mlp_params = 3 * hidden * inter
    attention = 6 * seq_len * heads * head_dim * attention_share
    layer = 4 * (attn_params + mlp_params) + attention
    head = float(4 * config.vocab_size * hidden)
    if fused_loss_share is None:
        return StageCosts(layer=float(layer), head=head, attention=float(attention))
    return StageCosts(
        layer=float(layer),
        head=head * fused_loss_share,
        head_time_per_flop=FUSED_HEAD_TIME_PER_FLOP,
        attention=float(attention),
    )


def run_split(
    config: Config, model_config: PretrainedConfig, attention_share: float = 1.0
) -> tuple[StageCosts, list[range]]:
    """The cost model and the layer ranges of every pipeline stage of a run (parallel.layers_per_stage, or
    balanced by cost for the run's sequence length, loss and `attention_share`: estimate_costs)."""
    t, d = config.train, config.data
    share = min(1.0, (d.max_summary_tokens + 1) / d.max_length) if t.fused_loss is True else None
    costs = estimate_costs(model_config, d.max_length, share, attention_share)
    p = config.parallel
    return costs, split_layers(model_config.num_hidden_layers, p.n_stages, p.layers_per_stage, costs)


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
    """Estimated time of each stage, in FLOPs per token of a decoder layer's efficiency."""
    return [len(r) * costs.layer + (costs.head_time if i == len(ranges) - 1 else 0.0) for i, r in enumerate(ranges)]


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
            result = (count * costs.layer + costs.head_time, [count])
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
