"""Designs of experiments: Monte Carlo, Sobol, LHS, grid and CSV points."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpo import designs, space
from hpo.errors import InputError
from hpo.scenario import Scenario, load_scenario

WriteScenario = Callable[..., Path]

UNIT_PARAMS = {
    "a": {"type": "float", "low": 0.0, "high": 1.0},
    "b": {"type": "float", "low": 0.0, "high": 1.0},
    "c": {"type": "float", "low": 0.0, "high": 1.0},
}


def _scenario(tmp_path: Path, write_scenario: WriteScenario, method: str, trials: int | None = None,
              seed: int = 1, parameters: dict[str, Any] | None = None, drop: tuple[str, ...] = ("parameters.x",
                                                                                                 "parameters.opt"),
              **overrides: Any) -> Scenario:
    """Load a scenario of ``method`` whose parameters replace the base ones."""
    search: dict[str, Any] = {"method": method, "trials": trials, "seed": seed}
    path = write_scenario(tmp_path, drop=drop, search=search,
                          parameters=UNIT_PARAMS if parameters is None else parameters, **overrides)
    return load_scenario(path)


@pytest.mark.parametrize("method", ["monte_carlo", "sobol", "lhs"])
def test_random_designs_are_seeded(tmp_path: Path, write_scenario: WriteScenario, method: str) -> None:
    first = designs.design_points(_scenario(tmp_path / "1", write_scenario, method, 8, seed=5))
    again = designs.design_points(_scenario(tmp_path / "2", write_scenario, method, 8, seed=5))
    other = designs.design_points(_scenario(tmp_path / "3", write_scenario, method, 8, seed=6))
    assert first is not None and len(first) == 8
    assert first == again
    assert first != other
    for point in first:
        assert set(point) == {"a", "b", "c"}
        assert all(0.0 <= value <= 1.0 for value in point.values())


@pytest.mark.parametrize("method", ["monte_carlo", "sobol"])
def test_random_designs_are_prefix_stable(tmp_path: Path, write_scenario: WriteScenario, method: str) -> None:
    short = designs.design_points(_scenario(tmp_path / "1", write_scenario, method, 4))
    longer = designs.design_points(_scenario(tmp_path / "2", write_scenario, method, 16))
    assert short is not None and longer is not None
    assert longer[:4] == short
    assert len(longer) == 16


@pytest.mark.parametrize("trials", [1, 7, 20])
def test_lhs_hits_every_stratum_once_per_dimension(tmp_path: Path, write_scenario: WriteScenario,
                                                   trials: int) -> None:
    points = designs.design_points(_scenario(tmp_path, write_scenario, "lhs", trials))
    assert points is not None and len(points) == trials
    for name in UNIT_PARAMS:
        strata = sorted(int(point[name] * trials) for point in points)
        assert strata == list(range(trials)), name


def test_sobol_is_balanced(tmp_path: Path, write_scenario: WriteScenario) -> None:
    points = designs.design_points(_scenario(tmp_path, write_scenario, "sobol", 16))
    assert points is not None
    for name in UNIT_PARAMS:
        assert sorted(int(point[name] * 4) for point in points) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_random_design_maps_through_the_space(tmp_path: Path, write_scenario: WriteScenario) -> None:
    parameters = {
        "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "units": {"type": "int", "low": 8, "high": 64, "step": 8},
        "epochs": {"type": "constant", "value": 2},
        "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
        "momentum": {"type": "float", "low": 0.0, "high": 0.9, "condition": {"opt": "sgd"}},
    }
    points = designs.design_points(_scenario(tmp_path, write_scenario, "monte_carlo", 30, parameters=parameters,
                                             drop=("parameters.x",)))
    assert points is not None
    for point in points:
        assert 1e-4 <= point["lr"] <= 1.0
        assert point["units"] in range(8, 65, 8)
        assert point["epochs"] == 2
        assert ("momentum" in point) == (point["opt"] == "sgd")
    assert {point["opt"] for point in points} == {"sgd", "adam"}


def test_model_methods_have_no_design(tmp_path: Path, write_scenario: WriteScenario) -> None:
    assert designs.design_points(_scenario(tmp_path, write_scenario, "tpe", 3)) is None


def test_grid_is_the_cartesian_product(tmp_path: Path, write_scenario: WriteScenario) -> None:
    parameters = {
        "a": {"type": "int", "low": 1, "high": 3},
        "b": {"type": "categorical", "choices": ["x", "y"]},
        "c": {"type": "constant", "value": 0},
    }
    scenario = _scenario(tmp_path, write_scenario, "grid", None, parameters=parameters)
    product = [{"a": a, "b": b, "c": 0} for a in (1, 2, 3) for b in ("x", "y")]
    assert designs.grid_points(scenario) == product
    points = designs.design_points(scenario)
    assert points is not None and sorted(points, key=repr) == sorted(product, key=repr)
    assert designs.total_trials(scenario) == 6


def test_grid_dedupes_inactive_conditionals(tmp_path: Path, write_scenario: WriteScenario) -> None:
    parameters = {
        "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
        "momentum": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.5, "condition": {"opt": "sgd"}},
        "nesterov": {"type": "categorical", "choices": [True, False], "condition": {"opt": "sgd"}},
    }
    points = designs.grid_points(_scenario(tmp_path, write_scenario, "grid", None, parameters=parameters))
    sgd = [{"opt": "sgd", "momentum": m, "nesterov": n} for m in (0.0, 0.5, 1.0) for n in (True, False)]
    assert points == sgd + [{"opt": "adam"}]


def _product_then_dedupe(scenario: Scenario) -> list[dict[str, Any]]:
    """The grid as it was first built: the whole Cartesian product, conditions applied, first copies kept."""
    params = scenario.parameters
    axes = [list(space.grid_values(name, p)) for name, p in params.items()]
    points: list[dict[str, Any]] = []
    for combo in itertools.product(*axes):
        point: dict[str, Any] = {}
        for name, value in zip(params, combo):
            if space.is_active(params[name], point):
                point[name] = value
        if point not in points:
            points.append(point)
    return points


def test_grid_keeps_the_order_of_the_deduplicated_product(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Nested, list and multi-parent conditions: the same points in the same order as the product gave."""
    parameters = {
        "opt": {"type": "categorical", "choices": ["sgd", "adam", "rms"]},
        "lr": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
        "sched": {"type": "categorical", "choices": ["none", "step"], "condition": {"opt": ["sgd", "rms"]}},
        "k": {"type": "constant", "value": 7, "condition": {"opt": "adam"}},
        "gamma": {"type": "int", "low": 1, "high": 3, "condition": {"sched": "step"}},
        "nesterov": {"type": "bool", "condition": {"opt": "sgd", "sched": "step"}},
        "units": {"type": "int", "low": 16, "high": 48, "step": 16},
    }
    scenario = _scenario(tmp_path, write_scenario, "grid", None, parameters=parameters)
    points = designs.grid_points(scenario)
    assert points == _product_then_dedupe(scenario)
    assert len(points) == 3 * 3 * (1 + 3 * 2) + 3 * 3 + 3 * 3 * (1 + 3)


