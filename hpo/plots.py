"""PNG charts of a study: a pure "compute the data" step, then a "draw it" step.

* ``history.png``: each completed trial's objective, the best so far and the held-out
  metrics of the best-so-far trial (what a user reports), against the trial number (a
  held-out metric on another scale gets its own panel); below, the trials without a value,
  one row per state in its colour; with no completed trial, the commonest failure reason
  (or the reasons that tie for it);
* ``states.png``: how the trials ended, one colour per :class:`~hpo.outcome.Outcome`;
* ``importances.png``: each parameter's share of the objective's variance by fANOVA;
* ``slice.png`` and ``parallel.png``: Optuna's own charts, titled and with readable log ticks.

The objective's axis is chosen from the values (:func:`value_axis`): a log axis when they
span orders of magnitude, an axis clipped to the bulk when a few outliers would squash the
rest, and the chart says so. The last three charts need two completed trials and a
parameter that took two values among them; a chart that is not drawn is said once, with
why, as a warning of the ``hpo.plots`` logger, and so is each parameter they leave out: one that
only some completed trials have (a condition, or added to the study later), or one that every
completed trial has with the same value.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import textwrap
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import matplotlib
import matplotlib.style
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, Locator, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

from hpo.errors import InputError
from hpo.files import replacing
from hpo.outcome import Outcome
from hpo.render import folder_full
from hpo.scenario import Param, Scenario

if TYPE_CHECKING:
    import optuna
    from matplotlib.axes import Axes

DPI = 110
LOG_SPAN = 100.0
OUTLIER_FENCE = 3.0
SQUASH = 10.0
FEW_OUTLIERS = 0.1
FANOVA_TREES = 32
FANOVA_DEPTH = 6
FEW_TRIALS = 10
OUTLIER_LABELS = 5
LABEL_INCHES = 0.55
LOG_SUBS = ((1.0, 2.0, 5.0), (1.0, 3.0), (1.0,))
TINY = 1e-200
CATEGORY_CHARS = 20
SLICE_PAD = 0.05
LABEL_GAP = 0.08
FEWER_TICKS = (6, 4, 3, 2, 1)
MANY_LINES = 200
CHOICE_JITTER = 0.2  # how far (of the gap between two choices) a slice point is spread about its choice
HELD_OUT_PANEL = "held out: "
REASONS_LISTED = 3
logger = logging.getLogger(__name__)
STATE_STYLE: Mapping[Outcome, tuple[str, str]] = {
    Outcome.COMPLETE: ("#2e7d32", "ran to the end"),
    Outcome.PRUNED: ("#f9a825", "stopped early by the pruner"),
    Outcome.STOPPED: ("#c49a6c", "stopped by a user"),
    Outcome.TIMEOUT: ("#8e0000", "killed at resources.timeout"),
    Outcome.FAIL: ("#e53935", "crashed or reported no valid metric"),
    Outcome.LOST: ("#757575", "its worker died: runs again, not its fault"),
    Outcome.INTERRUPTED: ("#b0bec5", "the sweep stopped: runs again, not its fault"),
    Outcome.RUNNING: ("#1e88e5", "running"),
    Outcome.WAITING: ("#90caf9", "waiting to start"),
}
"""Each outcome's colour and what it means, in the order the charts list them."""


