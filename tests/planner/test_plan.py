"""`pipetune plan` and `parallel.strategy = "auto"`: layouts from the model config alone, on a CPU, in seconds."""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from pipetune.cli import main
from pipetune.config import ConfigError, ParallelConfig, load_config, validate, validate_against_model
from pipetune.model.shapes import resolve_model
from pipetune.parallel.memory import GB, HOST_SHARE, MARGIN
from pipetune.planner.plan import format_plan, make_plan, resolve_auto
from pipetune.preflight import linear_layer_names
from tests.conftest import REPO, run_cli, tiny_config

QWEN3_4B = REPO / "configs" / "bench-qwen3-4b.toml"
QWEN25_72B = REPO / "configs" / "bench-qwen2.5-72b.toml"


def _summary(plan) -> list[tuple]:
    return [(p.layout, p.peaks, p.checkpointed, p.tokens_per_sec) for p in plan.predictions]


@pytest.mark.parametrize("path", [QWEN3_4B, QWEN25_72B])
def test_plan_of_a_builtin_shape_is_deterministic_and_lists_only_valid_layouts(path: Path) -> None:
    config = load_config(path)
    plan = make_plan(config, gpus=2)
    assert plan.predictions and plan.pick is not None
    if path == QWEN3_4B:  # the same inputs, the same plan (one shape is enough to tell)
        assert _summary(make_plan(config, gpus=2)) == _summary(plan)
    resolved = resolve_model(config.model)
    names = linear_layer_names(resolved)
    strategies = set()
    tensor_parallel = "tp" in {f.name for f in dataclasses.fields(ParallelConfig)}
    for prediction in plan.predictions:
        variant = prediction.layout.apply(config)
        validate(variant, 2)  # raises if the trainer would refuse it
        heads = (resolved.config.num_attention_heads, resolved.config.num_key_value_heads)
        validate_against_model(variant, resolved.config.num_hidden_layers, names, *heads[: 2 if tensor_parallel else 0])
        assert variant.train.batch_size * variant.parallel.dp * variant.train.grad_accum == 16  # the same batch
        strategies.add(prediction.layout.strategy)
    assert strategies == {"pp", "ddp", "fsdp"} | ({"tp"} if tensor_parallel else set())
    text = format_plan(plan)
    assert text.splitlines()[-1].startswith(f"pick: {plan.pick.layout.describe()}")


def test_layouts_over_the_gpu_memory_are_marked_and_never_picked() -> None:
    config = load_config(QWEN3_4B)
    plan = make_plan(config, gpus=2, budget=20 * GB)
    over = [p for p in plan.predictions if max(p.peaks) > 20 * GB]
    assert over and all(not p.fits for p in over)
    assert all(p.fits == (max(p.peaks) + MARGIN * 20 * GB <= 20 * GB) for p in plan.predictions)
    assert plan.pick is not None and max(plan.pick.peaks) <= (1 - MARGIN) * 20 * GB
    fitting = [p.tokens_per_sec for p in plan.predictions if p.fits]
    assert fitting == sorted(fitting, reverse=True) and plan.pick.tokens_per_sec == fitting[0]
    lines = format_plan(plan, top=None).splitlines()
    assert sum("no: " in line for line in lines) == len(plan.predictions) - len(fitting)


def test_packed_rows_attend_less_and_hold_the_same_memory() -> None:
    """A packed row's attention covers its samples only (attention_share, from the data: data/inspect): every
    layout is predicted faster, by no more than attention's part of the step, at the same peak memory."""
    config = load_config(QWEN3_4B, ["data.max_length=8192", "train.batch_size=4"])
    whole, packed = make_plan(config, gpus=2), make_plan(config, gpus=2, attention_share=0.25)
    packed_of = {p.layout: p for p in packed.predictions}
    assert set(packed_of) == {p.layout for p in whole.predictions}
    for a in whole.predictions:
        b = packed_of[a.layout]
        assert b.peaks == a.peaks
        assert a.tokens_per_sec < b.tokens_per_sec < 2 * a.tokens_per_sec
    assert "packed rows: attention 25% of a whole row's" in format_plan(packed).splitlines()[0]
    assert "packed rows" not in format_plan(whole).splitlines()[0]


