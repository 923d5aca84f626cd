"""Sample packing's data path: best fit, longest first, over windows of the epoch's order; packed rows with
per-sample labels and positions; and the config keys that turn it on."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pipetune.config import Config, ConfigError, apply_override, validate
from pipetune.data.batching import IGNORE, SampleStore, epoch_order
from pipetune.data.packing import (
    batches_of_rows,
    best_fit_rows,
    epoch_rows,
    members,
    packed_attention_share,
    packed_batch,
    row_documents,
    rows_attention_share,
)
from pipetune.data.prompt import Sample
from pipetune.model.attention import span_table
from pipetune.preflight import check_packing, epoch_steps, preflight, prepare
from tests.conftest import tiny_config, write_config


def _store(lengths: list[int], prompt: int = 3) -> SampleStore:
    ids = itertools.cycle(range(1, 10_000))
    return SampleStore.from_samples([Sample([next(ids) for _ in range(n)], min(prompt, n - 1), 0, 0) for n in lengths])


def test_best_fit_lays_the_longest_first_and_fills_the_tightest_gap() -> None:
    # Longest first: 60 opens row 0 (40 left), 45 row 1 (55 left), 40 fills row 0 exactly, 30 and 25 fill row 1.
    # (First fit over the order 30, 60, 45, 40, 25 would have opened a third row.)
    rows = best_fit_rows(torch.arange(5), torch.tensor([30, 60, 45, 40, 25]), 100, 4)
    assert rows.tolist() == [[1, 3, -1, -1], [2, 0, 4, -1]]
    # At most max_per_row samples a row, even where more would fit; equal lengths keep the order's.
    rows = best_fit_rows(torch.arange(5), torch.full((5,), 10), 100, 2)
    assert rows.tolist() == [[0, 1], [2, 3], [4, -1]]
    # Windows: the first window's two samples of 50 pair up before the next window's 70 and 30 are seen (rows of
    # 100 // 30 = 3 columns: no row holds more samples of 30 tokens or longer).
    lengths = torch.tensor([50, 50, 30, 70])
    assert best_fit_rows(torch.arange(4), lengths, 100, 4, window=2).tolist() == [[0, 1, -1], [3, 2, -1]]
    assert best_fit_rows(torch.arange(4), lengths, 100, 4).tolist() == [[3, 2, -1], [0, 1, -1]]


def test_a_bound_on_samples_a_row_the_data_cannot_reach_neither_changes_nor_sizes_the_rows() -> None:
    """data.max_samples_per_row = 1e8 once allocated [rows, 1e8] (a 16.8 GB traceback): rows are as wide as the
    most samples a row can hold (row_length // the shortest) and packed as under that bound."""
    lengths = torch.tensor([30, 12, 45, 25, 12, 60, 40])
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0))
    reachable = best_fit_rows(order, lengths, 100, 100 // 12)
    assert torch.equal(best_fit_rows(order, lengths, 100, 10**6), reachable)
    assert reachable.shape == (3, 8)


def test_best_fit_leaves_little_padding_on_meeting_lengths() -> None:
    """Log-normal lengths around 6,000 tokens (whole meetings) in rows of 16,384: within 1.5% of the fewest rows
    the tokens need; the bound on samples a row is kept, and every sample is in one row once."""
    lengths = (8.7 + 0.5 * torch.randn(2000, generator=torch.Generator().manual_seed(0))).exp()
    lengths = lengths.clamp(200, 16_384).long()
    rows = best_fit_rows(epoch_order(len(lengths), 0, 0), lengths, 16_384, 16)
    fewest = -(-int(lengths.sum()) // 16_384)
    assert len(rows) <= 1.015 * fewest
    assert sorted(members(rows).tolist()) == list(range(len(lengths)))
    sizes = torch.where(rows >= 0, lengths[rows.clamp(min=0)], 0).sum(-1)
    assert int(sizes.max()) <= 16_384 and int((rows >= 0).sum(-1).max()) <= 16


def test_a_packed_rows_attention_is_its_documents_own() -> None:
    """Two samples of 50 in each row of 100 attend over 2 x 50^2 of a whole row's 100^2 pairs: half; samples as
    long as the row attend as a whole row does; a longer sample is cut to the row first. The pad tail is a document
    of its own, which flex attention computes: one sample of 50 a row costs 50^2 + 50^2 too."""
    assert packed_attention_share(torch.full((6,), 50), 100, 2) == 0.5
    assert packed_attention_share(torch.full((6,), 50), 100, 1) == 0.5
    assert packed_attention_share(torch.tensor([30, 30]), 100, 2) == (30**2 + 30**2 + 40**2) / 100**2
    assert packed_attention_share(torch.tensor([100, 100, 300]), 100, 4) == 1.0
    assert packed_attention_share(torch.empty(0, dtype=torch.long), 100, 4) == 1.0


def test_packed_epochs_hold_every_sample_once_within_the_bounds_and_replay() -> None:
    lengths = torch.randint(20, 200, (300,), generator=torch.Generator().manual_seed(0))
    plan = batches_of_rows(epoch_rows(lengths, 256, 3, 7, 1), 4)
    assert plan.shape[1:] == (4, 3)
    rows = plan.view(-1, 3)
    sizes = torch.where(rows >= 0, lengths[rows.clamp(min=0)], 0).sum(-1)
    assert int(sizes.max()) <= 256
    packed = members(plan)
    assert len(packed) == len(set(packed.tolist()))  # no sample twice
    everything = best_fit_rows(epoch_order(300, 7, 1), lengths, 256, 3)
    assert len(everything) - len(rows) < 4  # only the rows that fill no whole batch are left out
    assert len(members(everything)) == 300
    # The epoch's rows are best fit's over its order, shuffled: not in the order they were opened.
    shuffled = epoch_rows(lengths, 256, 3, 7, 1)
    assert sorted(map(tuple, shuffled.tolist())) == sorted(map(tuple, everything.tolist()))
    assert not torch.equal(shuffled, everything)
    assert torch.equal(plan, batches_of_rows(epoch_rows(lengths, 256, 3, 7, 1), 4))
    assert not torch.equal(plan, batches_of_rows(epoch_rows(lengths, 256, 3, 7, 2), 4))
    # Fewer rows than samples: the point of packing.
    assert len(everything) < 300 * 0.6


def test_samples_of_at_most_half_a_row_pair_up() -> None:
    """With at most 2 samples a row and none longer than half of it, every row holds two: 4 rows a step hold the 8
    samples an unpacked step of 8 holds (what tests/parallel/test_packing.py's reference runs take)."""
    lengths = torch.randint(10, 51, (32,), generator=torch.Generator().manual_seed(1))
    packed = batches_of_rows(epoch_rows(lengths, 100, 2, 3, 0), 4)
    assert packed.shape == (4, 4, 2) and bool((packed >= 0).all())
    assert sorted(packed.flatten().tolist()) == list(range(32))


def test_packed_row_is_its_samples_unpacked_one_after_another() -> None:
    store = _store([9, 5, 12, 7])
    rows = torch.tensor([[0, 1, 2], [3, -1, -1]])
    input_ids, labels, position_ids = packed_batch(store, rows, 32, pad_id=0)
    alone_ids, alone_labels = store.batch([0, 1, 2, 3], 32, pad_id=0)
    for row, samples in enumerate(rows.tolist()):
        start = 0
        for i in (s for s in samples if s >= 0):
            n = int(store.lengths[i])
            assert torch.equal(input_ids[row, start : start + n], alone_ids[i, :n])
            # The same shifted labels: the sample's last token predicts nothing (not the next sample's first).
            assert torch.equal(labels[row, start : start + n], alone_labels[i, :n])
            assert labels[row, start + n - 1] == IGNORE
            assert torch.equal(position_ids[row, start : start + n], torch.arange(n))
            start += n
        assert (input_ids[row, start:] == 0).all() and (labels[row, start:] == IGNORE).all()
        assert torch.equal(position_ids[row, start:], -torch.arange(32 - start))  # the pads: 0, -1, -2, ...
    assert int((labels != IGNORE).sum()) == int(store.supervised.sum())
    # The documents flex attention computes (a new one wherever the position is 0): the samples and the pad tails;
    # the documents kernel's spans: the samples only.
    spans = span_table(position_ids)
    seen = sorted(int(end - start) for row in spans for start, end in row.tolist() if end > start)
    assert seen == [5, 7, 9, 12]
    docs = sorted(row_documents(rows, store.lengths, 32).tolist())
    assert docs == sorted([*seen, 32 - 26, 32 - 7]) == [5, 6, 7, 9, 12, 25]
    assert rows_attention_share(rows, store.lengths, 32) == pytest.approx(sum(n * n for n in docs) / (2 * 32**2))
    with pytest.raises(ValueError, match="overruns the row of 16"):
        packed_batch(store, torch.tensor([[0, 2]]), 16, pad_id=0)


def _config(*overrides: str) -> Config:
    config = Config()
    for item in overrides:
        apply_override(config, item)
    return config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.packing=true", "data.max_length=512", "data.buckets=[256, 512]"],
            r"data.packing = true fills rows of data.max_length, but data.buckets = \[256, 512\] pads each sample",
        ),
        (["data.packing=true", "data.max_samples_per_row=0"], "data.max_samples_per_row = 0 must be at least 1"),
        (  # once [rows, 1e8] tensors: a 16.8 GB allocation traceback
            ["data.packing=true", "data.max_length=512", "data.max_samples_per_row=100000000"],
            r"^data.max_samples_per_row = 100000000 is more samples than a row of data.max_length = 512 tokens holds "
            r"\(each takes 2 tokens at least, the chat template more\); set at most 256, e.g. 16$",
        ),
    ],
)
def test_packing_settings_are_validated(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_config(*overrides, "parallel.pp=1", 'parallel.strategy="single"'), 1)


