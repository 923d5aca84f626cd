"""Inference in one process: the base model plus a saved PEFT adapter, prompts built exactly as in training.

pipetune summarize --adapter runs/demo/adapter meeting.txt
pipetune summarize --adapter runs/demo/adapter meetings.jsonl > summaries.jsonl
cat meeting.txt | pipetune summarize --adapter runs/demo/adapter -
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from pipetune.config import Config, ConfigError, DataConfig, load_config
from pipetune.data.batching import IGNORE, TokenizedSplit
from pipetune.data.example import Example
from pipetune.data.sources import MESSAGES, clean_rows, is_chat_row
from pipetune.model.load import DTYPES, build_model
from pipetune.model.shapes import BUILTIN_SHAPES
from pipetune.preflight import Prepared, prepare

SUMMARY_FIELD = "generated_summary"
"""Key of the generated summary in JSONL output; never `summary`, which often holds the reference."""


def load_finetuned(
    config: Config, adapter_dir: str | Path, device: torch.device | None = None
) -> tuple[PeftModel, Prepared]:
    """The full base model of `config` (quantized as model.quantize says, as in training) with the adapter loaded
    by PEFT, in eval mode."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prepared = prepare(config)
    dtype = DTYPES[config.model.dtype]
    base, _ = build_model(prepared.model, dtype, device, seed=config.train.seed, quantize=config.model.quantize)
    base.config.use_cache = True  # pipetune trains without a KV cache; generate() wants one (quadratic without)
    if base.generation_config is not None:
        base.generation_config.use_cache = True
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return model, prepared


@dataclass
class InferenceSource:
    """Where the settings of an inference run came from, for the user's information."""

    config: Config
    config_path: Path | None
    """The TOML file read (--config, or the run's config.toml next to the adapter); None: defaults."""
    warning: str = ""
    """Set when the base model may not be the one the adapter was trained on."""


def inference_config(
    adapter_dir: str | Path,
    base: str | None = None,
    config_path: str | Path | None = None,
    trust_remote_code: bool = False,
) -> InferenceSource:
    """The config that rebuilds the adapter's base model: --config, else the run's config.toml, else defaults.

    The base model is `base`, else the adapter's `base_model_name_or_path`. A built-in shape (random init)
    is only the trained base when dtype, seed and tokenizer are the run's: hence the run's config.toml.
    Remote model code runs only with `trust_remote_code` (the command line's --trust-remote-code), never because
    a config file says so: a run directory may come from anyone.
    """
    adapter_dir = Path(adapter_dir)
    adapter_config = adapter_dir / "adapter_config.json"
    if not adapter_config.is_file():
        raise ConfigError(
            f"--adapter {str(adapter_dir)!r} has no adapter_config.json; point it at a run's adapter/ directory "
            "(e.g. runs/demo/adapter)"
        )
    if config_path is None and (adapter_dir.parent / "config.toml").is_file():
        config_path = adapter_dir.parent / "config.toml"
    config = load_config(config_path)
    recorded = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    if base is None and recorded and Path(recorded).is_absolute() and not Path(recorded).exists():
        beside = adapter_dir.parent / "base"  # an export moved since: its own base/, beside its adapter/
        recorded = str(beside) if (beside / "config.json").is_file() else recorded
    trained_on = config.model.name
    config.model.name = base or recorded or config.model.name
    if config.model.name != trained_on and config.model.init == "random" and _holds_weights(config.model.name):
        config.model.init = "pretrained"  # e.g. an export's base/: the random-init base, written with its weights
    warning = ""
    if config.model.trust_remote_code and not trust_remote_code:
        warning = (
            f"{config_path} sets model.trust_remote_code = true, which is not taken from a file: the model's own "
            "code does not run; pass --trust-remote-code if you trust it"
        )
    config.model.trust_remote_code = trust_remote_code
    if config.model.name in BUILTIN_SHAPES and config.model.init != "random":
        config.model.init = "random"  # a built-in shape has no weights: rebuilt from train.seed
    if config.model.name in BUILTIN_SHAPES and config_path is None:
        warning = (
            f"base {config.model.name!r} is a random-init built-in shape and no config.toml was found next to "
            f"the adapter: rebuilding it with the default seed {config.train.seed} and dtype {config.model.dtype}; "
            "pass --config RUN/config.toml to rebuild the base the adapter was trained on"
        )
    return InferenceSource(config, Path(config_path) if config_path else None, warning)


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_config.json as a dict; a ConfigError naming the file when it is not a JSON object."""
    path = adapter_dir / "adapter_config.json"
    try:
        loaded = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        loaded = f"not valid JSON ({type(e).__name__}: {str(e)[:100]})"
    if not isinstance(loaded, dict):
        why = loaded if isinstance(loaded, str) else f"a JSON {type(loaded).__name__}, not an object"
        raise ConfigError(f"{path} is {why}; restore the adapter directory that training wrote (adapter/)")
    return loaded


PROMPT_KEYS = ("prefix_ids", "suffix_ids", "stop_ids", "elision_ids", "transcript_budget", "transcript_max_chars")
"""The prompt.json entries that decide a prompt's tokens."""


