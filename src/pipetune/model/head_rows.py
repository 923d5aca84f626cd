"""The last decoder layer on the rows the loss reads (train.head_rows, with train.fused_loss; "auto" resolves it on
where the summary is a small share of a row: pipetune/switches.py).

The loss reads the last layer's output only at the supervised positions (the summary's tokens): the fused loss
applies the head to those rows alone (model/loss.py), and a row the loss does not read gets no gradient. The last
layer's output at a position depends on the layer's input there (the residual, the query, the MLP) and on the
keys and values of every earlier position of its document. So the last layer computes its keys and values for
every position, as every layer does, but attention's queries, the residual, the post-attention norm and the MLP
only at the rows the loss reads. A whole-meeting row of 16,384 tokens holds ~2 summaries of ~257 supervised
tokens: the layer's attention and MLP then run on ~3% of its rows. Its output elsewhere is its input, which
nothing reads.

How, for a family whose layers are x + attn(norm(x)), then h + mlp(norm(h)) (`Family.pre_norm_layers`): the
layer's own attention module runs on every row (its projections, norms and rotary embedding as the model has
them), with a `HeadRows` as its mask, which `attention.document_attention` hands to `head_rows_sdpa`: each run
of consecutive chosen rows of one document ([query start, end)) attends to its document's keys up to its end
([key start, end)) with the causal diagonal at the bottom right, by flash attention's kernel (grouped key-value
heads as they are; no mask tensor), zeros at the other rows (so o_proj's output there is not read either).
`head_rows_layer` then adds the residual and runs the post-attention norm and the MLP on the chosen rows alone.
The math is the layer's own: on those rows the output equals the whole layer's (tests/model/test_head_rows.py,
float32 on the CPU, with the gradients of every adapter).

Compiled (train.compile), the layer is a graph of its own (`HeadRowsLayer`) whose chosen rows' count is a dynamic
dimension: one compilation serves every microbatch. A stage uses it on the training forward of its last layer when
that layer is not checkpointed (`StageModule.forward`); validation runs the whole layer.

History: a first version (2026-12-06, E7) ran this layer eagerly with a dense [chosen x keys] mask and the
key-value heads repeated for SDPA's masked kernel: 2.6% slower than the whole layer compiled
(benchmarks/journal/2026-12-06-fast-by-default-eighth-round-one-h200.md). This one, on the same 64 whole-meeting
rows on one H200: 1.5% faster, every step 1.3-1.8% shorter (2026-12-07-head-rows-and-pad32-one-h200.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipetune.model.host_tensors import to_device
from pipetune.model.kept_attention import (
    FLASH,
    dense_kept,
    lse_slice,
    register_table_autograd,
    row_like,
    sdpa_backward,
)

RUNS_STEP = 8
"""`HeadRows.runs` holds a multiple of this many runs, the last ones empty: a microbatch's runs (~2 a row of whole
meetings, one a row of single samples) then meet a compiled layer in one or two shapes (a count of 1 would be
specialized apart from the others)."""

ROWS_STEP = 128
"""`HeadRows.flat` holds a multiple of this many rows where the documents leave room: runs are extended back over
their documents' earlier positions (the layer computes those rows too; nothing reads them). The layer's matmuls over
the chosen rows then meet a few shapes in a run instead of a new one most microbatches, and the fused loss pads its
rows to the same step (model/loss.py). A bf16 matmul at a shape cuBLAS has not seen took the host 0.15-0.2 ms
(median; up to ~4 ms where it loaded a kernel) against 0.02 ms for a shape seen before (an H100, torch 2.11), and
in a profiled step of whole meetings the GPU waited for such matmuls at each microbatch's turn to backward. With
both, the whole-meeting defaults ran 0.2-0.8% faster over the same 64 rows in three pairs of runs on one H100
(benchmarks/journal/2026-12-07-loss-rows-in-few-shapes-one-h100.md)."""


@dataclass(frozen=True)
class HeadRows:
    """The rows a microbatch's loss reads, as the last layer takes them: `runs` [k, 4] int64 on the host, each run
    of consecutive chosen positions of one document as (row, key start: its document's first position, query
    start, end); `flat` [n] on the device, every chosen position as row * seq + position, runs in order. The runs
    may start before the loss's first row of their document (ROWS_STEP)."""

    runs: torch.Tensor
    flat: torch.Tensor
    """`runs` ends in empty ones ((0, 0, 0, 0): `RUNS_STEP`)."""

    @classmethod
    def of(
        cls, chosen: torch.Tensor, positions: torch.Tensor | None, device: torch.device, step: int = ROWS_STEP
    ) -> HeadRows | None:
        """From a [b, s] bool table of the rows the loss reads and packed rows' [b, s] position ids (restarting at
        0 with each document; None: one document a row), both read on the host (where a step keeps them: no wait
        for the device). None where no row is chosen. The runs are extended back to a multiple of `step` rows
        where their documents leave room (ROWS_STEP)."""
        chosen = chosen.cpu()
        seq = chosen.shape[1]
        runs = []
        for row in range(chosen.shape[0]):
            index = torch.nonzero(chosen[row]).flatten()
            if not len(index):
                continue
            place = index if positions is None else positions[row].cpu()[index]
            # a run breaks where the positions skip, or a new document starts (its position restarts)
            breaks = torch.nonzero((index[1:] != index[:-1] + 1) | (place[1:] != place[:-1] + 1)).flatten() + 1
            bounds = [0, *breaks.tolist(), len(index)]
            for a, b in zip(bounds[:-1], bounds[1:], strict=False):
                start = int(index[a])
                runs.append([row, start - int(place[a]), start, int(index[b - 1]) + 1])
        if not runs:
            return None
        _extend_back(runs, step)
        flat = torch.cat([torch.arange(start, end) + row * seq for row, _, start, end in runs])
        runs += [(0, 0, 0, 0)] * (-len(runs) % RUNS_STEP)  # empty runs: a few shapes for a compiled layer
        return cls(torch.tensor(runs, dtype=torch.int64), to_device(flat, device))


