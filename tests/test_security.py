"""No pickle on the way in: every torch.load is weights_only, no remote code is trusted, tensors go to safetensors.

The checks read the source of src/ (its syntax tree, so formatting cannot hide a call).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pipetune.cli import main
from pipetune.config import ModelConfig
from pipetune.generate import inference_config
from tests.conftest import REPO, tiny_config, write_config

SOURCES = sorted((REPO / "src" / "pipetune").rglob("*.py"))


def problems(source: str) -> list[str]:
    """Unsafe loads and writes in one module's source, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
            found.append(f"line {node.lineno}: torch.load imported under another name")
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if name == "torch.load" and not _is(keywords.get("weights_only"), True):
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        if _is(keywords.get("trust_remote_code"), True):
            found.append(f"line {node.lineno}: trust_remote_code=True")
        if name in ("torch.save", "pickle.dump", "pickle.load", "pickle.loads"):
            found.append(f"line {node.lineno}: {name}; write tensors with safetensors, metadata as JSON")
        if name.endswith("save_pretrained") and _is(keywords.get("safe_serialization"), False):
            found.append(f"line {node.lineno}: save_pretrained(safe_serialization=False)")
    return found


def _is(value: ast.expr | None, constant: object) -> bool:
    return isinstance(value, ast.Constant) and value.value is constant


def test_sources_are_found() -> None:
    assert len(SOURCES) > 10 and any(p.name == "checkpoint.py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO / "src")))
def test_no_unsafe_load_remote_code_or_pickle_in(path: Path) -> None:
    assert problems(path.read_text()) == [], path


def test_the_check_catches_each_unsafe_form() -> None:
    source = """
import torch, pickle
from torch import load
a = torch.load(f)
b = torch.load(f, weights_only=False)
c = torch.load(f, weights_only=True)
m = AutoModel.from_pretrained(name, trust_remote_code=True)
torch.save(state, "x.pt")
pickle.dump(state, f)
model.save_pretrained(d, safe_serialization=False)
"""
    assert [p.split(":")[0] for p in problems(source)] == [f"line {n}" for n in (3, 4, 5, 7, 8, 9, 10)]


def test_trust_remote_code_is_off_by_default() -> None:
    assert ModelConfig().trust_remote_code is False


def test_adapters_and_checkpoints_are_written_as_safetensors() -> None:
    """The modules that write tensors do it through safetensors."""
    for module in ("model/lora.py", "checkpoint.py"):
        text = (REPO / "src" / "pipetune" / module).read_text()
        assert "safetensors" in text, module
        assert ".bin" not in text and '.pt"' not in text, module


def test_remote_code_named_in_a_run_directory_does_not_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """summarize and eval read RUN/config.toml, which anyone may have written: its trust_remote_code is ignored."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "crafted", "auto_map": {"AutoConfig": "crafted.CraftedConfig"}})
    )
    (model / "crafted.py").write_text(f"import pathlib\npathlib.Path({str(model / 'RAN')!r}).touch()\n")
    run = tmp_path / "run"
    config = tiny_config(run, f'model.name="{model}"', "model.trust_remote_code=true", 'model.init="pretrained"')
    write_config(config, run / "config.toml")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(model)}))
    (tmp_path / "meeting.txt").write_text("A: hello.\nB: bye.\n")

    assert main(["summarize", "--adapter", str(run / "adapter"), str(tmp_path / "meeting.txt"), "--quiet"]) == 2
    assert main(["eval", "--run", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("sets model.trust_remote_code = true, which is not taken from a file") == 2
    assert err.count("its config.json cannot be read (The repository") == 2  # transformers: "contains custom code"
    assert not (model / "RAN").exists()
    assert inference_config(run / "adapter", trust_remote_code=True).config.model.trust_remote_code  # the flag's way
