"""Speed switches: every "auto" resolved in one place (pipetune/switches.py), never into a combination validation
refuses; forced values kept; a layout fitted to the GPUs there are; MFU's peak from the GPU's name."""

from __future__ import annotations

import pytest
import torch

from pipetune.config import ConfigError, load_config, validate
from pipetune.planner.plan import fit_to_gpus, layout_asked
from pipetune.switches import AUTO, Hardware, resolve, unresolved

GPU, CPU = Hardware(True, "NVIDIA H100 80GB HBM3", (9, 0)), Hardware(False)
T4, P100 = Hardware(True, "Tesla T4", (7, 5)), Hardware(True, "Tesla P100-PCIE-16GB", (6, 0))
WHOLE = torch.full((8,), 7371)  # whole meetings' tokens a sample
SHORT = torch.full((8,), 550)


def _config(name: str = "qwen3-4b-meetings", *overrides: str):
    return load_config(name, ["model.name=qwen3-4b", "model.init=random", "data.source=synthetic", *overrides])


def test_the_meetings_config_on_one_gpu_resolves_to_the_measured_fast_setting() -> None:
    one_gpu = fit_to_gpus(_config(), gpus=1, explicit=False)
    speed = resolve(one_gpu, GPU, WHOLE)
    c = speed.config
    assert (c.parallel.strategy, c.parallel.pp, c.train.batch_size) == ("single", 1, 8)  # the same rows a step
    assert (c.lora.fast_path, c.lora.adapter_in_matmul, c.train.compile, c.train.fused_loss) == (True,) * 4
    assert (c.train.layers_per_graph, c.train.packed_attention, c.train.cuda_graphs) == (6, "documents", False)
    assert c.parallel.n_microbatches == 8  # one 16,384-token row a microbatch
    assert unresolved(c) == ["train.activation_checkpointing", "train.mlp_chunk"]  # each rank's own rules
    line = speed.line("checkpointing: stage 0: 0 of 36 layers")
    assert line.startswith("speed: fast LoRA path on (GPU), adapters in the matmuls on (plain bfloat16 base")
    assert "documents attention kernel (samples 7,371 tokens on average >= 4,096)" in line
    assert "CUDA graphs off (the documents kernel reads the host)" in line and line.endswith("0 of 36 layers")
    # short samples keep flex, and then CUDA graphs where they pay off; a pipeline keeps flex (not measured there)
    assert resolve(one_gpu, GPU, SHORT).config.train.packed_attention == "flex"
    assert resolve(_config(), GPU, WHOLE).config.train.packed_attention == "flex"
    assert resolve(one_gpu, GPU, SHORT).config.train.cuda_graphs is True


def test_the_seed_job_on_one_gpu_takes_whole_batches_a_microbatch() -> None:
    c = resolve(fit_to_gpus(_config("qwen3-4b-ami"), 1, explicit=False), GPU).config
    assert (c.parallel.n_microbatches, c.microbatch_size, c.train.grad_accum) == (1, 8, 2)  # 8 x 512 tokens
    # in its own pipeline the seed's 8 microbatches stay (set in the file); "auto" there: 2,048 tokens a microbatch
    assert resolve(_config("qwen3-4b-ami"), GPU).config.parallel.n_microbatches == 8
    piped = resolve(_config("qwen3-4b-ami", 'parallel.n_microbatches="auto"'), GPU).config
    assert (piped.parallel.n_microbatches, piped.microbatch_size) == (2, 4)