@pytest.mark.parametrize(("parameters", "message"), [
    ({"x": {"type": "int", "low": 0, "high": 100_000_000}},
     ("parameters.x: a grid over x (100,000,001 values) has more than the 1,000,000 points a grid design may have; "
      "give it a larger step or fewer choices, or use method monte_carlo, sobol or lhs")),
    ({"a": {"type": "categorical", "choices": ["p", "q"]}, "x": {"type": "int", "low": 0, "high": 9999},
      "y": {"type": "float", "low": 0, "high": 1999.8, "step": 0.2}},
     ("parameters: a grid over x (10,000 values) × y (10,000 values) has more than the 1,000,000 points a grid "
      "design may have; give them larger steps or fewer choices, or use method monte_carlo, sobol or lhs")),
])
def test_a_grid_too_large_to_list_is_refused_at_once(tmp_path: Path, write_scenario: WriteScenario,
                                                     parameters: dict[str, Any], message: str) -> None:
    """However few trials it runs: the grid is listed before a subset of it is taken."""
    scenario = _scenario(tmp_path, write_scenario, "grid", 3, parameters=parameters)
    started = time.monotonic()
    with pytest.raises(InputError) as info:
        designs.design_points(scenario)
    assert str(info.value) == message
    assert time.monotonic() - started < 20