class PlotRow(Protocol):
    """What the charts read of a trial (``hpo.rows.TrialRow`` has it)."""

    @property
    def number(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def params(self) -> Mapping[str, Any]: ...
    @property
    def value(self) -> float | None: ...
    @property
    def held_out(self) -> Mapping[str, float]: ...
    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class ValueAxis:
    """How an objective axis is drawn.

    Args:
        scale: ``linear`` or ``log``.
        low, high: the limits of the axis.
        below, above: how many values lie outside the limits (drawn at the edge, clipped).
    """

    scale: str
    low: float
    high: float
    below: int = 0
    above: int = 0

    @property
    def clipped(self) -> bool:
        """Whether some values lie outside the axis."""
        return bool(self.below or self.above)

    @property
    def note(self) -> str:
        """What the axis does to the values, for its label ('' for a plain linear axis)."""
        if self.scale == "log":
            return "log scale"
        parts = [f"{self.above} above {self.high:.3g}" if self.above else "",
                 f"{self.below} below {self.low:.3g}" if self.below else ""]
        return "clipped: " + ", ".join(p for p in parts if p) if self.clipped else ""

    def label(self, metric: str) -> str:
        """``metric`` with the axis note."""
        return f"{metric} ({self.note})" if self.note else metric

    def clip(self, value: float) -> float:
        """``value`` moved onto the axis (unchanged on a log or unclipped axis)."""
        return min(max(value, self.low), self.high) if self.clipped else value

    def target(self, value: float) -> float:
        """The value that importances and colour scales use: log10 on a log axis, else clipped."""
        return math.log10(value) if self.scale == "log" else self.clip(value)

    def target_label(self, metric: str) -> str:
        """What :meth:`target` measures."""
        if self.scale == "log":
            return f"log10({metric})"
        return f"{metric} (clipped to {self.low:.3g}..{self.high:.3g})" if self.clipped else metric


def _fences(values: np.ndarray) -> tuple[float, float]:
    q1, q3 = np.percentile(values, [25, 75])
    spread = q3 - q1
    return float(q1 - OUTLIER_FENCE * spread), float(q3 + OUTLIER_FENCE * spread)


def _padded(low: float, high: float, scale: str) -> tuple[float, float]:
    if scale == "log":
        pad = (math.log10(high) - math.log10(low)) * 0.05 or 0.05
        return low / 10 ** pad, high * 10 ** pad
    pad = (high - low) * 0.05 or (abs(high) * 0.05 or 0.5)
    return low - pad, high + pad


def value_axis(values: Sequence[float]) -> ValueAxis | None:
    """The axis for ``values`` (None when there is no finite value).

    A few outliers (at most 10 %, beyond 3 interquartile ranges of the bulk, measured in
    log space when every value is positive and they span two orders of magnitude) that
    stretch the axis more than tenfold are clipped: a linear axis covers the bulk (unless it
    spans two orders of magnitude itself) and they are drawn at its edge. Otherwise positive
    values spanning two orders of magnitude get a log axis, and anything else a linear one.
    """
    finite = np.array([v for v in values if math.isfinite(v)], dtype=float)
    if finite.size == 0:
        return None
    spans_decades = bool(finite.min() > 0 and finite.max() / finite.min() >= LOG_SPAN)
    space = np.log10(finite) if spans_decades else finite
    if finite.size >= 4:
        low_fence, high_fence = _fences(space)
        inside = (space >= low_fence) & (space <= high_fence)
        outliers = int(finite.size - inside.sum())
        bulk = finite[inside]
        stretch = np.ptp(finite) / max(np.ptp(bulk), 1e-12 * max(abs(bulk.max()), 1.0))
        bulk_spans_decades = bulk.min() > 0 and bulk.max() / bulk.min() >= LOG_SPAN
        if 0 < outliers <= max(1, FEW_OUTLIERS * finite.size) and stretch > SQUASH and not bulk_spans_decades:
            low, high = _padded(float(bulk.min()), float(bulk.max()), "linear")
            return ValueAxis("linear", low, high, int((finite < low).sum()), int((finite > high).sum()))
    scale = "log" if spans_decades else "linear"
    low, high = _padded(float(finite.min()), float(finite.max()), scale)
    return ValueAxis(scale, low, high)


@dataclass(frozen=True)
class History:
    """The data of the history chart.

    Args:
        numbers, values: the completed trials and their objective values.
        best_values: the best value so far at each completed trial.
        best_trial: the number of the best trial (None when no trial completed).
        best_held_out: per held-out metric, its value in the best-so-far trial (NaN if not reported).
        axis: the objective's axis (None when no trial completed).
        held_out_apart: the held-out metrics that do not fit the objective's axis (another scale):
            each gets its own panel; the others are drawn beside the objective.
        others: the numbers of the trials that did not complete, by state.
        last_number: the highest trial number.
        commonest: the commonest reasons of the failed trials, each with how many gave it: one,
            or all those that tie for the highest count (in the order they first occurred).
    """

    numbers: tuple[int, ...]
    values: tuple[float, ...]
    best_values: tuple[float, ...]
    best_trial: int | None
    best_held_out: Mapping[str, tuple[float, ...]]
    axis: ValueAxis | None
    held_out_apart: tuple[str, ...]
    others: Mapping[Outcome, tuple[int, ...]]
    last_number: int
    commonest: tuple[tuple[str, int], ...]


def _completed(rows: Sequence[PlotRow]) -> list[PlotRow]:
    return [r for r in rows if r.value is not None and math.isfinite(r.value)]


def _fits(values: Sequence[float], axis: ValueAxis) -> bool:
    """Whether ``values`` belong on ``axis``: within it, give or take a quarter of its span."""
    finite = [v for v in values if math.isfinite(v)]
    if axis.scale == "log":
        if any(v <= 0 for v in finite):
            return False
        low, high, finite = math.log10(axis.low), math.log10(axis.high), [math.log10(v) for v in finite]
    else:
        low, high = axis.low, axis.high
    margin = (high - low) / 4
    return all(low - margin <= v <= high + margin for v in finite)


def _widened(axis: ValueAxis | None, beside: Sequence[float]) -> ValueAxis | None:
    """``axis`` stretched (with its padding) to the finite values of ``beside``, the held-out
    metrics drawn on it, so that none leaves it; a clipped axis is left as it is (they are
    drawn at its edge, as the objective's outliers are)."""
    finite = [v for v in beside if math.isfinite(v)]
    if axis is None or axis.clipped or not finite:
        return axis
    low, high = _padded(min(finite), max(finite), axis.scale)
    return ValueAxis(axis.scale, min(axis.low, low), max(axis.high, high))


def history_data(rows: Sequence[PlotRow], direction: str, held_out: Sequence[str]) -> History:
    """Objective per completed trial, the running best, that best trial's held-out metrics, the others."""
    done = _completed(rows)
    pick = min if direction == "minimize" else max
    best: PlotRow | None = None
    best_values: list[float] = []
    best_held: dict[str, list[float]] = {name: [] for name in held_out}
    for row in done:
        best = row if best is None else pick(best, row, key=lambda r: r.value)  # type: ignore[arg-type, return-value]
        best_values.append(float(best.value))  # type: ignore[arg-type]
        for name in held_out:
            best_held[name].append(float(best.held_out.get(name, math.nan)))
    values = tuple(float(r.value) for r in done)  # type: ignore[arg-type]
    axis = value_axis(values)
    done_numbers = {row.number for row in done}
    others: dict[Outcome, list[int]] = {}
    for row in rows:
        if row.number not in done_numbers:
            others.setdefault(Outcome(row.state), []).append(row.number)
    reasons = Counter(r.reason for r in rows if r.reason and Outcome(r.state).failed)
    apart = tuple(name for name, series in best_held.items() if axis and not _fits(series, axis))
    return History(
        numbers=tuple(r.number for r in done), values=values, best_values=tuple(best_values),
        best_trial=best.number if best else None, best_held_out={k: tuple(v) for k, v in best_held.items()},
        axis=_widened(axis, [v for name, series in best_held.items() if name not in apart for v in series]),
        held_out_apart=apart,
        others={state: tuple(numbers) for state, numbers in others.items()},
        last_number=max((r.number for r in rows), default=0),
        commonest=tuple((reason, count) for reason, count in reasons.items() if count == max(reasons.values())))


@dataclass(frozen=True)
class StateBar:
    """One bar of the states chart: an outcome, how many trials ended so, its colour and meaning."""

    outcome: Outcome
    count: int
    colour: str
    meaning: str

    @property
    def label(self) -> str:
        """The bar's label: the outcome and what it means."""
        return f"{self.outcome.value}: {self.meaning}"


def states_data(rows: Sequence[PlotRow]) -> tuple[StateBar, ...]:
    """One bar per outcome that occurs, in :data:`STATE_STYLE` order."""
    counts = Counter(Outcome(row.state) for row in rows)
    return tuple(StateBar(outcome, counts[outcome], *STATE_STYLE[outcome]) for outcome in STATE_STYLE
                 if counts[outcome])


@dataclass(frozen=True)
class Importances:
    """Each parameter's fANOVA importance (most important first), of what, from how many trials."""

    params: tuple[str, ...]
    values: tuple[float, ...]
    target: str
    trials: int


def varying_params(rows: Sequence[PlotRow], parameters: Mapping[str, Param]) -> list[str]:
    """The scenario's parameters that every completed trial has and that took two values or more."""
    return [name for name, values in _held_by_all(rows, parameters).items() if len(values) > 1]


def _held_by_all(rows: Sequence[PlotRow], parameters: Mapping[str, Param]) -> dict[str, dict[str, Any]]:
    """The scenario's searched parameters that every completed trial has, each with its values
    among them (by ``repr``, in order of first appearance)."""
    done = _completed(rows)
    names = [n for n, p in parameters.items() if p.type != "constant" and done and all(n in r.params for r in done)]
    return {n: {repr(r.params[n]): r.params[n] for r in done} for n in names}


def partial_params(rows: Sequence[PlotRow], parameters: Mapping[str, Param]) -> list[str]:
    """The scenario's parameters that some completed trials have and others lack (a
    ``condition``, or one added to the study later): :func:`varying_params` leaves them out,
    and the charts say so."""
    done = _completed(rows)
    return [n for n in parameters if 0 < sum(n in r.params for r in done) < len(done)]


def fixed_params(rows: Sequence[PlotRow], parameters: Mapping[str, Param]) -> dict[str, Any]:
    """The scenario's searched parameters that every completed trial has with one same value
    (by name, that value): :func:`varying_params` leaves them out, and the charts say so."""
    return {name: next(iter(values.values())) for name, values in _held_by_all(rows, parameters).items()
            if len(values) == 1}


def _left_out(rows: Sequence[PlotRow], parameters: Mapping[str, Param]) -> list[str]:
    """What the charts that compare parameters say they leave out, and why, one line each."""
    charts = "importances.png, slice.png and parallel.png"
    lines = []
    for conditional in (True, False):
        names = [n for n in partial_params(rows, parameters) if (parameters[n].condition is not None) == conditional]
        if names:
            them, they = ("it", "it was") if len(names) == 1 else ("them", "they were")
            why = "a condition" if conditional else f"{they} added to the study later"
            lines.append(f"{charts} leave out {', '.join(names)}: only some completed trials have {them} ({why})")
    fixed = fixed_params(rows, parameters)
    if fixed:
        values = ", ".join(f"{name}={value}" for name, value in fixed.items())
        lines.append(f"{charts} leave out {', '.join(fixed)}: every completed trial has the same value ({values})")
    return lines


def importance_data(study: optuna.Study, params: list[str], metric: str, axis: ValueAxis,
                    seed: int) -> Importances | None:
    """fANOVA importances of ``params`` for ``metric`` as ``axis`` measures it (None if they cannot be had).

    Args:
        study: the study (its completed trials are used).
        params: the parameters to rank (every completed trial has them).
        metric: the objective's name.
        axis: the objective's axis: importances are of log10 on a log axis, of clipped values on a clipped one.
        seed: the seed of fANOVA's forest (32 trees of depth 6: under a second at 2,000 trials).
    """
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState

    evaluator = FanovaImportanceEvaluator(n_trees=FANOVA_TREES, max_depth=FANOVA_DEPTH, seed=seed)
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            found = get_param_importances(_one_space(completed, params), evaluator=evaluator, params=params,
                                          target=lambda t: axis.target(float(t.value)))
        except (ValueError, RuntimeError, ZeroDivisionError):
            return None
    ranked = sorted(found.items(), key=lambda item: -item[1])
    trials = len(completed)
    return Importances(tuple(n for n, _ in ranked), tuple(float(v) for _, v in ranked), axis.target_label(metric),
                       trials)


def _one_space(trials: Sequence[optuna.trial.FrozenTrial], params: list[str]) -> optuna.Study:
    """An in-memory study of ``trials`` (their ``params`` and values) in one search space, the
    union of theirs: fANOVA refuses trials whose ranges differ, as they do once a study is
    resumed with a widened range."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    union: dict[str, optuna.distributions.BaseDistribution] = {}
    for name in params:
        seen = [t.distributions[name] for t in trials]
        first = seen[0]
        union[name] = first if isinstance(first, CategoricalDistribution) else \
            type(first)(**{**vars(first), "low": min(d.low for d in seen), "high": max(d.high for d in seen)})
    copy = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    copy.add_trials([optuna.trial.create_trial(params={n: t.params[n] for n in params}, distributions=union,
                                               value=t.value) for t in trials])
    return copy


@contextlib.contextmanager
def _style() -> Iterator[None]:
    """Matplotlib's default style for hpo's own charts, whatever style another library set."""
    with matplotlib.style.context("default"), matplotlib.rc_context({"axes.grid": True, "grid.alpha": 0.3}):
        yield


def _save(figure: Figure, path: Path, **options: Any) -> Path:
    """Write ``figure`` to ``path`` whole or not at all (through a temporary file beside it);
    where it cannot be written, :class:`~hpo.render.FolderFull` for a full disk (no fault of
    the input: exit 1), else an InputError naming ``path`` and the system's reason."""
    try:
        with replacing(path) as temporary:
            figure.savefig(temporary, **options)
    except OSError as exc:
        raise folder_full(exc, path) or InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def _draw_values(ax: Axes, data: History, metric: str) -> None:
    axis = data.axis
    assert axis is not None
    ax.set_yscale(axis.scale)
    ax.set_ylim(axis.low, axis.high)
    shown = [(n, v) for n, v in zip(data.numbers, data.values) if not axis.clipped or axis.low <= v <= axis.high]
    size = 18 if len(shown) < MANY_LINES else 6
    ax.scatter([n for n, _ in shown], [v for _, v in shown], s=size, alpha=0.7, color="C0",
               label=f"{metric} of each completed trial")
    for edge, marker, off in ((axis.high, "^", lambda v: v > axis.high), (axis.low, "v", lambda v: v < axis.low)):
        out = [(n, v) for n, v in zip(data.numbers, data.values) if axis.clipped and off(v)]
        if not out:
            continue
        ax.scatter([n for n, _ in out], [edge] * len(out), marker=marker, s=50, color="C3", clip_on=False, zorder=3,
                   label=f"{metric} off the axis ({len(out)}), drawn at its edge")
        for number, value in out[:OUTLIER_LABELS]:
            ax.annotate(f"{value:.3g}", (number, edge), xytext=(5, -12 if marker == "^" else 4),
                        textcoords="offset points", fontsize=8, color="C3")
    best = f" (now {data.best_values[-1]:.4g}, trial {data.best_trial})" if data.best_values else ""
    ax.step(data.numbers, [axis.clip(v) for v in data.best_values], where="post", color="C1", lw=2,
            label=f"best {metric} so far{best}", **_now_marker(data.numbers))
    ax.set_ylabel(axis.label(metric))


def _now_marker(numbers: Sequence[int]) -> dict[str, Any]:
    """Options of a best-so-far step line that mark its last point, the value its legend calls
    "now": a line of one completed trial has no length and would not show at all."""
    return {"marker": "o", "markersize": 4, "markevery": [len(numbers) - 1]} if numbers else {}


def _draw_held_out(axes: Mapping[str, Axes], data: History, axis: ValueAxis) -> None:
    """The held-out metrics of the best trial so far: beside the objective on its axis, or each in its panel."""
    for index, (name, values) in enumerate(data.best_held_out.items()):
        now = f" (now {values[-1]:.4g})" if values and math.isfinite(values[-1]) else ""
        apart = name in data.held_out_apart
        ax = axes[HELD_OUT_PANEL + name] if apart else axes["values"]
        ax.step(data.numbers, values if apart else [axis.clip(v) for v in values], where="post",
                color=f"C{index + 2}", lw=1.5, ls="--", label=f"{name} of the best trial so far, held out{now}",
                **_now_marker(data.numbers))
        if apart:
            ax.set_ylabel(f"{name} (held out)")
            ax.legend(fontsize=8, loc="best")


def _draw_others(ax: Axes, others: Mapping[Outcome, tuple[int, ...]]) -> None:
    """One row of ticks per state, in its colour, for the trials that did not complete; rows named with counts."""
    states = [state for state in STATE_STYLE if others.get(state)]
    for row, state in enumerate(states):
        numbers = others[state]
        ax.scatter(numbers, [row] * len(numbers), marker="|", s=150, linewidths=2, color=STATE_STYLE[state][0])
    ax.set_yticks(range(len(states)), [f"{state.value} ({len(others[state])})" for state in states], fontsize=8)
    ax.set_ylim(len(states) - 0.5, -0.5)
    ax.grid(False)
    ax.set_title("trials without a value", fontsize=8, loc="left")


def _no_value_text(data: History) -> str:
    """What the history chart says without a completed trial: the commonest failure reason,
    or the reasons that tie for it (up to :data:`REASONS_LISTED`, one line each)."""
    if not data.commonest:
        return "no completed trial yet"
    if len(data.commonest) == 1:
        reason, count = data.commonest[0]
        return f"no completed trial yet\n\ncommonest reason ({count}×):\n" + "\n".join(textwrap.wrap(reason, 80))
    count = data.commonest[0][1]
    listed = [textwrap.shorten(reason, 100, placeholder=" ...") for reason, _ in data.commonest[:REASONS_LISTED]]
    more = len(data.commonest) - len(listed)
    return (f"no completed trial yet\n\n{len(data.commonest)} reasons, {count}× each:\n" + "\n".join(listed)
            + (f"\nand {more} more" if more else ""))


def _plural(count: int, noun: str) -> str:
    """``1 trial``, ``2 trials``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def draw_history(data: History, study: str, metric: str, direction: str, path: Path) -> Path:
    """Draw :class:`History` to ``path``: the objective, a panel per held-out metric on another scale, the others."""
    panels = ["values", *(HELD_OUT_PANEL + name for name in data.held_out_apart)] + (["others"] if data.others else [])
    heights = {"values": 3.4 if data.axis else 1.6, "others": 0.35 + 0.16 * len(data.others),
               **{HELD_OUT_PANEL + name: 1.4 for name in data.held_out_apart}}
    with _style():
        figure = Figure(figsize=(10, 2 + sum(heights[p] for p in panels)), dpi=DPI, layout="constrained")
        axes = dict(zip(panels, figure.subplots(len(panels), 1, sharex=True, squeeze=False,
                                                height_ratios=[heights[p] for p in panels])[:, 0]))
        total = len(data.numbers) + sum(len(n) for n in data.others.values())
        figure.suptitle(f"{study}: {metric} by trial ({direction}; {_plural(total, 'trial')}, "
                        f"{len(data.numbers)} completed)")
        main = axes["values"]
        if data.axis is None:
            main.set_yticks([])
            main.set_ylabel(metric)
            main.text(0.5, 0.5, _no_value_text(data), transform=main.transAxes, ha="center", va="center")
        else:
            _draw_values(main, data, metric)
            _draw_held_out(axes, data, data.axis)
            main.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, frameon=False)
        if "others" in axes:
            _draw_others(axes["others"], data.others)
        main.set_xlim(-0.5, data.last_number + 0.5)
        main.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes[panels[-1]].set_xlabel("trial number")
        return _save(figure, path)


def draw_states(bars: Sequence[StateBar], study: str, path: Path) -> Path:
    """Horizontal bars of how many trials ended in each state, each in its state's colour and labelled."""
    with _style():
        figure = Figure(figsize=(9, 1.3 + 0.45 * max(len(bars), 1)), dpi=DPI, layout="constrained")
        ax = figure.subplots()
        total = sum(bar.count for bar in bars)
        positions = list(range(len(bars)))[::-1]
        ax.barh(positions, [bar.count for bar in bars], color=[bar.colour for bar in bars], edgecolor="#424242")
        ax.set_yticks(positions, [bar.label for bar in bars], fontsize=9)
        for position, bar in zip(positions, bars):
            ax.text(bar.count, position, f" {bar.count} ({100 * bar.count / total:.0f} %)", va="center", fontsize=9)
        ax.set_xlim(0, max((bar.count for bar in bars), default=1) * 1.2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", visible=False)
        ax.set_axisbelow(True)
        ax.set_xlabel("trials")
        figure.suptitle(_states_title(bars, study))
        return _save(figure, path)


def _states_title(bars: Sequence[StateBar], study: str) -> str:
    """``demo: how the 8 trials ended``; with trials still running or waiting, which are not
    ends, ``demo: the 3 trials by state (1 ended, 2 not yet)``."""
    total = sum(bar.count for bar in bars)
    ended = sum(bar.count for bar in bars if bar.outcome.ended)
    if ended == total:
        return f"{study}: how the {_plural(total, 'trial')} ended"
    return f"{study}: the {_plural(total, 'trial')} by state ({ended} ended, {total - ended} not yet)"


def draw_importances(data: Importances, study: str, path: Path) -> Path:
    """Horizontal bars of each parameter's fANOVA importance, the most important on top."""
    with _style():
        figure = Figure(figsize=(9, 1.8 + 0.45 * len(data.params)), dpi=DPI, layout="constrained")
        ax = figure.subplots()
        positions = list(range(len(data.params)))[::-1]
        ax.barh(positions, data.values, color="C0")
        ax.set_yticks(positions, list(data.params))
        for position, value in zip(positions, data.values):
            ax.text(value, position, f" {value:.2f}", va="center", fontsize=9)
        ax.set_xlim(0, 1.1)
        ax.grid(axis="y", visible=False)
        ax.set_axisbelow(True)
        label = f"share of the variance of {data.target} that each parameter explains"
        ax.set_xlabel(label if len(label) <= 60 else label.replace(" that each", "\nthat each"))  # centred on the axes
        rough = " (few trials: a rough estimate)" if data.trials < FEW_TRIALS else ""
        figure.suptitle(f"{study}: parameter importance for {data.target}\n"
                        f"fANOVA over {_plural(data.trials, 'completed trial')}{rough}")
        return _save(figure, path)


def _log_locator(low: float, high: float, room: int) -> Locator:
    """Ticks for a log axis from ``low`` to ``high`` with ``room`` labels: at 1, 2 and 5 times powers of ten,
    or fewer of them (1 and 3, powers of ten, every few powers of ten) until at most ``room`` fit, at least two;
    evenly spaced ones on a range too short to hold two powers of ten."""
    for subs in LOG_SUBS:
        locator = LogLocator(base=10, subs=subs, numticks=room)
        if 2 <= sum(low <= t <= high for t in locator.tick_values(low, high)) <= room:
            return locator
    locator = LogLocator(base=10, subs=(1.0,), numticks=room)
    return locator if sum(low <= t <= high for t in locator.tick_values(low, high)) >= 2 else MaxNLocator(room)


def _compact(value: float) -> str:
    """``value`` as ``:g`` writes it, an exponent without its plus sign and leading zeros (``1e6``, ``1e-9``)."""
    mantissa, _, exponent = f"{value:g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def _tidy_axis(axis: Any, limits: tuple[float, float], integer: bool, inches: float) -> None:
    """Readable ticks on an axis ``inches`` long: on a log axis plain numbers (:func:`_log_locator`) and
    unlabelled minor ticks; on an integer parameter's axis whole numbers."""
    low, high = sorted(limits)
    if axis.get_scale() == "log" and low > 0:
        axis.set_major_locator(_log_locator(low, high, max(2, int(inches / LABEL_INCHES))))
        axis.set_major_formatter(FuncFormatter(lambda value, _: _compact(value)))
        axis.set_minor_formatter(NullFormatter())
    elif integer and axis.get_scale() == "linear":
        axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


class _InUnits(ScalarFormatter):
    """Tick labels of an axis drawn in units of ``10**exponent``: the ticks' numbers, and the unit as the
    axis's offset text (``1e-301``), as matplotlib writes a large axis's."""

    def __init__(self, exponent: int) -> None:
        super().__init__(useOffset=False)
        self.set_scientific(False)
        self.exponent = exponent

    def get_offset(self) -> str:
        """The unit, written like matplotlib's own offset text."""
        return f"1e{self.exponent}"


def _tiny_spans(study: optuna.Study, params: Sequence[str]) -> dict[str, tuple[float, float]]:
    """The lowest and highest value, among the completed trials with a finite value, of each of ``params``
    whose values are numbers all within ±:data:`TINY` and not all zero: too close to zero for matplotlib,
    which draws such a range as -0.05..0.05."""
    from optuna.trial import TrialState

    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if t.value is not None and math.isfinite(t.value)]
    spans = {}
    for name in params:
        values = [t.params[name] for t in trials if name in t.params]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < TINY for v in values) \
                and any(values):
            spans[name] = (float(min(values)), float(max(values)))
    return spans


