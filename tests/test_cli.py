"""The command line: `--help`, `--version` and `config` without importing torch; a reader that leaves early; `--set`
written with a space; the demo's note on too few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli import demo_config, main, version
from tests.conftest import REPO

HEAVY = ("torch", "transformers", "peft", "rich", "matplotlib")


def test_help_and_version_import_no_heavy_library() -> None:
    """What makes --help take seconds is importing torch and friends; none may be imported for these commands."""
    probe = (
        "import sys\n"
        "from pipetune.cli import main\n"
        "for argv in (['--help'], ['--version'], ['train', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "main(['config', 'list'])\n"
        "main(['config', 'show', '--config', 'demo'])\n"
        f"print('loaded:', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "loaded: []" in result.stdout
    assert "examples:" in result.stdout and "pipetune export --run" in result.stdout  # the top-level help
    assert f"pipetune {version()}\n" in result.stdout


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`pipetune config list | head -3`: when the reader has gone, the command ends without a traceback, with the
    status of a command ended by SIGPIPE. The pipe's read end is closed before the command starts: no race."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pipetune", "config", "list"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 141, result.stderr


def test_set_with_a_space_instead_of_equals_names_the_form(capsys: pytest.CaptureFixture[str]) -> None:
    for words in (["train.lr", "1e-4"], ["train.lr", "=", "1e-4"], ["train.lr=", "1e-4"], ["train.lr", "=1e-4"]):
        assert main(["config", "show", "--config", "demo", "--set", *words, "--set", "train.seed=1"]) == 2
        err = capsys.readouterr().err
        assert err == "pipetune: error: --set takes section.key=value: did you mean --set train.lr=1e-4?\n", words
    with pytest.raises(SystemExit):  # any other stray argument is argparse's, as before
        main(["config", "show", "--config", "demo", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def test_demo_with_few_steps_says_they_will_not_teach_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note comes before training (stopped here: run_train fails at once), with the default and why."""
    import pipetune.launch

    monkeypatch.setattr(pipetune.launch, "run_train", lambda config, nproc: 1)
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "few")]) == 1
    err = capsys.readouterr().err
    assert "pipetune: note: --steps 3 is too few to teach the model" in err
    default = demo_config().train
    assert f"the first {default.warmup_steps} steps only warm the learning rate up" in err
    assert f"the demo's default, {default.max_steps} steps, is what it is tuned for" in err
    assert main(["demo", "--steps", "100", "--out", str(tmp_path / "enough")]) == 1
    assert "too few" not in capsys.readouterr().err