def prompt_change(adapter_dir: Path, prepared: Prepared, config: Config) -> str:
    """'' when the prompt built now is the one the run recorded in prompt.json beside the adapter (or there is
    none); else a warning naming what changed: the tokenizer, its chat template or pipetune's prompt rules."""
    from pipetune.data.prompt import PROMPT_FILE, prompt_settings

    path = Path(adapter_dir).parent / PROMPT_FILE
    try:
        recorded = json.loads(path.read_bytes()) if path.is_file() else {}
    except (ValueError, RecursionError):
        recorded = None
    if not isinstance(recorded, dict):
        return f"{path} is not a JSON object: the prompt the adapter was trained on cannot be checked"
    now = prompt_settings(prepared.prompts, config)
    changed = [key for key in PROMPT_KEYS if key in recorded and recorded[key] != now[key]]
    if not changed:
        return ""
    return (
        f"the prompt built now differs from the one the adapter was trained on ({path}: {', '.join(changed)} "
        "differ): the tokenizer, its chat template or pipetune's prompt rules changed since; summaries may be "
        "worse than the run's (pass --config with the run's settings, or train again)"
    )


def _holds_weights(name: str) -> bool:
    """A local model directory with safetensors weights (not a shape that holds a config.json alone)."""
    path = Path(name).expanduser()
    return path.is_dir() and any(path.glob("*.safetensors"))


# --------------------------------------------------------------------------- losses and generation


LOSS_CHUNK_ROWS = 4096
"""Supervised positions whose logits `mean_token_loss` holds at once (rows x vocab floats, not batch x length)."""


@torch.no_grad()
def mean_token_loss(
    model: nn.Module, split: TokenizedSplit, batch_size: int = 8, chunk_rows: int = LOSS_CHUNK_ROWS
) -> float:
    """Sum of summary-token cross-entropies / number of summary tokens, over the whole split.

    The model's body gives the batch's hidden states; the LM head and the cross-entropy run only at the supervised
    positions (labels != IGNORE), `chunk_rows` of them at a time, so memory does not grow with batch x length x
    vocabulary (32 rows of 8,192 tokens with a 49,152-token vocabulary: 48 GiB of float32 logits)."""
    device = next(model.parameters()).device
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(causal, getattr(causal, "base_model_prefix", ""), None)
    head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
    # Models whose logits are more than head(hidden) (soft-capped, scaled) go through the full forward, row by row.
    plain_head = not any(
        getattr(causal.config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )
    total, count = 0.0, 0
    for start in range(0, len(split), batch_size):
        ids = split.input_ids[start : start + batch_size].to(device)
        labels = split.labels[start : start + batch_size].to(device)
        keep = labels != IGNORE
        count += int(keep.sum())
        if body is None or head is None or not plain_head:  # one row at a time: its logits only where supervised
            for row in range(len(ids)):
                logits = model(input_ids=ids[row : row + 1], use_cache=False).logits[0][keep[row]]
                total += float(F.cross_entropy(logits.float(), labels[row][keep[row]], reduction="sum"))
            continue
        hidden, targets = body(input_ids=ids, use_cache=False)[0][keep], labels[keep]
        for begin in range(0, len(targets), chunk_rows):
            logits = head(hidden[begin : begin + chunk_rows])
            total += float(F.cross_entropy(logits.float(), targets[begin : begin + chunk_rows], reduction="sum"))
    return total / max(count, 1)


@dataclass
class Sampling:
    """Nucleus sampling settings; generation is greedy when none are given."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"--temperature {self.temperature} must be positive (e.g. 0.7)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p} must be within (0, 1] (e.g. 0.9)")


def stop_ids(turn_end: int, tokenizer: Any) -> list[int]:
    """What ends a generated summary: the token closing the assistant turn, and the tokenizer's end of text (a base
    model may end with either)."""
    return [i for i in dict.fromkeys((turn_end, tokenizer.eos_token_id)) if i is not None]


@dataclass
class GenerationStats:
    """What `summarize` generated and how fast: the line `pipetune summarize` prints."""

    transcripts: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    """Summary tokens up to the stop token, per transcript (not the padding of rows that stopped early)."""
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.transcripts} summaries in {self.batches} batches: {self.new_tokens} new tokens in "
            f"{self.seconds:.1f} s, {rate:.1f} tokens/s ({self.prompt_tokens} prompt tokens)"
        )


def plan_batches(
    lengths: list[int], batch_size: int, max_batch_tokens: int | None, max_new_tokens: int
) -> list[list[int]]:
    """Indices of `lengths` (prompt lengths) in batches: shortest first, at most `batch_size` rows, and at most
    `max_batch_tokens` tokens of KV cache (rows x (longest prompt + max_new_tokens)); a prompt longer than the
    budget goes alone. Similar lengths share a batch, so left padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        fits = last is not None and len(last) < batch_size
        if fits and max_batch_tokens is not None:
            fits = (len(last) + 1) * (lengths[i] + max_new_tokens) <= max_batch_tokens
        if fits:
            last.append(i)
        else:
            batches.append([i])
    return batches