def test_the_cpu_runs_the_plain_path() -> None:
    speed = resolve(_config(), CPU, WHOLE)
    c = speed.config
    assert not any((c.lora.fast_path, c.lora.adapter_in_matmul, c.train.compile, c.train.fused_loss))
    assert (c.train.cuda_graphs, c.train.layers_per_graph) == (False, 1)
    assert speed.values()["train.compile"] is False and "CPU" in speed.line()
    # checkpointing is planned on a CPU too: for each rank's share of the host's memory, or train.memory_gb
    why = {choice.key: choice.why for choice in speed.choices}["train.activation_checkpointing"]
    assert c.train.activation_checkpointing == AUTO and why.endswith("on a CPU, its share of the host's")
    assert resolve(_config("demo", "train.memory_gb=2"), CPU).config.train.activation_checkpointing == AUTO
    # the fused loss where a microbatch's float32 logits reach 1 GB: SmolLM2's whole meetings, not its 512-token rows
    meetings = resolve(_config("demo-smollm2-meetings"), CPU, vocab=49152)
    assert meetings.config.train.fused_loss is True and "1.6 GB of logits a microbatch >= 1 GB" in meetings.line()
    assert resolve(_config("demo-smollm2"), CPU, vocab=49152).config.train.fused_loss is False


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["parallel.pp=1", "parallel.tp=2", 'parallel.strategy="tp"'],
        ["parallel.pp=1", "parallel.dp=2", 'parallel.strategy="fsdp"'],
        ['model.quantize="nf4"'],
        ['parallel.schedule="zbv"', "parallel.stages_per_rank=2"],
        ['parallel.schedule="interleaved_zero_bubble"', "parallel.stages_per_rank=2"],
        ["train.keep_attention=true", "data.packing=false"],
        ["lora.shared_dropout=true"],
        ['model.dtype="float32"', 'parallel.schedule="interleaved_1f1b"', "parallel.stages_per_rank=3"],
    ],
)
def test_auto_never_resolves_into_a_refusal(layout: list[str]) -> None:
    """Where a switch cannot work (tp, FSDP, a quantized base, a split backward, eager kept attention, the CPU),
    "auto" resolves it off; validation then accepts the run on a GPU and on a CPU alike."""
    for hardware in (GPU, CPU, T4, P100):
        for lengths in (WHOLE, SHORT, None):
            config = _config("qwen3-4b-meetings", *layout)
            resolved = resolve(config, hardware, lengths).config
            validate(resolved, resolved.parallel.world_size)
    tp = resolve(_config("qwen3-4b-meetings", *layout), GPU, WHOLE)
    if "parallel.tp=2" in layout or 'parallel.strategy="fsdp"' in layout:
        assert tp.config.lora.adapter_in_matmul is False and tp.config.train.layers_per_graph == 1
    if 'parallel.schedule="zbv"' in layout:
        assert tp.config.train.compile is False and tp.config.train.activation_checkpointing is False


def test_gpus_before_ampere_keep_what_they_cannot_run_off() -> None:
    """Below compute capability 8.0 there is no bfloat16 in hardware: inductor skips bfloat16 graphs (after tracing
    them) and SDPA has neither flash nor cuDNN attention, which the documents kernel runs; below 7.0 no Triton."""
    one_gpu = fit_to_gpus(_config(), gpus=1, explicit=False)
    old = resolve(one_gpu, T4, WHOLE)
    assert (old.config.train.compile, old.config.train.packed_attention) == (False, "flex")
    line = old.line()
    assert "compile off (Tesla T4, compute capability 7.5: inductor compiles bfloat16 from 8.0)" in line
    assert "flex attention kernel (Tesla T4, compute capability 7.5: no flash or cuDNN attention" in line
    half = fit_to_gpus(_config("qwen3-4b-meetings", 'model.dtype="float16"'), gpus=1, explicit=False)
    assert resolve(half, T4, WHOLE).config.train.compile is True  # float16: Triton compiles it on a T4
    assert "Triton needs 7.0 or higher" in resolve(half, P100, WHOLE).line()
    # a GPU whose capability is not known (the planned GPUs of `pipetune plan`) keeps the measured rules
    assert resolve(one_gpu, Hardware(True, "the planned GPU"), WHOLE).config.train.packed_attention == "documents"


def test_forced_values_stay_and_their_refusals_stay() -> None:
    forced = resolve(_config("qwen3-4b-meetings", "train.compile=false", "lora.adapter_in_matmul=false"), GPU, WHOLE)
    assert (forced.config.train.compile, forced.config.lora.adapter_in_matmul) == (False, False)
    assert "compile off (set)" in forced.line() and forced.config.train.layers_per_graph == 1
    # a forced switch that needs another turns that one on where it is "auto", and is refused where it is forced off
    needs = resolve(_config("demo", "lora.adapter_in_matmul=true"), CPU).config
    assert needs.lora.fast_path is True
    refused = _config("demo", "lora.adapter_in_matmul=true", "lora.fast_path=false")
    with pytest.raises(ConfigError, match="set lora.fast_path = true, or set lora.adapter_in_matmul = false"):
        validate(resolve(refused, GPU).config, 2)
    # forced CUDA graphs keep "auto" packed attention off the documents kernel, which validation refuses with them
    graphs = fit_to_gpus(_config("qwen3-4b-meetings", "train.cuda_graphs=true"), gpus=1, explicit=False)
    resolved = resolve(graphs, GPU, WHOLE).config
    assert (resolved.train.packed_attention, resolved.train.cuda_graphs) == ("flex", True)
    validate(resolved, resolved.parallel.world_size)