def test_a_conditional_grid_counts_its_points_not_its_product(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Parameters of exclusive branches multiply the product (4,000,000 here) but not the points (3,000)."""
    parameters = {
        "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
        "x": {"type": "int", "low": 0, "high": 1999, "condition": {"opt": "sgd"}},
        "y": {"type": "int", "low": 0, "high": 999, "condition": {"opt": "adam"}},
    }
    points = designs.design_points(_scenario(tmp_path, write_scenario, "grid", 5, parameters=parameters))
    assert points is not None and len(points) == 5
    whole = designs.grid_points(_scenario(tmp_path, write_scenario, "grid", None, parameters=parameters))
    assert whole[:2] == [{"opt": "sgd", "x": 0}, {"opt": "sgd", "x": 1}] and len(whole) == 3000


@pytest.mark.parametrize(("trials", "expected"), [(None, 4), (2, 2), (4, 4)])
def test_grid_trials_take_a_prefix_of_the_seeded_order(tmp_path: Path, write_scenario: WriteScenario,
                                                       trials: int | None, expected: int) -> None:
    parameters = {"a": {"type": "int", "low": 0, "high": 3}}
    scenario = _scenario(tmp_path, write_scenario, "grid", trials, parameters=parameters)
    points = designs.design_points(scenario)
    assert points == designs.grid_order(scenario)[:expected]
    assert [designs.grid_points(scenario)[n] for n in designs.design_numbers(scenario) or ()] == points
    assert sorted(point["a"] for point in designs.grid_order(scenario)) == [0, 1, 2, 3]
    assert designs.total_trials(scenario) == expected


GRID_56 = {  # the tester's grid: 7 x 4 x 2 points
    "x": {"type": "float", "low": -3, "high": 3, "step": 1},
    "y": {"type": "float", "low": -4, "high": 2, "step": 2},
    "kind": {"type": "categorical", "choices": ["a", "b"]},
}


def test_grid_below_its_size_spreads_over_the_grid(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Four of 56 points are a random subset, not the corner x=-3, y=-4 that the product starts with."""
    four = designs.design_points(_scenario(tmp_path / "1", write_scenario, "grid", 4, parameters=GRID_56))
    assert four is not None and len(four) == 4
    assert len({repr(point) for point in four}) == 4
    assert len({point["x"] for point in four}) > 1 and len({point["y"] for point in four}) > 1
    whole = designs.grid_points(_scenario(tmp_path / "1", write_scenario, "grid", 4, parameters=GRID_56))
    assert all(point in whole for point in four)


def test_grid_order_is_seeded_and_raising_trials_extends_it(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Resuming with more trials, or with none (the whole grid), runs on along the same sequence."""
    def points(folder: str, trials: int | None, seed: int = 1) -> list[dict[str, Any]]:
        found = designs.design_points(_scenario(tmp_path / folder, write_scenario, "grid", trials, seed=seed,
                                                parameters=GRID_56))
        assert found is not None
        return found

    four, ten, whole = points("4", 4), points("10", 10), points("all", None)
    assert ten[:4] == four and whole[:10] == ten and len(whole) == 56
    assert sorted(map(repr, whole)) == sorted(map(repr, designs.grid_points(
        _scenario(tmp_path / "all", write_scenario, "grid", None, parameters=GRID_56))))
    assert points("again", 4) == four
    assert points("other", 4, seed=2) != four


def test_grid_needs_steps_and_enough_points(tmp_path: Path, write_scenario: WriteScenario) -> None:
    with pytest.raises(InputError, match="parameters.a: method grid needs a step"):
        designs.design_points(_scenario(tmp_path / "1", write_scenario, "grid", None))
    scenario = _scenario(tmp_path / "2", write_scenario, "grid", 9, parameters={"a": {"type": "int", "low": 0,
                                                                                        "high": 1}})
    with pytest.raises(InputError, match="search.trials: 9 trials exceed the 2 points of the grid design"):
        designs.design_points(scenario)


CSV_PARAMETERS = {
    "lr": {"type": "float", "low": 0.0, "high": 1.0},
    "units": {"type": "int", "low": 1, "high": 100},
    "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
    "momentum": {"type": "float", "low": 0.0, "high": 1.0, "condition": {"opt": "sgd"}},
    "epochs": {"type": "constant", "value": 3},
}


def _csv_scenario(tmp_path: Path, write_scenario: WriteScenario, text: str, trials: int | None = None) -> Scenario:
    """Load a csv-method scenario over :data:`CSV_PARAMETERS` whose design.csv holds ``text``."""
    path = write_scenario(tmp_path, drop=("parameters.x", "parameters.opt"), parameters=CSV_PARAMETERS,
                          search={"method": "csv", "csv": "design.csv", "trials": trials},
                          files={"design.csv": text})
    return load_scenario(path)


def test_csv_rows_become_points(tmp_path: Path, write_scenario: WriteScenario) -> None:
    text = "lr,units,opt,momentum\n0.1,10,sgd,0.9\n 0.2 , 20 ,adam,\n\n0.3,30.0,sgd,0\n"
    scenario = _csv_scenario(tmp_path, write_scenario, text)
    points = designs.design_points(scenario)
    assert points == [
        {"lr": 0.1, "units": 10, "opt": "sgd", "momentum": 0.9, "epochs": 3},
        {"lr": 0.2, "units": 20, "opt": "adam", "epochs": 3},
        {"lr": 0.3, "units": 30, "opt": "sgd", "momentum": 0.0, "epochs": 3},
    ]
    assert all(type(point["units"]) is int for point in points)
    assert designs.total_trials(scenario) == 3


def test_csv_columns_in_any_order_with_constant(tmp_path: Path, write_scenario: WriteScenario) -> None:
    text = "epochs,opt,units,lr,momentum\n3,adam,5,0.5,\n"
    points = designs.design_points(_csv_scenario(tmp_path, write_scenario, text))
    assert points == [{"lr": 0.5, "units": 5, "opt": "adam", "epochs": 3}]


def test_csv_trials_take_the_first_rows(tmp_path: Path, write_scenario: WriteScenario) -> None:
    text = "lr,units,opt,momentum\n0.1,1,adam,\n0.2,2,adam,\n0.3,3,adam,\n"
    points = designs.design_points(_csv_scenario(tmp_path, write_scenario, text, trials=2))
    assert [point["units"] for point in points or []] == [1, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "design.csv: the design CSV is empty"),
        ("lr,units,opt,momentum\n", "design.csv: the design CSV has a header but no rows"),
        ("lr,units,opt,momentum,zz\n0.1,1,sgd,0,1\n", "design.csv: column zz is not a parameter"),
        ("lr,units,momentum\n0.1,1,0\n", "design.csv: no column for parameter opt"),
        ("lr,lr,units,opt,momentum\n0.1,0.1,1,sgd,0\n", "design.csv: column lr appears twice in the header"),
        ("lr,units,opt,momentum\n0.1,1,sgd,0\n0.1,1\n", "design.csv line 3: 2 values for 4 columns"),
        ("lr,units,opt,momentum\n0.1,1,sgd,0\n0.1\n", "design.csv line 3: 1 value for 4 columns"),
        ("lr,units,opt,momentum\n1.5,1,sgd,0\n", "design.csv line 2, column lr: 1.5 is outside [0, 1]"),
        ("lr,units,opt,momentum\n0.1,x,sgd,0\n", "design.csv line 2, column units: 'x' is not a number"),
        ("lr,units,opt,momentum\n0.1,2.5,sgd,0\n", "column units: '2.5' is not a whole number"),
        ("lr,units,opt,momentum\n0.1,1,lbfgs,0\n", "column opt: 'lbfgs' is not one of sgd, adam"),
        ("lr,units,opt,momentum\n0.1,1,sgd,\n", "design.csv line 2, column momentum: '' is not a number"),
        ("lr,units,opt,momentum\n0.1,1,adam,0.5\n", ("design.csv line 2, column momentum: 0.5 given, but "
                                                      "momentum is active only when opt is sgd (this row has "
                                                      "opt=adam); leave the cell empty")),
        ("lr,units,opt,momentum\n\n0.1,1,sgd,0\n\n0.1,x,sgd,0\n", "design.csv line 5, column units: 'x' is not"),
        ('lr,units,opt,momentum\n"0.1\n",1,sgd,0\n0.1,x,sgd,0\n', "design.csv line 4, column units: 'x' is not"),
    ],
)
def test_csv_errors_name_file_line_and_column(tmp_path: Path, write_scenario: WriteScenario, text: str,
                                              message: str) -> None:
    scenario = _csv_scenario(tmp_path, write_scenario, text)
    with pytest.raises(InputError) as info:
        designs.design_points(scenario)
    assert message in str(info.value)


def test_csv_cells_a_spreadsheet_rewrote_are_read_as_the_values_meant(tmp_path: Path,
                                                                    write_scenario: WriteScenario) -> None:
    """A number choice written another way matches it; a value next to a step runs on the step."""
    parameters = {"width": {"type": "categorical", "choices": [1, 2.5, -3]},
                  "drop": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.25}}
    path = write_scenario(tmp_path, drop=("parameters.x", "parameters.opt"), parameters=parameters,
                          search={"method": "csv", "csv": "design.csv", "trials": None},
                          files={"design.csv": "width,drop\n1.0,0.25000001\n2.50,0.5\n-3e0,1\n"})
    assert designs.design_points(load_scenario(path)) == [{"width": 1, "drop": 0.25}, {"width": 2.5, "drop": 0.5},
                                                         {"width": -3, "drop": 1.0}]


def test_csv_value_for_a_parameter_whose_condition_does_not_hold(tmp_path: Path,
                                                                  write_scenario: WriteScenario) -> None:
    parameters = {"opt": {"type": "categorical", "choices": ["sgd", "rms", "adam"]},
                  "nesterov": {"type": "bool", "condition": {"opt": "sgd"}},
                  "momentum": {"type": "float", "low": 0.0, "high": 1.0,
                               "condition": {"opt": ["sgd", "rms"], "nesterov": True}}}
    path = write_scenario(tmp_path, drop=("parameters.x", "parameters.opt"), parameters=parameters,
                          search={"method": "csv", "csv": "design.csv", "trials": None},
                          files={"design.csv": "opt,nesterov,momentum\nsgd,true,0.9\nrms,,0.9\n"})
    with pytest.raises(InputError) as info:
        designs.design_points(load_scenario(path))
    assert str(info.value) == ("design.csv line 3, column momentum: 0.9 given, but momentum is active only when opt "
                               "is sgd or rms and nesterov is True (this row has opt=rms, no nesterov); leave the "
                               "cell empty")


def test_csv_missing_file_and_too_many_trials(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = _csv_scenario(tmp_path / "1", write_scenario, "lr,units,opt,momentum\n0.1,1,adam,\n", trials=3)
    with pytest.raises(InputError, match="search.trials: 3 trials exceed the 1 point of the csv design"):
        designs.design_points(scenario)
    scenario = _csv_scenario(tmp_path / "2", write_scenario, "")
    (tmp_path / "2" / "design.csv").unlink()
    with pytest.raises(InputError, match="search.csv: design file .*design.csv not found"):
        designs.design_points(scenario)


def test_a_folder_for_the_design_csv_is_called_a_folder(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = _csv_scenario(tmp_path, write_scenario, "")
    csv_path = tmp_path / "design.csv"
    csv_path.unlink()
    csv_path.mkdir()
    with pytest.raises(InputError) as info:
        designs.design_points(scenario)
    assert str(info.value) == f"search.csv: {csv_path.resolve()} is a folder; name the design CSV in it"


def test_csv_with_a_byte_order_mark(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Excel's "CSV UTF-8" starts with a BOM; the header's first name is read without it."""
    scenario = _csv_scenario(tmp_path, write_scenario, "")
    text = "lr,units,opt,momentum\n0.1,10,adam,\n"
    (tmp_path / "design.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert designs.design_points(scenario) == [{"lr": 0.1, "units": 10, "opt": "adam", "epochs": 3}]


def test_csv_in_another_encoding_is_refused(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = _csv_scenario(tmp_path, write_scenario, "")
    text = "lr,units,opt,momentum\n0.1,10,adam,\n0.2,20,adam,\u00e9\n"
    (tmp_path / "design.csv").write_bytes(b"\xef\xbb\xbf" + text.encode("latin-1"))
    with pytest.raises(InputError, match=r"design.csv line 3: not UTF-8 text \(byte 0xe9\); save it as CSV UTF-8"):
        designs.design_points(scenario)


def test_total_trials_uses_search_trials(tmp_path: Path, write_scenario: WriteScenario) -> None:
    assert designs.total_trials(_scenario(tmp_path, write_scenario, "smac", 12)) == 12


def test_a_grid_resumed_in_another_order_runs_each_point_once(
        tmp_path: Path, write_scenario: WriteScenario,
        run_cli: Callable[..., Any]) -> None:
    """A study begun under one order (another seed; a study begun when grids ran in their
    natural order) goes on with the points not yet run, whatever their place in this order."""
    parameters = {"a": {"type": "int", "low": 0, "high": 5}, "kind": {"type": "categorical", "choices": ["p", "q"]}}
    path = write_scenario(tmp_path, drop=("parameters.x", "parameters.opt"), parameters=parameters,
                          search={"method": "grid", "trials": 5, "seed": 1},
                          template_text="print('val_error={{ a }}')\n")
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    path.write_text(path.read_text().replace("seed: 1", "seed: 2").replace("trials: 5", "trials: 12"))
    resumed = run_cli("run", path, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    exported = run_cli("export", path, cwd=tmp_path)
    ran = [tuple(line.split(",")[2:4]) for line in exported.stdout.splitlines()[1:]]
    assert sorted(ran) == sorted((str(a), kind) for a in range(6) for kind in "pq")
