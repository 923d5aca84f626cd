"""Whole synthetic meetings: log-normal lengths in tokens, facts in every quarter, summaries that state them all."""

import math
import random
import re
import statistics

import pytest

from pipetune.config import Config, ConfigError, DataConfig, validate
from pipetune.data.facts import fact_recall, mentions
from pipetune.data.sources import load_dataset
from pipetune.data.synthetic import generate_meetings
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.data.synthetic_whole import (
    LOG_SIGMA,
    MAX_TOKENS,
    MEDIAN_TOKENS,
    MIN_TOKENS,
    generate_whole_meetings,
    plan_whole_meetings,
    render_whole_meeting,
)
from pipetune.data.tokenizer import demo_tokenizer

LINE = re.compile(
    r"^(Project Manager|Marketing Expert|User Interface Designer|Industrial Designer) \([A-Z][a-z]+\): \S"
)


@pytest.fixture(scope="module")
def meetings():
    return generate_whole_meetings(300, seed=3)


def token_counts(tokenizer, transcripts: list[str]) -> list[int]:
    """Each transcript's length in tokens, each distinct piece tokenized once: a byte-level BPE never merges across
    its pre-tokenizer's splits, which fall between "Role (Name):", " the turn's text" and each newline."""
    pieces = [
        (line.split(": ", 1)[0] + ":", " " + line.split(": ", 1)[1]) for t in transcripts for line in t.split("\n")
    ]
    unique = sorted({piece for pair in pieces for piece in pair} | {"\n"})
    n_tokens = dict(zip(unique, map(len, tokenizer(unique, add_special_tokens=False)["input_ids"]), strict=True))
    counts = []
    for transcript in transcripts:
        lines = transcript.split("\n")
        turns = (line.split(": ", 1) for line in lines)
        counts.append(sum(n_tokens[role + ":"] + n_tokens[" " + text] for role, text in turns))
        counts[-1] += (len(lines) - 1) * n_tokens["\n"]
    return counts


def test_lengths_are_log_normal_around_the_median_in_tokens(meetings) -> None:
    """Measured with the demo tokenizer: median, spread and symmetry of the log lengths, and the clipped range."""
    tokenizer = demo_tokenizer()
    transcripts = [m.transcript for m in meetings]
    lengths = token_counts(tokenizer, transcripts)
    whole = [len(ids) for ids in tokenizer(transcripts[:3], add_special_tokens=False)["input_ids"]]
    assert lengths[:3] == whole  # the count by pieces is the tokenizer's own
    logs = [math.log(n) for n in lengths]
    mean, sd = statistics.fmean(logs), statistics.pstdev(logs)
    skew = statistics.fmean(((x - mean) / sd) ** 3 for x in logs)
    assert 0.9 * MEDIAN_TOKENS <= statistics.median(lengths) <= 1.1 * MEDIAN_TOKENS
    assert 0.8 * LOG_SIGMA <= sd <= 1.2 * LOG_SIGMA and abs(skew) < 0.4
    assert 0.8 * MIN_TOKENS <= min(lengths) and max(lengths) <= 1.2 * MAX_TOKENS
    assert max(lengths) > 3 * MEDIAN_TOKENS / 2  # a tail, not a narrow band


def _first_line_stating(lines: list[str], fact) -> int:
    """Where the meeting says the fact: the decision's phrase, the task, or the figure's subject with its value."""
    said = {"decision": [0], "action": [1], "figure": [0, 1]}[fact.kind]  # keys[1] of an action: the task
    return next(i for i, line in enumerate(lines) if all(fact.keys[k][0] in line for k in said))


def test_facts_are_said_in_every_quarter_of_the_meeting(meetings) -> None:
    for meeting in meetings[:100]:
        lines = meeting.transcript.split("\n")
        quarters = {4 * _first_line_stating(lines, fact) // len(lines) for fact in meeting.facts}
        assert quarters == {0, 1, 2, 3}
        assert all(mentions(meeting.transcript, fact) for fact in meeting.facts)


def test_the_reference_summary_states_every_fact(meetings) -> None:
    kinds = {fact.kind for meeting in meetings for fact in meeting.facts}
    assert kinds == {"decision", "action", "figure"}
    assert all(fact_recall(m.summary, m.facts) == 1.0 for m in meetings)
    short = generate_meetings(200, seed=3)  # the short meetings know their facts too
    assert all(m.facts and fact_recall(m.summary, m.facts) == 1.0 for m in short)
    assert {fact.kind for m in short for fact in m.facts} == {"decision", "action"}


def test_a_summary_leaving_facts_out_recalls_less(meetings) -> None:
    meeting = meetings[0]
    without_actions = meeting.summary.split("Action items:")[0]
    actions = sum(fact.kind == "action" for fact in meeting.facts)
    assert fact_recall(without_actions, meeting.facts) == pytest.approx(1 - actions / len(meeting.facts))


def test_every_line_is_a_turn_and_the_meeting_opens_and_closes(meetings) -> None:
    for meeting in meetings[:20]:
        lines = meeting.transcript.split("\n")
        assert all(LINE.match(line) for line in lines)
        assert lines[0].startswith("Project Manager") and lines[-1].startswith("Project Manager")
        speakers = [line.split(" (")[0] for line in lines]
        assert len(set(speakers)) == 4


def test_deterministic_and_independent_of_n_and_of_the_global_random_state() -> None:
    random.seed(1)
    state = random.getstate()
    first = generate_whole_meetings(3, seed=7)
    assert random.getstate() == state
    assert generate_whole_meetings(5, seed=7)[:3] == first
    assert [render_whole_meeting(plan) for plan in plan_whole_meetings(3, seed=7)] == first
    assert not {m.transcript for m in first} & {m.transcript for m in generate_whole_meetings(3, seed=8)}


def test_data_synthetic_lengths_reaches_the_rows_with_their_facts() -> None:
    data = DataConfig(source="synthetic", synthetic_train=3, synthetic_validation=2, synthetic_lengths="whole")
    dataset = load_dataset(data)
    validation = dataset.splits["validation"]
    assert validation == synthetic_splits(n_train=3, n_validation=2, lengths="whole")["validation"]
    assert len(validation) == 2 and all(m.facts and len(m.transcript) > 4000 for m in validation)
    short = load_dataset(DataConfig(source="synthetic", synthetic_train=3, synthetic_validation=2))
    assert short.splits["train"] == generate_meetings(3, seed=_train_seed())[:3]


def _train_seed() -> int:
    from pipetune.data.synthetic_splits import _derive_seed

    return _derive_seed(0, "train")


def test_an_unknown_length_is_refused() -> None:
    config = Config()
    config.data.synthetic_lengths = "long"
    with pytest.raises(ConfigError, match=r"data.synthetic_lengths = 'long' is unknown; use one of short, whole"):
        validate(config, config.parallel.pp)
    with pytest.raises(ValueError, match="lengths='long'"):
        synthetic_splits(n_train=1, n_validation=1, lengths="long")