def _in_units(axis: Any, span: tuple[float, float], pad: float) -> None:
    """Draw a linear axis whose values span ``span``, all within ±:data:`TINY`, in units of the power of ten
    of the largest: the points of its axes divided by the unit, limits the span plus ``pad`` of it each side,
    ticks labelled in units, the unit as the offset text (:class:`_InUnits`)."""
    exponent = math.floor(math.log10(max(abs(v) for v in span)))
    unit = 10.0 ** exponent
    column = 0 if axis.axis_name == "x" else 1
    for points in axis.axes.collections:
        offsets = np.array(points.get_offsets(), dtype=float).reshape(-1, 2)
        offsets[:, column] /= unit
        points.set_offsets(offsets)
    low, high = span[0] / unit, span[1] / unit
    margin = (high - low) * pad
    getattr(axis.axes, f"set_{axis.axis_name}lim")(low - margin, high + margin)
    axis.set_major_locator(MaxNLocator())
    axis.set_major_formatter(_InUnits(exponent))


def _shortened(labels: Sequence[str], width: int = CATEGORY_CHARS) -> list[str]:
    """``labels`` with each longer than ``width`` characters cut in its middle to ``width``, an ellipsis
    marking the cut; where that makes two alike, cut to the least greater width that keeps them apart."""
    for room in range(width, max(map(len, labels), default=0) + 1):
        head = room // 2
        cut = [label if len(label) <= room else f"{label[:head]}…{label[len(label) - room + head + 1:]}"
               for label in labels]
        if len(set(cut)) == len(set(labels)):
            return cut
    return list(labels)


