"""Everything checked before a process group exists: config values, the model, its tokenizer, the prompt budget.

The launcher runs this once before starting workers, so a bad value costs seconds and prints
one message; every worker runs it again to get the same resolved model and tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pipetune.config import Config, ConfigError, DataConfig, check_stage_count, validate, validate_against_model
from pipetune.data.batching import bucket_lengths, bucketed_epoch_batches
from pipetune.data.packing import epoch_rows
from pipetune.data.prompt import PromptBuilder
from pipetune.data.sources import require_local_source
from pipetune.loggers import check_loggers
from pipetune.model.families import Family, family_of
from pipetune.model.gguf import gguf_source
from pipetune.model.quantize import check_quantize
from pipetune.model.shapes import BUILTIN_SHAPES, ResolvedModel, one_layer_model, resolve_model
from pipetune.switches import Hardware, Resolution, resolve


@dataclass
class Prepared:
    model: ResolvedModel
    tokenizer: PreTrainedTokenizerBase
    prompts: PromptBuilder
    speed: Resolution | None = None
    """The config with its speed switches resolved for this machine (preflight's; pipetune/switches.py)."""

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def preflight(config: Config, world_size: int, speak: bool = True, hardware: Hardware | None = None) -> Prepared:
    """All checks for a training run of world_size processes, of its speed switches resolved for `hardware` (this
    machine's by default), then the resolved model and tokenizer. `speak`: say the checks' warnings and notes (a
    launcher does, for all its workers; they check again in silence)."""
    asked = config
    hardware = hardware or Hardware.here()
    config = resolve(config, hardware).config
    check_data_source(config.data)
    check_layout(config, world_size)
    check_loggers(config.output.loggers)
    prepared = prepare(config, speak)
    family = family_of(prepared.model.config)
    # a CPU's loss by its logits' size; the last layer on the loss's rows by the family's norms
    speed = resolve(asked, hardware, vocab=prepared.model.config.vocab_size, pre_norm=family.pre_norm_layers)
    config = speed.config
    check_packing(config, prepared.model.config)
    check_head_rows(config, family)
    if config.model.quantize == "fp8" and not config.train.compile:  # FP8 matmuls this GPU runs: say how they pay
        _say(
            'note: model.quantize = "fp8" pays compiled: with train.compile = false the quantization around each FP8 '
            "matmul costs more than FP8 saves (Qwen3-8B on one H200, 4,096-token rows: 9,945 tokens/s eagerly, "
            "11,816 in bf16, 21,983 compiled); set train.compile = true",
            speak,
        )
    from pipetune.model.split import run_split
    from pipetune.parallel.memory import check_row_fits, check_weights_fit

    ranges = run_split(config, prepared.model.config)[1]
    check_weights_fit(config, prepared.model.config, ranges)
    check_row_fits(config, prepared.model, ranges)  # after the weights: a row needs them to fit first
    prepared.speed = speed
    return prepared


def _say(line: str, speak: bool) -> None:
    """A warning or note of the start checks on stderr, where this process speaks for its run (`speak`)."""
    if speak:
        print(f"pipetune: {line}", file=sys.stderr, flush=True)


def check_positions(config: Config, model_config: PretrainedConfig) -> str | None:
    """A warning when data.max_length goes past the positions the model was trained for (max_position_embeddings)
    and its config scales no rope: attention past them has never been trained, and quality falls off."""
    trained = getattr(model_config, "max_position_embeddings", None)
    scaling = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    # One set of rope parameters, or one per attention kind (Gemma 3: {"full_attention": {...}, ...}).
    kinds = [v for v in scaling.values() if isinstance(v, dict)] or [scaling]
    scaled = any(kind.get("rope_type", kind.get("type", "default")) not in (None, "default") for kind in kinds)
    if trained is None or config.data.max_length <= trained or scaled:
        return None
    factor = max(2, math.ceil(config.data.max_length / trained))  # enough to reach the row
    return (
        f"data.max_length = {config.data.max_length} is beyond the {trained} positions {config.model.name!r} was "
        "trained for (max_position_embeddings) and its config scales no rope; train on shorter rows, or use a "
        'model whose config.json sets rope_scaling (e.g. {"rope_type": "yarn", "factor": '
        f'{factor}, "original_max_position_embeddings": {trained}}})'
    )


def check_data_source(data: DataConfig) -> None:
    """A data.source that names a local file or directory that is not there fails now, in the launching process,
    before the model and tokenizer are resolved (a download, a GGUF conversion), not after them."""
    require_local_source(data.source)


def check_layout(config: Config, world_size: int) -> None:
    """validate(), except that more pipeline stages than the model has decoder layers is named first: the schedule's
    rules for that many stages (a microbatch per stage, ...) would otherwise ask for changes that cannot help."""
    try:
        validate(config, world_size)
    except ConfigError:
        n_layers = _layer_count(config) if config.parallel.pipelined else None
        if n_layers is not None:
            check_stage_count(config, n_layers)
        raise


def _layer_count(config: Config) -> int | None:
    """The model's decoder layers from what this machine holds already: a built-in shape, a local directory or
    GGUF file (converted once, as prepare() would), or the config.json of a hub model in the Hugging Face cache.
    None otherwise (no download for a config that fails anyway), or when it cannot be read: a model that cannot
    be found is prepare()'s to report."""
    name = config.model.name
    try:
        if name in BUILTIN_SHAPES or Path(name).expanduser().exists() or gguf_source(name) is not None:
            return resolve_model(dataclasses.replace(config.model, init="random")).config.num_hidden_layers
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        return json.loads(Path(cached).read_text())["num_hidden_layers"] if isinstance(cached, str) else None
    except Exception:  # noqa: BLE001 (any failure here leaves the validation's own error to be raised)
        return None


def prepare(config: Config, speak: bool = True) -> Prepared:
    """Resolve the model, load its tokenizer and build the prompt builder (also used for inference)."""
    resolved = resolve_model(config.model)
    shape = resolved.config
    heads = shape.num_attention_heads
    kv_heads = getattr(shape, "num_key_value_heads", None) or heads
    validate_against_model(config, shape.num_hidden_layers, linear_layer_names(resolved), heads, kv_heads)
    check_lora_rank(config, shape)
    warning = check_positions(config, shape)
    if warning:
        _say(f"warning: {warning}", speak)
    check_quantize(config, resolved.config)  # before any weight is read
    tokenizer = load_tokenizer(config, resolved)
    if len(tokenizer) > resolved.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but {config.model.name!r} embeds only "
            f"{resolved.config.vocab_size}; set model.tokenizer to the model's own tokenizer"
        )
    prompts = PromptBuilder(
        tokenizer, config.data.max_length, config.data.max_summary_tokens, config.data.system_prompt
    )
    prompts.check_budget()
    return Prepared(resolved, tokenizer, prompts)


