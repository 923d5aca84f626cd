"""model.quantize: stages read their own weights and hold what a whole quantized model holds; FP8 math; refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from pipetune.config import ConfigError, ModelConfig
from pipetune.model.load import build_model
from pipetune.model.quantize import (
    FP8,
    base_linears,
    fp8_quantize,
    nf4_dequantize,
    quantize_linears,
    torchao_nf4,
    weight_writers,
)
from pipetune.model.shapes import resolve_model
from pipetune.model.split import split_layers
from pipetune.preflight import preflight
from tests.conftest import tiny_config
from tests.model.test_load import CPU, TINY, write_checkpoint


def _stored(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a model stores, a quantized weight by its parts (NF4 codes and scales; FP8 bytes)."""
    stored = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # a tied lm_head under its own name too
        if type(param).__name__ == "NF4Tensor":
            for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
                stored[f"{name}:{part}"] = getattr(param, part)
        else:
            stored[name] = param.view(torch.uint8) if param.dtype == FP8 else param
    stored.update(model.named_buffers())
    return stored


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_stages_load_per_stage_from_safetensors(tmp_path: Path, tied: bool) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt", Qwen3Config(**{**TINY, "tie_word_embeddings": tied}))
    assert (checkpoint / "model.safetensors.index.json").is_file()  # really sharded
    resolved = resolve_model(ModelConfig(name=str(checkpoint)))
    reference, _ = build_model(resolved, torch.float32, CPU)
    for method, dtype, error in (("nf4", torch.float32, 0.12), ("fp8", torch.bfloat16, 0.04)):
        whole, _ = build_model(resolved, dtype, CPU, quantize=method)
        expected = _stored(whole)
        for name, linear in base_linears(whole):
            values = (
                linear.weight.get_original_weight() if method == "nf4" else linear.weight.float() * linear.weight_scale
            )
            original = reference.get_parameter(f"{name}.weight")
            # Quantized, not copied; near the checkpoint (NF4: ~10% relative RMS error on normal weights; FP8 ~2%).
            assert float((values.float() - original).norm() / original.norm()) < error, (method, name)
        seen = set()
        for index, layers in enumerate(split_layers(4, 2)):
            stage, stats = build_model(resolved, dtype, CPU, layers, first=index == 0, last=index == 1, quantize=method)
            assert stats.tensors == sum(1 for _ in stage.parameters())  # its own tensors, each read once
            for name, tensor in _stored(stage).items():
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=f"{method} {name}")
                seen.add(name)
        assert seen == set(expected)  # together the stages hold the whole quantized model


def test_nf4_linear_is_torchaos_linear_with_its_own_dequantization() -> None:
    """pipetune dequantizes NF4 itself (compiled on GPUs): the same values as torchao's, and through the linear
    the same output and input gradient as torchao's own F.linear on an NF4Tensor."""
    _, to_nf4 = torchao_nf4()
    torch.manual_seed(0)
    weight = to_nf4(torch.randn(48, 128, dtype=torch.bfloat16), 64, 32)
    assert torch.equal(nf4_dequantize(weight, torch.bfloat16), weight.get_original_weight())
    linear = torch.nn.Linear(128, 48, bias=True, dtype=torch.bfloat16, device="meta")
    quantize_linears(torch.nn.ModuleDict({"layers": torch.nn.ModuleList([linear])}), "nf4")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.bias = torch.nn.Parameter(torch.randn(48, dtype=torch.bfloat16))
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    ours = linear(x)
    ours.sum().backward()
    expected_x = x.detach().clone().requires_grad_()
    expected = torch.nn.functional.linear(expected_x, weight, linear.bias)
    expected.sum().backward()
    assert torch.equal(ours, expected) and torch.equal(x.grad, expected_x.grad)


