"""Tensor parallelism (parallel.tp) against the single process at the same effective batch, and its settings.

tp splits every row-wise product (o_proj, down_proj, row-wise adapters) into tp partial sums, so float32
results differ from one process's in the last bits: losses and gradient norms agree to ~1e-7, gradients to
~2e-6 relative (measured on this model). Adam's first steps divide each gradient element by its own magnitude,
which makes an element whose gradient is near zero sensitive to those bits: in the tp runs here one element of
11,008 (layer 1's up_proj lora_B) ends 1e-5 away (lr 1e-3), all others within 1e-7; in pp x tp with sequence
parallelism one of 4,096 (layer 1's q_proj lora_B) 6.8e-5 away, a relative L2 difference of 6.6e-4 for that
tensor alone. Adapters are therefore compared element by element (tests/parity.py). pp x tp runs in
tests/parallel/test_parity.py, dp x tp (as two torchrun nodes) in tests/parallel/test_multinode.py.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from pipetune.bench import strategy_config
from pipetune.config import Config, ConfigError, apply_override, validate
from pipetune.data.batching import tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.generate import load_finetuned, mean_token_loss
from pipetune.parallel.tp import SplitInputDropout
from pipetune.preflight import preflight, prepare
from tests.conftest import tiny_config
from tests.parallel.test_data_parallel import EFFECTIVE_16
from tests.parallel.test_fsdp import _metrics, _train
from tests.parity import adapter, assert_adapter_matches, assert_same_training, learning_rates

TP2 = ['parallel.strategy="tp"', "parallel.pp=1", "parallel.tp=2", "train.batch_size=8"]
TP2_RUN = [*TP2, "train.save_every=2", "train.eval_every=2", "data.synthetic_validation=6", "parallel.n_microbatches=1"]
"""The tp2 run: a checkpoint and a validation every 2 steps, over 6 meetings (the last validation batch of 8 is
mostly ignored rows), and each batch of 8 in one microbatch: a tp step pays the DTensor dispatch and all-reduces of
every split product once a microbatch (2.6-3.1 s a step in 4 microbatches, 1.0-1.4 s in one, on 2 cores), and
train.grad_accum = 2 still sums two backward passes into the split gradients."""


def assert_matches_single(run: Path, single: Path) -> None:
    """Loss and gradient norm of every step to 1e-5, adapters apart by rounding only (tests/parity.py)."""
    assert_same_training(run, single, steps=3)


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs."""
    return {"tp2": tiny_config(tmp / "tp2", *EFFECTIVE_16, *TP2_RUN)}


