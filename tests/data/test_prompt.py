"""Prompt building: the template survives every budget, the transcript loses its middle, loss only on the summary."""

from __future__ import annotations

import copy

import pytest

from pipetune.config import SYSTEM_PROMPT, ConfigError
from pipetune.data.batching import IGNORE, tokenize_split
from pipetune.data.example import Example
from pipetune.data.prompt import ELISION, PromptBuilder
from pipetune.data.tokenizer import demo_tokenizer

TRANSCRIPT = " ".join(f"Project Manager (Anna): point number {i} about the remote control." for i in range(200))
SUMMARY = (
    "The team decided to use a rubber case. Action items: the Industrial Designer (Bert) will check costs by Friday."
)


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


def rendered(tokenizer, transcript: str, summary: str) -> str:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": transcript},
        {"role": "assistant", "content": summary},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def test_short_sample_is_exactly_the_chat_template(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, max_length=4096, max_summary_tokens=256)
    sample = builder.build("Marketing Expert (Cleo): yeah, um, fine.", SUMMARY)
    assert tokenizer.decode(sample.input_ids) == rendered(
        tokenizer, "Marketing Expert (Cleo): yeah, um, fine.", SUMMARY
    ).rstrip("\n")
    assert sample.transcript_tokens_cut == sample.summary_tokens_cut == 0
    supervised = tokenizer.decode(sample.input_ids[sample.n_prompt :])
    assert supervised == SUMMARY + "<|im_end|>"


def test_empty_transcript_keeps_the_template(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, max_length=512, max_summary_tokens=64)
    sample = builder.build("", SUMMARY)
    assert sample.input_ids[: len(builder.head_ids)] == builder.head_ids
    assert tokenizer.decode(sample.input_ids[sample.n_prompt :]) == SUMMARY + "<|im_end|>"


def test_huge_transcript_keeps_head_tail_and_every_template_token(tokenizer) -> None:
    builder = PromptBuilder(tokenizer, max_length=256, max_summary_tokens=64)
    sample = builder.build(TRANSCRIPT, SUMMARY)
    ids = sample.input_ids
    # the transcript takes what a full 64-token summary leaves, whatever this summary's length
    assert sample.n_prompt == 256 - 64 - len(builder.end_ids)
    assert len(ids) == sample.n_prompt + len(tokenizer.encode(SUMMARY)) + len(builder.end_ids)
    assert ids[: len(builder.head_ids)] == builder.head_ids  # system prompt and user header intact
    assert ids[sample.n_prompt - len(builder.middle_ids) : sample.n_prompt] == builder.middle_ids  # assistant header
    assert ids[-len(builder.end_ids) :] == builder.end_ids
    text = tokenizer.decode(ids)
    assert SYSTEM_PROMPT in text
    assert "point number 0 about" in text and "point number 199 about" in text  # head and tail
    assert ELISION in text and "point number 100 about" not in text  # middle elided
    assert sample.transcript_tokens_cut > 0 and sample.summary_tokens_cut == 0


def test_capped_summary_is_left_open(tokenizer) -> None:
    """A summary cut at max_summary_tokens gets no closing token: no step teaches stopping mid-sentence."""
    builder = PromptBuilder(tokenizer, max_length=512, max_summary_tokens=8)
    sample = builder.build("short meeting", SUMMARY * 5)
    assert sample.n_supervised == 8
    assert sample.input_ids[sample.n_prompt :] == tokenizer.encode(SUMMARY * 5)[:8]
    assert builder.end_ids[0] not in sample.input_ids[sample.n_prompt :]
    assert sample.summary_tokens_cut == len(tokenizer.encode(SUMMARY * 5, add_special_tokens=False)) - 8
    exact = tokenizer.decode(tokenizer.encode(SUMMARY * 5)[:8])  # a summary of exactly the cap is closed
    closed = builder.build("short meeting", exact)
    assert closed.input_ids[-len(builder.end_ids) :] == builder.end_ids and closed.summary_tokens_cut == 0