def test_an_nf4_base_pays_one_dequantization_per_layer_call() -> None:
    """The 72B shape on one GPU in 8 microbatches of 2: NF4 adds, to the same layout in bf16, one dequantization of
    a layer's weights per layer call (80 layers x 8 microbatches x forward and backward), no more (the head and
    the loss are not quantized)."""
    from pipetune.model.quantize import linear_shapes
    from pipetune.planner.speed import GpuRates

    config = load_config(QWEN25_72B)
    steps = {}
    for method in ("none", "nf4"):
        config.model.quantize = method
        layouts = make_plan(config, gpus=1).predictions
        (row,) = [
            p for p in layouts if (p.layout.microbatch, p.layout.grad_accum, p.layout.checkpointing) == (2, 8, False)
        ]
        steps[method] = row.step_seconds
    weights = sum(rows * columns for _, rows, columns in linear_shapes(resolve_model(config.model).config))
    assert steps["nf4"] - steps["none"] == pytest.approx(80 * 8 * 2 * weights * GpuRates().nf4_weight_seconds)


def test_lora_dropout_pays_per_masked_element_and_a_shared_mask_once() -> None:
    """Qwen3-4B on one GPU, one microbatch of 16 x 512: dropout adds, to the same layout without it, its masks'
    elements (the 7 adapted linears' input widths, 26,624 a token; one mask for q/k/v and one for gate/up under
    lora.shared_dropout: 18,944) per token of every layer call, forward and backward, nothing to the head."""
    from pipetune.planner.speed import GpuRates

    steps = {}
    for name, overrides in (
        ("none", ["lora.dropout=0.0"]),
        ("masks", []),
        ("shared", ["lora.shared_dropout=true"]),
    ):
        layouts = make_plan(load_config(QWEN3_4B, overrides), gpus=1).predictions
        (row,) = [
            p for p in layouts if (p.layout.microbatch, p.layout.grad_accum, p.layout.checkpointing) == (16, 1, False)
        ]
        steps[name] = row.step_seconds
    rates = GpuRates()
    per_element = 36 * 16 * 512 * rates.dropout_seconds * (1 + rates.backward_other)  # layers x tokens a step
    assert steps["masks"] - steps["none"] == pytest.approx(26_624 * per_element)
    assert steps["shared"] - steps["none"] == pytest.approx(18_944 * per_element)


def test_an_fp8_base_speeds_the_matmuls_and_pays_its_quantization_outside_compiled_layers() -> None:
    """A Qwen3-4B layer on 16 x 512 tokens with an FP8 base: its matmul time divided by fp8_matmul_speedup,
    forward and backward; eagerly also its quantization, per element of its linears' 57,344 input and output
    widths a token (a compiled layer fuses it)."""
    from pipetune.model.split import estimate_costs
    from pipetune.planner.plan import _shape
    from pipetune.planner.speed import GpuRates, LayerWork, layer_seconds

    config = load_config(QWEN3_4B, ['model.quantize="fp8"'])
    resolved = resolve_model(config.model)
    assert _shape(config, resolved, 1).widths == 57_344
    costs, tokens, rates = estimate_costs(resolved.config, 512), 16 * 512, GpuRates()
    bf16 = LayerWork(costs, 2560, tokens, 16, 512)
    fp8 = dataclasses.replace(bf16, fp8_elements=57_344)
    saved = 2 * tokens * (costs.layer - costs.attention) / 2 / rates.matmul_flops * (1 - 1 / rates.fp8_matmul_speedup)
    for mode, quantized in (("compiled", 0.0), ("eager", tokens * 57_344 * rates.fp8_element_seconds["eager"])):
        before, after = (sum(layer_seconds(work, rates, mode)) for work in (bf16, fp8))
        assert before - after == pytest.approx(saved - quantized)
    # The plan gives its layers the FP8 elements; a calibration files their times apart, and times them only
    # where FP8 matmuls run (not on a CPU: the model's time stands).
    from pipetune.planner.calibrate import can_time

    work = make_plan(config, gpus=1).predictions[0].work
    assert work.fp8_elements == 57_344 and work.key("compiled").endswith(" fp8")
    assert not can_time(work, torch.device("cpu")) and can_time(bf16, torch.device("cpu"))


