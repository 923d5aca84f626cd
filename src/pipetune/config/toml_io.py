"""A config in and out of text: TOML files and shipped configs by name, `--set section.key=value` overrides (typed
as each key's annotation, misspellings answered with the closest name), and the resolved config written back."""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import tomllib
import types
import typing
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pipetune.config.schema import Config
from pipetune.errors import ConfigError


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys by name."""
    config = Config()
    for section_name, values in raw.items():
        sections = [f.name for f in dataclasses.fields(Config)]
        if section_name not in sections:
            raise ConfigError(
                f"unknown config section [{section_name}]{_did_you_mean(section_name, sections, '[{}]')}; "
                f"sections are: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(
                f"{section_name} = {_toml_value_or_repr(values)} is a value, but [{section_name}] is a section: write "
                f"[{section_name}] on a line of its own and its keys below it (keys of [{section_name}] are: "
                f"{', '.join(_keys(section_name))})"
            )
        # output.tensorboard last: it adds to the output.loggers the table gives, before or after it
        for key in sorted(values, key=lambda k: (section_name, k) == ("output", "tensorboard")):
            _set_key(config, section_name, key, values[key])
    return config


def _set_key(config: Config, section_name: str, key: str, value: Any) -> None:
    if (section_name, key) == ("output", "tensorboard"):
        _migrate_tensorboard(config, value)
    else:
        _set_field(getattr(config, section_name), section_name, key, value)


def _migrate_tensorboard(config: Config, value: Any) -> None:
    """output.tensorboard (a bool) became output.loggers: older configs and run directories still load."""
    if value is True:
        if "tensorboard" not in config.output.loggers:
            config.output.loggers = [*config.output.loggers, "tensorboard"]
        print(
            "pipetune: note: output.tensorboard = true is read as output.loggers = "
            f"{_toml_value(config.output.loggers)}; write that instead (output.tensorboard will go)",
            file=sys.stderr,
        )
    elif value is not False:
        raise ConfigError(f'output.tensorboard = {value!r}: use output.loggers = ["csv", "tensorboard"] instead')


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with pipetune, by name (file name without .toml)."""
    with resources.as_file(resources.files("pipetune") / "configs") as directory:
        return {path.stem: path for path in sorted(Path(directory).glob("*.toml"))}


