"""`pipetune summarize` against transformers' plain generate: the same prompts, greedy, on one GPU.

From the repo root, with a finished run (its adapter/ and config.toml):

    PYTHONPATH=src python benchmarks/tools/summarize_speed.py --adapter RUN/adapter --out $OUT/speed \
        [--input meetings.jsonl | --meetings 16 --words 12000 --max-length 20000] [--batch-size 8]

The prompts are summarize's (the run's base, dtype and prompt; `--max-length` raises data.max_length, the prompt's
budget, for whole meetings of 16k+ tokens). Two modes generate the same summaries:

  plain     transformers' `generate` on one prompt at a time (KV cache on, no batching): the baseline
  pipetune  generate.summarize: prompts sorted by length in left-padded batches of at most --batch-size rows
            and --max-batch-tokens tokens of KV cache

It prints and writes result.json: per mode the summary tokens (up to the stop), seconds, tokens/s and peak GPU
memory, and how many summaries the two modes agree on (bfloat16 batches may round differently from one row).
`--meetings N --words W`: N synthetic transcripts of about W words each (synthetic meetings joined).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", required=True, help="a run's adapter/ (its config.toml beside it)")
    parser.add_argument("--out", required=True, help="directory for result.json")
    parser.add_argument("--input", help="JSONL or text transcripts, read as `pipetune summarize` reads them")
    parser.add_argument("--meetings", type=int, default=8, help="synthetic transcripts without --input (default: 8)")
    parser.add_argument("--words", type=int, default=2000, help="words per synthetic transcript (default: 2000)")
    parser.add_argument("--max-length", type=int, help="data.max_length: the prompt's budget (default: the run's)")
    parser.add_argument("--max-new-tokens", type=int, help="(default: data.max_summary_tokens)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=65_536)
    parser.add_argument("--skip-plain", action="store_true", help="time the pipetune mode only")
    args = parser.parse_args()

    from pipetune.generate import GenerationStats, inference_config, load_finetuned, read_transcripts, summarize

    config = inference_config(args.adapter).config
    if args.max_length:
        config.data.max_length = args.max_length
    transcripts = read_transcripts(args.input, config.data).transcripts if args.input else synthetic(args)
    model, prepared = load_finetuned(config, args.adapter)
    max_new = args.max_new_tokens or config.data.max_summary_tokens
    lengths = [len(prepared.prompts.prompt_ids(text)) for text in transcripts]
    print(
        f"{len(transcripts)} prompts of {min(lengths)}-{max(lengths)} tokens, {config.model.name} {config.model.dtype}"
    )
    result = {"device": device_name(), "prompt_tokens": lengths, "max_new_tokens": max_new, "modes": {}}
    outputs = {}
    summarize(model, prepared, transcripts[:1], 2)  # warm-up: kernels, allocator, caches out of the timings
    for mode in ("plain", "pipetune"):
        if mode == "plain" and args.skip_plain:
            continue
        reset_memory()
        stats = GenerationStats()
        batch_size, budget = (1, None) if mode == "plain" else (args.batch_size, args.max_batch_tokens)
        if mode == "plain":
            outputs[mode] = plain_generate(model, prepared, transcripts, max_new, stats)
        else:
            outputs[mode] = summarize(
                model, prepared, transcripts, max_new, batch_size, max_batch_tokens=budget, stats=stats
            )
        result["modes"][mode] = {
            "summary_tokens": stats.new_tokens,
            "seconds": round(stats.seconds, 2),
            "tokens_per_s": round(stats.new_tokens / stats.seconds, 1),
            "batches": stats.batches,
            "peak_gpu_gib": peak_memory(),
        }
        print(f"{mode}: {stats.line()}; peak GPU memory {result['modes'][mode]['peak_gpu_gib']} GiB")
    if len(outputs) == 2:
        result["agree"] = sum(a == b for a, b in zip(outputs["plain"], outputs["pipetune"], strict=True))
        print(f"{result['agree']} of {len(transcripts)} summaries agree")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


@torch.no_grad()
def plain_generate(model, prepared, transcripts: list[str], max_new: int, stats) -> list[str]:
    """transformers' generate, one prompt at a time, greedy, ending at summarize's stop tokens."""
    from pipetune.generate import stop_ids

    stops = stop_ids(prepared.prompts.end_ids[0], prepared.tokenizer)
    device = next(model.parameters()).device
    outputs = []
    start = time.perf_counter()
    for text in transcripts:
        ids = torch.tensor([prepared.prompts.prompt_ids(text)], device=device)
        new = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, eos_token_id=stops)
        new = new[0, ids.shape[1] :].tolist()
        new = new[: min((new.index(stop) for stop in stops if stop in new), default=len(new))]
        outputs.append(prepared.tokenizer.decode(new, skip_special_tokens=True).strip())
        stats.new_tokens += len(new)
        stats.prompt_tokens += ids.shape[1]
        stats.transcripts += 1
        stats.batches += 1
    stats.seconds = time.perf_counter() - start
    return outputs


def synthetic(args: argparse.Namespace) -> list[str]:
    """`--meetings` transcripts of about `--words` words, each synthetic meetings joined."""
    from pipetune.data.synthetic_splits import synthetic_splits

    pool = [m.transcript for m in synthetic_splits(seed=5, n_train=64, n_validation=0)["train"]]
    transcripts = []
    for i in range(args.meetings):
        parts, words = [], 0
        while words < args.words:
            parts.append(pool[(i + len(parts)) % len(pool)])
            words += len(parts[-1].split())
        transcripts.append("\n".join(parts))
    return transcripts


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def reset_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


if __name__ == "__main__":
    sys.exit(main())
