"""`pipetune export --gguf [TYPE]`: the base with the adapter merged in, as one GGUF file for llama.cpp and Ollama.

    exported/
      model-f16.gguf   the merged model: weights (f32, f16, bf16 or q8_0), its config, the tokenizer, the chat
                       template training used (Qwen3's with thinking off) and the tokens that end a summary
      Modelfile        `ollama create NAME -f Modelfile`: the prompt training built, greedy, stops at the turn's end

Tensor names are the gguf package's table (model/gguf.py's `tensor_names`, which reading checks files against);
the architecture's metadata is written as llama.cpp's own converter writes it, with Llama's q/k rows permuted
as llama.cpp expects them (transformers' GGUF reader undoes it). The file is written inside the export's staging
directory, so an export that fails leaves no file behind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipetune.config import Config, ConfigError
from pipetune.model.families import Family, family_of
from pipetune.model.gguf import tensor_names
from pipetune.model.shapes import head_dim as head_size

GGUF_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}
"""--gguf TYPE -> llama.cpp's general.file_type (LlamaFileType). Norms and biases are always f32; with q8_0, a
matrix whose rows are not a whole number of 32-value blocks is f16."""
WRITTEN_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""GGUF architectures whose metadata this module writes (Llama, Mistral and SmolLM2 are "llama")."""
SYSTEM_MARK, USER_MARK = "\x00pipetune-system\x00", "\x00pipetune-transcript\x00"
"""Stand-ins rendered through the chat template to find where the system prompt and the transcript go."""


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def check_gguf_export(config: Config, model_config: Any, tokenizer: Any, gguf_type: str) -> Family:
    """Refuse, in one line, what cannot become a GGUF file of the model trained, before anything is built: an
    unknown type, a quantized base, a family, rope scaling or tokenizer this module does not write. Returns the
    base's family."""
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf {gguf_type!r} is not a type pipetune writes; choose one of {', '.join(GGUF_TYPES)}")
    if config.model.quantize != "none":
        raise ConfigError(
            f"--gguf: the run trained on a base quantized as model.quantize = {config.model.quantize!r}, and a GGUF "
            "file merges the adapter into unquantized weights, which is not the model trained; export without "
            '--gguf (the adapter and the card), or train with model.quantize = "none" to export a GGUF'
        )
    family = family_of(model_config)
    if family.gguf_architecture not in WRITTEN_ARCHITECTURES:
        raise ConfigError(
            f"--gguf: the run's base is a {family.name} model ({model_config.model_type}), which pipetune does "
            f"not write as GGUF (it writes {', '.join(WRITTEN_ARCHITECTURES)} architectures: Llama, Mistral, "
            "SmolLM2, Qwen2, Qwen3); export without --gguf and load the adapter with transformers + PEFT"
        )
    rope = _rope(model_config)
    if rope.get("rope_type", "default") not in ("default", "llama3"):
        raise ConfigError(
            f"--gguf: the base's rope scaling (rope_type = {rope['rope_type']!r}) is not written to GGUF by "
            "pipetune; export without --gguf"
        )
    bpe_tokenizer(tokenizer)
    file_chat_template(tokenizer)
    return family


