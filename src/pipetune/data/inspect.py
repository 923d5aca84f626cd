"""`pipetune data inspect`: what a config's data looks like to the model before any training.

    pipetune data inspect --config configs/qwen3-4b-ami.toml [--set data.max_length=8192] [--json]

Which columns (or chat messages) rows were read from; rows per split and skipped rows by reason;
token lengths of transcripts and summaries under the model's tokenizer; how many samples the prompt
builder cuts to fit `data.max_length` / `data.max_summary_tokens`, and by how much; and the share of
every batch that is padding at the static length, beside what length buckets (max_length/4, /2, 3/4,
1) would leave, and what packing (data.packing: whole samples packed into rows of max_length) would leave, with the
rows it needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from pipetune.config import Config
from pipetune.data.batching import bucket_boundaries, bucket_lengths, pad_fraction
from pipetune.data.example import Example
from pipetune.data.packing import packed_attention_share, packed_pad_fraction, packed_rows_needed
from pipetune.data.prompt import PromptBuilder
from pipetune.data.sources import load_dataset

PERCENTILES = (50, 90, 99)


@dataclass
class Lengths:
    """Nearest-rank percentiles of token counts (0 for an empty split)."""

    p50: int
    p90: int
    p99: int
    max: int

    @classmethod
    def of(cls, values: list[int]) -> Lengths:
        ordered = sorted(values)
        return cls(*(percentile(ordered, q) for q in PERCENTILES), ordered[-1] if ordered else 0)


@dataclass
class SplitReport:
    """Token lengths, truncation and padding of one split under the config's prompt budget."""

    name: str
    samples: int
    transcript_tokens: Lengths
    """The transcript alone, before any cut."""
    summary_tokens: Lengths
    """The summary alone, before any cap."""
    sample_tokens: Lengths
    """Whole samples as trained: template, cut transcript, capped summary, closing token."""
    transcripts_cut: int
    """Samples whose transcript lost its middle to fit max_length."""
    transcript_cut_mean: float
    """Mean transcript tokens removed, over the samples that were cut."""
    transcript_cut_max: int
    summaries_capped: int
    """Samples whose summary was capped at max_summary_tokens (or the room left)."""
    summary_cut_max: int
    pad_fraction: float | None
    """1 - real tokens / (samples x max_length): padding at the static shape; None for an empty split."""
    bucket_pad_fraction: float | None
    """The same with each sample padded to the smallest bucket that holds it."""
    bucket_samples: list[int]
    """Samples per bucket."""
    packed_rows: int = 0
    """Rows of max_length that packing (data.packing, at most data.max_samples_per_row a row, best fit over the
    first epoch's order: packing.epoch_rows) fills with the split's samples; unpacked, each sample takes a row."""
    packed_pad_fraction: float | None = None
    """1 - real tokens / (packed_rows x max_length); None for an empty split."""
    packed_attention: float = 1.0
    """Attention work of the packed rows against whole rows', the pad tails' own included
    (packing.packed_attention_share)."""


@dataclass
class DataReport:
    source: str
    model: str
    max_length: int
    max_summary_tokens: int
    buckets: list[int]
    max_samples_per_row: int
    rows: dict[str, Any]
    """`Dataset.summary()`: rows read, kept and skipped by reason per split."""
    splits: list[SplitReport]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def inspect_data(config: Config, prompts: PromptBuilder, n_buckets: int = 4) -> DataReport:
    """Load a validated config's data and measure every split as `prompts` (its model's tokenizer) builds it."""
    dataset = load_dataset(config.data, seed=config.train.seed)
    buckets = bucket_boundaries(config.data.max_length, n_buckets)
    return DataReport(
        source=config.data.source,
        model=config.model.name,
        max_length=config.data.max_length,
        max_summary_tokens=config.data.max_summary_tokens,
        buckets=buckets,
        max_samples_per_row=config.data.max_samples_per_row,
        rows=dataset.summary(),
        splits=[
            split_report(name, examples, prompts, buckets, config.data.max_samples_per_row, config.train.seed)
            for name, examples in dataset.splits.items()
        ],
    )


