"""`python -m pipetune.cli`: the same as `pipetune`."""

from pipetune.cli import run

run()