def check_lora_rank(config: Config, model_config: PretrainedConfig) -> None:
    """lora.r beyond hidden_size: every adapted layer takes or gives hidden_size features, so no adapter can use a
    rank above it, while its weights and optimizer state grow with lora.r."""
    hidden = getattr(model_config, "hidden_size", None)
    if isinstance(hidden, int) and config.lora.r > hidden:
        raise ConfigError(
            f"lora.r = {config.lora.r} is beyond the {hidden} features of {config.model.name!r}'s layers "
            f"(hidden_size): an adapter's rank cannot exceed a layer's narrower side; set lora.r <= {hidden} "
            f"(e.g. {min(16, hidden)})"
        )


def check_optimizer_steps(
    config: Config, n_samples: int, skipped: str, n_batches: int | None = None, n_rows: int | None = None
) -> int:
    """Optimizer steps per epoch of `n_samples` training samples in `n_batches` schedule-step batches (default: as
    many as fill a global batch); `n_rows`: with data.packing, the rows the samples pack into. ConfigError when
    that is none."""
    t, p = config.train, config.parallel
    if n_batches is None:
        n_batches = n_samples // (t.batch_size * p.dp)
    steps = n_batches // t.grad_accum
    if steps == 0:
        packed, fix = "", "lower them or add data"
        if n_rows is not None:
            packed = (
                f" pack into {n_rows} rows of data.max_length {config.data.max_length} (data.packing: "
                "train.batch_size counts rows), which"
            )
            fix = "lower them, set data.packing = false (one sample a row), or add data"
        raise ConfigError(
            f"{n_samples} training samples ({skipped}){packed} make no optimizer step of "
            f"train.batch_size {t.batch_size} x train.grad_accum {t.grad_accum}"
            + (f" x parallel.dp {p.dp}" if p.dp > 1 else "")
            + f"; {fix}"
        )
    return steps