def test_nothing_fits_names_the_smallest_change_that_would() -> None:
    config = load_config(QWEN25_72B)  # 145 GB of weights on one 151 GB GPU
    config.parallel.strategy = "auto"
    with pytest.raises(ConfigError) as refused:
        resolve_auto(config, gpus=1)
    message = str(refused.value)
    assert message.startswith("parallel.strategy = 'auto': nothing fits 1 GPU of 151 GB"), message
    # The closest: every layer checkpointed (some inputs in host memory, as much as half this machine's holds).
    assert re.search(r"checkpointing all(, \d+ offloaded)?\), which needs", message), message
    assert "it would fit with 2 GPUs (pp=2" in message, message


def test_plan_arguments_and_an_unresolved_auto_are_refused(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--config", str(QWEN3_4B), "--gpus", "0"]) == 2
    assert main(["plan", "--config", str(QWEN3_4B), "--gpu-memory", "-1"]) == 2
    assert main(["plan", "--config", str(QWEN3_4B), "--host-memory", "nan"]) == 2
    if not torch.cuda.is_available():
        assert main(["plan", "--config", str(QWEN3_4B), "--calibrate"]) == 2
    errors = capsys.readouterr().err
    assert "--gpus 0 must be at least 1" in errors and "--gpu-memory -1.0 must be a positive" in errors, errors
    assert "--host-memory nan must be a finite number of GB, 0 or more" in errors, errors
    config = load_config(QWEN3_4B, ['parallel.strategy="auto"'])
    with pytest.raises(ConfigError, match="'auto' is chosen by pipetune train and pipetune bench"):
        validate(config, 2)


@pytest.mark.slow
def test_strategy_auto_runs_the_plans_pick(tmp_path: Path) -> None:
    """On the demo, "auto" picks a layout for 2 processes, says which and why, and trains with it."""
    out = tmp_path / "auto"
    result = run_cli(
        "train",
        "--config",
        str(REPO / "src" / "pipetune" / "configs" / "demo.toml"),
        "--set",
        'parallel.strategy="auto"',
        "--set",
        "train.max_steps=1",
        "--set",
        "data.synthetic_train=16",
        "--set",
        "data.synthetic_validation=0",
        "--set",
        f'output.dir="{out}"',
        "--nproc",
        "2",
        "--quiet",
    )
    said = [line for line in result.stdout.splitlines() if line.startswith("pipetune: parallel.strategy = auto: ")]
    assert len(said) == 1 and "the fastest of" in said[0], result.stdout
    ran = load_config(out / "config.toml")
    assert ran.parallel.strategy in ("pp", "ddp", "fsdp") and ran.parallel.pp * ran.parallel.dp == 2
    assert f"pick: {ran.parallel.strategy}" in said[0] or f"pick: pp={ran.parallel.pp}" in said[0]
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1] and rows[0]["strategy"] == ran.parallel.strategy


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5"])
def test_gpu_memory_must_be_a_positive_finite_number(value: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--config", str(QWEN3_4B), "--gpu-memory", value]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"pipetune: error: --gpu-memory {float(value)} must be a positive, finite number (GB per GPU, e.g. 141)\n"
    )


