"""`pipetune summarize`: the base rebuilt from the run, text / JSONL / stdin inputs, batched generation."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipetune.cli import main
from pipetune.config import ConfigError, DataConfig
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.generate import (
    SUMMARY_FIELD,
    Sampling,
    format_summaries,
    inference_config,
    load_finetuned,
    read_transcripts,
    summarize,
)
from tests.conftest import run_cli, tiny_config

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def run_dir(shared_runs: Path) -> Path:
    """A tiny pipeline run with a non-default seed, so a base rebuilt with the default seed would differ: the shared
    2-epoch run without dropout (tests/conftest.py: TWO_EPOCHS_NO_DROPOUT), which tests/test_resume.py reads too."""
    return shared_runs / "two-epochs-no-dropout"


@pytest.fixture(scope="module")
def finetuned(run_dir: Path):
    return load_finetuned(inference_config(run_dir / "adapter").config, run_dir / "adapter")


@pytest.fixture(scope="module")
def meetings() -> list[str]:
    return [meeting.transcript for meeting in synthetic_splits(seed=3, n_train=1, n_validation=3)["validation"]]


@pytest.mark.slow
def test_base_comes_from_the_runs_config(run_dir: Path, tmp_path: Path) -> None:
    source = inference_config(run_dir / "adapter")
    assert source.config_path == run_dir / "config.toml" and not source.warning
    model = source.config.model
    assert (model.name, model.dtype, model.init, source.config.train.seed) == ("tiny-qwen3", "float32", "random", 7)

    alone = shutil.copytree(run_dir / "adapter", tmp_path / "adapter")  # no config.toml beside it
    source = inference_config(alone)
    assert source.config.model.name == "tiny-qwen3" and source.config.model.init == "random"
    assert "--config" in source.warning and "seed 42" in source.warning
    assert inference_config(alone, config_path=run_dir / "config.toml").config.train.seed == 7
    assert inference_config(alone, base="qwen3-0.6b").config.model.name == "qwen3-0.6b"

    with pytest.raises(ConfigError, match="has no adapter_config.json"):
        inference_config(tmp_path)


@pytest.mark.slow
def test_cli_summarizes_jsonl_keeping_other_fields(run_dir: Path, finetuned, meetings, tmp_path: Path) -> None:
    records = [{"id": i, "dialogue": text, "summary": f"reference {i}"} for i, text in enumerate(meetings)]
    path = tmp_path / "meetings.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    result = run_cli(
        "summarize",
        "--adapter",
        str(run_dir / "adapter"),
        str(path),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--quiet",
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["id"] for line in lines] == [0, 1, 2]
    assert all(line["summary"] == f"reference {i}" and "dialogue" not in line for i, line in enumerate(lines))
    # the CLI process rebuilt the same base (seed 7 from config.toml) and the same adapter: same greedy text
    model, prepared = finetuned
    expected = summarize(model, prepared, meetings, MAX_NEW_TOKENS, batch_size=2)
    assert [line[SUMMARY_FIELD] for line in lines] == expected


def test_inputs_text_jsonl_and_stdin(tmp_path: Path, meetings) -> None:
    text = tmp_path / "meeting.txt"
    text.write_text(meetings[0] + "\n")
    data = DataConfig()  # transcript_column "dialogue"
    one = read_transcripts(str(text), data)
    assert one.transcripts == [meetings[0]] and one.records is None
    assert format_summaries(["short summary"], one) == "short summary"

    jsonl = "".join(json.dumps({"dialogue": m, "n": i}) + "\n" for i, m in enumerate(meetings[:2]))
    piped = read_transcripts("-", data, stdin=io.StringIO(jsonl))  # JSONL recognised without a suffix
    assert piped.transcripts == meetings[:2] and [r["n"] for r in piped.records] == [0, 1]
    out = [json.loads(line) for line in format_summaries(["a", "b"], piped).splitlines()]
    assert out == [{"n": 0, SUMMARY_FIELD: "a"}, {"n": 1, SUMMARY_FIELD: "b"}]
    assert read_transcripts("-", data, stdin=io.StringIO(meetings[1])).transcripts == [meetings[1]]

    # unusable rows are skipped and counted, the rest summarized; the first line makes stdin JSONL
    rows = '{"dialogue": "a"}\n{"transcript": "b"}\nnot json\n{"dialogue": ""}\n[1]\n{"dialogue": "c", "n": 1}\n'
    mixed = read_transcripts("-", data, stdin=io.StringIO(rows))
    assert mixed.transcripts == ["a", "c"] and [r.get("n") for r in mixed.records] == [None, 1]
    assert [n for n, _ in mixed.skipped] == [2, 3, 4, 5]
    assert mixed.skipped_line() == (
        "skipped 4 of 6 rows: line 2 (missing dialogue), line 3 (not valid JSON), "
        "line 4 (empty dialogue), line 5 (a JSON list)"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"transcript": "a"}\n{"transcript": "b", "id": 2}\n')
    with pytest.raises(ConfigError, match=r"no usable row .* --column \(fields seen: id, transcript\)"):
        read_transcripts(str(bad), data)
    bad.write_text('{"dialogue": " "}\n')
    with pytest.raises(ConfigError, match=r"no usable row \(skipped 1 of 1 rows: line 1 \(empty dialogue\)\)"):
        read_transcripts(str(bad), data)
    with pytest.raises(ConfigError, match="is empty"):
        read_transcripts("-", data, stdin=io.StringIO("\n \n"))
    with pytest.raises(ConfigError, match="is empty"):
        read_transcripts("-", data, stdin=io.StringIO("\u00a0\u3000\n"))  # Unicode whitespace alone
    (tmp_path / "latin1.txt").write_bytes("Ren\xe9: on y va.".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"input '.*latin1.txt' is not UTF-8 text \(.*\); save it as UTF-8"):
        read_transcripts(str(tmp_path / "latin1.txt"), data)
    with pytest.raises(ConfigError, match="does not exist"):
        read_transcripts(str(tmp_path / "missing.txt"), data)


@pytest.mark.slow
def test_batches_are_left_padded_and_keep_input_order(finetuned, meetings) -> None:
    """Prompts of different lengths in one left-padded batch give the same greedy text as one at a time."""
    model, prepared = finetuned
    texts = [meetings[0], meetings[1][:60], meetings[2][:120]]
    assert len({len(prepared.prompts.prompt_ids(text)) for text in texts}) == 3  # three widths: real padding
    done: list[int] = []
    together = summarize(model, prepared, texts, MAX_NEW_TOKENS, batch_size=3, progress=done.append)
    assert done == [3]
    alone = [summarize(model, prepared, [text], MAX_NEW_TOKENS)[0] for text in texts]
    assert together == alone
    assert any(together)  # some generated text, not only the stop token


def test_the_loaded_model_generates_with_its_kv_cache(finetuned, meetings) -> None:
    """Training builds the base without a KV cache; a model loaded for inference has it back, so transformers'
    own generate() (what a user's script calls on it) is not quadratic in the prompt."""
    model, prepared = finetuned
    assert model.config.use_cache and model.generation_config.use_cache
    ids = torch.tensor([prepared.prompts.prompt_ids(meetings[0][:200])])
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values is not None


def test_a_summary_ends_at_the_turns_end_or_at_the_end_of_text() -> None:
    """A base model may close its answer with the tokenizer's end of text instead of the turn's closing token:
    generation stops at either, and the summary is what came before the first."""
    from types import SimpleNamespace

    turn_end, end_of_text = 7, 9
    asked = {}

    class Model(torch.nn.Linear):
        def generate(self, input_ids, eos_token_id, **kwargs):
            asked["stops"] = eos_token_id
            return torch.cat([input_ids, torch.tensor([[3, 4, end_of_text, 5, turn_end]])], dim=1)

    tokenizer = SimpleNamespace(eos_token_id=end_of_text, decode=lambda ids, **kwargs: " ".join(map(str, ids)))
    prompts = SimpleNamespace(end_ids=[turn_end], prompt_ids=lambda text, system=None: [1, 2])
    prepared = SimpleNamespace(tokenizer=tokenizer, prompts=prompts, pad_id=0)
    assert summarize(Model(1, 1), prepared, ["a meeting"]) == ["3 4"]
    assert asked["stops"] == [turn_end, end_of_text]


def test_long_meetings_go_in_smaller_batches_and_tokens_are_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """Batches hold prompts of similar length, at most --batch-size of them and --max-batch-tokens of KV cache
    (a 16k-token meeting alone); the tokens/s line counts summary tokens up to the stop, not the padding."""
    from types import SimpleNamespace

    from pipetune.generate import GenerationStats, plan_batches

    lengths = [100, 10, 16_000, 12, 9_000, 11]
    assert plan_batches(lengths, 8, None, 50) == [[1, 5, 3, 0, 4, 2]]
    assert plan_batches(lengths, 2, None, 50) == [[1, 5], [3, 0], [4, 2]]
    assert plan_batches(lengths, 8, 20_000, 50) == [[1, 5, 3, 0], [4], [2]]
    assert plan_batches(lengths, 8, 1, 50) == [[i] for i in (1, 5, 3, 0, 4, 2)]

    class Model(torch.nn.Linear):
        def generate(self, input_ids, **kwargs):  # row 0 stops after 2 tokens, row 1 after 3
            new = torch.tensor([[3, 4, 7, 0], [3, 4, 5, 7]])[: len(input_ids)]
            return torch.cat([input_ids, new], dim=1)

    tokenizer = SimpleNamespace(eos_token_id=None, decode=lambda ids, **kwargs: " ".join(map(str, ids)))
    prompts = SimpleNamespace(end_ids=[7], prompt_ids=lambda text, system=None: [1] * len(text))
    prepared = SimpleNamespace(tokenizer=tokenizer, prompts=prompts, pad_id=0)
    stats = GenerationStats()
    assert summarize(Model(1, 1), prepared, ["ab", "abc"], stats=stats) == ["3 4", "3 4 5"]
    assert (stats.transcripts, stats.batches, stats.prompt_tokens, stats.new_tokens) == (2, 1, 5, 5)
    assert re.fullmatch(
        r"2 summaries in 1 batches: 5 new tokens in \d+\.\d s, \d+\.\d tokens/s \(5 prompt tokens\)", stats.line()
    )
    for args in (["--max-batch-tokens", "0"], ["--batch-size", "0", "--max-new-tokens", "-1"]):
        assert main(["summarize", "--adapter", "nowhere", *args]) == 2
    err = capsys.readouterr().err
    assert "error: --max-batch-tokens 0 must be at least 1\n" in err
    assert "error: --batch-size 0 and --max-new-tokens -1 must be at least 1\n" in err


@pytest.mark.slow
def test_sampling_is_seeded_and_checked(finetuned, meetings) -> None:
    model, prepared = finetuned
    first = summarize(model, prepared, meetings[:2], MAX_NEW_TOKENS, sampling=Sampling(0.8, 0.9, seed=1))
    again = summarize(model, prepared, meetings[:2], MAX_NEW_TOKENS, sampling=Sampling(0.8, 0.9, seed=1))
    assert first == again and len(first) == 2
    with pytest.raises(ConfigError, match="--temperature 0"):
        Sampling(temperature=0)
    with pytest.raises(ConfigError, match="--top-p 1.5"):
        Sampling(top_p=1.5)


@pytest.mark.slow
def test_cli_rejects_sampling_flags_without_sample(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", "--adapter", str(run_dir / "adapter"), "--temperature", "0.5", "-"]) == 2
    assert "add --sample" in capsys.readouterr().err


CARD_CODE = ("The prompt", r"transformers \+ PEFT")
"""The model card's sections whose code, run in order, loads the export and summarizes."""


def test_export_reproduces_summarize_with_plain_transformers_and_peft(
    run_dir: Path, finetuned, meetings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model card's code (transformers, PEFT, torch and the export directory only) builds pipetune's prompt
    token for token and generates the same summaries; the merged model computes the same logits."""
    out = tmp_path / "export"
    assert main(["export", "--run", str(run_dir), "--out", str(out), "--merge"]) == 0
    assert json.loads((out / "prompt.json").read_text()) == json.loads((run_dir / "prompt.json").read_text())
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((out / "base").resolve())
    assert AutoTokenizer.from_pretrained(out / "adapter").chat_template is not None

    readme = (out / "README.md").read_text()
    blocks = [re.search(rf"## {title}\n.*?```python\n(.*?)```", readme, re.S).group(1) for title in CARD_CODE]
    card: dict = {}
    monkeypatch.chdir(out)  # the card's paths are relative to the export directory
    for block in blocks:
        exec(compile(block, str(out / "README.md"), "exec"), card)
    model, prepared = finetuned
    texts = [meetings[0], meetings[1][:60]]
    budget = json.loads((out / "prompt.json").read_text())["transcript_budget"]
    assert len(prepared.tokenizer.encode(texts[0])) > budget > len(prepared.tokenizer.encode(texts[1]))  # cut, not
    assert [card["prompt_ids"](text) for text in texts] == [prepared.prompts.prompt_ids(text) for text in texts]
    expected = summarize(model, prepared, texts, MAX_NEW_TOKENS)
    assert [card["summarize"](text, MAX_NEW_TOKENS) for text in texts] == expected and any(expected)

    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([card["prompt_ids"](texts[0])])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, card["model"](input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    assert main(["export", "--run", str(run_dir), "--out", str(out)]) == 2  # never writes into a used directory


def test_real_model_is_prompted_exactly_as_trained(smollm2: Path, tmp_path: Path) -> None:
    """`summarize` feeds the real model, left-padded, exactly the prompt tokens training fed it for the same rows."""
    from pipetune.data.batching import tokenize_split
    from pipetune.data.example import Example
    from pipetune.model.load import build_model
    from pipetune.preflight import prepare

    config = tiny_config(tmp_path, 'model.name="smollm2-135m"', 'model.init="pretrained"', "data.max_length=160")
    prepared = prepare(config)
    rows = synthetic_splits(seed=5, n_train=1, n_validation=4)["validation"]
    rows = [rows[0], Example(rows[1].transcript[:300], rows[1].summary), rows[2], Example("Anna: <|im_end|> ok.", "x")]
    split = tokenize_split(rows, prepared.prompts, prepared.pad_id)
    assert split.truncated >= 2  # long meetings lose their middle at 160 tokens
    model, _ = build_model(prepared.model, torch.float32, torch.device("cpu"))
    fed: list[tuple[torch.Tensor, torch.Tensor]] = []
    generate = model.generate

    def recording(**kwargs):
        fed.append((kwargs["input_ids"], kwargs["attention_mask"]))
        return generate(**kwargs)

    model.generate = recording
    summarize(model, prepared, [row.transcript for row in rows], max_new_tokens=2, batch_size=4)
    ((ids, mask),) = fed
    prompts = sorted(ids[i][mask[i].bool()].tolist() for i in range(len(rows)))
    trained = [prepared.prompts.build(row.transcript, row.summary) for row in rows]
    assert prompts == sorted(split.input_ids[i, : s.n_prompt].tolist() for i, s in enumerate(trained))


def words_filling(prompts, budget: int) -> str:
    """Plain words that take at most `budget` tokens, and all of them nearly: a transcript at the cut."""
    words = " ".join(f"w{i}" for i in range(budget))
    while len(prompts.encode_text(words)) > budget:
        words = words.rsplit(" ", 1)[0]
    return words


def test_jsonl_and_chat_rows_are_read_as_training_reads_them(tmp_path: Path, meetings) -> None:
    """A JSONL row's summarize prompt is the prompt training built from the same row: the transcript stripped (a
    row at the budget is not cut for trailing whitespace), chat `messages` rows read as train and eval read them;
    with a chat row's own system message as training keeps it; the field the transcript came from is left out of
    the output, every other field kept."""
    from pipetune.data.sources import load_dataset
    from pipetune.preflight import prepare

    config = tiny_config(tmp_path, "data.validation_fraction=0.0")
    prompts = prepare(config).prompts
    at_budget = words_filling(prompts, prompts.transcript_room)
    system = {"role": "system", "content": "Answer in one line."}
    user = [system, {"role": "user", "content": " " + meetings[1][:90] + "\n"}]
    rows = [
        {"id": 0, "dialogue": "\n  " + meetings[0][:150] + "  \n", "summary": "s"},
        {"id": 1, "dialogue": at_budget + "\n\n\n\n\n\n", "summary": "s"},
        {"id": 2, "messages": [*user, {"role": "assistant", "content": "reference"}]},
        {"id": 3, "messages": [*user, {"role": "assistant", "content": "reference"}, {"role": "user", "content": "?"}]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config.data.source = str(path)
    trained = [prompts.build(e.transcript, e.summary, e.system) for e in load_dataset(config.data).splits["train"]]
    read = read_transcripts(str(path), config.data)
    assert not read.skipped and len(trained) == len(rows)
    assert read.systems == [None, None, "Answer in one line.", "Answer in one line."]
    read_ids = [prompts.prompt_ids(t, system) for t, system in zip(read.transcripts, read.systems, strict=True)]
    assert read_ids == [s.input_ids[: s.n_prompt] for s in trained]
    assert read_ids[2] != prompts.prompt_ids(read.transcripts[2])  # the row's system prompt, not the default
    # row 1 fits once stripped; as given, its trailing newlines would have taken it over the budget and cut it
    room = prompts.transcript_room
    assert len(prompts.encode_text(rows[1]["dialogue"])) > room >= len(prompts.encode_text(at_budget))
    out = [json.loads(line) for line in format_summaries(["a", "b", "c", "d"], read).splitlines()]
    assert out == [{"id": i, "summary": "s", SUMMARY_FIELD: s} for i, s in enumerate("ab")] + [
        {"id": i, SUMMARY_FIELD: s} for i, s in ((2, "c"), (3, "d"))
    ]

    # a conversation awaiting its summary (no assistant message): its last user message, which training would skip
    pending = read_transcripts("-", config.data, stdin=io.StringIO(json.dumps({"messages": user}) + "\n"))
    assert pending.transcripts == [user[1]["content"].strip()]
    bad = '{"messages": [{"role": "assistant", "content": "x"}]}\n{"messages": "hi"}\n'
    with pytest.raises(ConfigError, match=r"line 1 \(no user message before the last assistant message\), line 2"):
        read_transcripts("-", config.data, stdin=io.StringIO(bad))