def _shorten_categories(axis: Any) -> None:
    """The categorical tick labels of ``axis`` :func:`_shortened`, at their places."""
    ticks = list(axis.get_majorticklocs())
    axis.set_ticks(ticks, _shortened(axis.get_major_formatter().format_ticks(ticks)))


def _drawn_labels(axis: Any) -> list[Any]:
    """The tick labels that ``axis`` draws: visible, not empty, at a tick within its limits."""
    low, high = sorted(axis.get_view_interval())
    along = 0 if axis.axis_name == "x" else 1
    return [label for label in axis.get_ticklabels()
            if label.get_visible() and label.get_text() and low <= label.get_position()[along] <= high]


def _crowded(axis: Any, low: float, high: float) -> bool:
    """Whether the tick labels ``axis`` draws come closer to one another than half their font
    size (``10152025`` read as one number when they only touched) or reach out of
    ``low``..``high`` (display x)."""
    labels = _drawn_labels(axis)
    if not labels:
        return False
    gap = 0.5 * labels[0].get_fontsize() * axis.figure.dpi / 72
    spans = sorted((box.x0, box.x1) for box in (label.get_window_extent() for label in labels))
    return spans[0][0] < low or spans[-1][1] > high or any(right[0] - left[1] < gap for left, right in pairwise(spans))


