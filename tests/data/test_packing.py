"""Sample packing's data path: first fit over the epoch's order, packed rows with per-sample labels and positions,
and the config keys that turn it on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetune.config import Config, ConfigError, apply_override, validate
from pipetune.data.batching import IGNORE, SampleStore, epoch_batches
from pipetune.data.packing import (
    first_fit_rows,
    members,
    packed_attention_share,
    packed_batch,
    packed_epoch_batches,
)
from pipetune.data.prompt import Sample
from pipetune.preflight import prepare
from tests.conftest import tiny_config, write_config


def _store(lengths: list[int], prompt: int = 3) -> SampleStore:
    ids = iter(range(1, 10_000))
    return SampleStore.from_samples([Sample([next(ids) for _ in range(n)], min(prompt, n - 1), 0, 0) for n in lengths])


def test_first_fit_fills_earlier_rows_before_opening_new_ones() -> None:
    # 60 opens row 0 (40 left), 50 row 1 (50 left), 40 fills row 0, 30 joins row 1: next fit would make 3 rows.
    rows = first_fit_rows(torch.arange(4), torch.tensor([60, 50, 40, 30]), 100, 4)
    assert rows.tolist() == [[0, 2, -1, -1], [1, 3, -1, -1]]
    # At most max_per_row samples a row, even where more would fit.
    rows = first_fit_rows(torch.arange(5), torch.full((5,), 10), 100, 2)
    assert rows.tolist() == [[0, 1], [2, 3], [4, -1]]


def test_a_packed_rows_attention_is_its_samples_own() -> None:
    """Two samples of 50 in each row of 100 attend over 2 x 50^2 of a whole row's 100^2 pairs: half; samples as
    long as the row attend as a whole row does; a longer sample is cut to the row first."""
    assert packed_attention_share(torch.full((6,), 50), 100, 2) == 0.5
    assert packed_attention_share(torch.full((6,), 50), 100, 1) == 0.25  # one a row: the rest is padding
    assert packed_attention_share(torch.tensor([100, 100, 300]), 100, 4) == 1.0
    assert packed_attention_share(torch.empty(0, dtype=torch.long), 100, 4) == 1.0


def test_packed_epochs_hold_every_sample_once_within_the_bounds_and_replay() -> None:
    lengths = torch.randint(20, 200, (300,), generator=torch.Generator().manual_seed(0))
    plan = packed_epoch_batches(lengths, 4, seed=7, epoch=1, row_length=256, max_per_row=3)
    assert plan.shape[1:] == (4, 3)
    rows = plan.view(-1, 3)
    sizes = torch.where(rows >= 0, lengths[rows.clamp(min=0)], 0).sum(-1)
    assert int(sizes.max()) <= 256
    packed = members(plan)
    assert len(packed) == len(set(packed.tolist()))  # no sample twice
    everything = first_fit_rows(
        torch.randperm(300, generator=torch.Generator().manual_seed(7 * 1_000_003 + 1)), lengths, 256, 3
    )
    assert len(everything) - len(rows) < 4  # only the rows that fill no whole batch are left out
    assert len(members(everything)) == 300
    assert torch.equal(plan, packed_epoch_batches(lengths, 4, seed=7, epoch=1, row_length=256, max_per_row=3))
    assert not torch.equal(plan, packed_epoch_batches(lengths, 4, seed=7, epoch=2, row_length=256, max_per_row=3))
    # Fewer rows than samples: the point of packing.
    assert len(everything) < 300 * 0.6


def test_same_order_as_unpacked_when_every_pair_fits() -> None:
    """Samples of at most half a row pair up in the epoch's order: the packed step holds the unpacked step's
    samples (what tests/parallel/test_packing.py's runs rely on)."""
    lengths = torch.randint(10, 51, (32,), generator=torch.Generator().manual_seed(1))
    packed = packed_epoch_batches(lengths, 4, seed=3, epoch=0, row_length=100, max_per_row=2)
    unpacked = epoch_batches(32, 8, seed=3, epoch=0)
    assert torch.equal(packed.flatten(1), unpacked)


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
        assert torch.equal(position_ids[row, start:], torch.arange(32 - start))  # the pads: a document of their own
    assert int((labels != IGNORE).sum()) == int(store.supervised.sum())
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
    ],
)
def test_packing_settings_are_validated(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_config(*overrides, "parallel.pp=1", 'parallel.strategy="single"'), 1)


def test_packed_row_shorter_than_the_template_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.max_length = 8 cannot hold the chat template"):
        prepare(tiny_config(tmp_path, "data.packing=true", "data.max_length=8"))


def test_inspect_reports_rows_and_padding_with_and_without_packing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Short meetings in rows of 256: unpacked, one sample a row and most of it padding; packed, the rows first fit
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
    order = torch.randperm(len(store), generator=torch.Generator().manual_seed(5 * 1_000_003))
    packed = first_fit_rows(order, store.lengths, 256, 16)
    rows = len(packed)
    real = int(store.lengths.sum())
    squares = sum(int(store.lengths[i]) ** 2 for row in packed.tolist() for i in row if i >= 0)
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


def test_a_resumed_packed_run_continues_with_the_same_rows() -> None:
    """The training loop's plan (train.TrainData) with packing: every epoch repacked in its own order, as many
    steps in each as the shortest epoch holds, and a run resumed at a checkpoint's position gets the batches the
    uninterrupted run got from there on."""
    from pipetune.checkpoint import Position
    from pipetune.train import TrainData

    lengths = torch.randint(20, 120, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    store = _store(lengths)

    def plan() -> TrainData:
        data = TrainData(
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
            epochs=3,
            steps_per_epoch=0,
            total_steps=0,
            validation=None,
            max_samples_per_row=4,
        )
        data.steps_per_epoch = min(len(data.epoch_plan(e)[0]) for e in range(3)) // 2
        data.total_steps = 3 * data.steps_per_epoch
        return data

    whole = list(plan().steps_from(Position()))
    assert len(whole) == plan().total_steps
    assert not torch.equal(whole[0][2], whole[plan().steps_per_epoch][2])  # epoch 2 is packed anew
    at = plan().steps_per_epoch + 1  # a checkpoint one step into the second epoch
    resumed = list(plan().steps_from(Position(step=at, epoch=1, batch=1)))
    assert len(resumed) == len(whole) - at
    for (epoch, index, batches, lengths), expected in zip(resumed, whole[at:], strict=True):
        assert (epoch, index) == expected[:2]
        assert torch.equal(batches, expected[2]) and torch.equal(lengths, expected[3])
        assert batches.shape[1:] == (2, 4)
