"""The figures of ``bench compare``: which method wins on this link.

* ``final_loss_vs_time.png`` and ``final_loss_vs_bytes.png``: one point per method (or
  variant) at its mean final validation loss against its mean modeled time (bytes sent per
  worker), with the seed spread as error bars and every seed as a faint dot; the Pareto front
  (no other method is both faster, or cheaper, and better) is ringed and joined.
* ``val_loss_vs_step.png``, ``val_loss_vs_time.png`` and ``val_loss_vs_bytes.png``: the
  validation curves in small multiples, one panel per family (the option group a method
  reads, else its strategy module; ddp and zero1 are the synchronous family), each panel
  with ddp as a grey
  reference, so no panel holds more than a handful of curves.

A run's summary here carries ``curve``: (step, clock seconds, validation loss) at each
evaluation, and ``bytes_curve``: the bytes sent per worker up to each of those points.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from lowcomm.bench.runs import final_loss

Runs = dict[str, list[dict[str, Any]]]

#: Families shown under another name (the synchronous methods share one panel).
FAMILY_NAMES = {"ddp": "synchronous", "zero1": "synchronous", "local": "local updates (co2)"}
REFERENCE = "ddp"


def family(method: str) -> str:
    """The family of a method (a variant's, its method's): the option group it reads
    (``diloco`` for the whole DiLoCo family), else the strategy module that declares it."""
    from lowcomm.strategies import STRATEGIES

    base = method.split("+", 1)[0]
    cls = STRATEGIES.get(base)
    if cls is None:
        return base
    name = cls.options_field or cls.__module__.rsplit(".", 1)[-1]
    return FAMILY_NAMES.get(name, name)


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The labels no other point dominates (at most the cost and at most the loss, and less of
    one), by increasing cost."""
    front = [
        label
        for label, (cost, loss) in points.items()
        if not any(
            (c <= cost and v <= loss) and (c < cost or v < loss)
            for other, (c, v) in points.items()
            if other != label
        )
    ]
    return sorted(front, key=lambda label: points[label])


