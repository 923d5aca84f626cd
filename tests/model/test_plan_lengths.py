"""The documents kernel's padded lengths (model/plan_lengths.py): fewer than the octave rule's, for no more work."""

from __future__ import annotations

import bisect
import itertools
import random

from pipetune.model.plan_lengths import MAX_DISTINCT, STEP, choose_lengths, octave_length, tiles


def work(lengths: list[int], pad) -> int:
    return sum(tiles(pad(n)) for n in lengths)


def padder(chosen: list[int]):
    return lambda n: chosen[bisect.bisect_left(chosen, n)]


def test_whole_meetings_pad_to_fewer_lengths_for_no_more_work() -> None:
    draw = random.Random(7)
    lengths = [draw.randint(1300, 16200) for _ in range(1000)]  # whole meetings' spread, as qwen3-4b-meetings'
    chosen = choose_lengths(lengths)
    octave = {octave_length(n) for n in lengths}
    assert chosen == sorted(chosen) and chosen[-1] >= max(lengths) and all(p % STEP == 0 for p in chosen)
    assert len(chosen) < 0.75 * len(octave)  # 68 against 107 on the config's own 1,024 meetings
    assert work(lengths, padder(chosen)) <= work(lengths, octave_length)


def test_the_fewest_lengths_by_exhaustive_search() -> None:
    draw = random.Random(3)
    for _ in range(20):
        lengths = [draw.randint(1, 2000) for _ in range(draw.randint(2, 12))]
        chosen = choose_lengths(lengths)
        budget = work(lengths, octave_length)
        assert work(lengths, padder(chosen)) <= budget
        candidates = sorted({-(-n // STEP) * STEP for n in lengths})
        fewest = min(
            (
                size
                for size in range(1, len(candidates) + 1)
                for ends in itertools.combinations(candidates, size)
                if ends[-1] == candidates[-1] and work(lengths, padder(list(ends))) <= budget
            ),
        )
        assert len(chosen) == min(fewest, len({octave_length(n) for n in lengths})), lengths


def test_too_many_distinct_lengths_keep_the_octave_rule() -> None:
    lengths = list(range(STEP, STEP * (MAX_DISTINCT + 2), STEP))
    assert choose_lengths(lengths) == sorted({octave_length(n) for n in lengths})
    assert choose_lengths([300, 300]) == [320]