def split_report(
    name: str,
    examples: list[Example],
    builder: PromptBuilder,
    buckets: list[int],
    max_samples_per_row: int = 16,
    seed: int = 0,
) -> SplitReport:
    """Tokenize one split as training would (PromptBuilder.build) and measure it."""
    transcript_lengths = _token_counts(builder, [e.transcript for e in examples])
    summary_lengths = _token_counts(builder, [e.summary for e in examples])
    samples = builder.build_examples(examples)
    lengths = [len(s.input_ids) for s in samples]
    real_tokens = torch.tensor(lengths, dtype=torch.long)
    padded = bucket_lengths(real_tokens, buckets).tolist()
    transcript_cuts = [s.transcript_tokens_cut for s in samples if s.transcript_tokens_cut]
    summary_cuts = [s.summary_tokens_cut for s in samples if s.summary_tokens_cut]
    return SplitReport(
        name=name,
        samples=len(examples),
        transcript_tokens=Lengths.of(transcript_lengths),
        summary_tokens=Lengths.of(summary_lengths),
        sample_tokens=Lengths.of(lengths),
        transcripts_cut=len(transcript_cuts),
        transcript_cut_mean=sum(transcript_cuts) / len(transcript_cuts) if transcript_cuts else 0.0,
        transcript_cut_max=max(transcript_cuts, default=0),
        summaries_capped=len(summary_cuts),
        summary_cut_max=max(summary_cuts, default=0),
        pad_fraction=pad_fraction(real_tokens, [builder.max_length]) if lengths else None,
        bucket_pad_fraction=pad_fraction(real_tokens, buckets) if lengths else None,
        bucket_samples=[padded.count(b) for b in buckets],
        packed_rows=packed_rows_needed(real_tokens, builder.max_length, max_samples_per_row, seed),
        packed_pad_fraction=(
            packed_pad_fraction(real_tokens, builder.max_length, max_samples_per_row, seed) if lengths else None
        ),
        packed_attention=packed_attention_share(real_tokens, builder.max_length, max_samples_per_row, seed),
    )


def training_attention_share(config: Config, prompts: PromptBuilder) -> float:
    """The attention work a training token does against one of a whole row of data.max_length: with data.packing,
    that of the training split's packed rows (packing.packed_attention_share); with data.buckets, the token-
    weighted mean of each row's padded length over max_length (a row of b tokens does b / max_length of the work
    a token, and holds b tokens); else 1.0 (a padded row is attended whole). Over the token cache's lengths: the
    cache training reads, built here if missing; `prompts`: the run's prompt builder (preflight.prepare). The speed
    models (the plan, `strategy = "auto"`, the bench's MFU) scale attention's FLOPs by it."""
    if not config.data.packing and not config.data.buckets:
        return 1.0
    from pipetune.data.cache import tokenized_data

    store = tokenized_data(config.data, prompts, config.train.seed).splits.get("train")
    lengths = store.lengths if store is not None else torch.empty(0, dtype=torch.long)
    d = config.data
    if d.packing:
        return packed_attention_share(lengths, d.max_length, d.max_samples_per_row, config.train.seed)
    padded = bucket_lengths(lengths, d.buckets).double()
    return float((padded**2).sum() / (d.max_length * padded.sum())) if len(padded) else 1.0


def _token_counts(builder: PromptBuilder, texts: list[str]) -> list[int]:
    return [len(ids) for ids in builder.encode_texts(texts)]


def percentile(ordered: list[int], q: float) -> int:
    """Nearest-rank percentile of sorted values: the smallest value with at least q% of values at or below it."""
    if not ordered:
        return 0
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --------------------------------------------------------------------------- text


def format_report(report: DataReport) -> str:
    """The report as aligned plain text: the rows read, the token lengths and truncation, the padding."""
    return "\n".join([*_rows_part(report), *_lengths_part(report), *_padding_part(report)])