def test_nf4_dequantization_runs_without_grad_in_both_directions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled dequantization (GPUs) guards on grad mode: forward and backward must call it in the same one,
    or each weight shape compiles twice (past dynamo's limit of 8 recompilations at Qwen3-4B's 5 shapes)."""
    from pipetune.model import quantize

    modes = []
    values = quantize._nf4_values
    monkeypatch.setattr(quantize, "_nf4_values", lambda *parts: modes.append(torch.is_grad_enabled()) or values(*parts))
    _, to_nf4 = torchao_nf4()
    weight = to_nf4(torch.randn(48, 128), 64, 32)
    x = torch.randn(3, 128, requires_grad=True)
    quantize.nf4_matmul(x, *quantize._nf4_parts(weight), False).sum().backward()
    assert modes == [False, False] and x.grad is not None


def test_fp8_linear_runs_both_matmuls_in_fp8_against_its_dequantized_weight() -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        linear = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16))
    # quantize_linears picks the decoder layers' linears: give this one such a name.
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": linear})
    quantize_linears(model, "fp8")
    model.to_empty(device=CPU)
    values, scale = fp8_quantize(torch.randn(128, 256, generator=generator))
    layer = linear[0]
    layer.weight.copy_(values)
    layer.weight_scale.copy_(scale)
    assert layer.weight.element_size() == 1 and not layer.weight.requires_grad

    x = torch.randn(2, 48, 256, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().square().sum().backward()
    exact_x = x.detach().float().requires_grad_()
    exact = exact_x @ (values.float() * scale).t()
    exact.square().sum().backward()

    # The weight is exactly its FP8 values times the row scales, so the errors are those of rounding x (forward)
    # and the scaled output gradient (backward) to e4m3: 3 mantissa bits, a relative error of at most 2^-4 per
    # element and ~2^-4 / sqrt(3) = 3.6% RMS for uniformly placed values; bf16 output adds 2^-9.
    for got, want in ((out, exact), (x.grad, exact_x.grad)):
        relative = float((got.float() - want).norm() / want.norm())
        assert 0 < relative < 0.05, relative
    assert layer.weight.grad is None


def test_fp8_quantization_compiled_for_gpus_gives_the_eager_values() -> None:
    """An eager FP8 linear on a GPU quantizes activations and gradients through compiled functions (one fused
    kernel each instead of ~6 over float32 copies); compiled here, on a CPU, they give the eager values."""
    from pipetune.model.quantize import _fp8_quantizers, _fp8_quantizers_compiled, _scaled_fp8_quantize

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator).to(torch.bfloat16)
    columns = torch.rand(1, 256, generator=generator) + 0.5
    _, scaled = _fp8_quantizers_compiled()  # the gradient's: fp8_quantize (the activation's) inside, compiled
    got, want = scaled(x, columns), _scaled_fp8_quantize(x, columns)
    assert got[0].dtype == want[0].dtype == FP8
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    assert _fp8_quantizers(x) == (fp8_quantize, _scaled_fp8_quantize)  # a CPU tensor: the plain ones


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (['model.quantize="int4"'], 2, r"model.quantize = 'int4' is unknown; use one of none, nf4, fp8"),
        (
            ['model.quantize="fp8"'],
            2,
            r'model.quantize = "fp8" runs FP8 matmuls that write bfloat16, but model.dtype = \'float32\': set '
            r'model.dtype = "bfloat16", or use model.quantize = "nf4"',
        ),
        (
            ['model.quantize="fp8"', 'model.dtype="bfloat16"'],
            2,
            r'model.quantize = "fp8" needs a GPU with FP8 matmuls .* and this machine has no CUDA GPU; use '
            r'model.quantize = "nf4" \(any device\) or "none"',
        ),
        (
            ['model.quantize="nf4"', 'parallel.strategy="fsdp"', "parallel.pp=1", "parallel.dp=3"],
            3,
            r'model.quantize = "nf4" with FSDP over parallel.dp = 3: self_attn.q_proj \(256 x 256, 4 groups of NF4 '
            r"scales\) does not split into 3 equal row blocks of whole groups; use a parallel.dp that divides 4",
        ),
        (
            ['model.quantize="nf4"', 'parallel.strategy="tp"', "parallel.pp=1", "parallel.tp=2"],
            2,
            r"model.quantize = 'nf4' with parallel.tp = 2: quantized weights are not split over tensor-parallel ranks",
        ),
    ],
)
def test_quantize_settings_a_run_cannot_serve_are_refused_before_any_weight(
    tmp_path: Path, overrides: list[str], world_size: int, message: str
) -> None:
    if torch.cuda.is_available() and "no CUDA GPU" in message:
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=message):
        preflight(tiny_config(tmp_path, *overrides), world_size)


def test_an_fp8_run_without_compile_is_told_that_fp8_pays_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Where FP8 matmuls run (here: the device check passed over), an eager FP8 run gets one note before it starts:
    measured eagerly, FP8 was slower than bf16."""
    import pipetune.model.quantize as quantize

    monkeypatch.setattr(quantize, "_check_fp8_device", lambda: None)
    for compiled, told in ((False, True), (True, False)):
        overrides = ('model.quantize="fp8"', 'model.dtype="bfloat16"', f"train.compile={str(compiled).lower()}")
        preflight(tiny_config(tmp_path, *overrides), 2)
        said = capsys.readouterr().err
        assert ('model.quantize = "fp8" pays compiled' in said and "set train.compile = true" in said) == told, said


def test_a_compiled_nf4_layer_keeps_the_nf4_weight_for_backward_not_its_dequantized_copy() -> None:
    """Compiled, an NF4 linear is part of the layer's graph (fullgraph: no break around it) and keeps what eager
    keeps: the 4-bit weight, not a [rows, columns] dequantized copy per microbatch in flight (which is what ran
    the 72B shape out of memory)."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(256, 128, bias=False)])
    quantize_linears(model, "nf4")
    model.to_empty(device="cpu")
    (writer,) = weight_writers(model).values()
    writer(torch.randn(128, 256), slice(None))  # all rows: the weight is not sharded
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    x = torch.randn(4, 256, requires_grad=True)
    layer = torch.compile(model.layers[0], backend="aot_eager", fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    out.sum().backward()
    assert x.grad is not None and out.shape == (4, 128)
    assert not [t for t in saved if t.shape == (128, 256) and type(t) is torch.Tensor], [type(t) for t in saved]
