"""GGUF intake: the real SmolLM2-135M converted once, read as a trained model; bad GGUF sources named clearly;
damaged, crafted or mislabelled files refused before converting; a damaged conversion converted again."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
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
    # The real file passes the checks made before converting: its header, its tensor set and shapes.
    file = gguf._packaged_file("smollm2-135m")
    expected = gguf.expected_tensors(resolved.config, "llama")
    assert len(expected) == stats.tensors
    gguf.check_tensors(file, gguf.read_header(file), expected, "llama")
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


def _tiny_gguf(
    path: Path,
    architecture: str = "llama",
    q_k_norms: bool = False,
    shapes: dict[str, tuple[int, ...]] | None = None,
    head_dim: int = 8,
) -> Path:
    """A two-layer model of hidden size 16 (2 heads, 1 key/value head), float32, vocabulary 32; `shapes`
    overrides tensors' shapes. (transformers reads no head_dim from a qwen3 file: 128 there.)"""
    import gguf as gguf_package

    writer = gguf_package.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(2)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(32)
    tensors = {"token_embd.weight": (32, 16), "output_norm.weight": (16,)}
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (16,),
            f"blk.{i}.attn_q.weight": (2 * head_dim, 16),
            f"blk.{i}.attn_k.weight": (head_dim, 16),
            f"blk.{i}.attn_v.weight": (head_dim, 16),
            f"blk.{i}.attn_output.weight": (16, 2 * head_dim),
            f"blk.{i}.ffn_norm.weight": (16,),
            f"blk.{i}.ffn_gate.weight": (32, 16),
            f"blk.{i}.ffn_up.weight": (32, 16),
            f"blk.{i}.ffn_down.weight": (16, 32),
        }
        if q_k_norms:
            tensors |= {f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)}
    rng = np.random.default_rng(0)
    for name, shape in (tensors | (shapes or {})).items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def _patch(find: bytes, after: int, fmt: str, value: int) -> Callable[[bytearray], None]:
    """Overwrite the `fmt` value `after` bytes past the end of `find` (a tensor's name in the tensor table)."""

    def patch(data: bytearray) -> None:
        at = data.index(find) + len(find) + after
        data[at : at + struct.calcsize(fmt)] = struct.pack("<" + fmt, value)

    return patch


def _cut(keep: float) -> Callable[[bytearray], None]:
    def cut(data: bytearray) -> None:
        del data[int(len(data) * keep) :]

    return cut


def _at(offset: int, fmt: str, value: int) -> Callable[[bytearray], None]:
    def patch(data: bytearray) -> None:
        data[offset : offset + struct.calcsize(fmt)] = struct.pack("<" + fmt, value)

    return patch


