"""Charts: the computed data (axis choice, colours per state, labels, importances) and every PNG drawn.

The studies are real Optuna studies in memory: a small digits-like sweep (the main job's
parameters, on a response surface shaped like its results: every ``conv_size=1`` trial
errs 0.66-0.90), one where every trial failed, one with outliers, one with every outcome.
"""
from __future__ import annotations

import errno
import itertools
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from matplotlib.figure import Figure
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from hpo.errors import InputError
from hpo.outcome import Outcome
from hpo.plots import (
    CHOICE_JITTER,
    MANY_LINES,
    STATE_STYLE,
    Importances,
    draw_all,
    draw_importances,
    frozen,
    history_data,
    importance_data,
    states_data,
    value_axis,
    varying_params,
)
from hpo.render import FolderFull
from hpo.scenario import Objective, Param, Scenario, Search

DISTRIBUTIONS: dict[str, BaseDistribution] = {
    "nb_filters": IntDistribution(8, 64, log=True),
    "conv_size": IntDistribution(1, 5),
    "dropout": FloatDistribution(0.0, 0.5),
    "lr": FloatDistribution(1e-3, 0.1, log=True),
    "optimizer": CategoricalDistribution(["sgd", "adam"]),
    "momentum": FloatDistribution(0.5, 0.99),
}
PARAMETERS = {
    "nb_filters": Param(type="int", low=8, high=64, log=True),
    "conv_size": Param(type="int", low=1, high=5),
    "dropout": Param(type="float", low=0.0, high=0.5),
    "lr": Param(type="float", low=1e-3, high=0.1, log=True),
    "optimizer": Param(type="categorical", choices=("sgd", "adam")),
    "epochs": Param(type="constant", value=8),
}
optuna.logging.set_verbosity(optuna.logging.WARNING)
ARGPARSE_REASON = "exit code 2: main.py: error: unrecognized arguments: --batch_size 64"


@dataclass(frozen=True)
class Row:
    """A trial as the charts read it (what ``hpo.store.TrialRow`` provides)."""

    number: int
    state: str
    params: Mapping[str, Any] = field(default_factory=dict)
    value: float | None = None
    held_out: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""


def scenario(name: str = "digits", held_out: tuple[str, ...] = ("test_error",)) -> Scenario:
    """The main job's scenario, minus its template."""
    return Scenario(name=name, command=("python", "digits_cnn.py"), parameters=PARAMETERS,
                    search=Search(method="tpe", trials=15, seed=1),
                    objective=Objective(metric="val_error", direction="minimize", held_out=held_out),
                    path=Path("/project/scenarios/digits.yaml"))


def digits_error(params: Mapping[str, Any], rng: random.Random) -> float:
    """A validation error shaped like the main job's: conv_size 1 fails to learn, lr matters most after it."""
    if params["conv_size"] == 1:
        return rng.uniform(0.66, 0.90)
    lr = 0.05 * (math.log10(params["lr"]) + 1.7) ** 2
    filters = 0.02 * math.log2(64 / params["nb_filters"])
    return 0.03 + lr + filters + 0.04 * params["dropout"] + (0.03 if params["optimizer"] == "sgd" else 0.0)


def digits_study(trials: int = 15, seed: int = 1) -> tuple[optuna.Study, list[Row]]:
    """A small sweep run by Optuna's random sampler; its rows carry the held-out test error."""
    rng = random.Random(seed)
    study = optuna.create_study(study_name="digits", sampler=optuna.samplers.RandomSampler(seed=seed))

    def objective(trial: optuna.Trial) -> float:
        params = {"nb_filters": trial.suggest_int("nb_filters", 8, 64, log=True),
                  "conv_size": trial.suggest_int("conv_size", 1, 5),
                  "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                  "lr": trial.suggest_float("lr", 1e-3, 0.1, log=True),
                  "optimizer": trial.suggest_categorical("optimizer", ["sgd", "adam"])}
        error = digits_error(params, rng)
        trial.set_user_attr("test_error", error + rng.uniform(-0.01, 0.03))
        return error

    study.optimize(objective, n_trials=trials)
    rows = [Row(t.number, t.state.name, t.params, t.value, {"test_error": t.user_attrs["test_error"]})
            for t in study.trials]
    return study, rows


def study_of(name: str, rows: list[Row]) -> optuna.Study:
    """An Optuna study holding ``rows`` as trials (every outcome Optuna has no state for as FAIL)."""
    study = optuna.create_study(study_name=name)
    states = {"COMPLETE": TrialState.COMPLETE, "PRUNED": TrialState.PRUNED, "RUNNING": TrialState.RUNNING,
              "WAITING": TrialState.WAITING}
    for row in rows:
        study.add_trial(create_trial(state=states.get(row.state, TrialState.FAIL), params=dict(row.params),
                                     distributions={k: DISTRIBUTIONS[k] for k in row.params},
                                     value=row.value if row.state == "COMPLETE" else None))
    return study


def random_params(rng: random.Random) -> dict[str, Any]:
    """Parameters drawn like the main job's design."""
    return {"nb_filters": round(2 ** rng.uniform(3, 6)), "conv_size": rng.randint(1, 5),
            "dropout": rng.uniform(0, 0.5), "lr": 10 ** rng.uniform(-3, -1), "optimizer": rng.choice(["sgd", "adam"])}


