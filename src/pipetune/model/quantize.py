"""A quantized frozen base (model.quantize): the decoder layers' linear weights stored in NF4 or FP8.

With LoRA the base never changes, so its big matrices can be stored small:

- "nf4" (QLoRA): torchao's NF4Tensor, 4-bit NormalFloat in blocks of 64 weights with double-quantized
  block scales (~0.52 bytes a weight), dequantized to the compute dtype for each matmul (forward and input
  gradient). torchao's tensor is plain PyTorch (it runs and is tested on a CPU) and knows FSDP2's all-gather,
  as in torchtune's QLoRA.
- "fp8": float8_e4m3fn weights with one float32 scale per output row. The forward and the input-gradient
  matmuls run in FP8 (`torch._scaled_mm`, row-wise scaled activations and gradients, bfloat16 out); no
  weight gradient is computed. The row scales are folded into the output gradient, so one FP8 copy of the
  weight serves both directions.

Embeddings, norms, lm_head and the LoRA adapters stay in model.dtype / float32. Weights become quantized
placeholders on the meta device (`quantize_linears`) and get values when the model is materialized
(model/load.py): each weight is quantized whole as it is read, and a sharded one keeps its rows, so every
layout holds the same values.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from pipetune.config import QUANTIZE, Config, ConfigError
from pipetune.model.stage import local_part

NF4_BLOCK = 64
"""Weights per NF4 block (one scale each), as in QLoRA."""
NF4_SCALER_BLOCK = 256
"""Block scales per block of their double quantization, as in QLoRA (a smaller divisor where a matrix has
a block count that 256 does not divide)."""
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest float8_e4m3fn value: a row's absolute maximum maps to it."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 matmuls (Ada; Hopper is 9.0)."""


def torchao_nf4() -> tuple[type, Callable]:
    """torchao's NF4Tensor and to_nf4 (torchao is only needed for model.quantize = "nf4")."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def base_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The decoder layers' linear layers (PEFT's base layers where wrapped): what gets quantized."""
    for name, module in model.named_modules():
        if ".layers." in f".{name}" and type(module) is nn.Linear and ".lora_" not in name:
            yield name, module


