"""GGUF intake: the real SmolLM2-135M converted once, read as a trained model; bad GGUF sources named clearly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipetune.config import ConfigError, ModelConfig
from pipetune.data.batching import IGNORE, tokenize_split
from pipetune.data.example import Example
from pipetune.data.prompt import PromptBuilder
from pipetune.model import gguf
from pipetune.model.load import build_model
from pipetune.model.shapes import resolve_model

PARAGRAPH = (
    "The history of the city goes back more than two thousand years. It was founded as a small trading post on "
    "the banks of the river, and over the centuries it grew into one of the most important centres of commerce "
    "in the region. Today it is known for its museums, its parks and its busy markets."
)


def test_real_model_reads_as_a_trained_model(smollm2: Path) -> None:
    resolved = resolve_model(ModelConfig(name="smollm2-135m"))
    assert resolved.weights_dir == smollm2  # the session's conversion, found again by content hash
    assert (resolved.config.model_type, resolved.config.num_hidden_layers) == ("llama", 30)
    model, stats = build_model(resolved, torch.float32, torch.device("cpu"))
    assert stats.tensors == 272  # 30 layers x 9 + embedding + final norm; lm_head tied to the embedding
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = torch.tensor([tokenizer.encode(PARAGRAPH, add_special_tokens=False)])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    # A trained 135M model reads plain English at ~2 nats/token; random weights at ln(49152) = 10.8.
    assert loss < 3.0 < math.log(resolved.config.vocab_size), loss


def test_tokenizer_is_the_models_own(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    pieces = {text: tokenizer.convert_ids_to_tokens(tokenizer.encode(text)) for text in ("a  2", "\n\n1.", "2024")}
    # The model's own pre-tokenizer splits digits first: a whitespace run before a digit stays one token.
    assert pieces == {"a  2": ["a", "ĠĠ", "2"], "\n\n1.": ["ĊĊ", "1", "."], "2024": ["2", "0", "2", "4"]}
    assert "<|im_start|>assistant" in tokenizer.chat_template
    # Its pad token is the end-of-turn token; training still supervises every closing <|im_end|>.
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == end
    builder = PromptBuilder(tokenizer, max_length=160, max_summary_tokens=24)
    examples = [Example("Anna: we ship on Friday.", "They ship Friday."), Example("Bert: ok " * 60, "Fine.")]
    split = tokenize_split(examples, builder, pad_id=tokenizer.pad_token_id)
    for row in range(len(examples)):
        n = int(split.real_tokens[row])
        assert split.input_ids[row, n - 1] == end and split.labels[row, n - 2] == end
        assert (split.labels[row, n - 1 :] == IGNORE).all()  # the pads (also <|im_end|>) carry no label


def _fake_gguf(path: Path, architecture: str) -> Path:
    import gguf as gguf_package

    writer = gguf_package.GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_sources_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"does not exist; give an existing \.gguf file"):
        gguf.gguf_source(str(tmp_path / "missing.gguf"))
    falcon = _fake_gguf(tmp_path / "one" / "falcon.gguf", "falcon") if (tmp_path / "one").mkdir() is None else None
    assert gguf.gguf_source(str(tmp_path / "one")) == falcon  # a directory holding one GGUF file
    with pytest.raises(ConfigError, match=r"architecture 'falcon'; pipetune reads GGUF files of the llama, qwen2"):
        resolve_model(ModelConfig(name=str(falcon)))
    _fake_gguf(tmp_path / "one" / "other.gguf", "llama")
    with pytest.raises(ConfigError, match=r"holds several GGUF files \(falcon.gguf, other.gguf\)"):
        gguf.gguf_source(str(tmp_path / "one"))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        resolve_model(ModelConfig(name=str(text)))
    monkeypatch.setitem(gguf.PACKAGED_MODELS, "absent-1m", gguf.PackagedModel("no_such_package", "x.gguf", "pip x"))
    with pytest.raises(ConfigError, match=r"no_such_package package, which is not installed .*install it: pip x"):
        resolve_model(ModelConfig(name="absent-1m"))


def _tiny_gemma3_gguf(path: Path, state: dict[str, torch.Tensor], config) -> Path:
    """A GGUF file of a Gemma 3 model, as llama.cpp's converter writes one: its tensor names, norms stored as
    1 + weight (Gemma's norms scale by 1 + weight), and a sentencepiece vocabulary of vocab_size tokens."""
    import gguf as gguf_package

    names = gguf_package.get_tensor_name_map(gguf_package.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    writer = gguf_package.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = special + [f"<0x{byte:02X}>" for byte in range(256)]
    tokens += [f"\u2581w{index}" for index in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(special) + [-float(i) for i in range(len(tokens) - len(special))])
    writer.add_token_types([3] * len(special) + [6] * 256 + [1] * (len(tokens) - len(special) - 256))
    for key, token in (("pad", 0), ("eos", 1), ("bos", 2), ("unk", 3)):
        getattr(writer, f"add_{key}_token_id")(token)
    for name, tensor in state.items():
        if name == "lm_head.weight":  # tied: the file has the embedding only
            continue
        value = tensor + 1 if name.endswith("norm.weight") else tensor
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gemma3_gguf_file_reads_back_with_the_weights_it_was_written_from(tmp_path: Path) -> None:
    """tiny-gemma3's weights written as a gemma3 GGUF file come back through the GGUF intake (conversion, then
    per-stage loading) unchanged."""
    source = resolve_model(ModelConfig(name="tiny-gemma3", init="random"))
    model, _ = build_model(source, torch.float32, torch.device("cpu"), seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms away from their initial zeros, so that the stored 1 + weight is tested
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    state = model.state_dict()
    path = _tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", state, source.config)

    resolved = resolve_model(ModelConfig(name=str(path)))
    config = resolved.config
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "sliding_window", "vocab_size"):
        assert getattr(config, key) == getattr(source.config, key), key
    for first, last, layers in ((True, False, range(0, 2)), (False, True, range(2, 4))):
        stage, stats = build_model(resolved, torch.float32, torch.device("cpu"), layers=layers, first=first, last=last)
        assert stats.tensors > 0
        for name, tensor in stage.state_dict().items():
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-7, msg=name)