def test_without_a_gpu_the_plan_says_whose_predictions_and_what_auto_runs_here(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine without GPUs the figures are an H200's: `plan` and `parallel.strategy = "auto"` say so, and
    what auto runs on this machine (the pick, as CPU processes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["plan", "--config", "demo"]) == 0
    out = capsys.readouterr().out
    pick = re.search(r"^pick: (.+?), \d+ x \d+", out, re.MULTILINE).group(1)
    note = out.splitlines()[-1]
    assert note.startswith("no GPU found here: these predictions are for 2 H200 GPUs (151 GB each), not for"), note
    assert f'parallel.strategy = "auto" runs {pick} (' in note and "as 2 CPU processes" in note, note

    config = load_config("demo", ['parallel.strategy="auto"'])
    assert pick.startswith(resolve_auto(config, 2).parallel.strategy)  # "ddp dp=2", "pp=2 1f1b", ...
    said = capsys.readouterr().out
    assert said.startswith("pipetune: parallel.strategy = auto: no GPU found here, so this is the plan for 2 H200")
    assert f"pick: {pick}," in said

    # A plan for another host (--host-memory) is not the one "auto" runs here: the line plans "auto"'s own.
    import pipetune.planner.plan as plan_module

    here = make_plan(config, 2)
    planned = []
    monkeypatch.setattr(plan_module, "auto_plan", lambda c, gpus: planned.append(gpus) or here)
    assert plan_module.no_gpu_line(config, here) and planned == []
    assert plan_module.no_gpu_line(config, make_plan(config, 2, host_memory=1 * GB)) and planned == [2]


def test_a_plan_that_offloads_says_so_and_is_listed_beside_all_recomputed(tmp_path: Path) -> None:
    """One long row on a GPU where every layer recomputed just misses and 1 GB of host memory takes inputs: "auto"
    recomputes every layer too but offloads some inputs, and fits. The plan lists both and says how many inputs
    are offloaded (it had listed "all" once, the offloading plan dropped as the same: at 400,000 tokens of
    Qwen3-8B with an NF4 base it said nothing fits one H200)."""
    one_row = ["parallel.n_microbatches=1", "train.batch_size=1", "train.grad_accum=1", "train.fused_loss=true"]
    config = tiny_config(tmp_path, "parallel.pp=1", "data.max_length=65536", *one_row)

    def rows(budget: float, host: float = 1e9) -> dict:
        plan = make_plan(config, 1, budget=budget, search=False, host_memory=host / HOST_SHARE)  # host: a rank's
        return {p.layout.checkpointing: p for p in plan.predictions}

    budget = max(rows(1e12)[True].peaks) / (1 - MARGIN) * 0.98  # every layer recomputed: 2% short
    recomputed, auto = rows(budget)[True], rows(budget)["auto"]
    assert recomputed.checkpointing() == "all" and not recomputed.fits
    offloaded = sum(map(sum, auto.offloaded))
    assert auto.checkpointing() == f"all, {offloaded} offloaded" and offloaded > 0 and auto.fits
    # The host memory is the training machine's, as given: none, and no layout offloads ("auto" is "all" then).
    assert not any(sum(map(sum, p.offloaded)) for p in rows(budget, host=0.0).values())


def test_auto_picks_nothing_preflight_refuses_and_keeps_layouts_without_tp() -> None:
    """A layout whose frozen weights take more than 90% of a rank's memory is not a fit (preflight's
    check_weights_fit refuses it before any activation); parallel.sequence_parallel, a tensor-parallel setting,
    does not keep "auto" from layouts without tensor parallelism."""
    from pipetune.model.split import run_split
    from pipetune.parallel.memory import check_weights_fit, rank_weight_bytes

    small = ["data.max_length=512", "train.batch_size=1", "parallel.n_microbatches=1", "parallel.pp=1"]
    config = load_config(QWEN25_72B, [*small, 'parallel.strategy="single"', "lora.r=4", "train.grad_accum=1"])
    model_config = resolve_model(config.model).config
    ((layers, root),) = rank_weight_bytes(config, model_config, run_split(config, model_config)[1])
    config.train.memory_gb = (layers + root) / 0.91 / GB  # the weights alone: 91% of the memory
    config.parallel.strategy = "auto"
    try:
        picked = resolve_auto(config, 1)
    except ConfigError:
        picked = None
    if picked is not None:  # whatever "auto" picks, preflight lets through
        check_weights_fit(picked, model_config, run_split(picked, model_config)[1])

    sequence_parallel = load_config(QWEN3_4B, ["parallel.tp=2", "parallel.pp=1", 'parallel.strategy="tp"'])
    sequence_parallel.parallel.sequence_parallel = True
    strategies = {p.layout.strategy for p in make_plan(sequence_parallel, 2).predictions}
    assert {"tp", "ddp", "pp"} <= strategies, strategies
