import random
import re
import statistics

import pytest

from pipetune.data.synthetic import (
    MIN_TURNS,
    ROLES,
    generate_meetings,
    plan_meetings,
    render_meeting,
)
from pipetune.data.synthetic_splits import synthetic_splits

LINE = re.compile(r"^(?P<role>[A-Za-z ]+) \((?P<name>[A-Z][a-z]+)\): (?P<text>\S.*)$")


@pytest.fixture(scope="module")
def planned():
    """(plan, meeting) pairs with the default turn range."""
    plans = plan_meetings(200, seed=3)
    return list(zip(plans, generate_meetings(200, seed=3), strict=True))


def test_same_seed_gives_identical_meetings():
    assert generate_meetings(20, seed=7) == generate_meetings(20, seed=7)


def test_global_random_state_is_neither_used_nor_changed():
    random.seed(1)
    state = random.getstate()
    first = generate_meetings(5, seed=7)
    assert random.getstate() == state
    random.seed(2)
    assert generate_meetings(5, seed=7) == first


def test_different_seeds_give_different_meetings():
    a = {m.transcript for m in generate_meetings(20, seed=1)}
    b = {m.transcript for m in generate_meetings(20, seed=2)}
    assert len(a) == 20 and len(b) == 20
    assert not a & b


def test_first_meetings_do_not_depend_on_n():
    assert generate_meetings(10, seed=4)[:3] == generate_meetings(3, seed=4)


def test_plans_render_to_the_generated_meetings(planned):
    for plan, meeting in planned[:20]:
        assert render_meeting(plan) == meeting


def test_every_line_is_a_tagged_turn_by_one_of_four_participants(planned):
    for plan, meeting in planned:
        lines = meeting.transcript.split("\n")
        assert 12 <= len(lines) <= 40 and len(lines) == plan.n_turns
        names_by_role = {}
        for line in lines:
            match = LINE.match(line)
            assert match, line
            assert match["role"] in ROLES
            assert names_by_role.setdefault(match["role"], match["name"]) == match["name"], line
        assert set(names_by_role) == set(ROLES), meeting.transcript
        assert len(set(names_by_role.values())) == 4
        assert names_by_role == dict(plan.participants)


def test_decisions_are_in_summary_and_transcript(planned):
    for plan, meeting in planned:
        assert 1 <= len(plan.decisions) <= 3
        for option in plan.decisions:
            assert option.phrase in meeting.summary, (option, meeting.summary)
            assert option.phrase in meeting.transcript, (option, meeting.transcript)
        assert plan.topic in meeting.summary and plan.topic in meeting.transcript.split("\n")[0]


def test_action_items_with_owner_and_deadline_are_in_summary_and_transcript(planned):
    for plan, meeting in planned:
        assert 1 <= len(plan.action_items) <= 3
        for item in plan.action_items:
            assert dict(plan.participants)[item.role] == item.name
            for fact in (item.role, item.name, item.task, item.deadline):
                assert fact in meeting.summary, (fact, meeting.summary)
            # The task is said by its owner, or said to the owner by name, together with the deadline.
            owner_tag = f"{item.role} ({item.name}):"
            said = [line for line in meeting.transcript.split("\n") if item.task in line]
            assert any(line.startswith(owner_tag) or item.name in line.split(":", 1)[1] for line in said), said
            assert any(item.deadline in line for line in said), said


def test_rejected_alternatives_reach_the_summary_only_when_discussed(planned):
    mentioned = 0
    for plan, meeting in planned:
        for option in plan.rejected:
            assert option.phrase not in meeting.summary
            if option.thing in meeting.summary:
                assert f"{option.thing} would" in meeting.transcript or f"{option.thing} might" in meeting.transcript
                mentioned += 1
    assert mentioned > 0


def test_lengths_are_in_range(planned):
    transcript_words = [len(meeting.transcript.split()) for _, meeting in planned]
    summary_words = [len(meeting.summary.split()) for _, meeting in planned]
    assert 140 <= min(transcript_words) and max(transcript_words) <= 700
    assert 30 <= min(summary_words) and max(summary_words) <= 90


def test_more_turns_make_longer_transcripts():
    short = generate_meetings(30, seed=5, min_turns=12, max_turns=12)
    long = generate_meetings(30, seed=5, min_turns=40, max_turns=40)
    assert all(len(m.transcript.split("\n")) == 12 for m in short)
    assert all(len(m.transcript.split("\n")) == 40 for m in long)
    mean_short = statistics.mean(len(m.transcript.split()) for m in short)
    assert statistics.mean(len(m.transcript.split()) for m in long) > 2.5 * mean_short


def test_extreme_turn_counts_still_hold_all_facts():
    for min_turns, max_turns in [(MIN_TURNS, MIN_TURNS), (80, 80)]:
        plans = plan_meetings(20, seed=6, min_turns=min_turns, max_turns=max_turns)
        for plan in plans:
            meeting = render_meeting(plan)
            assert len(meeting.transcript.split("\n")) == min_turns
            assert all(option.phrase in meeting.transcript for option in plan.decisions)
            assert all(item.task in meeting.transcript for item in plan.action_items)


def test_transcripts_read_like_meetings(planned):
    corpus = "\n".join(meeting.transcript for _, meeting in planned)
    for filler in ("Um, ", ", uh, ", ", you know, ", ", like, ", "Yeah, ", "Mm-hmm."):
        assert filler in corpus, filler
    for digression in ("lunch", "coffee machine", "laptop", "pouring outside"):
        assert digression in corpus, digression
    backchannel = re.compile(r"^[^:]+: (Mm-hmm|Yeah|Okay|Right|Uh-huh|Mm)\.$", re.M)
    assert len(backchannel.findall(corpus)) > len(planned)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": -1}, "n=-1"),
        ({"n": 1, "min_turns": 5}, "min_turns=5"),
        ({"n": 1, "min_turns": 20, "max_turns": 10}, "max_turns=10"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate_meetings(**kwargs)


def test_splits_are_disjoint_deterministic_and_sized():
    splits = synthetic_splits(seed=0, n_train=64, n_validation=16)
    assert set(splits) == {"train", "validation"}
    assert len(splits["train"]) == 64 and len(splits["validation"]) == 16
    train = {m.transcript for m in splits["train"]}
    assert len(train) == 64
    assert not train & {m.transcript for m in splits["validation"]}
    assert synthetic_splits(seed=0, n_train=64, n_validation=16) == splits
    other = synthetic_splits(seed=1, n_train=64, n_validation=16)
    assert not train & {m.transcript for m in other["train"]}


def test_default_splits():
    splits = synthetic_splits()
    assert (len(splits["train"]), len(splits["validation"])) == (256, 32)
    # Bigger splits extend smaller ones, so changing the sizes does not reshuffle the data.
    assert synthetic_splits(n_train=8, n_validation=4)["validation"] == splits["validation"][:4]