@torch.no_grad()
def summarize(
    model: nn.Module,
    prepared: Prepared,
    transcripts: list[str],
    max_new_tokens: int = 128,
    batch_size: int = 8,
    sampling: Sampling | None = None,
    progress: Callable[[int], None] | None = None,
    systems: list[str | None] | None = None,
    max_batch_tokens: int | None = None,
    stats: GenerationStats | None = None,
) -> list[str]:
    """Summaries in input order; greedy unless `sampling`; generation stops at the token closing the
    assistant turn or at the tokenizer's end of text (a base model may end with either).

    `systems`: each transcript's own system prompt (a chat row's, as training read it; None: data.system_prompt).
    Prompts are batched by `plan_batches` (by length, at most `batch_size` of them and `max_batch_tokens` tokens of
    KV cache), left-padded, and generated with the KV cache; `progress(n)` is called after each batch with the number
    of transcripts it held; `stats`, when given, is filled with the token counts and the time taken.
    """
    import time

    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1")
    tokenizer, prompts = prepared.tokenizer, prepared.prompts
    stops = stop_ids(prompts.end_ids[0], tokenizer)
    systems = systems if systems is not None else [None] * len(transcripts)
    prompt_ids = [prompts.prompt_ids(text, system) for text, system in zip(transcripts, systems, strict=True)]
    sample_kwargs: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        torch.manual_seed(sampling.seed)
        sample_kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    outputs: list[str] = [""] * len(transcripts)
    stats = stats if stats is not None else GenerationStats()
    start_time = time.perf_counter()
    for rows in plan_batches([len(ids) for ids in prompt_ids], batch_size, max_batch_tokens, max_new_tokens):
        new_ids = _generate_batch(
            model, [prompt_ids[i] for i in rows], prepared.pad_id, max_new_tokens, stops, sample_kwargs
        )
        for i, new in zip(rows, new_ids, strict=True):
            new = new[: min((new.index(stop) for stop in stops if stop in new), default=len(new))]
            outputs[i] = tokenizer.decode(new, skip_special_tokens=True).strip()
            stats.new_tokens += len(new)
            stats.prompt_tokens += len(prompt_ids[i])
        stats.transcripts += len(rows)
        stats.batches += 1
        if progress is not None:
            progress(len(rows))
    stats.seconds += time.perf_counter() - start_time
    return outputs


def _generate_batch(
    model: nn.Module, prompts: list[list[int]], pad_id: int, max_new_tokens: int, stops: list[int], sample_kwargs: dict
) -> list[list[int]]:
    """The new tokens of each left-padded prompt of one batch (generation with the KV cache), on the model's device."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    generated = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad_id,
        use_cache=True,
        **sample_kwargs,
    )
    return generated[:, width:].tolist()


# --------------------------------------------------------------------------- input and output of `pipetune summarize`


@dataclass
class SummaryInput:
    """Transcripts read from a text file, a JSONL file or stdin; `records` is None for a plain-text transcript."""

    transcripts: list[str]
    """As training and eval read them: stripped and cut by characters (data/sources.clean_rows)."""
    records: list[dict[str, Any]] | None
    column: str
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of the JSONL rows left out: not JSON, not an object, no usable transcript."""
    read_from: list[str] = field(default_factory=list)
    """Per record, the field its transcript came from: `column`, or `messages` for a chat row."""
    systems: list[str | None] = field(default_factory=list)
    """Per transcript, its own system prompt as training keeps it (a chat row's system message), or None."""

    def skipped_line(self) -> str:
        """'skipped 2 of 5 rows: line 3 (...), line 4 (...)', or '' when none were."""
        if not self.skipped:
            return ""
        shown = ", ".join(f"line {n} ({why})" for n, why in self.skipped[:5])
        more = f", and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
        total = len(self.skipped) + len(self.transcripts)
        return f"skipped {len(self.skipped)} of {total} rows: {shown}{more}"


