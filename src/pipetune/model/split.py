"""Which decoder layers each pipeline stage runs."""

from __future__ import annotations


def split_layers(n_layers: int, n_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage: `layers_per_stage` when given, else as even as possible.

    An uneven remainder goes to the first stages: the last stage also runs norm, lm_head and the loss.
    """
    if layers_per_stage:
        counts = list(layers_per_stage)
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
