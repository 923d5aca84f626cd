"""Loss per optimizer step of two or more runs' metrics.csv on one chart, and the largest relative gap.

python3 benchmarks/tools/plot_loss_curves.py out.png plain=run_a/metrics.csv optimized=run_b/metrics.csv
"""

from __future__ import annotations

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, runs: list[str]) -> None:
    curves = {}
    for item in runs:
        name, path = item.rsplit("=", 1)
        with open(path) as f:
            curves[name] = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f) if r["loss"]]
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        axis.plot(*zip(*points, strict=True), marker=".", label=name)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    names = list(curves)
    reference = dict(curves[names[0]])
    for name in names[1:]:
        gaps = [
            (abs(loss - reference[step]) / reference[step], step) for step, loss in curves[name] if step in reference
        ]
        worst, step = max(gaps)
        print(f"{name} vs {names[0]}: largest relative gap {worst:.2%} at step {step}; last step {gaps[-1][0]:.2%}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