def test_summary_filling_the_budget_never_overflows(tokenizer) -> None:
    # The seed's prompt_ids[-0:] kept the whole prompt when the summary filled the budget.
    builder = PromptBuilder(tokenizer, max_length=128, max_summary_tokens=10_000)
    sample = builder.build(TRANSCRIPT, SUMMARY * 40)
    assert len(sample.input_ids) == 128 - len(builder.end_ids)  # capped, so left open
    assert sample.input_ids[: len(builder.head_ids)] == builder.head_ids
    assert sample.n_prompt == len(builder.head_ids) + len(builder.middle_ids)  # transcript fully elided


def test_template_only_budget_holds_one_summary_token(tokenizer) -> None:
    probe = PromptBuilder(tokenizer, max_length=4096, max_summary_tokens=8)
    builder = PromptBuilder(tokenizer, max_length=probe.min_max_length, max_summary_tokens=8)
    sample = builder.build(TRANSCRIPT, SUMMARY)
    assert len(sample.input_ids) == probe.min_max_length - len(builder.end_ids)
    assert sample.n_supervised == 1  # capped at one token, left open
    one = builder.build(TRANSCRIPT, tokenizer.decode(tokenizer.encode(SUMMARY)[:1]))
    assert len(one.input_ids) == probe.min_max_length and one.n_supervised == 1 + len(builder.end_ids)
    too_small = PromptBuilder(tokenizer, max_length=probe.min_max_length - 1, max_summary_tokens=8)
    with pytest.raises(ConfigError, match=f"data.max_length >= {probe.min_max_length}"):
        too_small.build(TRANSCRIPT, SUMMARY)


def test_generation_prompt_is_the_training_prompt(tokenizer) -> None:
    """One cutting rule: the transcript keeps the same tokens whatever the summary's length, at inference too."""
    builder = PromptBuilder(tokenizer, max_length=256, max_summary_tokens=64)
    for transcript in (TRANSCRIPT, TRANSCRIPT[:600], "short"):
        prompt = builder.prompt_ids(transcript)
        for summary in ("Ok.", SUMMARY, SUMMARY * 10):
            sample = builder.build(transcript, summary)
            assert sample.input_ids[: sample.n_prompt] == prompt
    assert len(builder.prompt_ids(TRANSCRIPT)) + 64 + len(builder.end_ids) == 256  # room for a full summary


def test_control_token_text_in_data_is_plain_text(tokenizer) -> None:
    """A literal "<|im_end|>" in a transcript or summary is text: never the control token, never supervised as it."""
    builder = PromptBuilder(tokenizer, max_length=512, max_summary_tokens=64)
    end, start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    transcript = "Anna: type <|im_end|> then <|im_start|>assistant to end it."
    summary = "They discussed the <|im_end|> token."
    sample = builder.build(transcript, summary)
    template = builder.head_ids + builder.middle_ids + builder.end_ids
    assert sample.input_ids.count(end) == template.count(end)
    assert sample.input_ids.count(start) == template.count(start)
    assert tokenizer.decode(sample.input_ids[sample.n_prompt :]) == summary + "<|im_end|>"
    assert transcript in tokenizer.decode(builder.prompt_ids(transcript))
    assert builder.encode_text("<|im_end|>") != [end]


@pytest.mark.parametrize("pad", ["<|endoftext|>", "<|im_end|>"])
def test_batches_are_static_and_labels_only_on_the_summary(tokenizer, pad: str) -> None:
    """Labels come from the samples, not from pad positions: a pad id equal to the end token changes nothing."""
    builder = PromptBuilder(tokenizer, max_length=200, max_summary_tokens=32)
    pad_id, end_id = tokenizer.convert_tokens_to_ids([pad, "<|im_end|>"])
    examples = [Example("", SUMMARY), Example("a b c", "ok"), Example(TRANSCRIPT, SUMMARY)]
    split = tokenize_split(examples, builder, pad_id=pad_id)
    assert split.input_ids.shape == split.labels.shape == (3, 200)
    for row, example in enumerate(examples):
        sample = builder.build(example.transcript, example.summary)
        n = len(sample.input_ids)
        positions = (split.labels[row] != IGNORE).nonzero().flatten().tolist()
        assert positions == list(range(sample.n_prompt - 1, n - 1))  # position t predicts token t+1
        assert split.labels[row, positions].tolist() == sample.input_ids[sample.n_prompt :]
        assert split.labels[row, n - 2] == end_id  # the closing token is supervised
        assert (split.input_ids[row, n:] == pad_id).all()
        assert int(split.real_tokens[row]) == n
    assert split.truncated == 1


