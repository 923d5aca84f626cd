"""FSDP2 over dp (strategy "fsdp", parallel.dp_shard) against the single process at the same effective batch.

Sharding changes where the frozen weights live and how the LoRA gradients are reduced (reduce-scatter,
summed: the loss is already divided by the global supervised-token count), not the function computed.
Checkpoints hold whole tensors, cut back into shards on load.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from pipetune.bench import strategy_config
from pipetune.config import Config, ConfigError, validate
from tests.conftest import run_cli, tiny_config, write_config
from tests.parallel.test_data_parallel import EFFECTIVE_16
from tests.parity import assert_same_training

FSDP2 = [
    'parallel.strategy="fsdp"',
    "parallel.pp=1",
    "parallel.dp=2",
    "train.batch_size=4",
    "parallel.n_microbatches=1",
]
"""Each replica's batch of 4 in one microbatch: FSDP gathers every layer's weights for each microbatch's forward
and backward and reduce-scatters its gradients after each backward (a run of 3 steps and 3 checkpoints took 7.9 s
in microbatches of 1, 4.5 s so, on 2 cores); train.grad_accum = 2 still sums two backward passes' shards."""
DDP2 = ['parallel.strategy="ddp"', "parallel.pp=1", "parallel.dp=2", "train.batch_size=4"]
ADAPTER = "adapter/adapter_model.safetensors"