def all_failed_rows() -> list[Row]:
    """Six trials that never started training, and one that hit the time limit."""
    rng = random.Random(5)
    rows = [Row(n, "FAIL", random_params(rng), reason=ARGPARSE_REASON) for n in range(6)]
    return rows + [Row(6, "TIMEOUT", random_params(rng), reason="killed after 300 s (resources.timeout)")]


def outlier_rows() -> list[Row]:
    """Thirty trials near 0.1-0.4 and two that diverged to 1e3 and 1e5."""
    rng = random.Random(7)
    rows = []
    for number in range(32):
        params = random_params(rng)
        value = {5: 1.2e3, 21: 9.5e4}.get(number, digits_error({**params, "conv_size": 3}, rng) + 0.08)
        rows.append(Row(number, "COMPLETE", params, value, {"test_error": value * 1.1}))
    return rows


def mixed_rows() -> list[Row]:
    """Every outcome: mostly complete, a few of each other state, two running and one waiting."""
    rng = random.Random(11)
    states = ["COMPLETE"] * 14 + ["PRUNED"] * 4 + ["FAIL"] * 3 + ["TIMEOUT", "STOPPED", "LOST", "INTERRUPTED",
                                                                   "RUNNING", "RUNNING", "WAITING"]
    rng.shuffle(states)
    rows = []
    for number, state in enumerate(states):
        params = random_params(rng)
        value = digits_error(params, rng) if state == "COMPLETE" else None
        reason = {"FAIL": "exit code 1: RuntimeError: CUDA error: an illegal memory access was encountered"}
        rows.append(Row(number, state, params, value, {"test_error": value + 0.01} if value else {},
                        reason.get(state, "")))
    return rows


@pytest.mark.parametrize(
    ("values", "scale", "below", "above"),
    [
        pytest.param([0.12, 0.3, 0.25, 0.18, 0.9], "linear", 0, 0, id="plain"),
        pytest.param([0.05 * 1.6 ** k for k in range(16)], "log", 0, 0, id="decades-spread-out"),
        pytest.param([0.1 + 0.01 * k for k in range(30)] + [1.2e3, 9.5e4], "linear", 0, 2, id="two-diverged"),
        pytest.param([-3.0 + 0.1 * k for k in range(20)] + [-500.0], "linear", 1, 0, id="one-low-outlier"),
        pytest.param([0.2, 0.21, 40.0], "log", 0, 0, id="too-few-to-call-outliers"),
        pytest.param([0.03 + 0.005 * k for k in range(12)] + [0.7, 0.8, 0.9], "linear", 0, 0,
                     id="bad-trials-are-not-outliers"),
        pytest.param([0.5] * 6, "linear", 0, 0, id="constant"),
        pytest.param([10 ** (k / 4) for k in range(-8, 9)] + [1e9], "log", 0, 0, id="bulk-spanning-decades-stays-log"),
        pytest.param([-1.0, 2.0, -300.0, 150.0, 4.0, 9.0, -20.0, 60.0], "linear", 0, 0, id="signed-spread"),
    ],
)
def test_the_value_axis_fits_the_values(values: list[float], scale: str, below: int, above: int) -> None:
    axis = value_axis(values)
    assert axis is not None
    assert (axis.scale, axis.below, axis.above) == (scale, below, above)
    kept = [v for v in values if axis.low <= v <= axis.high]
    assert len(kept) == len(values) - below - above
    assert axis.low < min(kept) and axis.high > max(kept)


def test_a_clipped_axis_says_so_and_clips() -> None:
    axis = value_axis([0.1 + 0.01 * k for k in range(30)] + [1.2e3, 9.5e4])
    assert axis is not None and axis.clipped
    assert axis.label("val_error") == f"val_error (clipped: 2 above {axis.high:.3g})"
    assert axis.clip(9.5e4) == axis.high and axis.clip(0.2) == 0.2
    assert axis.target_label("val_error") == f"val_error (clipped to {axis.low:.3g}..{axis.high:.3g})"


def test_a_log_axis_says_so_and_measures_in_log10() -> None:
    axis = value_axis([0.05 * 1.6 ** k for k in range(16)])
    assert axis is not None
    assert axis.label("loss") == "loss (log scale)" and axis.target_label("loss") == "log10(loss)"
    assert axis.target(100.0) == pytest.approx(2.0)
    assert value_axis([]) is None and value_axis([math.nan, math.inf]) is None


def test_history_of_a_real_small_study() -> None:
    _, rows = digits_study()
    assert sum(row.params["conv_size"] == 1 for row in rows) == 3
    data = history_data(rows, "minimize", ("test_error",))
    assert data.numbers == tuple(range(15))
    assert list(data.best_values) == [min(data.values[:k + 1]) for k in range(15)]
    best_at = [min(range(k + 1), key=lambda i: data.values[i]) for k in range(15)]
    assert data.best_held_out["test_error"] == tuple(rows[i].held_out["test_error"] for i in best_at)
    assert data.axis is not None and data.axis.scale == "linear" and not data.axis.clipped
    assert data.held_out_apart == ()
    assert data.others == {} and data.commonest == ()