def test_packed_rows_the_model_cannot_take_are_refused(tmp_path: Path) -> None:
    """A row shorter than the template; and Gemma 3's sliding-window layers (a mask of their own, which the
    document mask does not combine with) at rows longer than the window, refused by preflight with the stage's
    message, before any worker loads weights."""
    with pytest.raises(ConfigError, match=r"data.max_length = 8 cannot hold the chat template"):
        prepare(tiny_config(tmp_path, "data.packing=true", "data.max_length=8"))
    single = ["parallel.pp=1", 'parallel.strategy="single"']
    gemma = tiny_config(tmp_path, 'model.name="tiny-gemma3"', "data.packing=true", *single)  # window 16, rows 128
    with pytest.raises(
        ConfigError,
        match=r"^data.packing = true: sliding_attention layers \(gemma3_text\) have a mask of their own, which packed "
        r"rows' document mask does not combine with yet; set data.packing = false$",
    ):
        preflight(gemma, 1)
    model_config = prepare(gemma).model.config
    apply_override(gemma, "data.max_length=16")  # the window covers the row: plain causal layers
    check_packing(gemma, model_config)
    apply_override(gemma, "data.max_length=128")
    apply_override(gemma, "data.packing=false")
    check_packing(gemma, model_config)
    qwen = tiny_config(tmp_path, "data.packing=true", *single)
    check_packing(qwen, prepare(qwen).model.config)