def _metrics(run_dir: Path) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every training row (step 0 holds only the validation loss)."""
    with open(run_dir / "metrics.csv") as f:
        return [(float(row["loss"]), float(row["grad_norm"])) for row in csv.DictReader(f) if row["loss"]]


def _assert_same_run(run: Path, reference: Path) -> None:
    # The global gradient norm (sum of shards' squares) is logged before clipping, which it drives.
    assert_same_training(run, reference, steps=3)


def _train(tmp: Path, name: str, *overrides: str, nproc: int, resume: bool = False) -> str:
    """Train into tmp/name; returns what rank 0 printed."""
    config = tiny_config(tmp / name, *EFFECTIVE_16, *overrides)
    args = ["--resume"] if resume else []
    config_file = str(write_config(config, tmp / f"{name}.toml"))
    return run_cli("train", "--config", config_file, "--nproc", str(nproc), *args).stdout


def two_process_configs(tmp: Path) -> dict[str, Config | tuple[Config, dict[Path, Path]]]:
    """This file's runs that tests/conftest.py trains with other files' 2-process runs: FSDP2 with a checkpoint
    every step, then the same run resumed from its step-2 checkpoint (with its metrics.csv, trimmed on resume),
    copied into a new run directory."""
    run, resumed = tmp / "fsdp2", tmp / "fsdp2-resumed"
    copies = {
        run / "metrics.csv": resumed / "metrics.csv",
        run / "checkpoints" / "step-2": resumed / "checkpoints" / "step-2",
    }
    return {
        "fsdp2": tiny_config(run, *EFFECTIVE_16, *FSDP2, "train.save_every=1"),
        "fsdp2-resumed": (tiny_config(resumed, *EFFECTIVE_16, *FSDP2, 'train.resume="auto"'), copies),
    }


def four_process_configs(tmp: Path) -> dict[str, Config]:
    """pp=2 x dp=2, the replicas sharded, on the fast LoRA path, whose grouped down-projections read each layer's
    gathered adapters (without dropout, lora.shared_dropout changes no value)."""
    sharded = ["parallel.pp=2", "parallel.dp=2", "parallel.dp_shard=true"]
    fast = ["lora.fast_path=true", "lora.shared_dropout=true"]
    return {"pp2xdp2": tiny_config(tmp / "pp2xdp2", *EFFECTIVE_16, *sharded, *fast)}


@pytest.mark.slow
def test_fsdp_matches_single_process_and_resumes_exactly(single: Path, two_process_runs: Path) -> None:
    run = two_process_runs / "fsdp2"
    _assert_same_run(run, single)

    # Its step-2 checkpoint holds whole adapters and AdamW moments; each rank cuts its shards back out.
    resumed = two_process_runs / "fsdp2-resumed"  # two_process_configs: step-2 and metrics.csv copied, resumed
    assert json.loads((resumed / "run.json").read_text())["resumed_from_step"] == 2
    assert _metrics(resumed) == _metrics(run)  # step 3 bit for bit
    assert (resumed / ADAPTER).read_bytes() == (run / ADAPTER).read_bytes()


@pytest.mark.slow
def test_pipeline_with_sharded_replicas_matches_single_process(single: Path, four_process_runs: Path) -> None:
    """On the fast LoRA path, whose grouped down-projections read each layer's gathered adapters (without dropout,
    lora.shared_dropout changes no value)."""
    _assert_same_run(four_process_runs / "pp2xdp2", single)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            ['parallel.strategy="fsdp"', "parallel.pp=2", "parallel.dp=2"],
            4,
            r"parallel.strategy = 'fsdp' shards whole-model replicas: set parallel.pp = 1 \(got 2\)",
        ),
        (
            ['parallel.strategy="fsdp"', "parallel.pp=1"],
            1,
            r"parallel.strategy = 'fsdp' shards the model over dp replicas: set parallel.dp >= 2 \(got 1\)",
        ),
        (
            ["parallel.dp_shard=true"],
            2,
            r"parallel.dp_shard = true shards each stage over its dp replicas, but parallel.dp = 1: "
            r"set parallel.dp >= 2 or parallel.dp_shard = false",
        ),
        (
            [*DDP2, "parallel.dp_shard=true"],
            2,
            r"for replicas sharded with FSDP \(parallel.dp_shard = true\) use parallel.strategy = 'fsdp'",
        ),
    ],
)
def test_sharding_settings_are_validated(tmp_path: Path, overrides: list[str], world_size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, *overrides), world_size)


def test_bench_runs_fsdp_as_sharded_whole_model_replicas(tmp_path: Path) -> None:
    # The pp=2 x dp=2 config's schedule step of 8 samples becomes 4 replicas of 2 samples each.
    config = tiny_config(tmp_path, "parallel.dp=2", "parallel.dp_shard=true")
    variant = strategy_config(config, "fsdp", steps=2, warmup=1, out_dir=tmp_path)
    p = variant.parallel
    assert (p.strategy, p.pp, p.dp, variant.train.batch_size, p.n_microbatches, p.sharded) == ("fsdp", 1, 4, 2, 1, True)
    validate(variant, 4)
    variant = strategy_config(config, "ddp", steps=2, warmup=1, out_dir=tmp_path)  # the same replicas, unsharded
    p = variant.parallel
    assert (p.strategy, p.pp, p.dp, variant.train.batch_size, p.n_microbatches, p.sharded) == ("ddp", 1, 4, 2, 1, False)
    validate(variant, 4)
    validate(strategy_config(config, "single", steps=2, warmup=1, out_dir=tmp_path), 1)


def _sharded_build(rank: int, checkpoint: str, init_file: str, out_dir: str, threads: int) -> None:
    """One of 2 gloo ranks: build tiny-qwen3 on meta with LoRA, shard it (FSDP2), materialize, save full tensors.
    `threads`: the test process's thread count, so that both sides sum their products in one order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipetune.config import LoraConfig, ModelConfig
    from pipetune.model.load import build_meta, materialize
    from pipetune.model.lora import apply_lora, full_tensor
    from pipetune.model.quantize import quantize_linears
    from pipetune.model.shapes import resolve_model
    from pipetune.model.stage import StageModule
    from pipetune.parallel.fsdp import shard_stages

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for source in ("tiny-qwen3", checkpoint):
        resolved = resolve_model(ModelConfig(name=source, init="random" if source == "tiny-qwen3" else "pretrained"))
        model = apply_lora(build_meta(resolved, torch.float32, range(4)), LoraConfig(), source, seed=7)
        modules = [StageModule(model)]
        shard_stages(modules, init_device_mesh("cpu", (2,)), pipelined=False)
        materialize(model, resolved, torch.device("cpu"), seed=7, roots=modules)
        local = {name: param.to_local().clone() for name, param in model.named_parameters()}
        whole = {name: full_tensor(param).clone() for name, param in model.named_parameters()}
        if rank == 0:
            torch.save({"local": local, "whole": whole}, f"{out_dir}/{Path(source).name}.pt")
    # model.quantize: each rank keeps its rows of the whole matrix's quantization; FSDP gathers them per layer.
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    for method, dtype in (("nf4", torch.float32), ("fp8", torch.bfloat16)):
        model = apply_lora(build_meta(resolved, dtype, range(4)), LoraConfig(), "tiny-qwen3", seed=7)
        quantize_linears(model, method)
        modules = [StageModule(model).eval()]
        shard_stages(modules, init_device_mesh("cpu", (2,)), pipelined=False)
        materialize(model, resolved, torch.device("cpu"), seed=7, roots=modules)
        with torch.no_grad():
            logits = modules[0](torch.arange(64).view(2, 32))
        if rank == 0:
            torch.save(logits, f"{out_dir}/{method}-logits.pt")
    dist.destroy_process_group()