def test_history_maximizes_too() -> None:
    rows = [Row(n, "COMPLETE", value=v) for n, v in enumerate([0.5, 0.7, 0.6, 0.9])]
    assert history_data(rows, "maximize", ()).best_values == (0.5, 0.7, 0.7, 0.9)


def test_history_with_no_completed_trial_names_the_commonest_reason() -> None:
    data = history_data(all_failed_rows(), "minimize", ("test_error",))
    assert data.axis is None and data.values == ()
    assert data.others == {Outcome.FAIL: (0, 1, 2, 3, 4, 5), Outcome.TIMEOUT: (6,)}
    assert data.commonest == ((ARGPARSE_REASON, 6),)
    assert data.last_number == 6


def test_history_of_outliers_clips_and_keeps_the_held_out_metric_beside() -> None:
    data = history_data(outlier_rows(), "minimize", ("test_error",))
    assert data.axis is not None and data.axis.above == 2 and data.axis.high < 2
    assert data.held_out_apart == ()


@pytest.mark.parametrize(
    ("values", "held_out", "apart"),
    [
        pytest.param([0.05 - 0.005 * n for n in range(6)], {"test_error": 0.03, "correct": 9800.0}, ("correct",),
                     id="a-count-beside-an-error"),
        pytest.param([10 ** (1.5 - 0.5 * n) for n in range(8)], {"test_loss": 1.0, "correct": 9014.0}, ("correct",),
                     id="a-count-beside-a-log-loss"),
        pytest.param([0.5, 0.4, 0.3], {"test_error": 0.45, "test_loss": -1.0}, ("test_loss",), id="negative-value"),
        pytest.param([0.5, 0.4, 0.3], {"test_error": 0.55}, (), id="same-scale"),
    ],
)
def test_a_held_out_metric_on_another_scale_gets_its_own_panel(values: list[float], held_out: dict[str, float],
                                                               apart: tuple[str, ...]) -> None:
    rows = [Row(n, "COMPLETE", value=v, held_out=held_out) for n, v in enumerate(values)]
    assert history_data(rows, "minimize", tuple(held_out)).held_out_apart == apart


def test_a_held_out_metric_beside_the_objective_stays_on_its_axis() -> None:
    rows = [Row(n, "COMPLETE", value=v, held_out={"test_error": v + 0.05}) for n, v in enumerate([0.5, 0.4, 0.3])]
    data = history_data(rows, "minimize", ("test_error",))
    assert data.held_out_apart == () and data.axis is not None
    assert data.axis.low < 0.3 and data.axis.high > 0.55


def test_history_marks_the_trials_that_did_not_complete_by_state() -> None:
    rows = mixed_rows()
    data = history_data(rows, "minimize", ("test_error",))
    expected: dict[Outcome, list[int]] = {}
    for row in rows:
        if row.state != "COMPLETE":
            expected.setdefault(Outcome(row.state), []).append(row.number)
    assert data.others == {state: tuple(numbers) for state, numbers in expected.items()}
    assert len(data.numbers) == 14
    assert data.commonest == (("exit code 1: RuntimeError: CUDA error: an illegal memory access was encountered", 3),)


def test_every_outcome_has_its_own_colour_and_meaning() -> None:
    assert set(STATE_STYLE) == set(Outcome)
    colours = [colour for colour, _ in STATE_STYLE.values()]
    assert len(set(colours)) == len(colours)
    assert STATE_STYLE[Outcome.COMPLETE][0] == "#2e7d32"
    assert all("not its fault" in STATE_STYLE[o][1] for o in (Outcome.LOST, Outcome.INTERRUPTED))


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def test_failures_are_red_and_not_the_trials_fault_is_grey() -> None:
    for outcome in (Outcome.FAIL, Outcome.TIMEOUT):
        red, green, blue = _rgb(STATE_STYLE[outcome][0])
        assert red > 2 * max(green, blue)
    for outcome in (Outcome.LOST, Outcome.INTERRUPTED, Outcome.STOPPED, Outcome.PRUNED):
        red, green, blue = _rgb(STATE_STYLE[outcome][0])
        assert red < 2 * max(green, blue), outcome
    for outcome in (Outcome.LOST, Outcome.INTERRUPTED):
        assert max(_rgb(STATE_STYLE[outcome][0])) - min(_rgb(STATE_STYLE[outcome][0])) < 40


def test_states_are_counted_in_a_fixed_order_with_their_colours_and_labels() -> None:
    bars = states_data(mixed_rows())
    assert [(bar.outcome.value, bar.count) for bar in bars] == [
        ("COMPLETE", 14), ("PRUNED", 4), ("STOPPED", 1), ("TIMEOUT", 1), ("FAIL", 3), ("LOST", 1),
        ("INTERRUPTED", 1), ("RUNNING", 2), ("WAITING", 1)]
    assert all(bar.colour == STATE_STYLE[bar.outcome][0] for bar in bars)
    assert bars[5].label == "LOST: its worker died: runs again, not its fault"


def test_varying_params_leave_out_constants_and_unvaried_ones() -> None:
    rows = [Row(0, "COMPLETE", {"lr": 0.1, "conv_size": 3, "epochs": 8}, 0.2),
            Row(1, "COMPLETE", {"lr": 0.01, "conv_size": 3, "epochs": 8}, 0.3),
            Row(2, "FAIL", {"lr": 0.5, "conv_size": 5, "epochs": 8})]
    assert varying_params(rows, PARAMETERS) == ["lr"]
    assert varying_params([], PARAMETERS) == []