def _extend_back(runs: list[list[int]], step: int) -> None:
    """Move runs' query starts back (in order, each no further than its document's start or the row's run before
    it) until the runs hold a multiple of `step` rows, or every run is at its limit."""
    missing = -sum(end - start for _, _, start, end in runs) % step
    before = {}  # each row's end of its run before
    for run in runs:
        row, keys, start, end = run
        take = min(missing, start - max(keys, before.get(row, 0)))
        run[2], missing, before[row] = start - take, missing - take, end


def _flash(query: torch.Tensor) -> bool:
    """Whether a GPU runs these runs by flash attention's kernel (half precision on CUDA); else the reference."""
    return query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)


def _weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[1, heads, m, n] float32 attention weights of [1, heads, m, d] queries over [1, heads, n, d] keys (m <= n;
    query i is key n - m + i), causal with the diagonal at the bottom right."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    m, n = q.shape[2], k.shape[2]
    above = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(n - m + 1)
    return scores.masked_fill(above, float("-inf")).softmax(-1)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention `head_rows_sdpa` computes, in float32 ([1, kv heads, n, d] keys and values, repeated over
    their query heads): the [1, heads, m, d] output in q's dtype. The CPU's (and float32's) kernel."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return (_weights(q, k, scale) @ v.float()).to(q.dtype)


def _reference_backward(g, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_reference`'s query, key and value gradients for the output gradient `g`, in float32 (a key-value head's
    the sum over its query heads), in the inputs' dtype."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(groups, dim=1).float() for t in (k, v))
    weights, g = _weights(q, kr, scale), g.float()
    out = weights @ vr
    dv = weights.transpose(-1, -2) @ g
    dscores = weights * (g @ vr.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
    dq = dscores @ kr * scale
    dk = dscores.transpose(-1, -2) @ q.float() * scale

    def fold(t: torch.Tensor) -> torch.Tensor:  # [1, heads, n, d] -> [1, kv heads, n, d]
        return t.unflatten(1, (k.shape[1], groups)).sum(2)

    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@torch.library.custom_op("pipetune::head_rows_sdpa", mutates_args=())
def head_rows_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen rows' attention (see the module's doc): [b, heads, s, d] output laid out [b, s, heads, d], zeros
    past the runs, and the runs' float32 log-sum-exps, flat ([b x heads x s], `lse_slice`), for the backward."""
    batch, heads, seq, _ = query.shape
    out = row_like(query, zeros=True)
    lse = query.new_zeros(batch * heads * seq, dtype=torch.float32)
    for row, keys, start, end in runs.tolist():
        if end == start:
            continue
        q = query[row : row + 1, :, start:end]
        k, v = (t[row : row + 1, :, keys:end] for t in (key, value))
        if _flash(query):  # its causal diagonal lies at the bottom right where there are fewer queries than keys
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            run_out, run_lse = flash(q, k, v, 0.0, True, False, scale=scale)[:2]
            run_lse = run_lse.reshape(heads, end - start)
            lse[lse_slice(row, start, end, heads, seq)] = run_lse.flatten()
        else:  # its backward recomputes the weights: no log-sum-exp kept
            run_out = _reference(q, k, v, scale)
        out[row : row + 1, :, start:end] = run_out
    return out, lse


@torch.library.custom_op("pipetune::head_rows_sdpa_backward", mutates_args=())
def head_rows_sdpa_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    runs: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`head_rows_sdpa`'s query, key and value gradients: flash attention's backward for each run (runs of one
    document share keys: their key and value gradients add up), the reference's elsewhere."""
    heads, seq = query.shape[1], query.shape[2]
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    for row, keys, start, end in runs.tolist():
        if end == start:
            continue
        q = query[row : row + 1, :, start:end]
        k, v = (t[row : row + 1, :, keys:end] for t in (key, value))
        g = grad[row : row + 1, :, start:end]
        if _flash(query):
            run_lse = lse[lse_slice(row, start, end, heads, seq)].view(1, heads, end - start)
            kept = dense_kept(query, FLASH, end - start, end - keys)
            dq, dk, dv = sdpa_backward(g, q, k, v, out[row : row + 1, :, start:end], run_lse, kept, scale)
        else:
            dq, dk, dv = _reference_backward(g, q, k, v, scale)
        grads[0][row : row + 1, :, start:end] = dq
        grads[1][row : row + 1, :, keys:end] += dk
        grads[2][row : row + 1, :, keys:end] += dv
    return tuple(grads)


register_table_autograd(head_rows_sdpa, head_rows_sdpa_backward)


def head_rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: HeadRows, scale: float | None
) -> torch.Tensor:
    """[b, s, heads, d] attention of the chosen rows' queries ([b, heads, s, d] query, [b, kv heads, s, d] key and
    value), zeros at every other row."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, _ = head_rows_sdpa(query, key, value, rows.runs, scale)
    return out.transpose(1, 2).contiguous()


def head_rows_layer(layer: nn.Module, hidden: torch.Tensor, rows: HeadRows, kwargs: dict) -> torch.Tensor:
    """A pre-norm decoder layer's output ([b, s, hidden]) at the chosen rows, its input elsewhere: its attention
    module on every row with `rows` as its mask (keys and values from every row, queries from the chosen ones),
    then the residual, the post-attention norm and the MLP on the chosen rows alone. `kwargs`: the layer's call
    arguments (`stage.layer_call_kwargs`), whose mask `rows` replaces."""
    attention, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **{**kwargs, "attention_mask": rows})
    flat = hidden.flatten(0, 1)
    chosen = flat.index_select(0, rows.flat) + attention.flatten(0, 1).index_select(0, rows.flat)
    chosen = chosen.unsqueeze(0)  # [1, n, hidden]: a layer's MLP (chunked or not) takes 3-d hidden states
    chosen = chosen + layer.mlp(layer.post_attention_layernorm(chosen))
    return flat.index_copy(0, rows.flat, chosen.squeeze(0)).view_as(hidden)


class HeadRowsLayer(nn.Module):
    """The stage's last layer as a run of its own (`StageModule.compile_layers`): on the chosen rows where a
    training forward names them (`head_rows_layer`), the whole layer otherwise. Compiled, the chosen rows' count
    is a dynamic dimension (`mark_dynamic`), so one graph serves every microbatch of as many runs' steps."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, rows: HeadRows | None = None, **kwargs) -> torch.Tensor:
        if rows is None:
            out = self.layer(hidden, **kwargs)
            return out[0] if isinstance(out, tuple) else out
        return head_rows_layer(self.layer, hidden, rows, kwargs)


def mark_dynamic(rows: HeadRows) -> None:
    """Mark the chosen rows' count as dynamic for a compiled `HeadRowsLayer` (no recompilation as it changes from
    one microbatch to the next; the runs' count moves in steps of RUNS_STEP)."""
    torch._dynamo.maybe_mark_dynamic(rows.flat, 0)
