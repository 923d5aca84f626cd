"""Pad waste at AMI-like lengths: the static shape against length buckets, through `data inspect`'s own code.

    python benchmarks/tools/pad_waste.py [--samples 500] [--max-length 8192] [--seed 0]

AMI transcripts average about 6,000 tokens and their summaries about 300; the hub is not reachable
here, so lengths are drawn from log-normal distributions with those means, for a few spreads
(sigma of the log). Each sample is built by the real PromptBuilder (demo tokenizer, where " the" is
one token, so a transcript of n tokens is " the" * n) and measured by `split_report`.
Output of the command above is in benchmarks/pad_waste.md.
"""

from __future__ import annotations

import argparse
import math
import random

from pipetune.data.batching import bucket_boundaries
from pipetune.data.example import Example
from pipetune.data.inspect import split_report
from pipetune.data.prompt import PromptBuilder
from pipetune.data.tokenizer import demo_tokenizer

TRANSCRIPT_MEAN, SUMMARY_MEAN = 6000, 300


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float) -> list[int]:
    """n positive integers with the given mean, log-normally spread (sigma of the log)."""
    mu = math.log(mean) - sigma**2 / 2
    return [max(1, round(rng.lognormvariate(mu, sigma))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--max-summary-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    builder = PromptBuilder(demo_tokenizer(), args.max_length, args.max_summary_tokens)
    print(
        f"{args.samples} samples, transcripts ~{TRANSCRIPT_MEAN} tokens, summaries ~{SUMMARY_MEAN} (sigma 0.3), "
        f"max_length {args.max_length}, max_summary_tokens {args.max_summary_tokens}, "
        f"template {builder.template_length} tokens\n"
    )
    header = (
        f"{'sigma':>5}  {'transcript p50/p90/max':>22}  {'cut':>5}  {'static pad':>10}  "
        f"{'4 buckets pad':>13}  {'8 buckets pad':>13}  {'samples per 4 buckets':>21}"
    )
    print(header)
    for sigma in (0.25, 0.5, 0.75):
        rng = random.Random(args.seed)
        transcripts = lognormal_lengths(rng, args.samples, TRANSCRIPT_MEAN, sigma)
        summaries = lognormal_lengths(rng, args.samples, SUMMARY_MEAN, 0.3)
        examples = [Example(" the" * t, " the" * s) for t, s in zip(transcripts, summaries, strict=True)]
        four = split_report("train", examples, builder, bucket_boundaries(args.max_length, 4))
        eight = split_report("train", examples, builder, bucket_boundaries(args.max_length, 8))
        lengths = four.transcript_tokens
        print(
            f"{sigma:>5}  {f'{lengths.p50}/{lengths.p90}/{lengths.max}':>22}  "
            f"{four.transcripts_cut / four.samples:>5.0%}  {four.pad_fraction:>10.1%}  "
            f"{four.bucket_pad_fraction:>13.1%}  {eight.bucket_pad_fraction:>13.1%}  "
            f"{'/'.join(map(str, four.bucket_samples)):>21}"
        )
    print(f"\nbuckets: 4 = {bucket_boundaries(args.max_length, 4)}, 8 = {bucket_boundaries(args.max_length, 8)}")


if __name__ == "__main__":
    main()
