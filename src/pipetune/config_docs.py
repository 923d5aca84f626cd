"""`pipetune config show` and `config list`: the resolved config as TOML with each key's docstring, the shipped configs.

    pipetune config show --config qwen3-4b-ami --set train.lr=1e-4
    pipetune config list

The docstrings are read from the dataclasses in config/schema.py (the attribute docstrings under each field),
so the printed documentation is the code's own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from functools import cache
from pathlib import Path

from pipetune.config import Config, _toml_value, shipped_configs
from pipetune.config import schema as config_module

WIDTH = 100


@cache
def key_docs() -> dict[tuple[str, str], str]:
    """(section, key) -> the field's docstring, for every key of Config."""
    tree = ast.parse(inspect.getsource(config_module))
    by_class: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        for field, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = inspect.cleandoc(after.value.value)
        by_class[node.name] = docs
    result = {}
    for section in dataclasses.fields(Config):
        section_class = section.default_factory().__class__
        for key in dataclasses.fields(section_class):
            result[(section.name, key.name)] = by_class.get(section_class.__name__, {}).get(key.name, "")
    return result


def annotated_toml(config: Config) -> str:
    """The resolved config as TOML: each key preceded by its docstring as comments, and its default when changed."""
    defaults = Config().to_dict()
    docs = key_docs()
    lines: list[str] = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        for key, value in values.items():
            lines += [f"# {line}" for line in textwrap.wrap(" ".join(docs[(section_name, key)].split()), WIDTH - 2)]
            default = defaults[section_name][key]
            changed = f"  # default: {_toml_value(default)}" if value != default else ""
            lines.append(f"{key} = {_toml_value(value)}{changed}")
        lines.append("")
    return "\n".join(lines)


def config_listing() -> str:
    """Each shipped config: its name and the first sentence of its header comment, whole, wrapped to WIDTH."""
    configs = shipped_configs()
    width = max(map(len, configs))
    lines = []
    for name, path in configs.items():
        wrapped = textwrap.wrap(_description(path), WIDTH - width - 2) or [""]
        lines.append(f"{name:<{width}}  {wrapped[0]}".rstrip())
        lines += [f"{'':<{width}}  {line}" for line in wrapped[1:]]
    directory = next(iter(configs.values())).parent
    lines.append(
        f"\nfiles in {directory}; use one with --config NAME, or start your own from "
        "`pipetune config show --config NAME > my.toml`"
    )
    return "\n".join(lines)


def _description(path: Path) -> str:
    """The first sentence of the file's header comment (its first lines of prose, up to a command or a gap)."""
    prose = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("#  ") or not line.strip("# "):
            break
        prose.append(line.lstrip("# ").strip())
    return _FIRST_SENTENCE.split(" ".join(prose), maxsplit=1)[0]


_FIRST_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")
"""Where a sentence ends: '.', '!' or '?', a space, and a capital (not "e.g. the"), a backquote or a parenthesis."""
