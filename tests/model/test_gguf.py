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
