"""The documentation's relative links resolve, and the sample meeting the end of a run suggests is shipped."""

from __future__ import annotations

import fnmatch
import re
import shlex
import time
import tomllib
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def relative_links(page: Path) -> list[str]:
    """The page's link targets that point into the checkout (no scheme, not a bare #anchor), outside code blocks."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_existing_files(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)}: links to missing files: {missing}"


def test_link_check_sees_links_and_misses(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](here.md) [b](gone.md#x) ![c](img.png) [d](https://x.org) [e](#top)\n```\n[f](x.md)\n```\n")
    assert relative_links(page) == ["here.md", "gone.md#x", "img.png"]


def test_the_summarize_command_a_run_suggests_names_the_shipped_sample_meeting(tmp_path):
    from pipetune.config import DataConfig
    from pipetune.generate import read_transcripts
    from pipetune.run_log import finish_run

    summary = finish_run(tmp_path, time.time())
    line = next(line for line in summary.splitlines() if "pipetune summarize" in line)
    sample = Path(shlex.split(line.split("#")[0])[-1])
    shipped = resources.files("pipetune") / "examples" / "meeting.txt"
    assert sample == Path(str(shipped)) and sample.is_file()
    # one transcript, read as `pipetune summarize` reads a text file
    assert len(read_transcripts(str(sample), DataConfig()).transcripts) == 1
    # in a built wheel too: pyproject's package data covers it, and the checkout's examples/ holds the same file
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch("examples/meeting.txt", pattern) for pattern in package_data["pipetune"])
    assert (REPO / "examples" / "meeting.txt").read_text() == sample.read_text()