def config_path(name: str | Path) -> Path:
    """A TOML file's path, or the path of the shipped config of that name (`qwen3-4b-ami` or `demo.toml`). Any
    path that exists and is not a directory is read: /dev/null, a named pipe, `<(...)`'s /dev/fd/N."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        return path
    shipped = shipped_configs()
    stem = path.name.removesuffix(".toml")
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    raise ConfigError(f"config file {str(name)!r} does not exist; {_CONFIG_HINT.format(', '.join(shipped))}")


_CONFIG_HINT = "pass --config with a TOML file or the name of a shipped config: {} (pipetune config list)"


def load_config(path: str | Path | None, overrides: list[str] = (), command: str = "pipetune train") -> Config:
    """Read a TOML file or shipped config (defaults when path is None; an empty file is the defaults too) and apply
    `section.key=value` overrides. `command` is the one a data file given as the config is shown with."""
    raw: dict[str, Any] = {}
    if path is not None:
        if str(path) == "":  # Path("") is ".", a directory the user never named
            raise ConfigError(f"config file '' is an empty name; {_CONFIG_HINT.format(', '.join(shipped_configs()))}")
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a directory; pass --config with a TOML file")
        path = config_path(path)
        if path.suffix.lower() in DATA_SUFFIXES:
            raise ConfigError(_data_as_config(path, DATA_SUFFIXES[path.suffix.lower()], command))
        try:
            content = path.read_bytes()  # once: a pipe (/dev/fd/N) cannot be read twice
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror})") from None
        try:
            raw = tomllib.loads(content.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            kind = _data_kind(content)
            if kind is not None:
                raise ConfigError(_data_as_config(path, kind, command)) from None
            if isinstance(e, UnicodeDecodeError):
                raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e}); save it as UTF-8") from None
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    config = from_dict(raw)
    for item in overrides:
        apply_override(config, item)
    return config


DATA_SUFFIXES = {".jsonl": "JSONL", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet", ".txt": "text"}
"""File types that hold data or a transcript, never a config (a TOML file), and what they hold."""


def _data_kind(content: bytes) -> str | None:
    """What a config file that is not TOML holds, when it looks like data: "Parquet", "JSON", "JSONL", "CSV"."""
    if content.startswith(b"PAR1"):
        return "Parquet"
    text = content.decode("utf-8", errors="replace").strip()
    first = text.splitlines()[0] if text else ""
    for kind, candidate in (("JSON", text), ("JSONL", first)):
        try:
            if isinstance(json.loads(candidate), (dict, list)):
                return kind
        except ValueError:
            pass
    if "," in first and "=" not in first and not first.startswith(("[", "#")):
        return "CSV"
    return None


def _data_as_config(path: Path, kind: str, command: str) -> str:
    """The message for data given as --config: which option takes it, and the command with it there."""
    if kind == "text":
        return (
            f"--config {str(path)!r} is a text file, not a TOML config: a transcript to summarize goes to "
            f"`pipetune summarize --adapter RUN/adapter {path}`; training data is a JSONL, JSON, CSV or Parquet file "
            "given with --set data.source=FILE"
        )
    suffix = f".{kind.lower()}"
    named = "" if path.suffix.lower() == suffix else f" (a file named *{suffix})"
    source = path if not named else path.with_suffix(suffix)
    return (
        f"--config {str(path)!r} holds {kind} data, not a TOML config: give data with --set data.source=FILE"
        f"{named} and the settings with --config, e.g. `{command} --config qwen3-4b-ami --set data.source={source}`"
    )


def _did_you_mean(name: str, names: list[str], form: str = "{}") -> str:
    """The hint ' (did you mean X?)' with the closest of `names` to a misspelt `name` (`form` shapes X), or ""."""
    close = difflib.get_close_matches(name, [n for n in names if n != name], n=1, cutoff=0.6)
    return f" (did you mean {form.format(close[0])}?)" if close else ""


def apply_override(config: Config, item: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as TOML, else taken as a string (as it is for a
    string key that TOML would read as a number, bool or date: output.dir=2024-01-01)."""
    key_path, sep, text = item.partition("=")
    section_name, dot, key = key_path.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"--set {item!r} is not of the form section.key=value (e.g. train.lr=1e-4)")
    sections = [f.name for f in dataclasses.fields(Config)]
    if section_name not in sections:  # not hasattr: Config has methods and properties too
        close = difflib.get_close_matches(section_name, sections, n=1, cutoff=0.6)
        hint = f" (did you mean --set {close[0]}.{key}{sep}{text}?)" if close else ""
        raise ConfigError(f"--set {item!r}: unknown section {section_name!r}{hint}; sections: {', '.join(sections)}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if not isinstance(value, (str, list, dict)) and _declared_type(section_name, key) is str:
        value = text  # output.dir=2024-01-01 or model.name=123: a string key takes the text as written
    _set_key(config, section_name, key, value)


def _set_field(section: Any, section_name: str, key: str, value: Any) -> None:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        elsewhere = [f"{f.name}.{key}" for f in dataclasses.fields(Config) if key in _keys(f.name)]
        hint = _did_you_mean(key, list(fields), f"{section_name}.{{}}") or (
            f" (did you mean {elsewhere[0]}?)" if elsewhere else ""
        )
        raise ConfigError(f"unknown key {section_name}.{key}{hint}; keys of [{section_name}] are: {', '.join(fields)}")
    declared = fields[key]
    default = declared.default if declared.default is not dataclasses.MISSING else declared.default_factory()
    expected = _declared_type(section_name, key)
    if isinstance(value, str) and value in declared.metadata.get("also", ()):
        ok = True  # a named alternative to the declared type, e.g. activation_checkpointing = "auto"
    elif expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is list:
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, str)
    if not ok:
        quote = ""
        if expected is str and not isinstance(value, (list, dict)):  # e.g. dir = 2024-01-01, read as a date
            written = _toml_value(value) if isinstance(value, (bool, int, float)) else str(value)
            quote = f' (a string: write it in quotes, {key} = "{written}")'
        raise ConfigError(
            f"{section_name}.{key} = {value!r} has type {type(value).__name__}; "
            f"expected {expected.__name__}"
            + (f" like {default!r}" if isinstance(default, expected) else "")
            + "".join(f" or {alt!r}" for alt in declared.metadata.get("also", ()))
            + quote
        )
    setattr(section, key, value)


def _section_class(section_name: str) -> type:
    return next(f for f in dataclasses.fields(Config) if f.name == section_name).default_factory


def _keys(section_name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_section_class(section_name))]


@cache
def _declared_type(section_name: str, key: str) -> type | None:
    """The type a key is annotated with (bool, int, float, str or list), not its default's, which may be narrower
    (an int default of a float key). Of a union (`bool | str`), the first member: its strings are metadata["also"]."""
    hint = typing.get_type_hints(_section_class(section_name)).get(key)  # None: not a key
    if isinstance(hint, types.UnionType):
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) or hint


def to_toml(config: Config) -> str:
    """The resolved config as TOML (every key, defaults included)."""
    lines = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config through a temporary file and a rename: readers never see half a file."""
    from pipetune.files import write_atomic

    write_atomic(path, to_toml(config))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(c) or _escape_control(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
"""The short escapes of a TOML basic string (one line, in double quotes)."""


def _escape_control(c: str) -> str:
    """Any other control character (U+0000-U+001F, DEL) as \\uXXXX, which TOML allows; the rest as is."""
    return f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c


def _toml_value_or_repr(value: Any) -> str:
    """`value` as TOML, or Python's repr where _toml_value cannot write it (a date, a table)."""
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)