def _uncrowd(figure: Any, panels: Sequence[Any]) -> None:
    """Make the x tick labels of each of ``panels`` stop overlapping one another or reaching past halfway
    to the next axes (a panel or the colour bar) on either side: fewer ticks where matplotlib's locators
    place them (not at categories), else labels turned upright."""
    figure.draw_without_rendering()
    for ax in panels:
        box = ax.get_window_extent()
        others = [other.get_window_extent() for other in figure.axes if other is not ax]
        left = (max((other.x1 for other in others if other.x1 <= box.x0), default=-math.inf) + box.x0) / 2
        right = (min((other.x0 for other in others if other.x0 >= box.x1), default=math.inf) + box.x1) / 2
        low, high = sorted(ax.get_xlim())
        for count in FEWER_TICKS:
            locator = ax.xaxis.get_major_locator()
            if not _crowded(ax.xaxis, left, right):
                break
            if isinstance(locator, MaxNLocator):
                locator.set_params(nbins=count)
            elif isinstance(locator, LogLocator):
                ax.xaxis.set_major_locator(_log_locator(low, high, max(2, count)))
            else:
                break
            figure.draw_without_rendering()
        if _crowded(ax.xaxis, left, right):
            ax.tick_params(axis="x", labelrotation=90)


def _widen_for_labels(figure: Any, axes: Sequence[Any]) -> None:
    """Widen a parallel-coordinates figure until each axis's tick labels and offset text end before the
    next axis (or the colour bar): ``axes`` are the twins, one per axis, whose right spines are the axes;
    their offset texts (like ``1e15``) are moved from the figure's right edge to the top of their axis."""
    for ax in axes:
        ax.yaxis.offsetText.set_x(ax.spines["right"].get_position()[1])
        ax.yaxis.offsetText.set_horizontalalignment("left")
    figure.draw_without_rendering()
    spines = sorted((ax.spines["right"].get_window_extent().x0, ax) for ax in axes)
    bars = [ax.get_window_extent().x0 for ax in figure.axes if ax.get_label() == "<colorbar>"]
    ends = [x for x, _ in spines[1:]] + [min(bars, default=figure.bbox.x1)]
    need = 1.0
    for (x, ax), end in zip(spines, ends):
        texts = [*_drawn_labels(ax.yaxis), ax.yaxis.offsetText]
        reach = max((text.get_window_extent().x1 for text in texts if text.get_text()), default=x)
        if end > x:
            need = max(need, (reach - x + LABEL_GAP * figure.dpi) / (end - x))
    if need > 1.0:
        width, height = figure.get_size_inches()
        figure.set_size_inches(width * need, height)


