"""Prompt building, shared by every data source, training and generation.

A sample is the chat template rendered around three parts: the system prompt, the transcript
(user turn) and the summary (assistant turn). The template's own tokens are never cut. Training and
generation cut a transcript by one rule: it may take what `max_length` leaves after the template and
a full `max_summary_tokens` summary, keeping its head and tail with an elision marker between, so a
prompt at inference is token for token the prompt the model was trained on. Loss falls only on the
summary tokens and the token that closes the assistant turn. A summary longer than
`max_summary_tokens` is capped and left open: no closing token, so the model never learns to stop
mid-sentence.

The system prompt, transcript and summary are data: the template's fixed parts and each text are encoded
apart, and the text of any added token inside the data (a literal "<|im_end|>", or Qwen3's "<think>", which
its tokenizer does not flag special, so `split_special_tokens` alone leaves it whole) is encoded as ordinary
tokens, so data never yields a control token id.
A sample may carry its own system prompt (a chat row's system message); its template, and so its
transcript's room, is measured with that prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from pipetune.config import SYSTEM_PROMPT, Config, ConfigError
from pipetune.data.example import Example
from pipetune.data.sources import CHARS_PER_TOKEN

ELISION = "\n[...]\n"
_SYSTEM, _TRANSCRIPT, _SUMMARY = "@@SYSTEM@@", "@@TRANSCRIPT@@", "@@SUMMARY@@"


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


def data_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """A copy of a fast tokenizer's backend that encodes every added token's text as ordinary text (None for a slow
    tokenizer, whose `split_special_tokens` already does).

    `split_special_tokens` splits only tokens flagged special, and Qwen3 leaves <think>, </think> and <tool_call>
    unflagged: the copy flags them all, then encodes special-token text as text. Text free of added tokens gets
    the very ids the tokenizer gives it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    for token in spec.get("added_tokens", []):
        token["special"] = True
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    return copy


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
        self.system_prompt = system_prompt
        self._data_backend = data_backend(tokenizer)
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": _TRANSCRIPT},
                {"role": "assistant", "content": _SUMMARY},
            ],
            tokenize=False,
        )
        if not 0 <= rendered.find(_SYSTEM) < rendered.find(_TRANSCRIPT) < rendered.find(_SUMMARY):
            raise ValueError(
                "the tokenizer's chat template does not render the system, user and assistant contents in order"
            )
        before, _, rest = rendered.partition(_SYSTEM)
        after, _, rest = rest.partition(_TRANSCRIPT)
        middle, _, tail = rest.partition(_SUMMARY)
        self._around_system = (self._encode(before), self._encode(after))
        self._heads: dict[str, list[int]] = {}
        self.middle_ids = self._encode(middle)
        end = self._encode(tail.strip())
        self.end_ids = end if end else [tokenizer.eos_token_id]
        self.elision_ids = self._encode(ELISION)
        self.head_ids = self.head_for(system_prompt)

    def _encode(self, text: str) -> list[int]:
        """Template text: its control tokens (<|im_start|>, ...) are the real ones."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def head_for(self, system_prompt: str | None) -> list[int]:
        """The template up to the transcript with `system_prompt` (None: the builder's own) encoded as data."""
        system_prompt = self.system_prompt if system_prompt is None else system_prompt
        if system_prompt not in self._heads:
            before, after = self._around_system
            self._heads[system_prompt] = before + self.encode_text(system_prompt) + after
        return self._heads[system_prompt]

    def encode_text(self, text: str) -> list[int]:
        """Data (a transcript, a summary): control-token text in it is split into ordinary tokens."""
        return self.encode_texts([text])[0]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """`encode_text` of many texts in one call (the tokenizer's batch path)."""
        if not texts:
            return []
        if self._data_backend is not None:
            return [e.ids for e in self._data_backend.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    @property
    def template_length(self) -> int:
        """Tokens of the template alone (system prompt, headers, closing token)."""
        return len(self.head_ids) + len(self.middle_ids) + len(self.end_ids)

    @property
    def summary_room(self) -> int:
        """Tokens kept for the summary: max_summary_tokens, or what max_length leaves after the template."""
        return self._summary_room(self.head_ids)

    def _summary_room(self, head: list[int]) -> int:
        return min(self.max_summary_tokens, self.max_length - len(head) - len(self.middle_ids) - len(self.end_ids))

    @property
    def transcript_room(self) -> int:
        """Tokens a transcript may take, in training and generation alike."""
        return self._transcript_room(self.head_ids)

    def _transcript_room(self, head: list[int]) -> int:
        return self.max_length - len(head) - len(self.middle_ids) - len(self.end_ids) - self._summary_room(head)

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

    def build(self, transcript: str, summary: str, system_prompt: str | None = None) -> Sample:
        """A training sample: the prompt (as `prompt_ids`) then the summary, closed unless it was capped."""
        return self.build_many([(transcript, summary)], [system_prompt])[0]

    def build_many(self, pairs: list[tuple[str, str]], system_prompts: list[str | None] | None = None) -> list[Sample]:
        """`build` of many (transcript, summary) pairs, their texts encoded in one batch call; `system_prompts`:
        each pair's own (None: the builder's)."""
        self.check_budget()
        transcripts = self.encode_texts([transcript for transcript, _ in pairs])
        summaries = self.encode_texts([summary for _, summary in pairs])
        systems = system_prompts if system_prompts is not None else [None] * len(pairs)
        return [
            self._sample(t, s, self._fitted_head(system))
            for t, s, system in zip(transcripts, summaries, systems, strict=True)
        ]

    def build_examples(self, examples: list[Example]) -> list[Sample]:
        """`build_many` of Examples, each with its own system prompt where it has one."""
        return self.build_many([(e.transcript, e.summary) for e in examples], [e.system for e in examples])

    def _fitted_head(self, system_prompt: str | None) -> list[int]:
        """`head_for`, with a sample's own system prompt cut so that its template leaves one summary token."""
        head = self.head_for(system_prompt)
        over = len(head) + len(self.middle_ids) + len(self.end_ids) + 1 - self.max_length
        if over <= 0 or system_prompt is None:
            return head
        before, after = self._around_system
        system_ids = head[len(before) : len(head) - len(after)]
        return before + system_ids[: max(0, len(system_ids) - over)] + after

    def _sample(self, transcript_ids: list[int], summary_ids: list[int], head: list[int]) -> Sample:
        prompt, transcript_cut = self._prompt(transcript_ids, head)
        room = self._summary_room(head)
        if len(summary_ids) <= room:
            supervised = summary_ids + self.end_ids
        else:  # capped mid-text: left open, so no step teaches the model to stop there
            supervised = summary_ids[:room]
        return Sample(
            input_ids=prompt + supervised,
            n_prompt=len(prompt),
            transcript_tokens_cut=transcript_cut,
            summary_tokens_cut=max(0, len(summary_ids) - room),
        )

    def prompt_ids(self, transcript: str, system_prompt: str | None = None) -> list[int]:
        """The generation prompt: exactly the prompt part of `build` for the same transcript (and system prompt)."""
        self.check_budget()
        return self._prompt(self.encode_text(transcript), self._fitted_head(system_prompt))[0]

    def _prompt(self, ids: list[int], head: list[int]) -> tuple[list[int], int]:
        """Template around the transcript ids, cut to its room (head and tail kept): (ids, tokens cut)."""
        budget, n_original = self._transcript_room(head), len(ids)
        if n_original > budget:
            if budget > len(self.elision_ids):
                keep = budget - len(self.elision_ids)
                first = (keep + 1) // 2
                ids = ids[:first] + self.elision_ids + ids[n_original - (keep - first) :]
                n_kept = keep
            else:
                ids = ids[:budget]
                n_kept = budget
            return head + ids + self.middle_ids, n_original - n_kept
        return head + ids + self.middle_ids, 0


PROMPT_FILE = "prompt.json"
"""A run's prompt settings, beside its adapter: what export, summarize and plain transformers + PEFT rebuild the
training prompt from."""


def prompt_settings(prompts: PromptBuilder, config: Config) -> dict[str, Any]:
    """What builds an inference prompt: template ids around the transcript, the transcript's cleaning, budget and
    cut rule."""
    tokenizer = prompts.tokenizer
    return {
        "system_prompt": config.data.system_prompt,
        "max_length": prompts.max_length,
        "max_summary_tokens": prompts.max_summary_tokens,
        "transcript_budget": prompts.transcript_room,
        "transcript_max_chars": config.data.max_length * CHARS_PER_TOKEN,
        "cut_rule": (
            "the transcript is stripped of leading and trailing whitespace; one of more than transcript_max_chars "
            "characters keeps its first and last transcript_max_chars // 2 characters with a newline between; it "
            "is then encoded with split_special_tokens=True (control-token text in it is plain text); a transcript "
            "of more than transcript_budget tokens keeps its first ceil(k / 2) and last floor(k / 2) tokens with "
            "elision_ids between, k = transcript_budget - len(elision_ids) (if k < 1: its first transcript_budget "
            "tokens), in training and inference alike"
        ),
        "prefix": tokenizer.decode(prompts.head_ids),
        "prefix_ids": list(prompts.head_ids),
        "suffix": tokenizer.decode(prompts.middle_ids),
        "suffix_ids": list(prompts.middle_ids),
        "stop_ids": list(prompts.end_ids),
        "elision": tokenizer.decode(prompts.elision_ids),
        "elision_ids": list(prompts.elision_ids),
    }


def write_prompt_settings(path: Path, prompts: PromptBuilder, config: Config) -> None:
    path.write_text(json.dumps(prompt_settings(prompts, config), indent=1, ensure_ascii=False) + "\n")
