"""The atomic facts of a meeting, and whether a summary states them: fact recall, matched by strings.

A fact (a decision, an action item, a figure) carries key strings; each key lists the forms it may be written in
(a date as "14 March" or "March 14th"). Keys are compared as whole words after `normalize`: lower case,
punctuation as spaces, whitespace collapsed, thousands separators dropped ("40,000" = "40000") and trailing
decimal zeros dropped ("12.50" = "12.5").

A summary states a fact when one of its clauses (split at sentence ends, semicolons, blank lines and list items)
holds every key, in one of its forms, with at most MAX_GAP words between one key and the next: the keys of one
fact must be said together, so a budget's value said of another budget, or an owner and a date of two action
items, do not count. A text mentions a fact when every key appears anywhere in it: what a transcript, whose facts
are said over several turns, shows the model (`mentions`). Deterministic: no model judges.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

FACT_KINDS = ("decision", "action", "figure")


@dataclass(frozen=True)
class Fact:
    """One thing a meeting's summary must say, and the strings that say it."""

    kind: str
    """"decision", "action" (an owner, a task and a deadline) or "figure" (a budget, a price, a count)."""
    text: str
    """The fact as one sentence, e.g. "Anna (Project Manager) will build a first prototype by 14 March"."""
    keys: tuple[tuple[str, ...], ...]
    """Each key's accepted forms; the fact is stated when every key appears in one of its forms."""


MAX_GAP = 6
"""Words allowed between one key of a fact and the next within a clause ("Anna, the Industrial Designer, is to
build a first prototype by 14 March": 5 between the name and the task)."""

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL_ZEROS = re.compile(r"(\d)\.(\d*?)0+(?!\d)")
_NOT_WORD = re.compile(r"[^a-z0-9.]+|\.(?!\d)|(?<!\d)\.")


def normalize(text: str) -> str:
    """`text` in the form keys and summaries are compared in, padded with one space on each side."""
    text = _THOUSANDS.sub("", text.lower())
    text = _DECIMAL_ZEROS.sub(lambda m: m.group(1) + ("." + m.group(2) if m.group(2) else ""), text)
    return " " + " ".join(_NOT_WORD.sub(" ", text).split()) + " "


_CLAUSE_END = re.compile(r"[.!?](?=\s|$)|;|\n\s*\n|\n\s*(?=[-*\u2022]|\d+[.)]\s)")
"""A sentence's end, a semicolon, a blank line, a line break before a list item; not a line wrapped in a sentence."""


def mentions(text: str, fact: Fact) -> bool:
    """Whether every key of `fact` appears somewhere in `text`, in one of its forms, as whole words."""
    normalized = normalize(text)
    return all(any(normalize(form) in normalized for form in forms) for forms in fact.keys)


def states(summary: str, fact: Fact) -> bool:
    """Whether `summary` states `fact`: one clause holds each key, in one of its forms, as whole words, with at
    most MAX_GAP words from one key to the next (in the order they are written)."""
    forms = [[normalize(form).split() for form in key] for key in fact.keys]
    for clause in _CLAUSE_END.split(summary):
        words = normalize(clause).split()
        spans = [sorted(_spans(words, key)) for key in forms]
        if all(spans) and any(_close(choice) for choice in itertools.product(*spans)):
            return True
    return False


def _spans(words: list[str], forms: list[list[str]]) -> set[tuple[int, int]]:
    """(first word, one past the last) of every place one of `forms` is written in `words`."""
    return {
        (i, i + len(form))
        for form in forms
        for i in range(len(words) - len(form) + 1)
        if form and words[i : i + len(form)] == form
    }


def _close(spans: tuple[tuple[int, int], ...]) -> bool:
    ordered = sorted(spans)
    return all(later[0] - earlier[1] <= MAX_GAP for earlier, later in itertools.pairwise(ordered))


def fact_recall(summary: str, facts: tuple[Fact, ...] | list[Fact], match: Callable = states) -> float | None:
    """The share of `facts` that `summary` states (`match`: or mentions); None for a meeting without facts (not 0:
    nothing to recall)."""
    if not facts:
        return None
    return sum(match(summary, fact) for fact in facts) / len(facts)


def mean_fact_recall(summaries: list[str], facts: list[tuple[Fact, ...]], match: Callable = states) -> float | None:
    """Fact recall averaged over the meetings that have facts; None when none has."""
    if len(summaries) != len(facts):
        raise ValueError(f"{len(summaries)} summaries for {len(facts)} meetings")
    recalls = [r for r in (fact_recall(s, f, match) for s, f in zip(summaries, facts, strict=True)) if r is not None]
    return sum(recalls) / len(recalls) if recalls else None