def read_transcripts(source: str, data: DataConfig, stdin: IO | None = None) -> SummaryInput:
    """A text file (one transcript), a JSONL of records, or `-` for stdin (either kind).

    A JSONL record is read as training and eval read a row (data/sources.py): its `data.transcript_column`
    field, or, for a chat row, the last user message of its `messages` (before the last assistant message,
    when it has one); the transcript is cleaned by the same rule (stripped, cut by characters), so the prompt
    is the one training built from the same row (with a chat row's own system message where training keeps it).
    JSONL is recognised by a .jsonl suffix, or by a first
    non-empty line that is a JSON object. Unusable rows are skipped and counted; an input with no usable row is
    an error.
    """
    name = "stdin" if source == "-" else repr(source)
    if source == "-":
        raw = (stdin or sys.stdin.buffer).read()
        content = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"input {source!r} does not exist; give a text or JSONL file, or - for stdin")
        content = path.read_bytes()
    lines = [(n, line) for n, line in enumerate(content.splitlines(), start=1) if line.strip()]
    empty = ConfigError(
        f"input {name} is empty; give a transcript (text) or JSONL records with a {data.transcript_column!r} field"
    )
    if not lines:
        raise empty
    if source.endswith(".jsonl") or isinstance(_json_object(lines[0][1]), dict):
        return _parse_jsonl(lines, data, name)
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"input {name} is not UTF-8 text ({e}); save it as UTF-8") from None
    example, _ = training_example({data.transcript_column: text}, data)
    if example is None:  # Unicode whitespace alone (no-break spaces, ...)
        raise empty
    return SummaryInput([example.transcript], None, data.transcript_column, systems=[example.system])


SUMMARY_PLACEHOLDER = "-"
"""Stands in for the reference summary a training row needs and a row to summarize may lack."""


def training_example(row: Any, data: DataConfig) -> tuple[Example | None, str]:
    """(the example training reads from `row`: its transcript and own system prompt, "") or (None, why the row is
    unusable), by training's own reading and cleaning (data/sources.clean_rows); its summary plays no part."""
    cleaned = clean_rows({"input": [("", _with_summary(row, data))]}, data)
    if cleaned.splits["input"]:
        return cleaned.splits["input"][0], ""
    return None, next(iter(cleaned.stats["input"].skipped))


def _with_summary(row: Any, data: DataConfig) -> Any:
    """`row` with a placeholder summary in place of its own (a chat row: in place of its last assistant message
    and what follows it), so that only its transcript decides whether training could read it."""
    if not isinstance(row, dict):
        return row
    if is_chat_row(row, data):
        messages = row[MESSAGES]
        if not isinstance(messages, list):
            return row
        answers = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        asked = messages[: answers[-1]] if answers else messages
        return {**row, MESSAGES: [*asked, {"role": "assistant", "content": SUMMARY_PLACEHOLDER}]}
    if data.summary_column == data.transcript_column:
        return row
    return {**row, data.summary_column: SUMMARY_PLACEHOLDER}


def _json_object(line: bytes) -> Any:
    """The JSON value of a line; None when it is not one (not UTF-8, not JSON, nested too deep, ...)."""
    try:
        return json.loads(line.decode("utf-8-sig"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _parse_jsonl(lines: list[tuple[int, bytes]], data: DataConfig, name: str) -> SummaryInput:
    column = data.transcript_column
    parsed = SummaryInput([], [], column)
    fields: set[str] = set()
    for n, line in lines:
        record = _json_object(line)
        if not isinstance(record, dict):
            parsed.skipped.append((n, "not valid JSON" if record is None else f"a JSON {type(record).__name__}"))
            continue
        fields.update(record)
        example, reason = training_example(record, data)
        if example is None:
            parsed.skipped.append((n, reason))
            continue
        parsed.transcripts.append(example.transcript)
        parsed.systems.append(example.system)
        parsed.records.append(record)
        parsed.read_from.append(MESSAGES if is_chat_row(record, data) else column)
    if not parsed.transcripts:
        fix = (
            f"name the transcript field with --column (fields seen: {', '.join(sorted(fields))})"
            if fields and column not in fields and MESSAGES not in fields
            else f"give JSON objects with a non-empty string field {column!r} (or a {MESSAGES!r} list of "
            "role/content messages), one per line"
        )
        raise ConfigError(f"input {name} has no usable row ({parsed.skipped_line()}); {fix}")
    return parsed


def format_summaries(summaries: list[str], source: SummaryInput) -> str:
    """The text to print: the summary alone for a text input; for JSONL, one line per record, the field its
    transcript came from (the transcript column, or a chat row's `messages`) replaced by `generated_summary` and
    every other field kept."""
    if source.records is None:
        return summaries[0]
    lines = []
    read_from = source.read_from or [source.column] * len(source.records)
    for record, summary, field_read in zip(source.records, summaries, read_from, strict=True):
        kept = {key: value for key, value in record.items() if key != field_read}
        lines.append(json.dumps({**kept, SUMMARY_FIELD: summary}, ensure_ascii=False))
    return "\n".join(lines)