def _recolour(figure: Any, cmap: str) -> None:
    """Give the figure's colour-mapped artists ``cmap`` (Optuna's blues fade to white: invisible trials)."""
    for ax in figure.axes:
        for artist in ax.collections:
            if artist.get_array() is not None:
                artist.set_cmap(cmap)
                if artist.colorbar is not None:
                    artist.colorbar.update_normal(artist)


@dataclass(frozen=True)
class _Kinds:
    """What tidying an Optuna chart's axes needs of the parameters drawn.

    Args:
        integers: the int parameters (whole-number ticks).
        categories: the categorical ones (labels shortened).
        tiny: the range of those whose values lie within ±TINY (drawn in units: :func:`_in_units`).
    """

    integers: frozenset[str]
    categories: frozenset[str]
    tiny: Mapping[str, tuple[float, float]]


class _OptunaChart:
    """One of Optuna's matplotlib charts, drawn, titled, tidied and saved."""

    def __init__(self, draw: Callable[[], Any], title: str, kinds: _Kinds, cmap: str) -> None:
        self.draw, self.title, self.kinds, self.cmap = draw, title, kinds, cmap

    def save(self, path: Path, prepare: Callable[[list[Any]], None] = lambda axes: None,
             finish: Callable[[list[Any]], None] = lambda axes: None) -> Path | None:
        """Draw to ``path``; None, with a warning that says why, when Optuna cannot draw it for these trials.

        Args:
            path: the PNG file.
            prepare: changes the axes before their ticks are tidied (a scale, say).
            finish: changes the figure after that, just before it is saved.
        """
        import matplotlib.pyplot as plt

        with matplotlib.rc_context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = self.draw()
            except (ValueError, RuntimeError, ZeroDivisionError) as exc:
                logger.warning("%s not drawn: Optuna cannot draw it for these trials (%s)", path.name, exc)
                return None
            axes = list(result.flat) if hasattr(result, "flat") else [result]
            figure = axes[0].figure
            try:
                prepare(axes)
                self._tidy(figure, axes)
                finish(axes)
                _save(figure, path, dpi=DPI, bbox_inches="tight")
            finally:
                plt.close(figure)
        return path

    def _tidy_param(self, axis: Any, name: str | None, limits: tuple[float, float], inches: float,
                    pad: float) -> None:
        """Ticks for the axis of parameter ``name`` (None: not a parameter's), ``pad`` of its span beyond its values."""
        if name in self.kinds.tiny:
            _in_units(axis, self.kinds.tiny[name], pad)
        elif name in self.kinds.categories:
            _shorten_categories(axis)
        else:
            _tidy_axis(axis, limits, name in self.kinds.integers, inches)

    def _tidy(self, figure: Any, axes: list[Any]) -> None:
        for ax in axes:
            ax.set_title("")
        figure.suptitle(self.title)
        figure.set_size_inches(max(figure.get_size_inches()[0], 9), max(figure.get_size_inches()[1], 5))
        _recolour(figure, self.cmap)
        names = [label.get_text() for label in axes[0].get_xticklabels()]
        width, height = figure.get_size_inches()
        for ax in figure.axes:
            box = ax.get_position()
            self._tidy_param(ax.xaxis, ax.get_xlabel(), ax.get_xlim(), box.width * width, SLICE_PAD)
            self._tidy_param(ax.yaxis, _parallel_name(ax, names), ax.get_ylim(), box.height * height, 0.0)


