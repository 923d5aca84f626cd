"""Model configs: built-in shapes (no hub needed) and resolution of hub ids and local directories.

Built-in shapes carry the published Qwen3 configs so random-weight runs of real sizes need no
network; "tiny-qwen3" is the few-million-parameter model of the demo and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig, Qwen3Config

from pipetune.config import ConfigError, ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
"""Decoder-only families with the model.embed_tokens / layers / norm / rotary_emb + lm_head layout."""

_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

BUILTIN_SHAPES: dict[str, dict] = {
    "tiny-qwen3": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        # Wider than HF's 0.02: behind the frozen final RMSNorm, 0.02 caps the logits near +-5, too flat
        # for a random base to express a learned distribution through its adapters alone.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "qwen3-0.6b": dict(
        _QWEN3_COMMON,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        _QWEN3_COMMON,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        _QWEN3_COMMON,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3_COMMON,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-14b": dict(
        _QWEN3_COMMON,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        _QWEN3_COMMON,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
}


@dataclass
class ResolvedModel:
    """Where a model comes from: its config, and the directory of its weights (None for built-ins)."""

    name: str
    config: PretrainedConfig
    weights_dir: Path | None

    @property
    def is_builtin(self) -> bool:
        return self.weights_dir is None


def resolve_model(model: ModelConfig) -> ResolvedModel:
    """Find the model's config (and weights directory); raise ConfigError with the fix when unavailable."""
    if model.name in BUILTIN_SHAPES:
        if model.init != "random":
            raise ConfigError(
                f"model.name = {model.name!r} is a built-in shape without weights; "
                f"set model.init = 'random', or point model.name at a checkpoint directory or hub id"
            )
        config = Qwen3Config(**BUILTIN_SHAPES[model.name])
        return ResolvedModel(model.name, _check_family(config, model.name), None)

    local = Path(model.name).expanduser()
    if local.is_dir():
        weights_dir = local
    elif local.exists() or model.name.startswith((".", "/", "~")):
        raise ConfigError(f"model.name = {model.name!r} is not a directory with a config.json")
    else:
        weights_dir = _download(model.name, weights=model.init == "pretrained")
    if not (weights_dir / "config.json").is_file():
        raise ConfigError(f"model.name = {model.name!r}: {weights_dir} has no config.json")
    config = AutoConfig.from_pretrained(weights_dir, trust_remote_code=model.trust_remote_code)
    return ResolvedModel(model.name, _check_family(config, model.name), weights_dir)


def _check_family(config: PretrainedConfig, name: str) -> PretrainedConfig:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.name = {name!r} has model_type {config.model_type!r}; pipetune builds pipeline stages for "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} decoder-only models"
        )
    config.use_cache = False
    return config


def _download(repo_id: str, weights: bool) -> Path:
    """Fetch a hub repo's config, tokenizer and (optionally) safetensors into the local HF cache."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.jinja"] + (["*.safetensors"] if weights else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub raises many kinds: offline, 404, auth, timeouts
        raise ConfigError(
            f"model.name = {repo_id!r} could not be fetched from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Download it where the hub is reachable "
            f"(`hf download {repo_id} --local-dir DIR`) and set model.name = DIR, or run a random-weight "
            f"model of the same shape with model.name = one of {', '.join(BUILTIN_SHAPES)} and model.init = 'random'"
        ) from None
