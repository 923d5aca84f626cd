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
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from pipetune.config import Config, ConfigError, load_config
from pipetune.data.batching import IGNORE, TokenizedSplit
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
    recorded = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    config.model.name = base or recorded or config.model.name
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


# --------------------------------------------------------------------------- losses and generation


@torch.no_grad()
def mean_token_loss(model: nn.Module, split: TokenizedSplit, batch_size: int = 8) -> float:
    """Sum of summary-token cross-entropies / number of summary tokens, over the whole split."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(split), batch_size):
        ids = split.input_ids[start : start + batch_size].to(device)
        labels = split.labels[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        total += float(
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        )
        count += int((labels != IGNORE).sum())
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


@torch.no_grad()
def summarize(
    model: nn.Module,
    prepared: Prepared,
    transcripts: list[str],
    max_new_tokens: int = 128,
    batch_size: int = 8,
    sampling: Sampling | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Summaries in input order; greedy unless `sampling`; generation stops at the token closing the assistant turn.

    Prompts are sorted by length so each left-padded batch carries little padding; `progress(n)` is
    called after each batch with the number of transcripts it held.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1")
    tokenizer, prompts = prepared.tokenizer, prepared.prompts
    device = next(model.parameters()).device
    stop_id = prompts.end_ids[0]
    prompt_ids = [prompts.prompt_ids(text) for text in transcripts]
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    sample_kwargs: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        torch.manual_seed(sampling.seed)
        sample_kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    outputs: list[str] = [""] * len(transcripts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompt_ids[i]) for i in rows)
        ids = torch.full((len(rows), width), prepared.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, i in enumerate(rows):
            ids[row, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            mask[row, width - len(prompt_ids[i]) :] = 1
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_id,
            pad_token_id=prepared.pad_id,
            use_cache=True,
            **sample_kwargs,
        )
        for i, new in zip(rows, generated[:, width:].tolist(), strict=True):
            if stop_id in new:
                new = new[: new.index(stop_id)]
            outputs[i] = tokenizer.decode(new, skip_special_tokens=True).strip()
        if progress is not None:
            progress(len(rows))
    return outputs


# --------------------------------------------------------------------------- input and output of `pipetune summarize`


@dataclass
class SummaryInput:
    """Transcripts read from a text file, a JSONL file or stdin; `records` is None for a plain-text transcript."""

    transcripts: list[str]
    records: list[dict[str, Any]] | None
    column: str
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of the JSONL rows left out: not JSON, not an object, no usable transcript."""

    def skipped_line(self) -> str:
        """'skipped 2 of 5 rows: line 3 (...), line 4 (...)', or '' when none were."""
        if not self.skipped:
            return ""
        shown = ", ".join(f"line {n} ({why})" for n, why in self.skipped[:5])
        more = f", and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
        total = len(self.skipped) + len(self.transcripts)
        return f"skipped {len(self.skipped)} of {total} rows: {shown}{more}"


def read_transcripts(source: str, column: str, stdin: TextIO | None = None) -> SummaryInput:
    """A text file (one transcript), a JSONL of records with a `column` field, or `-` for stdin (either kind).

    JSONL is recognised by a .jsonl suffix, or by a first non-empty line that is a JSON object. Its unusable
    rows are skipped and counted; an input with no usable row is an error.
    """
    name = "stdin" if source == "-" else repr(source)
    if source == "-":
        text = (stdin or sys.stdin).read()
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"input {source!r} does not exist; give a text or JSONL file, or - for stdin")
        text = path.read_text(encoding="utf-8")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise ConfigError(f"input {name} is empty; give a transcript (text) or JSONL records with a {column!r} field")
    if source.endswith(".jsonl") or isinstance(_json_object(lines[0][1]), dict):
        return _parse_jsonl(lines, column, name)
    return SummaryInput([text.strip()], None, column)


def _json_object(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _parse_jsonl(lines: list[tuple[int, str]], column: str, name: str) -> SummaryInput:
    parsed = SummaryInput([], [], column)
    fields: set[str] = set()
    for n, line in lines:
        record = _json_object(line)
        if not isinstance(record, dict):
            parsed.skipped.append((n, "not valid JSON" if record is None else f"a JSON {type(record).__name__}"))
            continue
        fields.update(record)
        value = record.get(column)
        if not isinstance(value, str) or not value.strip():
            reason = "no field" if column not in record else "empty" if isinstance(value, str) else "not a string"
            parsed.skipped.append((n, f"{column!r}: {reason}"))
            continue
        parsed.transcripts.append(value)
        parsed.records.append(record)
    if not parsed.transcripts:
        fix = (
            f"name the transcript field with --column (fields seen: {', '.join(sorted(fields))})"
            if fields and column not in fields
            else f"give JSON objects with a non-empty string field {column!r}, one per line"
        )
        raise ConfigError(f"input {name} has no usable row ({parsed.skipped_line()}); {fix}")
    return parsed


def format_summaries(summaries: list[str], source: SummaryInput) -> str:
    """The text to print: the summary alone for a text input; for JSONL, one line per record, the transcript
    field replaced by `generated_summary` and every other field kept."""
    if source.records is None:
        return summaries[0]
    lines = []
    for record, summary in zip(source.records, summaries, strict=True):
        kept = {key: value for key, value in record.items() if key != source.column}
        lines.append(json.dumps({**kept, SUMMARY_FIELD: summary}, ensure_ascii=False))
    return "\n".join(lines)
