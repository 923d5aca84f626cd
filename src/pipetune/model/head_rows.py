"""The last decoder layer on the rows the loss reads (with train.fused_loss, where the summary is a small share).

The loss reads the last layer's output only at the supervised positions (the summary's tokens): the fused loss
applies the head to those rows alone (model/loss.py), and a row the loss does not read gets no gradient. The last
layer's output at a position depends on the layer's input there (the residual, the query, the MLP) and on the
keys and values of every earlier position of its document. So the last layer computes its keys and values for
every position, as every layer does, but attention's queries, the residual, the post-attention norm and the MLP
only at the rows the loss reads. A whole-meeting row of 16,384 tokens holds ~2 summaries of <= 257 supervised
tokens: the layer's attention and MLP then run on ~3% of its rows, which saves most of one layer in 36 (~2% of a
Qwen3-4B step). Its output elsewhere is its input, which nothing reads.

How, for a family whose layers are x + attn(norm(x)), then h + mlp(norm(h)) (`Family.pre_norm_layers`): the
layer's own attention module runs on every row (its projections, norms and rotary embedding as the model has
them), with a `HeadRows` as its mask, which `attention.document_attention` hands to `head_rows_attention`: SDPA
over each row's chosen queries, each masked to its own document's earlier keys, zeros at the other rows (so
o_proj's output there is not read either). `head_rows_layer` then adds the residual and runs the post-attention
norm and the MLP on the chosen rows alone. The math is the layer's own: on those rows the output equals the whole
layer's (tests/model/test_head_rows.py, float32 on the CPU, with the gradients of every adapter).

The layer runs eagerly, outside the compiled groups (its chosen rows' count changes every microbatch). A stage
uses it only on the training forward of its last layer when that layer is not checkpointed (`StageModule.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipetune.config import Config

HEAD_ROWS_SHARE = 1 / 3
"""The most of a row the loss may read for the last layer to run on those rows alone: above it the eager layer's
cost outweighs the rows it skips (the seed's job reads up to 257 of 512)."""


@dataclass(frozen=True)
class HeadRows:
    """The rows a microbatch's loss reads, as the last layer's attention takes them: `index[r]` the positions of
    row r (on the device; empty: none), `ends[r]` one past its last (on the host: how many keys it needs), `flat`
    every chosen position as row * seq + position, and `documents` [b, s] the document of each position (packed
    rows' samples; one document a row otherwise)."""

    index: list[torch.Tensor]
    ends: list[int]
    flat: torch.Tensor
    documents: torch.Tensor

    @classmethod
    def of(cls, chosen: torch.Tensor, documents: torch.Tensor) -> HeadRows:
        """From a [b, s] bool table of the rows the loss reads (on the host, where the labels are: no wait for the
        device) and [b, s] document ids on the device."""
        device, seq = documents.device, chosen.shape[1]
        index, ends = [], []
        for row in chosen.cpu():
            positions = torch.nonzero(row).flatten()
            index.append(positions.to(device, non_blocking=True))
            ends.append(int(positions[-1]) + 1 if len(positions) else 0)
        flat = torch.cat([positions + r * seq for r, positions in enumerate(index)])
        return cls(index, ends, flat, documents)


def head_rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: HeadRows, scale: float | None
) -> torch.Tensor:
    """[b, s, heads, d] causal attention within documents of the chosen rows' queries ([b, heads, s, d] query,
    [b, kv heads, s, d] key and value), zeros at every other row: SDPA with each row's document mask over its
    keys up to its last chosen query (key-value heads repeated to the query's: SDPA's masked kernel takes no
    grouped heads)."""
    batch, heads, seq, dim = query.shape
    groups = heads // key.shape[1]
    out = query.new_zeros(batch, seq, heads, dim)
    for r, (positions, end) in enumerate(zip(rows.index, rows.ends, strict=True)):
        if not end:
            continue
        keys = torch.arange(end, device=query.device)
        documents = rows.documents[r]
        mask = (documents[positions].unsqueeze(1) == documents[:end].unsqueeze(0)) & (
            keys.unsqueeze(0) <= positions.unsqueeze(1)
        )
        k, v = (t[r : r + 1, :, :end].repeat_interleave(groups, dim=1) for t in (key, value))
        q = query[r : r + 1].index_select(2, positions)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)
        out[r].index_copy_(0, positions, attended[0].transpose(0, 1))
    return out


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


def head_rows_share(config: Config) -> float:
    """The most of a row the loss reads: a sample's supervised tokens, data.max_summary_tokens + 1, of
    data.max_length (a packed row's samples share it)."""
    return min(1.0, (config.data.max_summary_tokens + 1) / config.data.max_length)


def head_rows_pays(config: Config, stage: nn.Module) -> bool:
    """Whether a run with the fused loss runs its last stage's last layer on the loss's rows alone: a pre-norm
    family (`Family.pre_norm_layers`), the layer whole and plain on this rank (no tensor parallelism, which splits
    its modules, nor FSDP, which gathers its weights around the layer's own call), and the loss reading at most
    HEAD_ROWS_SHARE of a row."""
    p = config.parallel
    whole = not p.tensor_parallel and not p.sharded and stage.sequence_shards == 1
    return stage.family.pre_norm_layers and whole and head_rows_share(config) <= HEAD_ROWS_SHARE