def test_fanova_ranks_conv_size_first_on_the_small_study() -> None:
    study, rows = digits_study()
    axis = value_axis([r.value for r in rows if r.value is not None])
    assert axis is not None
    data = importance_data(study, varying_params(rows, PARAMETERS), "val_error", axis, seed=1)
    assert data is not None
    assert data.params[0] == "conv_size" and data.values[0] > 0.5
    assert sum(data.values) == pytest.approx(1.0)
    assert data.target == "val_error" and data.trials == 15
    again = importance_data(study, varying_params(rows, PARAMETERS), "val_error", axis, seed=1)
    assert again == data


def test_importances_of_outliers_are_of_the_clipped_values() -> None:
    rows = outlier_rows()
    axis = value_axis([r.value for r in rows if r.value is not None])
    assert axis is not None
    data = importance_data(study_of("outliers", rows), varying_params(rows, PARAMETERS), "val_error", axis, seed=1)
    assert data is not None and data.target.startswith("val_error (clipped to ")


CASES = {
    "small-study": lambda: digits_study(),
    "all-failed": lambda: (study_of("all-failed", all_failed_rows()), all_failed_rows()),
    "outliers": lambda: (study_of("outliers", outlier_rows()), outlier_rows()),
    "mixed-states": lambda: (study_of("mixed", mixed_rows()), mixed_rows()),
}
EXPECTED_FILES = {
    "small-study": ["history", "states", "importances", "slice", "parallel"],
    "all-failed": ["history", "states"],
    "outliers": ["history", "states", "importances", "slice", "parallel"],
    "mixed-states": ["history", "states", "importances", "slice", "parallel"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_draw_all_writes_every_chart_the_trials_allow(case: str, tmp_path: Path) -> None:
    study, rows = CASES[case]()
    paths = draw_all(study, scenario(case), tmp_path / "plots", rows=rows)
    assert [p.name for p in paths] == [f"{name}.png" for name in EXPECTED_FILES[case]]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures that charts save from now on, in order (each is still saved)."""
    figures: list[Figure] = []
    save = Figure.savefig

    def keep(figure: Figure, path: Any, **options: Any) -> None:
        figures.append(figure)
        save(figure, path, **options)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _visible_ticks(axis: Any, limits: tuple[float, float]) -> list[float]:
    return [float(t) for t in axis.get_majorticklocs() if limits[0] <= t <= limits[1]]


def test_one_completed_trial_gets_integer_trial_ticks_and_says_what_is_not_drawn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rows = [Row(0, "COMPLETE", {"optimizer": "sgd"}, 0.5)]
    figures = saved_figures(monkeypatch)
    with caplog.at_level("WARNING", logger="hpo.plots"):
        paths = draw_all(study_of("one", rows), scenario("one", held_out=()), tmp_path, rows=rows)
    assert [p.name for p in paths] == ["history.png", "states.png"]
    assert [r.getMessage() for r in caplog.records] == [
        "importances.png, slice.png and parallel.png not drawn: they need 2 completed trials, and the study has 1"]
    history, states = figures
    trials = history.axes[-1]
    assert _visible_ticks(trials.xaxis, trials.get_xlim()) == [0.0]
    assert history.get_suptitle() == "one: val_error by trial (minimize; 1 trial, 1 completed)"
    assert states.get_suptitle() == "one: how the 1 trial ended"
    assert all(t.is_integer() for t in _visible_ticks(states.axes[0].xaxis, states.axes[0].get_xlim()))


@pytest.mark.parametrize(("rows", "why"), [
    ([Row(0, "FAIL", {"optimizer": "sgd"}, reason="exit code 3")], "they need 2 completed trials, and the study has none"),
    ([Row(n, "COMPLETE", {"optimizer": "sgd"}, 0.5 - n / 10) for n in range(3)],
     "no parameter took two values or more among the completed trials"),
])
def test_charts_that_compare_trials_say_once_why_they_are_not_drawn(
        rows: list[Row], why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="hpo.plots"):
        paths = draw_all(study_of("few", rows), scenario("few", held_out=()), tmp_path, rows=rows)
    assert [p.name for p in paths] == ["history.png", "states.png"]
    assert [r.getMessage() for r in caplog.records] == [f"importances.png, slice.png and parallel.png not drawn: {why}"]


def test_a_chart_not_drawn_leaves_no_earlier_plots_file_beside_the_new_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """hpo plot -o DIR kept the importances, slice and parallel charts of an earlier plot (of
    another study) beside this one's history and states, and said nothing of them."""
    for name in ("importances.png", "slice.png", "parallel.png", "notes.png"):
        (tmp_path / name).write_bytes(b"earlier")
    rows = [Row(0, "COMPLETE", {"optimizer": "sgd"}, 0.5)]
    with caplog.at_level("WARNING", logger="hpo.plots"):
        paths = draw_all(study_of("few", rows), scenario("few", held_out=()), tmp_path, rows=rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.png", "notes.png", "states.png"]
    assert [p.name for p in paths] == ["history.png", "states.png"]
    assert [r.getMessage() for r in caplog.records][1:] == [
        f"{name} of an earlier plot removed from {tmp_path}" for name in ("importances.png", "parallel.png", "slice.png")]


def test_the_states_title_does_not_call_running_or_waiting_trials_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [Row(0, "COMPLETE", {"optimizer": "sgd"}, 0.5), Row(1, "RUNNING", {"optimizer": "adam"}),
            Row(2, "WAITING", {"optimizer": "sgd"})]
    figures = saved_figures(monkeypatch)
    draw_all(study_of("slow", rows), scenario("slow", held_out=()), tmp_path, rows=rows)
    assert figures[1].get_suptitle() == "slow: the 3 trials by state (1 ended, 2 not yet)"


def test_charts_say_which_conditional_parameters_they_leave_out(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A parameter that only some completed trials have (a condition) was left out of the
    importances, slice and parallel charts without a word."""
    rows = [Row(n, "COMPLETE", {"lr": 0.001 * (n + 1), "optimizer": ("sgd", "adam")[n % 2],
                                **({"momentum": 0.5 + n / 20} if n % 2 == 0 else {})}, 0.5 - n / 20)
            for n in range(6)]
    parameters = {"lr": PARAMETERS["lr"], "optimizer": PARAMETERS["optimizer"],
                  "momentum": Param(type="float", low=0.5, high=0.99, condition={"optimizer": "sgd"})}
    conditional = Scenario(name="cond", command=("python", "train.py"), parameters=parameters,
                           search=Search(method="tpe", trials=6, seed=1),
                           objective=Objective(metric="val_error", direction="minimize"), path=Path("/p/cond.yaml"))
    with caplog.at_level("WARNING", logger="hpo.plots"):
        paths = draw_all(study_of("cond", rows), conditional, tmp_path, rows=rows)
    assert [p.name for p in paths] == ["history.png", "states.png", "importances.png", "slice.png", "parallel.png"]
    assert "importances.png, slice.png and parallel.png leave out momentum: only some completed trials have it " \
           "(a condition)" in [r.getMessage() for r in caplog.records]


def test_the_best_so_far_lines_of_one_completed_trial_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step line of one point has no length: the best value and the held-out panel were
    drawn empty while their legends said "now 0.3686". Each line marks its last point."""
    rows = [Row(0, "COMPLETE", {"optimizer": "sgd"}, 0.32, {"test_error": 0.37}), Row(1, "RUNNING", {})]
    figures = saved_figures(monkeypatch)
    draw_all(study_of("one", rows), scenario("one"), tmp_path, rows=rows)
    lines = [line for ax in figures[0].axes for line in ax.get_lines() if "so far" in str(line.get_label())]
    assert len(lines) == 2
    for line in lines:
        assert line.get_marker() == "o" and list(line.get_markevery()) == [0]
        assert list(line.get_xdata()) == [0]


def test_failure_reasons_that_tie_are_all_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two reasons once each: neither is "the commonest"; five: three are listed and the rest counted."""
    reasons = ["exit code 3: dataset shard missing", "exit code 1: ValueError: bad thing happened",
               "killed after 3 s (resources.timeout)", "exit code 2: usage", "out of GPU memory"]
    rows = [Row(n, "FAIL", {"optimizer": "sgd"}, reason=reason) for n, reason in enumerate(reasons[:2])]
    data = history_data(rows, "minimize", ())
    assert data.commonest == ((reasons[0], 1), (reasons[1], 1))
    figures = saved_figures(monkeypatch)
    draw_all(study_of("two", rows), scenario("two", held_out=()), tmp_path / "two", rows=rows)
    text = "\n".join(t.get_text() for t in figures[0].axes[0].texts)
    assert "commonest" not in text
    assert f"2 reasons, 1× each:\n{reasons[0]}\n{reasons[1]}" in text
    rows = [Row(n, "FAIL", {"optimizer": "sgd"}, reason=reason) for n, reason in enumerate(reasons)]
    draw_all(study_of("five", rows), scenario("five", held_out=()), tmp_path / "five", rows=rows)
    text = "\n".join(t.get_text() for t in figures[2].axes[0].texts)
    assert text.endswith(f"5 reasons, 1× each:\n{reasons[0]}\n{reasons[1]}\n{reasons[2]}\nand 2 more")


def test_draw_all_refuses_a_study_without_trials(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="study digits has no trials to plot yet"):
        draw_all(optuna.create_study(), scenario(), tmp_path, rows=[])


def test_draw_all_reads_the_rows_from_the_study_when_not_given(tmp_path: Path) -> None:
    study, _ = digits_study(trials=4)
    paths = draw_all(study, scenario(held_out=()), tmp_path)
    assert {p.name for p in paths} >= {"history.png", "states.png"}



def test_a_frozen_study_keeps_the_trials_of_its_one_read_while_the_sweep_goes_on(tmp_path: Path) -> None:
    """hpo plot draws every chart from one read: a trial that ends, or one that starts, while
    the charts are drawn shows in none of them (the slice chart once counted a trial that
    the history chart, drawn a moment earlier, showed running)."""
    study, _ = digits_study(trials=5)
    running = study.ask()
    running.suggest_int("conv_size", 1, 5)
    copy = frozen(study, study.get_trials(deepcopy=False))
    study.tell(running, 0.5)
    study.optimize(lambda trial: trial.suggest_float("dropout", 0.0, 0.5), n_trials=2)
    assert [(t.number, t.state, t.value, t.params) for t in copy.trials] == \
        [(t.number, t.state, t.value, t.params) for t in study.trials[:6]][:5] + \
        [(5, TrialState.RUNNING, None, {"conv_size": running.params["conv_size"]})]
    assert copy.study_name == "digits" and copy.direction == study.direction
    assert len(draw_all(copy, scenario(held_out=()), tmp_path)) == 5


def test_a_trial_whose_values_lie_outside_its_distributions_is_left_out_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trial queued from Optuna with a value outside the range (enqueue_trial allows it, with
    a warning) made hpo plot fail on the whole study with Optuna's ValueError."""
    import warnings

    study, _ = digits_study(trials=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study.enqueue_trial({"dropout": 0.9})
        study.optimize(lambda trial: trial.suggest_float("dropout", 0.0, 0.5), n_trials=1)
    copy = frozen(study, study.get_trials(deepcopy=False))
    assert [t.number for t in copy.trials] == [0, 1, 2]
    assert "trial 3 left out of the charts: its values lie outside the search space" in caplog.text


@pytest.mark.parametrize("failing", ["states", "slice"])
def test_a_chart_that_cannot_be_written_is_named_and_left_out_whole(failing: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    save = Figure.savefig

    def disk_full(figure: Figure, path: Any, **options: Any) -> None:
        if Path(path).name.startswith(f".{failing}."):
            Path(path).write_bytes(b"\x89PNG half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save(figure, path, **options)

    monkeypatch.setattr(Figure, "savefig", disk_full)
    study, rows = digits_study()
    with pytest.raises(FolderFull) as raised:
        draw_all(study, scenario(), tmp_path, rows=rows)
    assert str(raised.value).startswith(f"cannot write {tmp_path / failing}.png: No space left on device (")
    written = {"states": ["history.png"], "slice": ["history.png", "importances.png", "states.png"]}[failing]
    assert sorted(path.name for path in tmp_path.iterdir()) == written
    assert all(path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in tmp_path.iterdir())


def test_a_plot_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    study, rows = digits_study(trials=4)
    with pytest.raises(InputError, match=r"^cannot create the folder /proc/hpo-plots: No such file or directory$"):
        draw_all(study, scenario(), Path("/proc/hpo-plots"), rows=rows)


def test_importances_cover_a_study_resumed_with_widened_ranges() -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    rng = random.Random(0)
    for number in range(12):
        widened = number >= 6
        distributions = {"x": FloatDistribution(0.0, 2.0 if widened else 1.0), "k": IntDistribution(1, 9 if widened else 5),
                         "c": CategoricalDistribution(["a", "b"])}
        params = {"x": rng.random(), "k": rng.randint(1, distributions["k"].high),
                  "c": rng.choice(distributions["c"].choices)}
        study.add_trial(create_trial(params=params, distributions=distributions, value=params["x"] ** 2))
    axis = value_axis([t.value for t in study.trials])
    assert axis is not None
    data = importance_data(study, ["x", "k", "c"], "val_error", axis, seed=1)
    assert data is not None and data.params[0] == "x" and data.trials == 12


LONG_CHOICES = ("x" * 135 + " long", "x" * 135 + " lung")
ODD_CHOICES = ("a b c", 'quote"d', "it's", "ünï©ødé ✓", "comma,semi;colon", *LONG_CHOICES, "=eq=", "", " lead")
ODD_PARAMETERS = {
    "lr": Param(type="float", low=1e-10, high=1e10, log=True),
    "big": Param(type="int", low=1, high=10 ** 12, log=True),
    "café": Param(type="float", low=-1e-300, high=1e-300),
    "choice": Param(type="categorical", choices=ODD_CHOICES),
    "prec": Param(type="float", low=0.1, high=0.9),
}


def odd_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[optuna.Study, dict[str, Figure]]:
    """Thirty trials over 20 decades, 12 decades, ±1e-300 and a 140-character choice; their saved
    slice and parallel figures."""
    study = optuna.create_study(study_name="odd", sampler=optuna.samplers.RandomSampler(seed=3))
    study.optimize(lambda t: abs(t.suggest_float("prec", 0.1, 0.9) - 0.5) + 0 * (
        t.suggest_float("lr", 1e-10, 1e10, log=True) + t.suggest_int("big", 1, 10 ** 12, log=True)
        + t.suggest_float("café", -1e-300, 1e-300) + len(t.suggest_categorical("choice", ODD_CHOICES))), n_trials=30)
    odd = Scenario(name="odd", command=("python", "t.py"), parameters=ODD_PARAMETERS,
                   search=Search(method="monte_carlo", trials=30, seed=7),
                   objective=Objective(metric="val_error", direction="minimize"), path=Path("/project/odd.yaml"))
    figures = saved_figures(monkeypatch)
    paths = draw_all(study, odd, tmp_path)
    return study, {path.stem: figure for path, figure in zip(paths, figures)}


def slice_panel(figure: Figure, name: str) -> Any:
    """The slice chart's panel of parameter ``name``."""
    return next(ax for ax in figure.axes if ax.get_xlabel() == name)


def parallel_axis(figure: Figure, name: str) -> Any:
    """The parallel chart's axis of parameter ``name`` (a twin of the first axes, its spine at its place)."""
    names = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    place = names.index(name) / (len(names) - 1)
    return next(ax.yaxis for ax in figure.axes[1:]
                if ax.spines["right"].get_position() == ("axes", pytest.approx(place)))


def shown_labels(axis: Any) -> list[tuple[float, str]]:
    """The tick locations and labels that ``axis`` draws (within its limits, labelled)."""
    low, high = sorted(axis.get_view_interval())
    ticks = [float(t) for t in axis.get_majorticklocs()]
    texts = axis.get_major_formatter().format_ticks(ticks)
    return [(t, text) for t, text in zip(ticks, texts) if low <= t <= high and text]


def values_of(study: optuna.Study, name: str) -> list[float]:
    return [t.params[name] for t in study.trials]


def test_log_axes_over_many_decades_get_labelled_powers_of_ten(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _, figures = odd_study(tmp_path, monkeypatch)
    for name in ("lr", "big"):
        for axis in (slice_panel(figures["slice"], name).xaxis, parallel_axis(figures["parallel"], name)):
            assert axis.get_scale() == "log"
            shown = shown_labels(axis)
            assert len(shown) >= 3, (name, shown)
            assert all(text == f"1e{math.log10(t):.0f}" if abs(t) >= 1e5 or abs(t) < 1e-4 else text == f"{t:g}"
                       for t, text in shown), shown
            assert all(math.log10(t).is_integer() for t, _ in shown)


def test_a_range_within_1e_300_is_drawn_in_units_of_a_power_of_ten(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    study, figures = odd_study(tmp_path, monkeypatch)
    values = values_of(study, "café")
    exponent = math.floor(math.log10(max(abs(v) for v in values)))
    unit = 10.0 ** exponent
    panel = slice_panel(figures["slice"], "café")
    twin = parallel_axis(figures["parallel"], "café")
    for axis in (panel.xaxis, twin):
        figures["slice"].draw_without_rendering()
        figures["parallel"].draw_without_rendering()
        assert axis.get_offset_text().get_text() == f"1e{exponent}"
        shown = shown_labels(axis)
        assert len(shown) >= 3
        assert all(float(text.replace("\N{MINUS SIGN}", "-")) == pytest.approx(t) for t, text in shown)
    assert twin.get_view_interval() * unit == pytest.approx([min(values), max(values)])
    low, high = panel.get_xlim()
    assert low * unit < min(values) and max(values) < high * unit
    points = panel.collections[0].get_offsets()[:, 0] * unit
    assert sorted(points) == pytest.approx(sorted(values))


def _boxes(axis: Any) -> list[Any]:
    """Where the tick labels that ``axis`` draws are (those within its limits)."""
    low, high = sorted(axis.get_view_interval())
    along = 0 if axis.axis_name == "x" else 1
    return [label.get_window_extent() for label in axis.get_ticklabels()
            if label.get_visible() and label.get_text() and low <= label.get_position()[along] <= high]


def test_long_categories_are_shortened_distinct_and_overlap_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, figures = odd_study(tmp_path, monkeypatch)
    slices, parallel = figures["slice"], figures["parallel"]
    slices.draw_without_rendering()
    texts = [text for _, text in shown_labels(slice_panel(slices, "choice").xaxis)]
    assert len(texts) == len(set(texts)) == len(ODD_CHOICES)
    assert max(len(text) for text in texts) <= 20 and "'a b c'" in texts
    panels = [ax for ax in slices.axes if ax.get_xlabel()]
    everything = [(ax, box) for ax in panels for box in _boxes(ax.xaxis)]
    for ax, box in everything:
        assert not any(box.overlaps(other) for other_ax, other in everything if other is not box)
        assert not any(box.overlaps(other.bbox) for other in slices.axes if other is not ax)
    parallel.draw_without_rendering()
    axis = parallel_axis(parallel, "choice")
    texts = axis.get_major_formatter().format_ticks(axis.get_majorticklocs())
    assert len(texts) == len(set(texts)) == len(ODD_CHOICES)
    assert max(len(text) for text in texts) <= 20 and "a b c" in texts
    names = [label.get_text() for label in parallel.axes[0].get_xticklabels()]
    colour_bar = next(ax for ax in parallel.axes if ax.get_label() == "<colorbar>")
    spines = [parallel_axis(parallel, name).axes.spines["right"].get_window_extent().x0 for name in names[1:]]
    ends = [*spines[1:], colour_bar.get_window_extent().x0]
    for name, end in zip(names[1:], ends):
        right = max(box.x1 for box in _boxes(parallel_axis(parallel, name)))
        assert right < end, name


def test_normal_charts_keep_their_size_and_upright_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    study, rows = digits_study()
    figures = saved_figures(monkeypatch)
    draw_all(study, scenario(), tmp_path, rows=rows)
    slices, parallel = figures[-2:]
    assert [label.get_rotation() for label in slice_panel(slices, "optimizer").get_xticklabels()] == [0.0, 0.0]
    assert [text for _, text in shown_labels(slice_panel(slices, "optimizer").xaxis)] == ["'sgd'", "'adam'"]
    assert [text for _, text in shown_labels(parallel_axis(parallel, "optimizer"))] == ["sgd", "adam"]
    assert [text for _, text in shown_labels(parallel_axis(parallel, "lr"))] == ["0.002", "0.005", "0.01", "0.02",
                                                                                  "0.05"]
    assert parallel.get_size_inches()[0] == pytest.approx(9)


def test_charts_say_why_they_leave_out_a_parameter_added_later_or_one_that_never_varied(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A parameter added with --allow-space-change was said to be left out for 'a condition' it
    does not have, and one with the same value in every completed trial was left out unsaid."""
    rows = [Row(n, "COMPLETE", {"lr": 0.001 * (n + 1), "optimizer": "adam", **({"nb_filters": 8 * n} if n > 2 else {})},
                0.5 - n / 20) for n in range(6)]
    parameters = {"lr": PARAMETERS["lr"], "optimizer": PARAMETERS["optimizer"], "nb_filters": PARAMETERS["nb_filters"]}
    later = Scenario(name="later", command=("python", "train.py"), parameters=parameters,
                     search=Search(method="tpe", trials=6, seed=1),
                     objective=Objective(metric="val_error", direction="minimize"), path=Path("/p/later.yaml"))
    with caplog.at_level("WARNING", logger="hpo.plots"):
        draw_all(study_of("later", rows), later, tmp_path, rows=rows)
    said = [r.getMessage() for r in caplog.records]
    charts = "importances.png, slice.png and parallel.png leave out"
    assert said == [f"{charts} nb_filters: only some completed trials have it (it was added to the study later)",
                    f"{charts} optimizer: every completed trial has the same value (optimizer=adam)"], said


def test_the_points_of_a_choice_are_spread_about_it_when_there_are_many(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2,000 trials each choice of a categorical panel was one solid bar."""
    study = optuna.create_study(study_name="many", sampler=optuna.samplers.RandomSampler(seed=3))
    study.optimize(lambda t: t.suggest_float("x", 0, 1) + len(t.suggest_categorical("act", ["relu", "tanh"])),
                   n_trials=MANY_LINES + 1)
    scenario = Scenario(name="many", command=("python", "t.py"),
                        parameters={"x": Param(type="float", low=0.0, high=1.0),
                                    "act": Param(type="categorical", choices=["relu", "tanh"])},
                        search=Search(method="monte_carlo", trials=MANY_LINES + 1, seed=7),
                        objective=Objective(metric="val_error", direction="minimize"), path=Path("/p/many.yaml"))
    figures = saved_figures(monkeypatch)
    paths = draw_all(study, scenario, tmp_path)
    chart = dict(zip((path.stem for path in paths), figures))["slice"]
    places = np.concatenate([points.get_offsets()[:, 0] for points in slice_panel(chart, "act").collections])
    assert len(places) == MANY_LINES + 1
    spread = np.abs(places - np.round(places))
    assert 0.1 < spread.max() <= CHOICE_JITTER and len(np.unique(np.round(places))) == 2
    low, high = slice_panel(chart, "act").get_xlim()
    assert low < places.min() and places.max() < high


def test_tick_labels_that_only_touch_are_crowded() -> None:
    """Ten labels 0.2 px apart read as one number, 10152025303540455055; they did not overlap,
    so they were not thinned."""
    from matplotlib.figure import Figure as PlainFigure

    from hpo.plots import _crowded
    figure = PlainFigure(figsize=(4, 2), dpi=100)
    ax = figure.add_axes((0.1, 0.3, 0.8, 0.6))
    ax.set_xlim(0, 100)
    labels = [str(10 + 5 * i) for i in range(11)]

    def gaps(size: float) -> list[float]:
        ax.set_xticks(range(0, 101, 10), labels, fontsize=size)
        figure.draw_without_rendering()
        spans = sorted((box.x0, box.x1) for box in (label.get_window_extent() for label in ax.xaxis.get_ticklabels()))
        return [right[0] - left[1] for left, right in itertools.pairwise(spans)]

    assert min(gaps(6)) > 6 * 0.5 * figure.dpi / 72 and not _crowded(ax.xaxis, -math.inf, math.inf)
    size = next(size / 10 for size in range(300, 60, -1) if min(gaps(size / 10)) > 0)  # the largest not to overlap
    assert 0 < min(gaps(size)) < size * 0.5 * figure.dpi / 72 and _crowded(ax.xaxis, -math.inf, math.inf)


def test_a_long_importance_label_is_folded_to_stay_on_the_image(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Centred under bars that a long parameter name pushes right, the label ran past the
    image's edge ('... that each parameter exp')."""
    figures = saved_figures(monkeypatch)
    data = Importances(("very_long_parameter_name_for_the_network_width", "lr"), (0.71, 0.29),
                       "loss (clipped to -55.2..1.05e+03)", 8)
    draw_importances(data, "toy", tmp_path / "importances.png")
    [figure] = figures
    assert figure.axes[0].get_xlabel() == "share of the variance of loss (clipped to -55.2..1.05e+03)\n" \
                                          "that each parameter explains"
    figure.canvas.draw()
    label = figure.axes[0].xaxis.label.get_window_extent()
    assert 0 <= label.x0 and label.x1 <= figure.bbox.width