def nf4_scaler_block(numel: int) -> int:
    """Block scales per double-quantization block for a matrix of `numel` weights: 256, or the largest divisor
    of its block count below that (torchao needs the count to divide evenly)."""
    blocks = numel // NF4_BLOCK
    return next(size for size in range(min(NF4_SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Turn the decoder layers' linear weights of a meta-device model into quantized placeholders; returns how many.

    "nf4": the weight becomes an NF4Tensor, and the module runs `_nf4_linear_forward` (`nf4_linear`).
    "fp8": the weight becomes float8_e4m3fn with a `weight_scale` buffer (one float32 per row), and the module
    runs `_fp8_linear_forward`."""
    if method == "none":
        return 0
    count = 0
    for _, linear in base_linears(model):
        weight = linear.weight
        if not weight.is_meta:
            raise ValueError("quantize_linears works on a meta-device model, before it is materialized")
        if method == "nf4":
            _, to_nf4 = torchao_nf4()
            placeholder = to_nf4(weight.detach(), NF4_BLOCK, nf4_scaler_block(weight.numel()))
            linear.weight = nn.Parameter(placeholder, requires_grad=False)
            linear.forward = types.MethodType(_nf4_linear_forward, linear)
        elif method == "fp8":
            linear.weight = nn.Parameter(torch.empty_like(weight, dtype=FP8), requires_grad=False)
            linear.compute_dtype = weight.dtype  # PEFT sizes adapters by it (bitsandbytes' convention), not by FP8
            linear.register_buffer("weight_scale", torch.empty(weight.shape[0], 1, dtype=torch.float32, device="meta"))
            linear.forward = types.MethodType(_fp8_linear_forward, linear)
        else:
            raise ValueError(f"unknown quantization {method!r}; one of {', '.join(QUANTIZE)}")
        count += 1
    return count


def weight_writers(model: nn.Module) -> dict[int, Callable[[torch.Tensor, slice], None]]:
    """For each quantized weight of a materialized model (by id of the parameter), a function that stores a whole
    tensor of its unquantized values and the rows of it this rank holds: quantized whole, those rows kept (FSDP
    shards dim 0)."""
    writers: dict[int, Callable[[torch.Tensor, slice], None]] = {}
    for _, linear in base_linears(model):
        weight = linear.weight
        local = local_part(weight)
        if local.dtype == FP8:
            writers[id(weight)] = lambda whole, rows, linear=linear: _write_fp8(linear, whole, rows)
        elif type(local).__name__ == "NF4Tensor":
            writers[id(weight)] = lambda whole, rows, weight=weight: _write_nf4(weight, whole, rows)
    return writers


def _write_nf4(param: torch.Tensor, whole: torch.Tensor, rows: slice) -> None:
    _, to_nf4 = torchao_nf4()
    # The shard itself: to_local() returns a view, and a view of an NF4Tensor is a new object.
    local = param._local_tensor if isinstance(param, DTensor) else param
    quantized = to_nf4(whole.to(local.dtype).contiguous(), local.block_size, local.scaler_block_size)
    if rows != slice(None):  # torchao splits an NF4Tensor into equal row blocks (as FSDP2 shards it)
        quantized = torch.split(quantized, rows.stop - rows.start)[rows.start // (rows.stop - rows.start)]
    for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
        getattr(local, name).copy_(getattr(quantized, name))
    # empty_like (to_empty) allocates only the three tensors above; the scales' mean and the code table are set here.
    local.scaler_mean, local.nf4 = quantized.scaler_mean, quantized.nf4


def fp8_quantize(whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 of a matrix: (float8_e4m3fn values, float32 scale per row), whole ~= values * scale."""
    whole = whole.float()
    scale = whole.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (whole / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _write_fp8(linear: nn.Linear, whole: torch.Tensor, rows: slice) -> None:
    values, scale = fp8_quantize(whole)
    weight = linear.weight
    local = local_part(weight)
    local.copy_(values[rows])
    linear.weight_scale.copy_(scale)  # a buffer: every rank holds all rows' scales (4 bytes a row)


def _nf4_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = nf4_matmul(x, *_nf4_parts(self.weight), False)
    return out if self.bias is None else out + self.bias


def _nf4_parts(weight: torch.Tensor) -> tuple:
    """An NF4Tensor as the parts `nf4_matmul` takes: its tensors, then its block sizes and shape."""
    rows, columns = weight.shape
    return (
        weight.quantized_data,
        weight.quantized_scalers,
        weight.quantization_factor,
        weight.scaler_mean,
        weight.nf4,
        weight.block_size,
        weight.scaler_block_size,
        rows,
        columns,
    )


# An NF4 linear is one operator to torch.compile: a compiled decoder layer stays one graph around it (outside the
# graph, each of a layer's 7 NF4 linears split it, and the host's launches of the pieces took ~8 ms a layer call
# at the 72B shape, leaving its GPU idle 43% of a step). Inside the operator the weight is dequantized (one
# compiled kernel on GPUs) and multiplied; its backward takes only the NF4 parts, so the partitioner cannot keep
# the 2-byte dequantized copy for backward (per layer and microbatch in flight, that undoes what NF4 saves). The
# input gradient is the same operator on the transposed weight, dequantized again, as torchao's own linear does;
# there is no weight gradient.
@torch.library.custom_op("pipetune::nf4_matmul", mutates_args=())
def nf4_matmul(
    x: torch.Tensor,
    data: torch.Tensor,
    scalers: torch.Tensor,
    factor: torch.Tensor,
    mean: torch.Tensor,
    table: torch.Tensor,
    block: int,
    scaler_block: int,
    rows: int,
    columns: int,
    transposed: bool,
) -> torch.Tensor:
    """x W^T for the NF4 weight W of `rows` x `columns` given by its parts; `transposed`: x W (an input gradient)."""
    weight = _dequantize_parts(data, scalers, factor, mean, table, block, scaler_block, (rows, columns))
    weight = weight.to(x.dtype)
    return x @ weight if transposed else nn.functional.linear(x, weight)


@nf4_matmul.register_fake
def _(x, data, scalers, factor, mean, table, block, scaler_block, rows, columns, transposed):
    return x.new_empty(*x.shape[:-1], columns if transposed else rows)


def _nf4_setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[1:6])
    ctx.sizes, ctx.transposed = inputs[6:10], inputs[10]


def _nf4_backward(ctx, grad: torch.Tensor) -> tuple:
    return (nf4_matmul(grad, *ctx.saved_tensors, *ctx.sizes, not ctx.transposed), *([None] * 10))


nf4_matmul.register_autograd(_nf4_backward, setup_context=_nf4_setup_context)


def nf4_dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An NF4Tensor's values as a plain `dtype` matrix: torchao's get_original_weight, written over the tensor's
    parts. On a GPU it runs compiled (one fused kernel per weight shape) instead of torchao's ~10 eager kernels
    per weight, which took ~1.5 ms for each of the ~9,000 dequantizations of a 72B step: 14 of its 21 s."""
    *parts, rows, columns = _nf4_parts(weight)
    return _dequantize_parts(*parts, (rows, columns)).to(dtype)


def _dequantize_parts(*parts) -> torch.Tensor:
    # Without grad (the weight has none): the forward runs with grad mode on and the backward with it off, and
    # the compiled function would otherwise compile each weight shape twice, past dynamo's limit of 8 at Qwen3-4B.
    with torch.no_grad():
        return (_nf4_values_compiled() if parts[0].is_cuda else _nf4_values)(*parts)


def _nf4_values(
    data: torch.Tensor,
    scalers: torch.Tensor,
    factor: torch.Tensor,
    mean: torch.Tensor,
    table: torch.Tensor,
    block: int,
    scaler_block: int,
    shape: tuple[int, ...],
) -> torch.Tensor:
    # Two 4-bit codes per byte (first in the high bits), each an index into the NF4 table; one scale per block
    # of `block` weights, itself stored in int8 with a factor per `scaler_block` scales and their mean added.
    first, second = table[(data >> 4).long()], table[(data & 0b1111).long()]
    scales = (scalers.view(-1, scaler_block) / factor.unsqueeze(-1)).flatten().to(table.dtype) + mean
    repeated = scales.unsqueeze(-1).expand(scales.numel(), block // 2).flatten()
    return torch.stack([first * repeated, second * repeated], dim=-1).reshape(shape)


@functools.cache
def _nf4_values_compiled() -> Callable:
    return torch.compile(_nf4_values, dynamic=False, fullgraph=True)


def _fp8_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = _Float8Linear.apply(x, self.weight, self.weight_scale)
    return out if self.bias is None else out + self.bias


def _scaled_fp8_quantize(flat: torch.Tensor, column_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quantize of `flat` with each column first multiplied by `column_scale` ([1, columns])."""
    return fp8_quantize(flat.float() * column_scale)


@functools.cache
def _fp8_quantizers_compiled() -> tuple[Callable, Callable]:
    return torch.compile(fp8_quantize), torch.compile(_scaled_fp8_quantize)


def _fp8_quantizers(x: torch.Tensor) -> tuple[Callable, Callable]:
    """(fp8_quantize, _scaled_fp8_quantize) for x: compiled on a GPU outside a compiled region, where eagerly each
    is ~6 kernels over float32 copies of the activation (an eager FP8 run measured 0.70x an eager bf16 one at
    4,096-token rows, before they were compiled); plain where torch.compile traces the layer itself (it fuses them
    there) and on a CPU."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return _fp8_quantizers_compiled()
    return fp8_quantize, _scaled_fp8_quantize


class _Float8Linear(torch.autograd.Function):
    """y = x W^T with W in FP8 (row scales s), x quantized per row; dx = (dy * s^T) W8 in FP8 too; no dW."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        flat = x.reshape(-1, x.shape[-1])
        x8, x_scale = _fp8_quantizers(flat)[0](flat)  # dynamic: each row's absolute maximum
        # Fast (less often promoted) accumulation in the forward only, as torchao's float8 recipes do.
        out = torch._scaled_mm(
            x8, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype, use_fast_accum=True
        )
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight, scale = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        # dx[m, k] = sum_n dy[m, n] s[n] W8[n, k]: the weight's row scales go into the gradient before it is quantized.
        g8, g_scale = _fp8_quantizers(flat)[1](flat, scale.t())
        ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=weight.device)
        # _scaled_mm takes its second operand column-major: a transposed copy of W8 for this call only.
        dx = torch._scaled_mm(g8, weight.t().contiguous().t(), scale_a=g_scale, scale_b=ones, out_dtype=grad.dtype)
        return dx.view(*grad.shape[:-1], weight.shape[1]), None, None


# --------------------------------------------------------------------------- what a machine and a layout can serve


def check_quantize(config: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before any weight is read, a model.quantize that this machine or layout cannot serve."""
    method, p = config.model.quantize, config.parallel
    if method == "none":
        return
    if method == "fp8":
        _check_fp8_device()
    else:
        try:
            torchao_nf4()
        except ImportError:
            raise ConfigError(
                'model.quantize = "nf4" stores weights as torchao\'s NF4Tensor, and torchao is not installed: '
                "pip install 'pipetune[quant]' (torchao >= 0.18)"
            ) from None
    for name, rows, columns in linear_shapes(model_config):
        if method == "fp8" and (rows % 16 or columns % 16):
            raise ConfigError(
                f'model.quantize = "fp8": {name} is {rows} x {columns}, and FP8 matmuls need both sides to be '
                'multiples of 16; use model.quantize = "nf4" or "none"'
            )
        if method == "nf4" and (rows * columns) % NF4_BLOCK:
            raise ConfigError(
                f'model.quantize = "nf4": {name} ({rows} x {columns}) does not divide into NF4 blocks of '
                f'{NF4_BLOCK} weights; use model.quantize = "none"'
            )
        groups = rows * columns // NF4_BLOCK // nf4_scaler_block(rows * columns)
        if method == "nf4" and p.sharded and (rows % p.dp or groups % p.dp):
            raise ConfigError(
                f'model.quantize = "nf4" with FSDP over parallel.dp = {p.dp}: {name} ({rows} x {columns}, '
                f"{groups} groups of NF4 scales) does not split into {p.dp} equal row blocks of whole groups; "
                f"use a parallel.dp that divides {math.gcd(rows, groups)}, or replicas without sharding "
                "(parallel.dp_shard = false, strategy 'ddp' for pp = 1)"
            )


def _check_fp8_device() -> None:
    if not torch.cuda.is_available():
        raise ConfigError(
            'model.quantize = "fp8" needs a GPU with FP8 matmuls (CUDA compute capability 8.9 or higher: Ada, '
            'Hopper, Blackwell), and this machine has no CUDA GPU; use model.quantize = "nf4" (any device) or "none"'
        )
    capability = torch.cuda.get_device_capability(0)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f'model.quantize = "fp8" needs a GPU with FP8 matmuls (CUDA compute capability 8.9 or higher), and '
            f'{torch.cuda.get_device_name(0)} has {capability[0]}.{capability[1]}; use model.quantize = "nf4" '
            'or "none"'
        )


def linear_shapes(model_config: PretrainedConfig) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of one decoder layer's linear weights, read off a meta-device layer."""
    from pipetune.model.shapes import one_layer_model

    known = _LINEAR_SHAPES.get(id(model_config))
    if known is not None and known[0] is model_config:  # a plan asks once per layout (~15 ms a layer to build)
        return list(known[1])
    layer = one_layer_model(model_config).model.layers[0]
    shapes = [
        (name, module.out_features, module.in_features)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    ]
    _LINEAR_SHAPES[id(model_config)] = (model_config, shapes)
    return list(shapes)


_LINEAR_SHAPES: dict[int, tuple[PretrainedConfig, list[tuple[str, int, int]]]] = {}


def stored_bytes(rows: int, columns: int, method: str, element: int) -> float:
    """Bytes one linear weight of rows x columns takes when stored with `method` (`element`: model.dtype's size)."""
    numel = rows * columns
    if method == "nf4":  # 4-bit codes, an int8 scale per block, a model.dtype factor per group of scales
        return numel / 2 + numel / NF4_BLOCK + element * numel / NF4_BLOCK / nf4_scaler_block(numel)
    if method == "fp8":
        return numel + 4 * rows
    return numel * element
