"""Print one of the two commands at the top of README.md (`demo` or `tests`): the first bash block's line whose
trailing comment names it, with its continuation lines joined and the comment dropped."""

import re
import sys
from pathlib import Path

block = Path(__file__).resolve().parents[1].joinpath("README.md").read_text().split("```bash\n", 1)[1].split("```")[0]
commands = re.split(r"(?<!\\)\n", block.strip())  # a line ending in a backslash continues
which = {"demo": "the runtime", "tests": "the tests"}[sys.argv[1]]
for command in commands:
    code, _, comment = command.partition("#")
    if comment.strip().startswith(which):
        print(" ".join(code.replace("\\\n", " ").split()))
        break
else:
    sys.exit(f"README.md's first bash block has no command commented '# {which} ...'")
