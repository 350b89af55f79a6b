"""PNG charts of a study: a pure "compute the data" step, then a "draw it" step.

* ``history.png``: every trial's objective, the best so far, and the held-out metric of the
  best-so-far trial (what a user reports), against trial number;
* ``states.png``: how trials ended;
* Optuna's own charts where they apply: parameter importances, slice and parallel
  coordinates (they need at least two completed trials).
"""
from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hpo.errors import InputError  # noqa: E402
from hpo.scenario import Scenario  # noqa: E402
from hpo.store import TrialRow  # noqa: E402


@dataclass(frozen=True)
class History:
    """The data of the history chart."""

    numbers: tuple[int, ...]
    values: tuple[float, ...]
    best_numbers: tuple[int, ...]
    best_values: tuple[float, ...]
    best_held_out: dict[str, tuple[float, ...]]


def history_data(rows: list[TrialRow], direction: str, held_out: tuple[str, ...]) -> History:
    """Objective per completed trial, the running best, and that best trial's held-out metrics."""
    done = [r for r in rows if r.value is not None and math.isfinite(r.value)]
    better = (lambda a, b: a < b) if direction == "minimize" else (lambda a, b: a > b)
    best: TrialRow | None = None
    best_numbers: list[int] = []
    best_values: list[float] = []
    best_held: dict[str, list[float]] = {name: [] for name in held_out}
    for row in done:
        if best is None or better(row.value, best.value):
            best = row
        best_numbers.append(row.number)
        best_values.append(float(best.value))  # type: ignore[arg-type]
        for name in held_out:
            best_held[name].append(best.held_out.get(name, math.nan))
    return History(tuple(r.number for r in done), tuple(float(r.value) for r in done),  # type: ignore[arg-type]
                   tuple(best_numbers), tuple(best_values), {k: tuple(v) for k, v in best_held.items()})


def draw_history(data: History, metric: str, title: str, path: Path) -> Path:
    """Draw :class:`History` to ``path``."""
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.scatter(data.numbers, data.values, s=18, alpha=0.6, label=f"{metric} of each trial")
    ax.step(data.best_numbers, data.best_values, where="post", color="C1", lw=2, label=f"best {metric} so far")
    for index, (name, values) in enumerate(data.best_held_out.items()):
        ax.step(data.best_numbers, values, where="post", color=f"C{index + 2}", lw=1.5, ls="--",
                label=f"{name} of the best trial (held out)")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_states(rows: list[TrialRow], title: str, path: Path) -> Path:
    """Bar chart of how many trials ended in each state."""
    counts = Counter(row.state for row in rows)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    names = sorted(counts)
    ax.bar(names, [counts[n] for n in names], color=["C2" if n == "COMPLETE" else "C3" for n in names])
    ax.set_ylabel("trials")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _optuna_chart(draw: Callable[..., Any], study: Any, path: Path, **kwargs: Any) -> Path | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = draw(study, **kwargs)
        except (ValueError, RuntimeError, ZeroDivisionError):
            return None
    figure = result.flat[0].figure if hasattr(result, "flat") else result.figure
    figure.set_size_inches(max(figure.get_size_inches()[0], 8), max(figure.get_size_inches()[1], 4.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def draw_all(study: Any, scenario: Scenario, folder: Path, rows: list[TrialRow]) -> list[Path]:
    """Draw every chart that the study's trials (``rows``) allow into ``folder``; return the files."""
    from optuna.visualization import matplotlib as ov

    if not rows:
        raise InputError(f"study {scenario.name} has no trials to plot yet")
    folder.mkdir(parents=True, exist_ok=True)
    metric = scenario.objective.metric
    paths = [draw_history(history_data(rows, scenario.objective.direction, scenario.objective.held_out),
                          metric, f"{scenario.name}: {metric} by trial", folder / "history.png"),
             draw_states(rows, f"{scenario.name}: trial outcomes", folder / "states.png")]
    if sum(r.value is not None for r in rows) >= 2:
        varying = [n for n, p in scenario.parameters.items() if p.type != "constant"]
        for name, draw, kwargs in (("importances", ov.plot_param_importances, {"params": varying}),
                                   ("slice", ov.plot_slice, {"params": varying}),
                                   ("parallel", ov.plot_parallel_coordinate, {"params": varying})):
            path = _optuna_chart(draw, study, folder / f"{name}.png", target_name=metric, **kwargs)
            if path is not None:
                paths.append(path)
    return paths
