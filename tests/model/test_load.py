"""Per-stage loading reads exactly the stage's tensors from (sharded) safetensors and equals a full load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import pipetune.model.load as load_module
from pipetune.config import Config, ConfigError, ModelConfig, apply_override
from pipetune.model.load import build_model
from pipetune.model.shapes import BUILTIN_SHAPES, ResolvedModel, builtin_config, resolve_model
from pipetune.model.split import estimate_costs, split_layers, stage_costs
from pipetune.model.stage import StageModule
from pipetune.parallel.memory import parameter_counts
from pipetune.preflight import preflight, prepare

CPU = torch.device("cpu")
TINY = {k: v for k, v in BUILTIN_SHAPES["tiny-qwen3"].items() if k != "model_type"}


def write_checkpoint(path: Path, config, shard: str | None = "300KB") -> Path:
    model, _ = build_model(ResolvedModel("tiny", config, None), torch.float32, CPU, seed=3)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return path


def test_a_bfloat16_model_keeps_its_rotary_frequencies_in_float32() -> None:
    """As transformers computes them: in bfloat16 each frequency keeps ~3 significant digits, so a position far
    into a long row is rotated by a visibly wrong angle."""
    config = Qwen3Config(**{**TINY, "max_position_embeddings": 131072})
    model, _ = build_model(ResolvedModel("tiny", config, None), torch.bfloat16, CPU, seed=3)
    rotary = model.model.rotary_emb
    reference = type(rotary)(config=config)
    assert rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary.inv_freq, reference.inv_freq, rtol=0, atol=0)
    positions = torch.tensor([[100_000]])
    x = torch.zeros(1, 1, config.head_dim, dtype=torch.bfloat16)
    torch.testing.assert_close(rotary(x, positions)[0], reference(x, positions)[0], rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_exactly_the_weights_of_a_full_load(tmp_path: Path, tied: bool) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt", Qwen3Config(**{**TINY, "tie_word_embeddings": tied}))
    assert (checkpoint / "model.safetensors.index.json").is_file()  # really sharded
    full = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    if tied:
        assert "lm_head.weight" not in load_module.checkpoint_index(checkpoint)

    resolved = resolve_model(ModelConfig(name=str(checkpoint)))
    seen = set()
    for index, layers in enumerate(split_layers(4, 2)):
        stage, stats = build_model(resolved, torch.float32, CPU, layers=layers, first=index == 0, last=index == 1)
        for name, tensor in stage.state_dict().items():
            torch.testing.assert_close(tensor, full[name], rtol=0, atol=0, msg=name)
            seen.add(name)
        assert stats.tensors > 0 and stats.bytes > 0
    assert seen == set(full)  # together the stages hold the whole model, lm_head included


def test_a_stage_reads_no_tensor_of_another_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt", Qwen3Config(**TINY))
    read: list[str] = []
    real_open = load_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._inner = real_open(*args, **kwargs)

        def __enter__(self):
            self._file = self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self._file.get_tensor(name)

        def get_slice(self, name):  # shapes only: the data comes through get_tensor
            return self._file.get_slice(name)

        def keys(self):
            return self._file.keys()

    monkeypatch.setattr(load_module, "safe_open", Recording)
    resolved = resolve_model(ModelConfig(name=str(checkpoint)))
    build_model(resolved, torch.float32, CPU, layers=range(2, 4), first=False, last=True)
    layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
    assert layers == {2, 3}
    assert "model.embed_tokens.weight" in read  # tied: the last stage's lm_head comes from the embedding
    assert len(read) == len(set(read)) == 2 * 11 + 2  # 11 tensors a layer, norm, embedding (as lm_head)


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        MistralConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=None,
        ),
        # Scaled embeddings, a local and a global rotary embedding, sliding-window masks (4 of 16 positions).
        Gemma3TextConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        ),
    ],
    ids=["qwen2", "llama", "mistral", "gemma3"],
)
def test_other_families_split_into_stages_that_match_the_full_model(config) -> None:
    resolved = ResolvedModel(config.model_type, config, None)
    full, _ = build_model(resolved, torch.float32, CPU, seed=5)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(input_ids=ids).logits
        hidden = ids
        for index, layers in enumerate(split_layers(4, 2)):
            stage, _ = build_model(
                resolved, torch.float32, CPU, layers=layers, first=index == 0, last=index == 1, seed=5
            )
            hidden = StageModule(stage)(hidden)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_family_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        resolve_model(ModelConfig(name=str(tmp_path / "gpt2")))


def test_balanced_split_gives_the_last_stage_of_qwen3_4b_fewer_layers() -> None:
    config = builtin_config("qwen3-4b")
    costs = estimate_costs(config, seq_len=512)
    assert 3 < costs.head / costs.layer < 4.5  # lm_head of 151,936 x 2,560: the FLOPs of 3-4 decoder layers
    assert 1.5 < costs.head_time / costs.layer < 2.5  # measured time: about 2 layers
    ranges = split_layers(36, 2, costs=costs)
    assert [len(r) for r in ranges] == [19, 17]
    balanced, even = stage_costs(ranges, costs), stage_costs(split_layers(36, 2), costs)
    assert max(balanced) < max(even)
    assert [len(r) for r in split_layers(36, 2, [10, 26], costs)] == [10, 26]  # explicit counts win
    # Fused loss on a summary of <= 256 of 512 tokens: the head sees at most half the rows and costs
    # the time of ~1.3-1.4 layers (measured); 19/17 still, and 10/9/9/8 over four stages.
    fused = estimate_costs(config, 512, fused_loss_share=257 / 512)
    assert 1.2 < fused.head_time / fused.layer < 1.6
    assert [len(r) for r in split_layers(36, 2, costs=fused)] == [19, 17]
    assert [len(r) for r in split_layers(36, 4, costs=fused)] == [10, 9, 9, 8]


@pytest.mark.parametrize(
    "name, billions",
    [
        ("qwen3-4b", 4.02),
        ("qwen3-32b", 32.8),
        ("qwen2.5-72b", 72.7),
        ("llama-3.1-8b", 8.03),
        ("llama-3.1-70b", 70.6),
        ("gemma-3-1b", 1.00),
    ],
)
def test_builtin_shapes_have_their_published_sizes(name: str, billions: float) -> None:
    config = builtin_config(name)
    layer, embedding, head = parameter_counts(config)
    total = (
        config.num_hidden_layers * layer + embedding + head - (head - config.hidden_size) * config.tie_word_embeddings
    )
    assert total / 1e9 == pytest.approx(billions, rel=5e-3)


def test_a_directory_with_only_a_config_builds_a_random_model(tmp_path: Path) -> None:
    """model.init = "random" needs nothing but config.json; the demo tokenizer stands in for a missing one."""
    shape = tmp_path / "llama-shape"
    LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(shape)
    assert sorted(p.name for p in shape.iterdir()) == ["config.json"]
    config = Config()
    config.model = ModelConfig(name=str(shape), init="random", dtype="float32")
    prepared = prepare(config)
    assert prepared.model.weights_dir is None and prepared.model.config.model_type == "llama"
    assert prepared.tokenizer.chat_template  # the built-in demo tokenizer
    model, stats = build_model(prepared.model, torch.float32, CPU, seed=1)
    assert stats.tensors == 0 and model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 4096)
    with pytest.raises(ConfigError, match="has no model.safetensors"):  # "pretrained" still needs weights
        build_model(resolve_model(ModelConfig(name=str(shape))), torch.float32, CPU)


def test_a_layout_whose_weights_cannot_fit_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = Config()
    for item in (
        'model.name="qwen2.5-72b"',
        'model.init="random"',
        "train.memory_gb=141",
        "parallel.pp=1",
        'parallel.strategy="single"',
        "train.batch_size=8",
        "parallel.n_microbatches=8",
    ):
        apply_override(config, item)
    with pytest.raises(ConfigError, match=r"rank 0 hold 145 GB of frozen bfloat16 weights .* Raise parallel.pp"):
        preflight(config, 1)
    apply_override(config, 'model.quantize="nf4"')
    preflight(config, 1)  # ~41 GB: NF4 decoder layers (0.52 bytes a weight), bfloat16 embedding and lm_head
    apply_override(config, 'model.quantize="none"')
    apply_override(config, 'parallel.strategy="pp"')
    apply_override(config, "parallel.pp=2")
    preflight(config, 2)  # 73 GB a rank: fits