def _rope(model_config: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5's rope_parameters, or the older rope_theta/rope_scaling)."""
    rope = dict(getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(model_config, "rope_theta", None) or 10_000.0)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def file_chat_template(tokenizer: Any) -> str:
    """The tokenizer's chat template as the file carries it: thinking off where the template switches on
    `enable_thinking` (Qwen3), as training rendered it, whatever the reader passes."""
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ConfigError("--gguf: the run's tokenizer has no chat template; pipetune trains with one")
    if "enable_thinking" in template:
        template = "{%- set enable_thinking = false %}\n" + template
    return template


def write_gguf(path: Path, model: Any, tokenizer: Any, settings: dict[str, Any], gguf_type: str, name: str) -> None:
    """Write `model` (merged, any dtype) with `tokenizer`, the chat template and the stop tokens as one GGUF file."""
    import gguf

    model_config = model.config
    family = family_of(model_config)
    architecture = family.gguf_architecture
    writer = gguf.GGUFWriter(path, architecture)
    # transformers' GGUF reader reads a "llama" file as Mistral when its general.name says so.
    writer.add_name(f"{name} ({family.name.lower()})")
    writer.add_file_type(GGUF_TYPES[gguf_type])
    _add_config(writer, model_config, architecture)
    n_vocab = model.get_input_embeddings().weight.shape[0]
    _add_tokenizer(writer, tokenizer, n_vocab, settings["stop_ids"])
    writer.add_chat_template(file_chat_template(tokenizer))
    _add_tensors(writer, model, family, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_config(writer: Any, config: Any, architecture: str) -> None:
    """The architecture's hyperparameters, as llama.cpp's converter writes them."""
    head_dim = head_size(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(_rope(config)["rope_theta"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)


def _add_tokenizer(writer: Any, tokenizer: Any, n_vocab: int, stops: list[int]) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens padded to the embedding's rows, their types,
    the merges, the pre-tokenizer's name, and the special tokens (the template writes BOS itself)."""
    import gguf

    spec, pre = bpe_tokenizer(tokenizer)
    vocab = {i: token for token, i in tokenizer.get_vocab().items()}
    if max(vocab) >= n_vocab:
        raise ConfigError(f"--gguf: the tokenizer has token id {max(vocab)}, past the model's {n_vocab} embeddings")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in vocab:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            text = added[i].content
            tokens.append(text)
            control = added[i].special or (text.startswith("<|") and text.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(vocab[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = spec["model"].get("merges", [])
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge) for merge in merges])
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    if stops and stops[0] != tokenizer.eos_token_id:
        writer.add_eot_token_id(stops[0])  # the turn's end: llama.cpp and Ollama stop generating there
    writer.add_add_bos_token(False)  # the chat template renders the prompt's BOS, as training encoded it
    writer.add_add_eos_token(False)


def bpe_tokenizer(tokenizer: Any) -> tuple[dict[str, Any], str]:
    """The tokenizer's tokenizer.json as a dict and llama.cpp's name of its pre-tokenizer; a ConfigError for a
    tokenizer llama.cpp's "gpt2" model does not reproduce."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    kind = spec["model"].get("type")
    if kind != "BPE" or spec["model"].get("byte_fallback"):
        raise ConfigError(
            f"--gguf: the run's tokenizer is a {kind}{' byte-fallback' if kind == 'BPE' else ''} model; pipetune "
            "writes byte-level BPE tokenizers (Qwen, Llama 3, SmolLM2) to GGUF; export without --gguf"
        )
    return spec, pre_tokenizer_name(spec.get("pre_tokenizer"))


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
"""The split expressions of Qwen2/Qwen3's and Llama 3's tokenizers (pre_tokenizer Split + ByteLevel)."""


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json pre_tokenizer: the rule it splits text by."""
    steps = (pre.get("pretokenizers") or []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        known = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}
        if pattern in known:
            return known[pattern]
    raise ConfigError(
        f"--gguf: the run's tokenizer splits text by a rule llama.cpp has no name for ({json.dumps(pre)[:200]}); "
        "pipetune names GPT-2's, SmolLM2's, Qwen2/Qwen3's and Llama 3's; export without --gguf"
    )


def _add_tensors(writer: Any, model: Any, family: Family, gguf_type: str) -> None:
    """Every weight under its llama.cpp name, encoded as `gguf_type` (a tied output layer is the embedding's)."""
    import torch

    config = model.config
    names = tensor_names(family.gguf_architecture, config.num_hidden_layers)
    tied = dict(family.tied) if getattr(config, "tie_word_embeddings", False) else {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for key, tensor in model.state_dict().items():
        if key in tied:
            continue
        name = names(key)
        if name is None:
            raise ConfigError(f"--gguf: the merged model's tensor {key} has no GGUF name; export without --gguf")
        data = tensor.detach().to(torch.float32)
        if family.gguf_architecture == "llama" and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            data = llama_permute(data, heads if key.endswith("q_proj.weight") else kv_heads)
        _add_tensor(writer, name, data.numpy(), gguf_type)
    rope = _rope(config)
    if rope["rope_type"] == "llama3":
        head_dim = head_size(config)
        _add_tensor(writer, "rope_freqs.weight", llama3_rope_factors(rope, head_dim), "f32")


def llama_permute(weight: Any, n_heads: int) -> Any:
    """llama.cpp's row order of a Llama q or k projection: each head's two rotary halves interleaved."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> Any:
    """Llama 3.1's rope frequency factors, as llama.cpp's converter writes them (rope_freqs.weight)."""
    import numpy as np

    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tensor(writer: Any, name: str, data: Any, gguf_type: str) -> None:
    import gguf
    import numpy as np

    kinds = gguf.GGMLQuantizationType
    if data.ndim == 1 or gguf_type == "f32":
        writer.add_tensor(name, data.astype(np.float32))
    elif gguf_type == "f16" or (gguf_type == "q8_0" and data.shape[-1] % 32):
        writer.add_tensor(name, data.astype(np.float16))
    else:
        kind = kinds.BF16 if gguf_type == "bf16" else kinds.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


# --------------------------------------------------------------------------- Ollama


def rendered_prompt(template: str, tokenizer: Any, system: str, transcript: str) -> str:
    """The file's chat template rendered around (system, transcript) with the assistant's turn opened: the prompt
    text a chat front end (llama.cpp, Ollama, transformers) sends."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": transcript}]
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)


def modelfile(gguf_name: str, tokenizer: Any, settings: dict[str, Any], system_prompt: str) -> str:
    """An Ollama Modelfile: the file's chat template as a Go template around {{ .System }} and {{ .Prompt }},
    the training system prompt, greedy decoding, the summary's cap and the tokens that end it."""
    rendered = rendered_prompt(file_chat_template(tokenizer), tokenizer, SYSTEM_MARK, USER_MARK)
    if not 0 <= rendered.find(SYSTEM_MARK) < rendered.find(USER_MARK):
        raise ConfigError("--gguf: the chat template does not render the system prompt before the transcript")
    before, _, rest = rendered.partition(SYSTEM_MARK)
    between, _, after = rest.partition(USER_MARK)
    template = f"{_go_text(before)}{{{{ .System }}}}{_go_text(between)}{{{{ .Prompt }}}}{_go_text(after)}"
    stops = [
        tokenizer.convert_ids_to_tokens(i) for i in dict.fromkeys([*settings["stop_ids"][:1], tokenizer.eos_token_id])
    ]
    for text in (template, system_prompt):
        if '"""' in text:
            raise ConfigError('--gguf: the chat template or data.system_prompt holds """, which a Modelfile cannot')
    lines = [
        f"FROM ./{gguf_name}",
        f'TEMPLATE """{template}"""',
        f'SYSTEM """{system_prompt}"""',
        *(f"PARAMETER stop {json.dumps(stop)}" for stop in stops),
        "PARAMETER temperature 0",
        "PARAMETER top_k 1",
        f"PARAMETER num_predict {settings['max_summary_tokens']}",
        f"PARAMETER num_ctx {settings['max_length']}",
    ]
    return "\n".join(lines) + "\n"


def _go_text(text: str) -> str:
    """Literal text inside a Go template: its own `{{` written as a string action."""
    return text.replace("{{", '{{ "{{" }}')


def write_gguf_files(
    directory: Path, merged: Any, tokenizer: Any, settings: dict[str, Any], config: Config, gguf_type: str
) -> str:
    """The GGUF file and its Modelfile in `directory`; returns the model card's section on them."""
    name = gguf_file_name(gguf_type)
    write_gguf(directory / name, merged, tokenizer, settings, gguf_type, f"pipetune {Path(config.model.name).name}")
    (directory / "Modelfile").write_text(modelfile(name, tokenizer, settings, config.data.system_prompt))
    return f"""
## llama.cpp and Ollama

`{name}` is the base with the adapter merged in ({gguf_type}), with the tokenizer, the chat template training
used and the tokens that end a summary in its metadata; `Modelfile` makes it an Ollama model whose template
renders the training prompt:

    ollama create summarizer -f Modelfile
    ollama run summarizer < meeting.txt

or with llama.cpp: `llama-cli -m {name} --jinja -sys "<the system prompt above>"`. Ollama and llama.cpp build the
prompt from the text as given: they neither strip it nor cut a long transcript in the middle as `prompt_ids`
above does (set the context with `num_ctx`).
"""