def test_inspect_reports_rows_and_padding_with_and_without_packing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Short meetings in rows of 256: unpacked, one sample a row and most of it padding; packed, the rows best fit
    fills, and their padding, computed here from the tokenized split."""
    from pipetune.cli import run_data_inspect
    from tests.parallel.test_packing import write_short_meetings

    data = write_short_meetings(tmp_path / "meetings.jsonl", 40)
    config = tiny_config(
        tmp_path / "run", f'data.source="{data}"', 'data.system_prompt="Sum."', "data.max_length=256", "train.seed=5"
    )
    assert run_data_inspect(config) == 0
    lines = capsys.readouterr().out.splitlines()
    prepared = prepare(config)
    store = SampleStore.from_samples(
        prepared.prompts.build_many([(e.transcript, e.summary) for e in _examples(config)])
    )
    packed = best_fit_rows(
        torch.randperm(len(store), generator=torch.Generator().manual_seed(5 * 1_000_003)), store.lengths, 256, 16
    )
    rows = len(packed)
    real = int(store.lengths.sum())
    used = [[int(store.lengths[i]) for i in row if i >= 0] for row in packed.tolist()]
    squares = sum(n**2 for row in used for n in row) + sum((256 - sum(row)) ** 2 for row in used)  # pad tails too
    assert rows < len(store) / 3  # 30-64 tokens a sample: four or more a row
    padding = next(line for line in lines if line.startswith("train") and "->" in line).split()
    assert padding[1] == f"{100 * (1 - real / (len(store) * 256)):.1f}%"
    packed_pad, attention = f"{100 * (1 - real / (rows * 256)):.1f}%", f"{100 * squares / (rows * 256**2):.1f}%"
    assert padding[4:] == [packed_pad, str(len(store)), "->", str(rows), attention]
    # `pipetune plan` of the packed run counts the attention of the same rows (data/inspect.training_attention_share).
    from pipetune.cli import main

    apply_override(config, "data.packing=true")
    assert main(["plan", "--config", str(write_config(config, tmp_path / "packed.toml")), "--gpus", "1"]) == 0
    assert f"packed rows: attention {100 * squares / (rows * 256**2):.0f}% of a whole row's" in capsys.readouterr().out


def _examples(config: Config) -> list:
    from pipetune.data.sources import load_dataset

    return load_dataset(config.data, seed=config.train.seed).splits["train"]


def test_the_launcher_counts_optimizer_steps_of_packed_rows() -> None:
    """train.batch_size counts rows with data.packing: 32 samples of 379-943 tokens pack into 11 rows of 2048, 2
    batches of 4 rows, no optimizer step of grad_accum 4. The launcher refuses it (preflight.epoch_steps, which
    every worker's build_data counts with too), naming the rows; unpacked, the same samples make 2 steps an epoch."""
    lengths = torch.randint(379, 944, (32,), generator=torch.Generator().manual_seed(0))
    settings = ["data.max_length=2048", "train.batch_size=4", "train.grad_accum=4", "train.epochs=3"]
    assert epoch_steps(_config(*settings), lengths, "skipped rows: none") == [2, 2, 2]
    with pytest.raises(
        ConfigError,
        match=r"^32 training samples \(skipped rows: none\) pack into 11 rows of data.max_length 2048 \(data.packing: "
        r"train.batch_size counts rows\), which make no optimizer step of train.batch_size 4 x train.grad_accum 4; "
        r"lower them, set data.packing = false \(one sample a row\), or add data$",
    ):
        epoch_steps(_config("data.packing=true", *settings), lengths, "skipped rows: none")


def test_a_resumed_packed_run_continues_with_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training loop's plan (train.TrainData, its steps counted by preflight.epoch_steps as build_data counts
    them) with packing: every epoch repacked in its own order and as many steps in it as its own rows hold
    (14, 13, 13 here, with windows of 8 samples: the 120 samples would all be one window), whatever train.epochs
    is. A run resumed at a checkpoint's position gets the batches the uninterrupted run got from there on, also
    when it plans more epochs than the run that saved it."""
    from pipetune.checkpoint import Position
    from pipetune.train import TrainData

    monkeypatch.setattr("pipetune.data.packing.PACK_WINDOW", 8)
    lengths = torch.randint(20, 200, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    store = _store(lengths)

    def plan(epochs: int, *overrides: str) -> TrainData:
        config = _config(
            "data.packing=true",
            "data.max_length=256",
            "data.max_samples_per_row=4",
            "train.batch_size=2",
            "train.grad_accum=2",
            "train.seed=11",
            f"train.epochs={epochs}",
            *overrides,
        )
        steps = epoch_steps(config, store.lengths, "skipped rows: none")
        total = sum(steps) if config.train.max_steps < 0 else min(sum(steps), config.train.max_steps)
        return TrainData(
            split=store,
            real_tokens=store.lengths,
            supervised=store.supervised,
            padded_lengths=store.lengths,
            buckets=[],
            max_length=256,
            global_batch=2,
            grad_accum=2,
            pad_id=0,
            seed=11,
            epoch_steps=steps,
            total_steps=total,
            validation=None,
            max_samples_per_row=4,
        )

    def same(got: list, expected: list) -> None:
        assert len(got) == len(expected)
        for (epoch, index, batches, lengths), want in zip(got, expected, strict=True):
            assert (epoch, index) == want[:2]
            assert torch.equal(batches, want[2]) and torch.equal(lengths, want[3])
            assert batches.shape[1:] == (2, 4)

    three = plan(3)
    assert three.epoch_steps == [14, 13, 13]
    whole = list(three.steps_from(Position()))
    assert len(whole) == three.total_steps == 40
    for epoch, steps in enumerate(three.epoch_steps):  # each epoch's steps in order, the last one its end
        assert [index for e, index, *_ in whole if e == epoch] == list(range(steps))
        rows = three.epoch_plan(epoch)[0]
        assert torch.equal(torch.cat([b for e, _, b, _ in whole if e == epoch]), rows[: steps * 2])
    assert not torch.equal(whole[0][2], whole[14][2])  # epoch 2 is packed anew
    same(list(plan(3).steps_from(Position(step=15, epoch=1, batch=1))), whole[15:])  # one step into epoch 2
    # A finished 1-epoch run, continued with train.epochs = 3: all 13 steps of epoch 2, then epoch 3.
    one = plan(1)
    assert one.epoch_steps == [14] and len(list(one.steps_from(Position()))) == 14
    same(list(plan(3).steps_from(Position(step=14, epoch=1, batch=0))), whole[14:])
    # train.max_steps ends the run in epoch 2: the epochs after it are not counted (nor packed).
    capped = plan(3, "train.max_steps=20")
    assert capped.epoch_steps == [14, 13] and len(list(capped.steps_from(Position()))) == 20