def plot_all(out: Path, runs: Runs, clock: str) -> list[str]:
    """Write every figure into ``out``; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    names = []
    for name, axis_name, cost_of in (
        ("final_loss_vs_time.png", f"modeled time on the {clock} clock (s)", _time),
        ("final_loss_vs_bytes.png", "bytes sent per worker", _bytes),
    ):
        _final_scatter(out / name, runs, axis_name, cost_of, log=cost_of is _bytes)
        names.append(name)
    for name, axis_name, index in (
        ("val_loss_vs_step.png", "step", 0),
        ("val_loss_vs_time.png", f"time on the {clock} clock (s)", 1),
        ("val_loss_vs_bytes.png", "bytes sent per worker", 3),
    ):
        _family_panels(out / name, runs, axis_name, index)
        names.append(name)
    _utilization(out / "utilization.png", runs)
    return [*names, "utilization.png"]


def _time(summary: dict[str, Any]) -> float:
    return float(summary["modeled_time_s"])


def _bytes(summary: dict[str, Any]) -> float:
    return float(summary["bytes_sent_per_worker"])


def _final_scatter(
    path: Path, runs: Runs, axis_name: str, cost_of: Any, *, log: bool = False
) -> None:
    import matplotlib.pyplot as plt

    points: dict[str, tuple[float, float]] = {}
    figure, axis = plt.subplots(figsize=(9, 6))
    colours = _colours(sorted(runs))
    for label, every in sorted(runs.items()):
        # (a seed whose final validation had no batch has no point; a method with none, no mark)
        summaries = [s for s in every if final_loss(s) is not None]
        if not summaries:
            continue
        costs = [cost_of(s) for s in summaries]
        losses = [float(s["final_val_loss"]) for s in summaries]
        cost, loss = statistics.fmean(costs), statistics.fmean(losses)
        points[label] = (cost, loss)
        spread = len(summaries) > 1
        axis.errorbar(
            cost, loss, xerr=statistics.stdev(costs) if spread else None,
            yerr=statistics.stdev(losses) if spread else None, fmt="o", color=colours[label],
            capsize=3, markersize=6,
        )  # fmt: skip
        axis.scatter(costs, losses, s=10, alpha=0.35, color=colours[label])
    _label_points(axis, points, log=log)
    front = pareto_front(points)
    if front:
        xs = [points[label][0] for label in front]
        ys = [points[label][1] for label in front]
        axis.plot(xs, ys, "-", color="black", alpha=0.5, linewidth=1, label="Pareto front")
        axis.scatter(xs, ys, s=180, facecolors="none", edgecolors="black", linewidths=1.2)
        axis.legend(loc="upper right", fontsize=8)
    if log and all(cost > 0 for cost, _ in points.values()):
        axis.set_xscale("log")
    axis.set_xlabel(axis_name)
    axis.set_ylabel("final validation loss (mean ± sd over seeds)")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _label_points(axis: Any, points: dict[str, tuple[float, float]], *, log: bool) -> None:
    """Name every point; a label near one already placed (within 4% of both axes' spans)
    moves down a line, so clustered methods stay readable."""

    def position(cost: float) -> float:
        return math.log10(cost) if log and cost > 0 else cost

    xs = [position(c) for c, _ in points.values()]
    ys = [v for _, v in points.values()]
    width = (max(xs) - min(xs)) or 1.0
    height = (max(ys) - min(ys)) or 1.0
    placed: list[tuple[float, float]] = []
    for label, (cost, loss) in sorted(points.items(), key=lambda item: item[1][1]):
        x, y = position(cost), loss
        near = sum(
            1 for px, py in placed if abs(px - x) < 0.04 * width and abs(py - y) < 0.04 * height
        )
        placed.append((x, y))
        axis.annotate(
            label, (cost, loss), textcoords="offset points", xytext=(6, 4 - 10 * near),
            fontsize=8,
        )  # fmt: skip


def _family_panels(path: Path, runs: Runs, axis_name: str, index: int) -> None:
    import matplotlib.pyplot as plt

    families: dict[str, list[str]] = {}
    for label in sorted(runs):
        if label != REFERENCE or len(runs) == 1:
            families.setdefault(family(label), []).append(label)
    columns = min(3, len(families)) or 1
    rows = math.ceil(len(families) / columns) or 1
    size = (4.2, 3.2) if len(families) > 1 else (7.0, 4.8)
    figure, axes = plt.subplots(
        rows, columns, figsize=(size[0] * columns, size[1] * rows), squeeze=False, sharey=True
    )
    for panel, (name, labels) in zip(axes.flat, sorted(families.items()), strict=False):
        if REFERENCE in runs and REFERENCE not in labels:
            xs, ys = _mean_curve(runs[REFERENCE], index)
            panel.plot(xs, ys, "--", color="grey", label=f"{REFERENCE} (reference)")
        for number, label in enumerate(labels):
            xs, ys = _mean_curve(runs[label], index)
            panel.plot(xs, ys, "-o", markersize=3, color=f"C{number}", label=label)
        panel.set_title(name, fontsize=10)
        panel.grid(alpha=0.3)
        panel.legend(fontsize=7)
        panel.set_xlabel(axis_name, fontsize=8)
        if index == 3:
            panel.set_xscale("log")  # evaluations before a method's first exchange: not drawn
    for panel in list(axes.flat)[len(families) :]:
        panel.set_visible(False)
    for row in axes:
        row[0].set_ylabel("validation loss")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _mean_curve(summaries: list[dict[str, Any]], index: int) -> tuple[list[float], list[float]]:
    """The seeds' mean curve: x (step, seconds or bytes by ``index``) and validation loss."""
    curves = [_points(s) for s in summaries]
    length = min(len(c) for c in curves)
    xs = [statistics.fmean(c[i][index] for c in curves) for i in range(length)]
    ys = [statistics.fmean(c[i][2] for c in curves) for i in range(length)]
    if index == 3:  # on a log axis: only the points after something was sent
        kept = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0]
        return [x for x, _ in kept], [y for _, y in kept]
    return xs, ys


def _points(summary: dict[str, Any]) -> list[tuple[float, float, float, float]]:
    sent = summary.get("bytes_curve") or [math.nan] * len(summary["curve"])
    return [
        (float(step), float(seconds), float(loss), float(b))
        for (step, seconds, loss), b in zip(summary["curve"], sent, strict=True)
    ]


def _colours(labels: list[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    colour_map = plt.get_cmap("tab20")
    return {label: colour_map(i % 20) for i, label in enumerate(labels)}


def _utilization(path: Path, runs: Runs) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(7, 0.45 * len(runs)), 4))
    names = sorted(runs)
    axis.bar(names, [statistics.fmean(s["utilization"] for s in runs[m]) for m in names])
    axis.set_ylim(0, 1)
    axis.set_ylabel("utilisation")
    axis.tick_params(axis="x", rotation=60)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
