"""Fact matching on crafted summaries: a stated fact, a wrong owner, other date forms, numbers written otherwise."""

import pytest

from pipetune.data.facts import fact_recall, mean_fact_recall, mentions, normalize, states
from pipetune.data.synthetic import ActionItem, Option, action_fact, decision_fact
from pipetune.data.synthetic_whole import Figure, date_keys, figure_fact

PROTOTYPE = action_fact(
    ActionItem("Industrial Designer", "Anna", "build a first prototype", "14 March"), date_keys("14 March")
)
BUDGET = figure_fact(Figure("marketing budget", "40,000", "euros"))
COST = figure_fact(Figure("production cost target", "12.50", "euros per unit"))
RUBBER = decision_fact(Option("the case", "a rubber case", "use a rubber case"))


def test_a_stated_action_item_matches_in_any_case_and_spacing() -> None:
    assert states("Action items: Anna (Industrial Designer) will build a first prototype by 14 March.", PROTOTYPE)
    assert states("ANNA  will build a first\nprototype by 14 march", PROTOTYPE)


def test_a_wrong_owner_a_missing_date_or_another_date_does_not_match() -> None:
    assert not states("Bert (Industrial Designer) will build a first prototype by 14 March.", PROTOTYPE)
    assert not states("Anna will build a first prototype soon.", PROTOTYPE)
    assert not states("Anna will build a first prototype by 4 March.", PROTOTYPE)  # whole words: 4 is not 14
    assert not states("Anna will build a first prototype by 14 May.", PROTOTYPE)


@pytest.mark.parametrize(
    "date",
    ["March 14", "March 14th", "the 14th of March", "14 March", "14th March", "14th of March", "Mar 14", "14 Mar"],
)
def test_a_date_matches_in_every_form_the_generator_writes_and_the_usual_others(date: str) -> None:
    assert states(f"Anna is to build a first prototype by {date}.", PROTOTYPE)


def test_a_facts_keys_must_be_said_together() -> None:
    """One clause, at most MAX_GAP words from one key to the next: a value said of another subject, owners and
    dates of two action items swapped, or a figure's value that is another fact's day do not count."""
    swapped = "The marketing budget is 100,000 euros and the production budget is 40,000 euros."
    assert not states(swapped, BUDGET)
    assert states("The production budget is 100,000 euros and the marketing budget is 40,000 euros.", BUDGET)
    swapped_owners = "Bert will build a first prototype by 3 April; Anna will write the report by 14 March."
    assert not states(swapped_owners, PROTOTYPE)
    focus = figure_fact(Figure("focus group size", "12", "people"))
    assert not states("The focus group size is 40 people. Anna will test it by 12 March.", focus)
    assert states("Anna, the Industrial Designer, is to build a first prototype by the 14th of March.", PROTOTYPE)
    assert states("By 14 March, Anna will build a first prototype.", PROTOTYPE)  # in any order
    # A transcript says a fact over several turns: it mentions it, and a summary written so would not state it.
    turns = "Anna: I can build a first prototype.\nBert: When?\nAnna: By 14 March."
    assert mentions(turns, PROTOTYPE) and not states(turns, PROTOTYPE)
    assert not states("- Anna will build a first prototype\n- the report by 14 March", PROTOTYPE)  # list items
    assert fact_recall(turns, (PROTOTYPE,), mentions) == 1.0 and fact_recall(turns, (PROTOTYPE,)) == 0.0


def test_numbers_match_without_separators_and_trailing_zeros() -> None:
    assert states("The marketing budget is 40000 euros.", BUDGET)
    assert states("Figures: the marketing budget is 40,000 euros; ...", BUDGET)
    assert not states("The marketing budget is 4,000 euros.", BUDGET)
    assert not states("The budget is 40,000 euros.", BUDGET)  # which budget: the subject is a key too
    assert states("the production cost target is 12.5 euros", COST)
    assert not states("the production cost target is 12.55 euros", COST)
    assert normalize("1,250.50 and 3.0, v2.") == " 1250.5 and 3 v2 "


def test_recall_is_the_share_of_facts_stated_and_none_without_facts() -> None:
    summary = "It was agreed to use a rubber case. The marketing budget is 40,000 euros."
    assert fact_recall(summary, (RUBBER, BUDGET, PROTOTYPE, COST)) == pytest.approx(2 / 4)
    assert fact_recall(summary, ()) is None
    # averaged over the meetings that have facts; a meeting without facts counts for nothing, not for 0
    assert mean_fact_recall([summary, summary, "nothing"], [(RUBBER,), (), (BUDGET, COST)]) == pytest.approx(0.5)
    assert mean_fact_recall([summary], [()]) is None
