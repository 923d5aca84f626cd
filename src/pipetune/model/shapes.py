"""Model configs: built-in shapes (no hub needed) and resolution of hub ids and local directories.

Built-in shapes carry the published configs of Qwen3, Qwen2.5, Llama 3.1 and Gemma 3 models, so random-weight
runs of real sizes need no network; "tiny-qwen3" is the few-million-parameter model of the demo and the
tests, "tiny-gemma3" its Gemma 3 counterpart. A local directory holding only a config.json is a shape too:
with model.init = "random" the model is built from it, with the built-in demo tokenizer unless the directory
has a tokenizer of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from pipetune.config import ConfigError, ModelConfig
from pipetune.model.families import SUPPORTED_MODEL_TYPES, family_of
from pipetune.model.gguf import converted_checkpoint, gguf_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in a model directory means it brings its own tokenizer."""

_QWEN3_COMMON = dict(
    model_type="qwen3",
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
_LLAMA31_COMMON = dict(
    model_type="llama",
    vocab_size=128256,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500_000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    rms_norm_eps=1e-5,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)

BUILTIN_SHAPES: dict[str, dict] = {
    "tiny-qwen3": dict(
        model_type="qwen3",
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
    "tiny-gemma3": dict(  # tiny-qwen3's size in Gemma 3's layout: sliding-window and full attention alternate
        model_type="gemma3_text",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.1,  # as tiny-qwen3's
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
    "qwen2.5-72b": dict(  # Qwen/Qwen2.5-72B-Instruct
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B-Instruct
        _LLAMA31_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
    ),
    "llama-3.1-70b": dict(  # meta-llama/Llama-3.1-70B-Instruct
        _LLAMA31_COMMON,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
    ),
    "gemma-3-1b": dict(  # google/gemma-3-1b-it: 5 sliding-window layers (512 positions) to 1 of full attention
        model_type="gemma3_text",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
    ),
}
"""Published configs by name; `builtin_config` builds the family's config class from one."""


def head_dim(config: PretrainedConfig) -> int:
    """An attention head's size: the config's head_dim where it sets one (Qwen3's 128 at a hidden size of 2,560
    and 32 heads), else the hidden size over the heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def builtin_config(name: str) -> PretrainedConfig:
    """The transformers config of a built-in shape."""
    values = dict(BUILTIN_SHAPES[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


@dataclass
class ResolvedModel:
    """Where a model comes from: its config, the directory of its weights (None: random init) and the
    directory it was found in (None for built-in shapes), which may hold its tokenizer."""

    name: str
    config: PretrainedConfig
    weights_dir: Path | None
    source_dir: Path | None = None

    @property
    def is_builtin(self) -> bool:
        return self.weights_dir is None and self.source_dir is None

    @property
    def has_tokenizer(self) -> bool:
        """The model's directory brings a tokenizer (else random-init shapes use the demo tokenizer)."""
        return self.source_dir is not None and any((self.source_dir / f).is_file() for f in TOKENIZER_FILES)


def resolve_model(model: ModelConfig) -> ResolvedModel:
    """Find the model's config (and weights directory); raise ConfigError with the fix when unavailable."""
    random_init = model.init == "random"
    if model.name in BUILTIN_SHAPES:
        if not random_init:
            raise ConfigError(
                f"model.name = {model.name!r} is a built-in shape without weights; "
                f"set model.init = 'random', or point model.name at a checkpoint directory or hub id"
            )
        return ResolvedModel(model.name, _check_family(builtin_config(model.name), model.name), None)

    gguf = gguf_source(model.name)
    local = Path(model.name).expanduser()
    if gguf is not None:  # converted once into a cached checkpoint directory, then read like any other
        source_dir = converted_checkpoint(gguf)
    elif local.is_dir():
        source_dir = local
    elif local.exists() or model.name.startswith((".", "/", "~")):
        raise ConfigError(f"model.name = {model.name!r} is not a directory with a config.json")
    else:
        source_dir = _download(model.name, weights=not random_init)
    if not (source_dir / "config.json").is_file():
        raise ConfigError(f"model.name = {model.name!r}: {source_dir} has no config.json")
    try:
        config = AutoConfig.from_pretrained(source_dir, trust_remote_code=model.trust_remote_code)
    except ValueError as e:  # a model_type transformers does not know
        raise ConfigError(
            f"model.name = {model.name!r}: its config.json cannot be read ({str(e).splitlines()[0]}); pipetune "
            f"builds {', '.join(SUPPORTED_MODEL_TYPES)} decoder-only models"
        ) from None
    config = _check_family(config, model.name)
    return ResolvedModel(model.name, config, None if random_init else source_dir, source_dir)


def one_layer_model(config: PretrainedConfig) -> PreTrainedModel:
    """A meta-device model of `config` with one decoder layer: its module names and parameter shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    one = config.__class__.from_dict(config.to_dict())
    one.num_hidden_layers = 1
    one.tie_word_embeddings = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(one)


def _check_family(config: PretrainedConfig, name: str) -> PretrainedConfig:
    family_of(config, f"model.name = {name!r}")
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
