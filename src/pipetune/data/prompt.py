"""Prompt building, shared by every data source, training and generation.

A sample is the chat template rendered around three parts: the system prompt, the transcript
(user turn) and the summary (assistant turn). The template's own tokens are never cut. Training and
generation cut a transcript by one rule: it may take what `max_length` leaves after the template and
a full `max_summary_tokens` summary, keeping its head and tail with an elision marker between, so a
prompt at inference is token for token the prompt the model was trained on. Loss falls only on the
summary tokens and the token that closes the assistant turn. A summary longer than
`max_summary_tokens` is capped and left open: no closing token, so the model never learns to stop
mid-sentence. Transcript and summary are data: a control token's text inside them (a literal
"<|im_end|>") is encoded as plain text, never as the control token.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pipetune.config import ConfigError
from pipetune.data.prompt_text import SYSTEM_PROMPT

ELISION = "\n[...]\n"
_TRANSCRIPT, _SUMMARY = "@@TRANSCRIPT@@", "@@SUMMARY@@"


@dataclass(frozen=True)
class Sample:
    """One tokenized example: ids = prompt (template + transcript) followed by supervised ids."""

    input_ids: list[int]
    n_prompt: int
    transcript_tokens_cut: int = 0
    summary_tokens_cut: int = 0

    @property
    def n_supervised(self) -> int:
        return len(self.input_ids) - self.n_prompt


class PromptBuilder:
    """Turns (transcript, summary) into token ids that fit `max_length`, keeping every template token."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        max_summary_tokens: int,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_summary_tokens = max_summary_tokens
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": _TRANSCRIPT},
                {"role": "assistant", "content": _SUMMARY},
            ],
            tokenize=False,
        )
        if _TRANSCRIPT not in rendered or _SUMMARY not in rendered:
            raise ValueError("the tokenizer's chat template does not render the user and assistant contents")
        head, _, rest = rendered.partition(_TRANSCRIPT)
        middle, _, tail = rest.partition(_SUMMARY)
        self.head_ids = self._encode(head)
        self.middle_ids = self._encode(middle)
        end = self._encode(tail.strip())
        self.end_ids = end if end else [tokenizer.eos_token_id]
        self.elision_ids = self._encode(ELISION)

    def _encode(self, text: str) -> list[int]:
        """Template text: its control tokens (<|im_start|>, ...) are the real ones."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def encode_text(self, text: str) -> list[int]:
        """Data (a transcript, a summary): control-token text in it is split into ordinary tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    @property
    def template_length(self) -> int:
        """Tokens of the template alone (system prompt, headers, closing token)."""
        return len(self.head_ids) + len(self.middle_ids) + len(self.end_ids)

    @property
    def summary_room(self) -> int:
        """Tokens kept for the summary: max_summary_tokens, or what max_length leaves after the template."""
        return min(self.max_summary_tokens, self.max_length - self.template_length)

    @property
    def transcript_room(self) -> int:
        """Tokens a transcript may take, in training and generation alike."""
        return self.max_length - self.template_length - self.summary_room

    @property
    def min_max_length(self) -> int:
        """The smallest max_length that holds the template and one summary token."""
        return self.template_length + 1

    def check_budget(self) -> None:
        if self.max_length < self.min_max_length:
            raise ConfigError(
                f"data.max_length = {self.max_length} cannot hold the chat template ({self.template_length} tokens "
                f"with the system prompt) plus one summary token; set data.max_length >= {self.min_max_length}"
            )

    def build(self, transcript: str, summary: str) -> Sample:
        """A training sample: the prompt (as `prompt_ids`) then the summary, closed unless it was capped."""
        return self.build_many([(transcript, summary)])[0]

    def build_many(self, pairs: list[tuple[str, str]]) -> list[Sample]:
        """`build` of many (transcript, summary) pairs, their texts encoded in one batch call."""
        self.check_budget()
        transcripts = self.encode_texts([transcript for transcript, _ in pairs])
        summaries = self.encode_texts([summary for _, summary in pairs])
        return [self._sample(t, s) for t, s in zip(transcripts, summaries, strict=True)]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """`encode_text` of many texts in one call (the tokenizer's batch path)."""
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _sample(self, transcript_ids: list[int], summary_ids: list[int]) -> Sample:
        prompt, transcript_cut = self._prompt(transcript_ids)
        if len(summary_ids) <= self.summary_room:
            supervised = summary_ids + self.end_ids
        else:  # capped mid-text: left open, so no step teaches the model to stop there
            supervised = summary_ids[: self.summary_room]
        return Sample(
            input_ids=prompt + supervised,
            n_prompt=len(prompt),
            transcript_tokens_cut=transcript_cut,
            summary_tokens_cut=max(0, len(summary_ids) - self.summary_room),
        )

    def prompt_ids(self, transcript: str) -> list[int]:
        """The generation prompt: exactly the prompt part of `build` for the same transcript."""
        self.check_budget()
        return self._prompt(self.encode_text(transcript))[0]

    def _prompt(self, ids: list[int]) -> tuple[list[int], int]:
        """Template around the transcript ids, cut to `transcript_room` (head and tail kept): (ids, tokens cut)."""
        budget, n_original = self.transcript_room, len(ids)
        if n_original > budget:
            if budget > len(self.elision_ids):
                keep = budget - len(self.elision_ids)
                head = (keep + 1) // 2
                ids = ids[:head] + self.elision_ids + ids[n_original - (keep - head) :]
                n_kept = keep
            else:
                ids = ids[:budget]
                n_kept = budget
            return self.head_ids + ids + self.middle_ids, n_original - n_kept
        return self.head_ids + ids + self.middle_ids, 0
