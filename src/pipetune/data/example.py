"""The record every data module passes around: one transcript and its reference summary."""

from __future__ import annotations

from dataclasses import dataclass

from pipetune.data.facts import Fact


@dataclass(frozen=True)
class Example:
    """One transcript and its reference summary, whatever the source (a synthetic meeting is one too)."""

    transcript: str
    """The meeting transcript (for AMI and the synthetic corpus: speaker-tagged turns, one per line)."""
    summary: str
    """The reference summary."""
    facts: tuple[Fact, ...] = ()
    """What the summary must state, key by key (synthetic meetings); () when unknown (real data): no fact recall."""
