"""The README's two commands: CI runs the test command as the README writes it, and both install one torch."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def _command(which: str) -> str:
    return subprocess.run(
        [sys.executable, str(REPO / ".ci" / "readme_command.py"), which], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_ci_runs_the_readme_test_command_and_both_commands_install_the_same_torch() -> None:
    demo, tests = _command("demo"), _command("tests")
    assert demo.endswith("pipetune demo") and tests.endswith("python3 -m pytest -q"), (demo, tests)
    pins = [re.findall(r"torch==[\w.+]+", command) for command in (demo, tests)]
    assert pins[0] and pins[0] == pins[1], pins  # the tests check the torch a user gets
    ci = (REPO / ".ci" / "run").read_text()
    assert "readme_command.py tests" in ci
    # CI sets nothing a user following the README does not: no variable, no thread count.
    assert not re.search(r"^\s*(export\s+\w+=|\w+=\S+\s+python)", ci, re.MULTILINE), ci
