"""The command line answers `--help`, `--version` and `config` without importing torch."""

from __future__ import annotations

import subprocess
import sys

from pipetune.cli import version
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