@pytest.mark.slow
def test_tensor_parallel_matches_single_process_and_resumes_in_one_process(
    single: Path, two_process_runs: Path, tmp_path: Path
) -> None:
    run = two_process_runs / "tp2"
    assert_matches_single(run, single)

    # The adapter gathered from the tp shards, loaded by PEFT in one process, gives the logits the split model
    # gave: its validation loss is the one the run logged.
    with open(run / "metrics.csv") as f:
        logged = {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"]}
    assert sorted(logged) == [0, 2, 3]  # before the first step, every 2 steps, and at the end
    config = tiny_config(run, *EFFECTIVE_16, *TP2_RUN)
    model, prepared = load_finetuned(config, run / "adapter", torch.device("cpu"))
    dataset = load_dataset(config.data, seed=config.train.seed)
    split = tokenize_split(dataset.splits["validation"], prepared.prompts, prepared.pad_id)
    assert len(split) == 6
    assert logged[3] == pytest.approx(mean_token_loss(model, split), rel=1e-5)
    with model.disable_adapter():  # lora_B starts at zero: before the first step the base model's loss
        assert logged[0] == pytest.approx(mean_token_loss(model, split), rel=1e-5)

    # Its step-2 checkpoint (adapters and AdamW moments saved whole) resumes in one process: step 3 as tp ran it,
    # up to the last bits of the split sums.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "metrics.csv", resumed / "metrics.csv")
    shutil.copytree(run / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    # the run's validation meetings too: a resume that changed them is refused (val_loss would mean another thing)
    one_process = ['parallel.strategy="single"', "parallel.pp=1", "train.batch_size=8", "data.synthetic_validation=6"]
    printed = _train(tmp_path, "resumed", *one_process, nproc=1, resume=True)
    assert f"resumed from {resumed / 'checkpoints' / 'step-2'} at step 2" in printed
    torch.testing.assert_close(torch.tensor(_metrics(resumed)), torch.tensor(_metrics(run)), rtol=1e-6, atol=0)
    assert_adapter_matches(adapter(resumed), adapter(run), learning_rates(run))


@pytest.mark.parametrize("width, ranks", [(12, 2), (10, 4)])  # 10 over 4: torch.chunk's 3, 3, 3, 1 columns
def test_split_input_dropout_draws_the_mask_of_the_whole_input(width: int, ranks: int) -> None:
    """Each rank of a tp group (same random stream) keeps its columns of the mask one process draws."""
    x = torch.randn(3, 5, width)
    torch.manual_seed(0)
    expected = torch.nn.Dropout(0.3)(x)
    parts = []
    for rank, columns in enumerate(x.chunk(ranks, dim=-1)):
        torch.manual_seed(0)
        parts.append(SplitInputDropout(0.3, width, rank, ranks)(columns))
    assert torch.equal(torch.cat(parts, dim=-1), expected)
    assert (expected == 0).any() and (expected != 0).any()
    assert torch.equal(SplitInputDropout(0.3, width, 0, ranks).eval()(x), x)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            ['parallel.strategy="tp"', "parallel.pp=2", "parallel.tp=2"],
            4,
            r"parallel.strategy = 'tp' splits whole-model replicas over tensor-parallel ranks: set parallel.pp = 1 "
            r"and parallel.tp >= 2 \(got pp = 2, tp = 2\)",
        ),
        (
            ['parallel.strategy="ddp"', "parallel.pp=1", "parallel.dp=2", "parallel.tp=2"],
            4,
            r"parallel.tp = 2 with parallel.strategy = 'ddp', which replicates whole models: .* use "
            r"parallel.strategy = 'tp' with parallel.dp replicas, or set parallel.tp = 1",
        ),
        (
            ["parallel.sequence_parallel=true"],
            2,
            r"parallel.sequence_parallel = true splits sequences over tensor-parallel ranks, but parallel.tp = 1",
        ),
        (
            ["parallel.tp=4", "parallel.sequence_parallel=true", "data.max_length=126"],
            8,
            r"the padded length 126 \(data.max_length / data.buckets\) is not a multiple of 4; use multiples of 4",
        ),
        (["parallel.tp=2"], 2, r"world size 2 does not match parallel.pp x parallel.dp x parallel.tp = 2 x 1 x 2"),
    ],
)
def test_tensor_parallel_settings_are_validated(
    tmp_path: Path, overrides: list[str], world_size: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, *overrides), world_size)


def test_tp_must_divide_the_attention_heads(tmp_path: Path) -> None:
    # tiny-qwen3 has 4 attention heads and 2 key-value heads.
    prepare(tiny_config(tmp_path, "parallel.tp=2"))
    with pytest.raises(ConfigError, match=r"parallel.tp = 4 does not divide the 4 attention heads and 2 key-value "):
        prepare(tiny_config(tmp_path, "parallel.tp=4"))
    with pytest.raises(ConfigError, match=r"use a tp that divides both \(2\)"):
        prepare(tiny_config(tmp_path, "parallel.tp=3"))


def test_tp_splits_the_weights_each_rank_must_hold() -> None:
    config = Config()
    for item in ('model.name="qwen2.5-72b"', 'model.init="random"', "train.memory_gb=141", "train.batch_size=8"):
        apply_override(config, item)
    for item in ('parallel.strategy="tp"', "parallel.pp=1", "parallel.tp=2", "parallel.n_microbatches=8"):
        apply_override(config, item)
    preflight(config, 2)  # 73 GB a rank: fits
    apply_override(config, "train.memory_gb=80")
    with pytest.raises(ConfigError, match=r"hold 73 GB .* \(parallel.pp = 1, split over parallel.tp = 2\)"):
        preflight(config, 2)