EMBEDDING = b"token_embd.weight"
BROKEN = {
    "cut in the tensor data": (_cut(0.9), r"tensor '.*' \(\d+ bytes at byte \d+\) ends past the end of the file"),
    "cut in the header": (_cut(0.02), r"the tensor count claims 20, more than the \d+ bytes left can hold"),
    "cut in the tensor table": (_cut(0.05), r"tensor \d+'s name at byte \d+ needs \d+ bytes, past the end of"),
    "version": (_at(4, "I", 99), r"GGUF version 99 \(llama.cpp writes versions 2 and 3\)"),
    "2**62 tensors": (_at(8, "Q", 2**62), r"the tensor count claims 4611686018427387904, more than the \d+ bytes left"),
    "2**62 metadata entries": (_at(16, "Q", 2**62), r"the metadata count claims 4611686018427387904"),
    "2**40 rows": (_patch(EMBEDDING, 4 + 8, "Q", 2**40), r"tensor 'token_embd.weight' \(70368744177664 bytes"),
    "5 dimensions": (_patch(EMBEDDING, 0, "I", 5), r"tensor 'token_embd.weight' has 5 dimensions"),
    "unknown data type": (_patch(EMBEDDING, 4 + 16, "I", 999), r"tensor 'token_embd.weight' has data type 999"),
    "string of 2**62 bytes": (_at(24, "Q", 2**62), r"metadata entry 0 at byte 32 needs 4611686018427387904 bytes"),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_damaged_or_crafted_gguf_files_are_refused_in_one_line(tmp_path: Path, broken: str) -> None:
    path = _tiny_gguf(tmp_path / "model.gguf")
    data = bytearray(path.read_bytes())
    damage, what = BROKEN[broken]
    damage(data)
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as error:
        resolve_model(ModelConfig(name=str(path)))
    message = str(error.value)
    assert message.startswith(f"model.name = '{path}' is a damaged or cut GGUF file: ") and "\n" not in message
    assert message.endswith(
        f"(the file has {len(data)} bytes); download it again, or point model.name at a complete .gguf file"
    )
    assert re.search(what, message), message


def test_tensors_the_architecture_needs_are_checked_before_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    relabelled = _tiny_gguf(tmp_path / "llama-as-qwen3.gguf", "qwen3")  # a llama file: no q_norm / k_norm
    with pytest.raises(ConfigError) as error:
        resolve_model(ModelConfig(name=str(relabelled)))
    assert str(error.value) == (
        f"model.name = '{relabelled}' lacks 4 tensors a qwen3 model needs (blk.0-1.attn_k_norm.weight, "
        f"blk.0-1.attn_q_norm.weight); it is not a whole qwen3 model: use a GGUF file converted from a qwen3 "
        f"checkpoint, or one whose general.architecture names its real family"
    )
    wide = _tiny_gguf(tmp_path / "wide.gguf", shapes={"blk.1.ffn_down.weight": (16, 24), "output_norm.weight": (8,)})
    with pytest.raises(
        ConfigError,
        match=(
            r"holds tensors of other shapes than its own llama config says \(as transformers reads it\): "
            r"blk.1.ffn_down.weight is \[16, 24\], not \[16, 32\]; output_norm.weight is \[8\], not \[16\]; "
            r"the file is damaged or mislabelled"
        ),
    ):
        resolve_model(ModelConfig(name=str(wide)))
    import gguf as gguf_package

    writer = gguf_package.GGUFWriter(str(tmp_path / "text-width.gguf"), "llama")
    writer.add_string("llama.embedding_length", "wide")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(
        ConfigError,
        match=r"text-width.gguf': its metadata does not make a llama config \(.+\); download the file again$",
    ):
        resolve_model(ModelConfig(name=str(tmp_path / "text-width.gguf")))
    whole = _tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", q_k_norms=True, head_dim=128)
    assert gguf.check_gguf(whole).model_type == "qwen3"  # a whole file passes
    monkeypatch.delitem(gguf_package.MODEL_ARCH_NAMES, gguf_package.MODEL_ARCH.QWEN3)  # an older gguf package
    with pytest.raises(ConfigError, match=r"architecture 'qwen3', which the installed gguf package does not know; up"):
        gguf.check_gguf(whole)


def _cut_file(name: str) -> Callable[[Path], None]:
    def cut(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: len(data) // 2])

    return cut


def _same_size(name: str) -> Callable[[Path], None]:
    def overwrite(directory: Path) -> None:
        (directory / name).write_bytes(b" " * (directory / name).stat().st_size)

    return overwrite


CONVERSION_DAMAGE = {
    "weights cut short": (_cut_file("model.safetensors"), "model.safetensors has"),
    "weights overwritten, same size": (_same_size("model.safetensors"), "model.safetensors's header runs past"),
    "config overwritten, same size": (_same_size("config.json"), "config.json's content differs"),
    "weights deleted": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
    "record deleted": (lambda d: (d / gguf.RECORD).unlink(), f"{gguf.RECORD} is missing"),
    "record cut short": (_cut_file(gguf.RECORD), f"{gguf.RECORD} cannot be read"),
}


@pytest.mark.parametrize("damage", CONVERSION_DAMAGE)
def test_a_damaged_conversion_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, damage: str
) -> None:
    from safetensors.torch import save_file

    conversions = []

    def convert(source: Path, out: Path, config=None) -> None:  # the real one's files, without its minute
        conversions.append(source)
        save_file({"model.embed_tokens.weight": torch.ones(32, 16)}, out / "model.safetensors")
        (out / "config.json").write_text('{"model_type": "llama"}\n')
        (out / "tokenizer.json").write_text("{}\n")

    monkeypatch.setattr(gguf, "convert", convert)
    source = _tiny_gguf(tmp_path / "model.gguf")
    first = gguf.converted_checkpoint(source, tmp_path / "cache")
    assert gguf.converted_checkpoint(source, tmp_path / "cache") == first and len(conversions) == 1
    damage_files, problem = CONVERSION_DAMAGE[damage]
    damage_files(first)
    capsys.readouterr()

    assert gguf.converted_checkpoint(source, tmp_path / "cache") == first and len(conversions) == 2
    note = capsys.readouterr().err.splitlines()[0]
    assert note.startswith(f"pipetune: note: the converted model {first} is damaged (") and problem in note, note
    assert note.endswith("; converting again")
    assert gguf.conversion_damage(first) is None
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # the damaged copy is gone


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