def test_the_last_layer_runs_on_the_loss_rows_where_the_loss_reads_a_small_share() -> None:
    """train.head_rows: "auto" on with the fused loss where the loss reads at most a third of a row, of a family
    whose layers norm only their inputs, without tp or FSDP; forced on, it takes the fused loss along, and is
    refused where it cannot run."""
    whole = resolve(fit_to_gpus(_config(), 1, explicit=False), GPU, WHOLE)
    assert whole.config.train.head_rows is True and whole.values()["train.head_rows"] is True
    assert "last layer on the loss's rows (the loss reads up to 513 of 16,384 tokens a row)" in whole.line()
    seed = resolve(fit_to_gpus(_config("qwen3-4b-ami"), 1, explicit=False), GPU)  # up to 257 of 512
    assert (
        seed.config.train.head_rows is False
        and "last layer on every row (the loss reads up to 257 of 512" in seed.line()
    )
    off = {
        "parallel.tp = 2 splits the layer": resolve(
            _config("qwen3-4b-meetings", "parallel.pp=1", "parallel.tp=2"), GPU
        ),
        "FSDP gathers": resolve(
            _config("qwen3-4b-meetings", "parallel.pp=1", "parallel.dp=2", 'parallel.strategy="fsdp"'), GPU
        ),
        "norm their outputs": resolve(_config(), GPU, WHOLE, pre_norm=False),  # Gemma 3's layers
        "no fused loss": resolve(_config("demo-smollm2"), CPU, vocab=49152),
    }
    for why, speed in off.items():
        assert speed.config.train.head_rows is False and why in {c.key: c.why for c in speed.choices}["train.head_rows"]
    assert "loss's rows" not in off["no fused loss"].line()  # nothing to say where the loss is the plain one
    forced = resolve(_config("demo", "train.head_rows=true"), CPU)
    assert forced.config.train.fused_loss is True and "last layer on the loss's rows (set)" in forced.line()
    refusals = {
        "set train.fused_loss = true, or set train.head_rows = false": ["train.fused_loss=false"],
        "set parallel.tp = 1, or set train.head_rows = false": ["parallel.pp=1", "parallel.tp=2"],
    }
    for message, extra in refusals.items():
        with pytest.raises(ConfigError, match=message):
            validate(resolve(_config("demo", "train.head_rows=true", *extra), GPU).config, 2)
    from pipetune.model.families import FAMILIES
    from pipetune.preflight import check_head_rows

    gemma3 = next(family for family in FAMILIES if not family.pre_norm_layers)
    with pytest.raises(ConfigError, match="Gemma 3's layers norm .* set train.head_rows = false"):
        check_head_rows(forced.config, gemma3)
    check_head_rows(forced.config, FAMILIES[0])


def test_fewer_gpus_than_the_layout_fit_it_or_refuse_in_one_line() -> None:
    config = _config()
    assert layout_asked(["train.lr=1e-4", " parallel.pp =2"]) and not layout_asked(["model.name=qwen3-4b"])
    assert fit_to_gpus(config, gpus=2, explicit=False) is config  # enough GPUs: as it is
    with pytest.raises(ConfigError, match=r"is 2 processes, one a GPU, but this machine has 1: use --nproc 2"):
        fit_to_gpus(config, gpus=1, explicit=True)  # asked for on the command line: kept, or the fix named
    four = _config("qwen3-4b-meetings", "parallel.dp=2", "train.batch_size=4")
    single = fit_to_gpus(four, gpus=1, explicit=False)
    assert (single.parallel.world_size, single.train.batch_size, single.parallel.n_microbatches) == (1, 8, AUTO)


def test_mfu_counts_the_datasheet_peak_of_the_gpu_by_its_name() -> None:
    from pipetune.bench import spec_peak_tflops

    assert spec_peak_tflops("NVIDIA H100 80GB HBM3") == spec_peak_tflops("NVIDIA H200") == 989.4
    assert spec_peak_tflops("NVIDIA H100 PCIe") == 756.5 and spec_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert spec_peak_tflops("Some GPU") == 989.4  # unknown: an H100 / H200 SXM's (--peak-tflops to set it)