def test_bench_runs_tp_on_the_same_ranks_at_the_same_batch(tmp_path: Path) -> None:
    # pp=2: one schedule step of 4 samples in microbatches of 1 becomes one replica split over both ranks; with
    # pp=2 x dp=2, two such replicas.
    config = tiny_config(tmp_path, "parallel.layers_per_stage=[1, 3]")
    variant = strategy_config(config, "tp", steps=2, warmup=1, out_dir=tmp_path)
    p = variant.parallel
    assert (p.strategy, p.pp, p.dp, p.tp, variant.train.batch_size, p.n_microbatches) == ("tp", 1, 1, 2, 4, 4)
    validate(variant, 2)
    variant = strategy_config(tiny_config(tmp_path, "parallel.dp=2"), "tp", steps=2, warmup=1, out_dir=tmp_path)
    p = variant.parallel
    assert (p.pp, p.dp, p.tp, variant.train.batch_size, p.n_microbatches) == (1, 2, 2, 4, 4)
    validate(variant, 4)
    # A pp x tp config's other strategies use all its ranks.
    pp_tp = tiny_config(tmp_path, "parallel.tp=2")
    assert strategy_config(pp_tp, "ddp", steps=2, warmup=1, out_dir=tmp_path).parallel.dp == 4
    validate(strategy_config(pp_tp, "single", steps=2, warmup=1, out_dir=tmp_path), 1)


def test_a_fused_optimizer_steps_over_split_and_whole_adapters(tmp_path: Path) -> None:
    """tp leaves some adapters whole (plain tensors) and splits others (DTensors); a fused AdamW step (the GPUs'
    default) refuses one group of both kinds, so each kind gets its own group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipetune.config import load_config
    from pipetune.train import build_optimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        split = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)]))
        whole = torch.nn.Parameter(torch.ones(3))
        for param in (split, whole):
            param.grad = torch.ones_like(param)
        optimizer, _ = build_optimizer(load_config(None), [split, whole], 10)
        optimizer.found_inf = torch.ones(())  # a non-finite step, skipped on the device: nothing changes
        optimizer.step()
        assert split.full_tensor().eq(1).all() and whole.eq(1).all()
        optimizer.found_inf = torch.zeros(())
        optimizer.step()
        assert [len(group["params"]) for group in optimizer.param_groups] == [1, 1]
        assert split.full_tensor().lt(1).all() and whole.lt(1).all()  # both took a step against their gradient
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_each_family_splits_its_projections_by_their_roles(tmp_path: Path, name: str) -> None:
    """The plan of a decoder layer splits the family's column-wise projections (and their lora_B) by output
    columns, its row-wise ones (and their lora_A) by input columns; sequence parallelism runs the norms that feed
    attention and MLP on the split. Applied over a one-rank mesh, the stage computes what it computed whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from pipetune.config import LoraConfig, ModelConfig
    from pipetune.model.load import build_model
    from pipetune.model.lora import apply_lora
    from pipetune.model.shapes import resolve_model
    from pipetune.model.stage import StageModule
    from pipetune.parallel.tp import apply_tp, layer_plan

    resolved = resolve_model(ModelConfig(name=name, init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(4), seed=0)
    stage = StageModule(apply_lora(model, LoraConfig(dropout=0.0), name, seed=0))
    family = stage.family
    plan = layer_plan(stage.layers[0], family, None, sequence_parallel=True)
    for projection in family.column_wise:
        part = "self_attn" if projection.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
        assert isinstance(plan[f"{part}.{projection}.base_layer"], ColwiseParallel)
        assert isinstance(plan[f"{part}.{projection}.lora_B.default"], ColwiseParallel)
    for projection in family.row_wise:
        part = "self_attn" if projection == "o_proj" else "mlp"
        assert isinstance(plan[f"{part}.{projection}.base_layer"], RowwiseParallel)
        assert isinstance(plan[f"{part}.{projection}.lora_A.default"], RowwiseParallel)
    assert sorted(k for k, v in plan.items() if isinstance(v, SequenceParallel) and "lora" not in k) == sorted(
        family.block_norms
    )

    ids = torch.randint(0, 2000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = stage(ids)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        apply_tp([stage], init_device_mesh("cpu", (1,)), sequence_parallel=True)
        with torch.no_grad():
            torch.testing.assert_close(stage(ids), expected, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()