def test_a_sharded_build_holds_the_unsharded_values(tmp_path: Path) -> None:
    """FSDP shards at build: each rank allocates only its rows, filled as an unsharded build would be."""
    from transformers import Qwen3Config

    from pipetune.config import LoraConfig, ModelConfig
    from pipetune.model.load import build_model
    from pipetune.model.lora import apply_lora
    from pipetune.model.shapes import resolve_model
    from pipetune.model.stage import StageModule
    from tests.model.test_load import TINY, write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "ckpt", Qwen3Config(**{**TINY, "tie_word_embeddings": False}))
    torch.multiprocessing.spawn(
        _sharded_build,
        args=(str(checkpoint), str(tmp_path / "init"), str(tmp_path), torch.get_num_threads()),
        nprocs=2,
        join=True,
    )
    for source in ("tiny-qwen3", str(checkpoint)):
        resolved = resolve_model(ModelConfig(name=source, init="random" if source == "tiny-qwen3" else "pretrained"))
        base, _ = build_model(resolved, torch.float32, torch.device("cpu"), range(4), seed=7)
        expected = dict(apply_lora(base, LoraConfig(), source, seed=7).named_parameters())
        saved = torch.load(tmp_path / f"{Path(source).name}.pt", weights_only=True)
        assert sorted(saved["whole"]) == sorted(expected), (source, set(expected) - set(saved["whole"]))
        for name, value in expected.items():
            torch.testing.assert_close(saved["whole"][name], value.detach(), rtol=0, atol=0, msg=name)
            # rank 0 holds the first half of the rows (FSDP2 shards dim 0 as torch.chunk does)
            rows = -(-value.shape[0] // 2)
            torch.testing.assert_close(saved["local"][name], value.detach()[:rows], rtol=0, atol=0, msg=name)
    tiny = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    ids = torch.arange(64).view(2, 32)
    for method, dtype in (("nf4", torch.float32), ("fp8", torch.bfloat16)):
        whole, _ = build_model(tiny, dtype, torch.device("cpu"), seed=7, quantize=method)
        with torch.no_grad():
            expected = StageModule(apply_lora(whole, LoraConfig(), "tiny-qwen3", seed=7)).eval()(ids)
        # The same quantized weights, gathered: the same function (float32 NF4: up to summation order).
        sharded = torch.load(tmp_path / f"{method}-logits.pt", weights_only=True)
        torch.testing.assert_close(sharded, expected, rtol=1e-5, atol=1e-5, msg=method)
