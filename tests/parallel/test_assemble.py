"""The one assembly line of stages: training and the memory probe build a decoder layer the same way."""

from __future__ import annotations

import torch
from torch import nn

from pipetune.config import ModelConfig, apply_override
from pipetune.metrics import PhaseLog
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule
from pipetune.parallel.assemble import StagePart, build_stage_modules
from pipetune.parallel.memory import measure_layer_memory
from pipetune.parallel.mesh import build_mesh
from pipetune.parallel.process_group import DistEnv
from pipetune.preflight import Prepared
from pipetune.train import build_stages
from tests.conftest import tiny_config


def layer_anatomy(layer: nn.Module) -> list[tuple]:
    """What a built layer is: each module's name, type and forward, each parameter's name, shape, dtype and
    whether it trains."""
    modules = [
        (name, type(module).__name__, getattr(module.forward, "__name__", "")) for name, module in layer.named_modules()
    ]
    params = [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters()]
    return modules + params


def test_memory_probe_and_training_build_a_layer_identically(tmp_path, monkeypatch) -> None:
    """On the meta device, the layer the checkpointing plan measures is the layer training runs: same modules
    (the fast LoRA path's forwards included), same parameters, shapes and dtypes."""
    config = tiny_config(tmp_path, "lora.fast_path=true", "lora.dropout=0.1", 'model.dtype="bfloat16"')
    apply_override(config, "parallel.pp=1")
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    meta = torch.device("meta")
    env = DistEnv(0, 1, 0, meta)
    prepared = Prepared(resolved, None, None)
    stages = build_stages(config, env, build_mesh(env, 1, 1), prepared, PhaseLog(tmp_path, False), print, True)
    trained = stages.modules[0].layers[0]

    probed: list[StageModule] = []
    measure = StageModule.layer_memory

    def spy(self: StageModule, batch: int, seq: int) -> tuple[int, int]:
        probed.append(self)
        return measure(self, batch, seq)

    monkeypatch.setattr(StageModule, "layer_memory", spy)
    measure_layer_memory(config, resolved, meta, 1, 16)
    assert len(probed) == 1
    assert layer_anatomy(probed[0].layers[0]) == layer_anatomy(trained)
    assert any(entry[2] == "_fast_lora_forward" for entry in layer_anatomy(trained) if len(entry) == 3)


def test_stages_of_one_model_share_its_adapter_names(tmp_path) -> None:
    """Two stages built together are one PEFT model: each registers only its own layers, under full-model names."""
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    config = tiny_config(tmp_path)
    parts = [StagePart([0, 1], first=True), StagePart([3], last=True)]
    built = build_stage_modules(resolved, torch.float32, config.lora, parts, torch.device("meta"))
    first, last = built.modules
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    assert [len(m.layers) for m in built.modules] == [2, 1]
    names = {name for name, _ in built.peft_model.named_parameters()}
    assert any(".layers.3." in name for name in names) and not any(".layers.2." in name for name in names)
