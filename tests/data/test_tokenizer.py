import json
import multiprocessing
import os
from pathlib import Path

import pytest

import pipetune.data.tokenizer as tokenizer_module
from pipetune.data.synthetic import generate_meetings
from pipetune.data.tokenizer import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    demo_tokenizer,
    tokenizer_dir,
)
from pipetune.files import default_cache_dir


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tok(cache_dir):
    return demo_tokenizer(cache_dir)


def test_special_tokens_are_single_ids_0_1_2(tok):
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.encode(token, add_special_tokens=False) == [token_id]
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.bos_token is None
    assert tok.model_max_length >= 100_000


def test_special_tokens_are_never_split_or_merged_with_text(tok):
    text = "x<|im_start|>user\nhi<|im_end|>\n<|im_end|><|im_start|>assistant"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 2 and ids.count(2) == 2
    pieces = tok.convert_ids_to_tokens(ids)
    assert all(piece in SPECIAL_TOKENS or "<|" not in piece and "|>" not in piece for piece in pieces)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "xuser\nhi\nassistant"


def test_round_trip_on_unseen_meetings_and_unicode(tok):
    for meeting in generate_meetings(5, seed=12345):
        for text in (meeting.transcript, meeting.summary):
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    odd = "Café – naïve façade 😀\t  two  spaces\n\nand [...]"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd


def test_merges_compress_meeting_text(tok):
    meeting = generate_meetings(1, seed=54321)[0]
    n_tokens = len(tok.encode(meeting.transcript, add_special_tokens=False))
    assert n_tokens < 1.6 * len(meeting.transcript.split())
    assert 1000 < len(tok) <= 2048


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    expected = "<|im_start|>system\na<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == expected + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert tok.chat_template == CHATML_TEMPLATE


def test_second_call_loads_the_cache_instead_of_training(tmp_path, monkeypatch):
    first = demo_tokenizer(tmp_path)
    directory = tokenizer_dir(tmp_path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in [directory, *directory.iterdir()]}

    def no_training(vocab_size):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(tokenizer_module, "_train", no_training)
    second = demo_tokenizer(tmp_path)
    assert second.get_vocab() == first.get_vocab()
    assert second.apply_chat_template([{"role": "user", "content": "b"}], tokenize=False) == (
        "<|im_start|>user\nb<|im_end|>\n"
    )
    assert (second.eos_token_id, second.pad_token_id, second.bos_token) == (2, 0, None)
    assert {p.name: p.stat().st_mtime_ns for p in [directory, *directory.iterdir()]} == mtimes


def test_training_is_deterministic(tmp_path):
    a = tokenizer_dir(tmp_path / "a")
    demo_tokenizer(tmp_path / "a")
    demo_tokenizer(tmp_path / "b")
    b = tokenizer_dir(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_cache_location(tmp_path, monkeypatch):
    assert tokenizer_dir(tmp_path) == tmp_path / "tokenizers" / "tiny-qwen3-v1"
    assert tokenizer_dir(tmp_path, vocab_size=512).name == "tiny-qwen3-v1-vocab512"
    monkeypatch.setenv("PIPETUNE_CACHE", str(tmp_path / "pc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "pc"
    monkeypatch.delenv("PIPETUNE_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "pipetune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "pipetune"


def test_default_cache_dir_is_used_when_none_given(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETUNE_CACHE", str(tmp_path))
    demo_tokenizer()
    assert (tmp_path / "tokenizers" / "tiny-qwen3-v1" / "tokenizer.json").is_file()


def test_vocab_size_is_honoured_and_validated(tmp_path):
    small = demo_tokenizer(tmp_path, vocab_size=300)
    assert len(small) == 300
    assert tokenizer_dir(tmp_path, 300).is_dir() and not tokenizer_dir(tmp_path).exists()
    with pytest.raises(ValueError, match="vocab_size=200"):
        demo_tokenizer(tmp_path, vocab_size=200)


def test_losing_the_rename_race_loads_the_winner(tmp_path, monkeypatch):
    target = tokenizer_dir(tmp_path)
    real_train = tokenizer_module._train

    def train_while_another_process_finishes_first(vocab_size):
        trained = real_train(vocab_size)
        tokenizer_module._wrap(real_train(vocab_size)).save_pretrained(target)
        (target / "winner").write_text("")
        return trained

    monkeypatch.setattr(tokenizer_module, "_train", train_while_another_process_finishes_first)
    tok = demo_tokenizer(tmp_path)
    assert (target / "winner").exists()
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    assert os.listdir(target.parent) == [target.name]  # the loser's staging directory is gone


def _build_and_dump(cache_dir: str, out_path: str, barrier) -> None:
    barrier.wait()
    tok = demo_tokenizer(cache_dir)
    Path(out_path).write_text(json.dumps(tok.get_vocab(), sort_keys=True))


def test_concurrent_builds_into_one_empty_cache(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    outputs = [tmp_path / f"vocab{i}.json" for i in range(2)]
    processes = [
        context.Process(target=_build_and_dump, args=(str(tmp_path / "cache"), str(out), barrier)) for out in outputs
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=600)
    assert [process.exitcode for process in processes] == [0, 0]
    vocabs = [json.loads(out.read_text()) for out in outputs]
    assert vocabs[0] == vocabs[1]
    assert os.listdir(tmp_path / "cache" / "tokenizers") == ["tiny-qwen3-v1"]