def epoch_steps(
    config: Config, lengths: torch.Tensor, skipped: str, rows_of: Callable[[int], torch.Tensor] | None = None
) -> list[int]:
    """Optimizer steps in each epoch of the training split (`lengths`: its samples' tokens), counted the same way
    by the launcher and by every worker; ConfigError when an epoch makes none (check_optimizer_steps).

    Unpacked, every epoch holds the same batches (with data.buckets: those each bucket fills). Packed, each epoch's
    rows are packed from its own order, so epochs may differ by a row or two; an epoch's count depends only on
    (seed, epoch), never on train.epochs, so a run resumed with more epochs continues where it stopped. Packed
    epochs are counted up to the one where train.max_steps ends the run. `rows_of(epoch)`: that epoch's packed rows
    (default: packed here; a worker passes its plan's, so that packing runs once an epoch)."""
    t, d = config.train, config.data
    global_batch = t.batch_size * config.parallel.dp
    if not d.packing:
        n_batches = len(lengths) // global_batch
        if d.buckets:  # batches of one bucket each, as the run cuts them: every bucket drops its remainder
            n_batches = len(bucketed_epoch_batches(bucket_lengths(lengths, d.buckets), global_batch, t.seed, 0)[1])
        return [check_optimizer_steps(config, len(lengths), skipped, n_batches)] * t.epochs
    rows_of = rows_of or (lambda epoch: epoch_rows(lengths, d.max_length, d.max_samples_per_row, t.seed, epoch))
    steps: list[int] = []
    for epoch in range(t.epochs):
        n_rows = len(rows_of(epoch))
        steps.append(check_optimizer_steps(config, len(lengths), skipped, n_rows // global_batch, n_rows))
        if 0 < t.max_steps <= sum(steps):
            break
    return steps


def check_packing(config: Config, model_config: PretrainedConfig) -> None:
    """Packed rows (data.packing) on a family whose layers have a mask of their own at data.max_length (Gemma 3's
    sliding window): refused now, with the message the stage raises at its first forward, not once per worker
    after the weights are loaded."""
    if not config.data.packing:
        return
    from pipetune.model.stage import layer_call_kwargs

    class NoRotary:  # the layers' inputs are built for their masks only: no position embeddings
        config = model_config

        def __call__(self, *args: object) -> None:
            return None

    length = config.data.max_length
    hidden = torch.empty((1, length, 1), device="meta")
    positions = torch.zeros((1, length), dtype=torch.long, device="meta")
    layer_call_kwargs(family_of(model_config), NoRotary(), hidden, positions, document=True)


def check_head_rows(config: Config, family: Family) -> None:
    """train.head_rows = true on a family whose layers norm their sublayers' outputs too: the last layer's output
    at a row is then not its input plus the sublayers' (model/head_rows.py)."""
    if config.train.head_rows is True and not family.pre_norm_layers:
        raise ConfigError(
            f"train.head_rows = true runs the last layer on the loss's rows of a layer x + attn(norm(x)), but "
            f"{family.name}'s layers norm their attention's and MLP's outputs too; set train.head_rows = false "
            '(or "auto")'
        )


def load_tokenizer(config: Config, resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """model.tokenizer if set; else the model directory's own; else, for a random-init shape (built in, or a
    directory with only a config.json), the built-in demo tokenizer."""
    name = config.model.tokenizer
    if not name and not resolved.has_tokenizer and resolved.weights_dir is None:
        from pipetune.data.tokenizer import demo_tokenizer

        return demo_tokenizer()
    source = name or str(resolved.source_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.model.trust_remote_code)
    except Exception as e:  # missing files, offline hub
        raise ConfigError(f"tokenizer {source!r} could not be loaded ({type(e).__name__}: {e})") from None
    if tokenizer.chat_template is None:
        raise ConfigError(f"tokenizer {source!r} has no chat template; use an instruct/chat model's tokenizer")
    return tokenizer


def linear_layer_names(resolved: ResolvedModel) -> set[str]:
    """Short names of the model's linear layers (q_proj, ...), read off a meta-device instance of one layer."""
    model = one_layer_model(resolved.config)
    return {name.rsplit(".", 1)[-1] for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)}