def _rows_part(report: DataReport) -> list[str]:
    """Rows read, kept, skipped (by reason, with the first of each) and held out, per split."""
    out = [
        f"data.source = {report.source}   model = {report.model}   "
        f"max_length = {report.max_length}   max_summary_tokens = {report.max_summary_tokens}",
        "",
    ]
    rows = report.rows["splits"]
    for how, count in report.rows.get("columns", {}).items():
        out.append(f"read as: {how} ({count} rows)")
    out += _table(
        ["rows", "read", "kept", "skipped", "held out"],
        [[name, r["read"], r["kept"], sum(r["skipped"].values()), r["held_out"] or "-"] for name, r in rows.items()],
    )
    if report.rows["skipped"]:
        out.append("skipped rows by reason:")
        for reason, count in report.rows["skipped"].items():
            where = ", ".join(f"{name} {r['skipped'][reason]}" for name, r in rows.items() if reason in r["skipped"])
            first = next(r["skipped_at"][reason][0] for r in rows.values() if r["skipped_at"].get(reason))
            out.append(f"  {count:>6}  {reason}  ({where}; first: {first})")
    else:
        out.append("skipped rows: none")
    shortened = sum(r["shortened"] for r in rows.values())
    if shortened:
        out.append(f"{shortened} row(s) with text too long for any sample were cut by characters before tokenizing")
    out.append("")
    return out


def _lengths_part(report: DataReport) -> list[str]:
    """Token lengths per split, and how many transcripts were cut and summaries capped."""
    out = []
    length_rows = []
    for s in report.splits:
        for what, lengths in (
            ("transcript", s.transcript_tokens),
            ("summary", s.summary_tokens),
            ("sample as trained", s.sample_tokens),
        ):
            length_rows.append([s.name, what, lengths.p50, lengths.p90, lengths.p99, lengths.max])
    out += _table(["tokens", "", "p50", "p90", "p99", "max"], length_rows, text_columns=2)
    out.append("")

    out += _table(
        ["truncation", "samples", "transcripts cut", "cut mean", "cut max", "summaries capped", "capped max"],
        [
            [
                s.name,
                s.samples,
                s.transcripts_cut,
                f"{s.transcript_cut_mean:.0f}" if s.transcripts_cut else "-",
                s.transcript_cut_max if s.transcripts_cut else "-",
                s.summaries_capped,
                s.summary_cut_max if s.summaries_capped else "-",
            ]
            for s in report.splits
        ],
    )
    out.append("(cut mean/max: transcript tokens removed from the samples that were cut)")
    out.append("")
    return out


def _padding_part(report: DataReport) -> list[str]:
    """The padding of each way to lay out rows: static, buckets, packed (with packed rows' attention share)."""
    out = []
    bucket_names = "/".join(str(b) for b in report.buckets)
    out += _table(
        [
            "padding",
            f"static {report.max_length}",
            f"buckets {bucket_names}",
            "samples per bucket",
            "packed",
            "rows",
            "attention",
        ],
        [
            [
                s.name,
                _percent(s.pad_fraction),
                _percent(s.bucket_pad_fraction),
                "/".join(map(str, s.bucket_samples)),
                _percent(s.packed_pad_fraction),
                f"{s.samples} -> {s.packed_rows}",
                _percent(s.packed_attention),
            ]
            for s in report.splits
        ],
    )
    out.append("(pad share of all tokens; buckets: each sample padded to the smallest bucket that holds it;")
    out.append(
        f" packed: data.packing = true, whole samples in rows of {report.max_length}, at most "
        f"{report.max_samples_per_row} a row; rows: unpacked -> packed; attention: a packed row's attention work"
        " against a whole row's, each sample and the pad tail attending only to itself)"
    )
    return out


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(header: list[str], rows: list[list[Any]], text_columns: int = 1) -> list[str]:
    """Aligned columns: the first `text_columns` to the left, the numbers to the right."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if i < text_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
