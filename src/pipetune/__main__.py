from pipetune.cli import run

run()
