"""`pipetune data inspect`: counts, skipped rows, truncation and pad fractions checked against independent sums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetune.cli import main, run_data_inspect
from pipetune.data.batching import bucket_boundaries, pad_fraction, tokenize_split
from pipetune.data.inspect import percentile
from pipetune.data.sources import load_dataset
from pipetune.preflight import prepare
from tests.conftest import tiny_config, write_config


def test_percentiles_buckets_and_pad_fractions_by_hand() -> None:
    assert [percentile(list(range(1, 101)), q) for q in (50, 90, 99)] == [50, 90, 99]
    assert percentile([7], 99) == 7 and percentile([], 50) == 0
    assert bucket_boundaries(8192) == [2048, 4096, 6144, 8192]
    assert pad_fraction(torch.tensor([100, 300]), [400]) == pytest.approx(1 - 400 / 800)
    # 100 -> bucket 100, 150 -> 200, 400 -> 400: 650 real of 700
    assert pad_fraction(torch.tensor([100, 150, 400]), [100, 200, 300, 400]) == pytest.approx(1 - 650 / 700)


def test_inspect_synthetic_counts_and_pad_fraction(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # 768 tokens: most synthetic meetings fit (padding), the longest are cut
    config = tiny_config(tmp_path / "run", "data.max_length=768", "data.max_summary_tokens=80")
    assert run_data_inspect(config) == 0
    text = capsys.readouterr().out

    prepared = prepare(config)
    dataset = load_dataset(config.data, seed=config.train.seed)
    train = tokenize_split(dataset.splits["train"], prepared.prompts, prepared.pad_id)
    real = train.real_tokens.tolist()
    expected_pad = 1 - sum(real) / (len(real) * 768)
    expected_bucketed = 1 - sum(real) / sum(-(-n // 192) * 192 for n in real)  # buckets 192/384/576/768
    assert 0.05 < expected_bucketed < expected_pad  # the config makes both visible

    lines = text.splitlines()
    assert any(line.split() == ["train", "32", "32", "0", "-"] for line in lines)
    assert any(line.split() == ["validation", "8", "8", "0", "-"] for line in lines)
    assert "skipped rows: none" in text
    padding = next(line for line in lines if line.startswith("train") and "%" in line).split()
    assert padding[1:3] == [f"{100 * expected_pad:.1f}%", f"{100 * expected_bucketed:.1f}%"]
    samples = [prepared.prompts.build(e.transcript, e.summary) for e in dataset.splits["train"]]
    cut = [s.transcript_tokens_cut for s in samples if s.transcript_tokens_cut]
    capped = sum(bool(s.summary_tokens_cut) for s in samples)
    assert 0 < len(cut) < 32 and train.truncated == sum(
        bool(s.transcript_tokens_cut or s.summary_tokens_cut) for s in samples
    )
    truncation = next(line for line in lines if line.startswith("train") and len(line.split()) == 7).split()
    assert truncation[1:4] == ["32", str(len(cut)), f"{sum(cut) / len(cut):.0f}"]
    assert truncation[4] == str(max(cut)) and truncation[5] == str(capped)


def test_inspect_json_through_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [
        {"dialogue": f"Project Manager (Anna): item {i}. " * (20 * i + 1), "summary": f"Item {i}."} for i in range(8)
    ]
    source = tmp_path / "meetings.jsonl"
    source.write_text("\n".join([json.dumps(r) for r in rows] + ["{broken", json.dumps({"dialogue": "x"})]) + "\n")
    config = write_config(tiny_config(tmp_path / "run"), tmp_path / "config.toml")

    code = main(
        ["data", "inspect", "--config", str(config), "--set", f'data.source="{source}"', "--set", "data.max_length=512"]
        + ["--set", "data.validation_fraction=0.25", "--json"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone

    assert report["max_length"] == 512 and report["buckets"] == [128, 256, 384, 512]
    assert report["rows"]["skipped"] == {"missing summary": 1, "unparsable JSON line": 1}
    assert report["rows"]["splits"]["train"] == {
        "read": 10,
        "kept": 6,
        "skipped": {"missing summary": 1, "unparsable JSON line": 1},
        "held_out": 2,
        "from_train": 0,
        "skipped_at": {"missing summary": [f"{source}:10"], "unparsable JSON line": [f"{source}:9"]},
        "shortened": 0,
    }
    splits = {s["name"]: s for s in report["splits"]}
    assert splits["train"]["samples"] == 6 and splits["validation"]["samples"] == 2
    # transcripts grow with i: the longest are cut to fit 512 tokens, and only those
    every = splits["train"]["transcripts_cut"] + splits["validation"]["transcripts_cut"]
    assert 0 < every < 8
    assert splits["train"]["sample_tokens"]["max"] <= 512
    assert sum(splits["train"]["bucket_samples"]) == 6


def test_inspect_reports_a_bad_config_value(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tiny_config(tmp_path / "run"), tmp_path / "config.toml")
    assert main(["data", "inspect", "--config", str(config), "--set", "data.validation_fraction=1.5"]) == 2
    assert "data.validation_fraction = 1.5" in capsys.readouterr().err


def test_bucketed_rows_attend_as_far_as_their_bucket(tmp_path: Path) -> None:
    """With data.buckets a token of a row padded to b tokens does b / max_length of a whole row's attention work;
    the speed models (plan, bench MFU) take the token-weighted mean over the training split."""
    from pipetune.data.batching import bucket_lengths
    from pipetune.data.cache import tokenized_data
    from pipetune.data.inspect import training_attention_share

    config = tiny_config(tmp_path, "data.max_length=512", "data.buckets=[256, 384, 512]")
    prompts = prepare(config).prompts
    lengths = tokenized_data(config.data, prompts, config.train.seed).splits["train"].lengths
    padded = bucket_lengths(lengths, [256, 384, 512]).double()
    share = training_attention_share(config, prompts)
    assert share == pytest.approx(float((padded**2).sum() / (512 * padded.sum())))
    assert 0 < share < 1 and training_attention_share(tiny_config(tmp_path), prompts) == 1.0