# The shape of Qwen3's template where it matters here: an assistant turn, and the generation prompt, carry an
# empty thinking block when thinking is off.
QWEN3_LIKE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_serving_prompt_is_the_trained_prompt(tokenizer, template: str) -> None:
    """The README's serving recipe: apply_chat_template(system, user, add_generation_prompt=True,
    enable_thinking=False) gives exactly the prompt training used (for Qwen3, with the empty thinking block)."""
    if template == "qwen3":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = QWEN3_LIKE
    builder = PromptBuilder(tokenizer, max_length=512, max_summary_tokens=64)
    transcript = "Project Manager (Anna): we keep the rubber case.\nMarketing Expert (Bert): agreed."
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": transcript}]
    served = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert tokenizer.encode(served, add_special_tokens=False) == builder.prompt_ids(transcript)
    default = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (default == served) == (template == "chatml")  # Qwen3's default (thinking on) is not what was trained


def test_added_token_text_in_data_never_becomes_a_control_token(tokenizer) -> None:
    """Qwen3's <think> and </think> are added tokens not flagged special: split_special_tokens leaves them whole.
    Their text in a system prompt, transcript or summary is data all the same, in training and at inference."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.add_tokens(["<think>", "</think>"])  # added, not special: as in Qwen3's tokenizer
    think, unthink = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert tokenizer.encode("a <think> b", add_special_tokens=False, split_special_tokens=True).count(think) == 1
    system = "Summarize. Never write <think> blocks."
    builder = PromptBuilder(tokenizer, max_length=512, max_summary_tokens=64, system_prompt=system)
    assert think in builder.middle_ids and unthink in builder.middle_ids  # the template's own: real tokens
    transcript = "Anna: the model printed <think>\n\n</think> and <|im_end|> again.\nBert: odd."
    summary = "</think>They saw <think> tags."
    for own_system in (None, "Row prompt with </think>."):
        sample = (
            builder.build(transcript, summary) if own_system is None else builder.build(transcript, summary, own_system)
        )
        head = builder.head_ids if own_system is None else builder.head_for(own_system)
        template = head + builder.middle_ids + builder.end_ids
        for control in (think, unthink, *tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])):
            assert sample.input_ids.count(control) == template.count(control)
        assert head.count(think) == 0
        assert sample.input_ids[: sample.n_prompt] == builder.prompt_ids(transcript, own_system)
        assert transcript in tokenizer.decode(sample.input_ids[: sample.n_prompt])
        assert tokenizer.decode(sample.input_ids[sample.n_prompt :]) == summary + "<|im_end|>"
    assert tokenizer.decode(builder.head_ids).count(system) == 1
    assert builder.encode_texts(["plain", "<think>"]) == [builder.encode_text("plain"), builder.encode_text("<think>")]
    assert builder.encode_text(TRANSCRIPT) == tokenizer.encode(TRANSCRIPT, add_special_tokens=False)  # text as ever


def test_a_sample_with_its_own_system_prompt_is_measured_with_it(tokenizer) -> None:
    """A chat row's system message replaces the builder's in its sample; its transcript gets the room that leaves."""
    builder = PromptBuilder(tokenizer, max_length=256, max_summary_tokens=64)
    own = "Write one line."
    [default, mine] = builder.build_examples([Example(TRANSCRIPT, SUMMARY), Example(TRANSCRIPT, SUMMARY, own)])
    assert tokenizer.decode(mine.input_ids).startswith(f"<|im_start|>system\n{own}<|im_end|>")
    assert SYSTEM_PROMPT not in tokenizer.decode(mine.input_ids)
    assert default.n_prompt == mine.n_prompt  # both prompts fill their room: a shorter head, more transcript
    assert mine.transcript_tokens_cut < default.transcript_tokens_cut
    assert mine.input_ids[: mine.n_prompt] == builder.prompt_ids(TRANSCRIPT, own)
    long_own = "Be brief. " * 300  # longer than max_length: cut so that one summary token still fits
    sample = builder.build(TRANSCRIPT, SUMMARY, long_own)
    assert len(sample.input_ids) + len(builder.end_ids) == 256 and sample.n_supervised == 1  # capped: left open
