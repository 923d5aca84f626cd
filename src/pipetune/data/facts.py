"""The atomic facts of a meeting, and whether a summary states them: fact recall, matched by strings.

A fact (a decision, an action item, a figure) carries key strings; each key lists the forms it may be written in
(a date as "14 March" or "March 14th"). A summary states a fact when every key appears in it, in one of its forms,
as whole words after `normalize`: lower case, punctuation as spaces, whitespace collapsed, thousands separators
dropped ("40,000" = "40000") and trailing decimal zeros dropped ("12.50" = "12.5"). Deterministic: no
model judges.
"""

from __future__ import annotations

import re
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


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL_ZEROS = re.compile(r"(\d)\.(\d*?)0+(?!\d)")
_NOT_WORD = re.compile(r"[^a-z0-9.]+|\.(?!\d)|(?<!\d)\.")


def normalize(text: str) -> str:
    """`text` in the form keys and summaries are compared in, padded with one space on each side."""
    text = _THOUSANDS.sub("", text.lower())
    text = _DECIMAL_ZEROS.sub(lambda m: m.group(1) + ("." + m.group(2) if m.group(2) else ""), text)
    return " " + " ".join(_NOT_WORD.sub(" ", text).split()) + " "


def states(summary: str, fact: Fact, normalized: str | None = None) -> bool:
    """Whether `summary` states `fact`: each of its keys appears, in one of its forms, as whole words."""
    text = normalized if normalized is not None else normalize(summary)
    return all(any(normalize(form) in text for form in forms) for forms in fact.keys)


def fact_recall(summary: str, facts: tuple[Fact, ...] | list[Fact]) -> float | None:
    """The share of `facts` that `summary` states; None for a meeting without facts (not 0: nothing to recall)."""
    if not facts:
        return None
    text = normalize(summary)
    return sum(states(summary, fact, text) for fact in facts) / len(facts)


def mean_fact_recall(summaries: list[str], facts: list[tuple[Fact, ...]]) -> float | None:
    """Fact recall averaged over the meetings that have facts; None when none has."""
    if len(summaries) != len(facts):
        raise ValueError(f"{len(summaries)} summaries for {len(facts)} meetings")
    recalls = [r for r in map(fact_recall, summaries, facts) if r is not None]
    return sum(recalls) / len(recalls) if recalls else None
