"""The record every data module passes around: one transcript, its reference summary, and maybe its own system
prompt."""

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
    system: str | None = None
    """The row's own system prompt (a chat row's system message), used instead of data.system_prompt; None: that."""
    facts: tuple[Fact, ...] = ()
    """What the summary must state, key by key (synthetic meetings); () when unknown (real data): no fact recall."""