def _parallel_name(ax: Any, names: Sequence[str]) -> str | None:
    """The parameter whose axis ``ax`` is in a parallel-coordinates chart of ``names`` (a twin whose right
    spine stands at the parameter's place), else None."""
    position = ax.spines["right"].get_position()
    if not (isinstance(position, tuple) and position[0] == "axes" and len(names) > 1):
        return None
    index = round(position[1] * (len(names) - 1))
    return names[index] if 0 <= index < len(names) else None


def _thin_lines(axes: list[Any]) -> None:
    """Many trials' lines thin and translucent, the axes' tick labels on a white ground so lines do not hide them."""
    figure = axes[0].figure
    for ax in figure.axes:
        for artist in ax.collections:
            if isinstance(artist, LineCollection) and len(artist.get_segments()) > MANY_LINES:
                artist.set_linewidth(0.6)
                artist.set_alpha(0.35)
                if artist.colorbar is not None:
                    artist.colorbar.solids.set_alpha(1.0)
        for label in ax.get_yticklabels():
            label.set_bbox({"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 0.5})


def _optuna_charts(study: optuna.Study, scenario: Scenario, params: list[str], axis: ValueAxis, folder: Path,
                   trials: int) -> list[Path]:
    """``slice.png`` and ``parallel.png``: Optuna's charts of the completed trials, titled with the study."""
    from optuna.visualization import matplotlib as ov

    metric, name = scenario.objective.metric, scenario.name
    kinds = _Kinds(frozenset(n for n in params if scenario.parameters[n].type == "int"),
                   frozenset(n for n in params if scenario.parameters[n].type == "categorical"),
                   _tiny_spans(study, params))
    good_dark = "viridis" if scenario.objective.direction == "minimize" else "viridis_r"

    def slice_axes(axes: list[Any]) -> None:
        rng = np.random.default_rng(0)
        for ax in axes:
            ax.set_yscale(axis.scale)
            if trials > MANY_LINES:
                for points in ax.collections:
                    points.set_sizes([8])
                    points.set_linewidth(0)
                    if ax.get_xlabel() in kinds.categories:
                        _spread_about_choices(ax, points, rng)
        axes[0].set_ylabel(axis.label(metric))

    def slice_finish(axes: list[Any]) -> None:
        _uncrowd(axes[0].figure, axes)

    def parallel_finish(axes: list[Any]) -> None:
        _thin_lines(axes)
        figure = axes[0].figure
        names = [label.get_text() for label in axes[0].get_xticklabels()]
        _widen_for_labels(figure, [ax for ax in figure.axes if _parallel_name(ax, names) is not None])

    slice_chart = _OptunaChart(
        lambda: ov.plot_slice(study, params=params, target=None if axis.scale == "log" else (
            lambda t: axis.clip(float(t.value))), target_name=axis.label(metric)),
        f"{name}: {metric} against each parameter ({_plural(trials, 'completed trial')}; colour: trial number)",
        kinds, "viridis")
    measured = f"log10({metric})" if axis.scale == "log" else metric
    clipped = f"; {axis.note}" if axis.clipped else ""
    parallel_chart = _OptunaChart(
        lambda: ov.plot_parallel_coordinate(study, params=params, target=lambda t: axis.target(float(t.value)),
                                            target_name=measured),
        f"{name}: parameters of the {_plural(trials, 'completed trial')} (colour: {measured}, best darkest{clipped})",
        kinds, good_dark)
    paths = [slice_chart.save(folder / "slice.png", slice_axes, slice_finish),
             parallel_chart.save(folder / "parallel.png", finish=parallel_finish)]
    return [p for p in paths if p is not None]


def _spread_about_choices(ax: Any, points: Any, rng: np.random.Generator) -> None:
    """Spread the ``points`` of a categorical slice panel about their choice by up to
    :data:`CHOICE_JITTER`, within the panel: at each choice, thousands of points drew a
    solid bar that showed no density."""
    offsets = np.array(points.get_offsets(), dtype=float)
    if not len(offsets):
        return
    offsets[:, 0] += rng.uniform(-CHOICE_JITTER, CHOICE_JITTER, len(offsets))
    points.set_offsets(offsets)
    low, high = ax.get_xlim()
    ax.set_xlim(min(low, offsets[:, 0].min() - 0.1), max(high, offsets[:, 0].max() + 0.1))


def _why_not_compared(completed: int, params: Sequence[str]) -> str | None:
    """Why the charts that compare trials (importances, slice, parallel) cannot be drawn, or None."""
    if completed < 2:
        return f"they need 2 completed trials, and the study has {'none' if completed == 0 else '1'}"
    if not params:
        return "no parameter took two values or more among the completed trials"
    return None


def frozen(study: optuna.Study, trials: Sequence[optuna.trial.FrozenTrial]) -> optuna.Study:
    """An in-memory study of ``study``'s name and direction that holds ``trials`` (all of the
    study's, in number order, as one read gave them): charts drawn from it show the same trials
    while a sweep goes on changing ``study``. A trial whose values its distributions do not hold
    (queued from Optuna with ``study.enqueue_trial``, which allows them) is left out, and said."""
    import optuna

    copy = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name=study.study_name,
                               direction=study.direction)
    left_out = []
    for trial in trials:
        try:
            copy.add_trial(trial)
        except ValueError:
            left_out.append(str(trial.number))
    if left_out:
        logger.warning("trial %s left out of the charts: its values lie outside the search space", ", ".join(left_out))
    return copy


def draw_all(study: optuna.Study, scenario: Scenario, folder: Path,
             rows: Sequence[PlotRow] | None = None) -> list[Path]:
    """Draw every chart that the study's trials allow into ``folder``; return the files. Each
    file is written whole or not at all; an InputError names one that cannot be. A chart the
    trials do not allow is said once, with why, as a warning of the ``hpo.plots`` logger, and
    an earlier plot's file of that name in ``folder`` is removed (and said so).

    Args:
        study: the scenario's Optuna study, read once per chart: a study that a sweep may change
            meanwhile is passed :func:`frozen`, so that every chart and ``rows`` agree.
        scenario: the scenario (name, objective, parameters).
        folder: where the PNG files go (created if need be).
        rows: the study's trials as rows, if the caller has them (read from the study otherwise).
    """
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    if rows is None:
        from hpo.store import read_row

        rows = [read_row(trial) for trial in study.get_trials(deepcopy=False)]
    if not rows:
        raise InputError(f"study {scenario.name} has no trials to plot yet")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the folder {folder}: {exc.strerror or exc}") from None
    paths = _draw_allowed(study, scenario, folder, rows)
    for stale in sorted(set(CHARTS) - {path.name for path in paths}):
        if (folder / stale).is_file():  # an earlier plot's, not of these trials: gone rather than beside them
            (folder / stale).unlink()
            logger.warning("%s of an earlier plot removed from %s", stale, folder)
    return paths


CHARTS = ("history.png", "states.png", "importances.png", "slice.png", "parallel.png")
"""The files :func:`draw_all` may write."""


def _draw_allowed(study: optuna.Study, scenario: Scenario, folder: Path, rows: Sequence[PlotRow]) -> list[Path]:
    """:func:`draw_all`'s charts, those the trials allow."""
    objective = scenario.objective
    history = history_data(rows, objective.direction, objective.held_out)
    paths = [draw_history(history, scenario.name, objective.metric, objective.direction, folder / "history.png"),
             draw_states(states_data(rows), scenario.name, folder / "states.png")]
    params = varying_params(rows, scenario.parameters)
    why = _why_not_compared(len(history.values), params)
    if why is not None:
        logger.warning("importances.png, slice.png and parallel.png not drawn: %s", why)
        return paths
    for line in _left_out(rows, scenario.parameters):
        logger.warning("%s", line)
    assert history.axis is not None
    importances = importance_data(study, params, objective.metric, history.axis, scenario.search.seed)
    if importances is None:
        logger.warning("importances.png not drawn: fANOVA cannot rank the parameters on these trials")
    else:
        paths.append(draw_importances(importances, scenario.name, folder / "importances.png"))
    return paths + _optuna_charts(study, scenario, params, history.axis, folder, len(history.values))
