"""A design edited between runs: the point a trial ran from (its ``design_index``) must stay as
it was, so every point runs exactly once; rows appended at the end run, and only they."""
from __future__ import annotations

import csv
import io
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpo.outcome import Outcome
from hpo.rows import TrialRow
from hpo.scenario import Scenario, load_scenario
from hpo.spacecheck import design_change

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]

PARAMETERS = {
    "x": {"type": "float", "low": 0.0, "high": 1.0},
    "y": {"type": "int", "low": 1, "high": 10},
    "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
    "mom": {"type": "float", "low": 0.0, "high": 1.0, "condition": {"opt": "sgd"}},
    "epochs": {"type": "constant", "value": 3},
}
HEADER = "x,y,opt,mom\n"
RAN = "0.1,1,sgd,0.5\n0.2,2,adam,\n"
HOW = "rows already run must stay as they were: add new rows at the end, or start a new study with another name"
GRID_HOW = ("so points would run twice or never; give the parameters the values the study ran with, or start a new "
            "study with another name")


def _csv_scenario(folder: Path, write_scenario: WriteScenario, text: str, trials: int | None = None) -> Path:
    """A csv-method scenario over :data:`PARAMETERS` whose design.csv holds ``text``."""
    return write_scenario(folder, drop=("parameters.x", "parameters.opt"), parameters=PARAMETERS,
                          search={"method": "csv", "csv": "design.csv", "trials": trials, "seed": 1},
                          files={"design.csv": text})


def _row(number: int, index: int | None, **params: Any) -> TrialRow:
    """A completed trial that ran ``params`` from design point ``index``."""
    return TrialRow(number, Outcome.COMPLETE, {**params, "epochs": 3}, 0.5, {}, 1.0, f"trial-{number:04d}", "",
                    design_index=index)


RAN_ROWS = [_row(0, 0, x=0.1, y=1, opt="sgd", mom=0.5), _row(1, 1, x=0.2, y=2, opt="adam")]


@pytest.mark.parametrize(("text", "problem"), [
    pytest.param(HEADER + RAN, None, id="unchanged"),
    pytest.param(HEADER + RAN + "0.3,3,sgd,0.7\n", None, id="row-appended"),
    pytest.param(HEADER + "\n0.10,1.0,sgd,5e-1\n 0.2 ,2, adam , \n", None, id="same-values-written-another-way"),
    pytest.param("opt,mom,y,x,epochs\nsgd,0.5,1,0.1,3\nadam,,2,0.2,3\n", None, id="columns-reordered"),
    pytest.param(HEADER + "0.9,9,adam,\n" + RAN,
                 f"design.csv line 2: the row now says x=0.9 y=9 opt=adam, but trial 0 ran x=0.1 y=1 opt=sgd mom=0.5 "
                 f"from it; {HOW}", id="row-inserted-first"),
    pytest.param(HEADER + "0.1,1,sgd,0.5\n\n0.2,3,adam,\n",
                 f"design.csv line 4: the row now says x=0.2 y=3 opt=adam, but trial 1 ran x=0.2 y=2 opt=adam "
                 f"from it; {HOW}", id="int-edited-after-a-blank-line"),
    pytest.param(HEADER + "0.1,1,sgd,0.25\n0.2,2,adam,\n",
                 f"design.csv line 2: the row now says x=0.1 y=1 opt=sgd mom=0.25, but trial 0 ran x=0.1 y=1 opt=sgd "
                 f"mom=0.5 from it; {HOW}", id="conditional-edited"),
    pytest.param(HEADER + "0.1,1,adam,\n0.2,2,adam,\n",
                 f"design.csv line 2: the row now says x=0.1 y=1 opt=adam, but trial 0 ran x=0.1 y=1 opt=sgd mom=0.5 "
                 f"from it; {HOW}", id="categorical-edited"),
    pytest.param(HEADER + "0.1000001,1,sgd,0.5\n0.2,2,adam,\n",
                 f"design.csv line 2: the row now says x=0.1000001 y=1 opt=sgd mom=0.5, but trial 0 ran x=0.1 y=1 "
                 f"opt=sgd mom=0.5 from it; {HOW}", id="float-edited-slightly"),
    pytest.param(HEADER + "0.1,1,sgd,0.5\n",
                 f"design.csv: trial 1 ran x=0.2 y=2 opt=adam from data row 2, but the file's rows now end at data "
                 f"row 1; {HOW}", id="row-run-removed"),
])
def test_csv_design_change(tmp_path: Path, write_scenario: WriteScenario, text: str, problem: str | None) -> None:
    scenario = load_scenario(_csv_scenario(tmp_path, write_scenario, text))
    assert design_change(scenario, RAN_ROWS) == problem


def test_replicate_rows_are_points_of_their_own(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Rows may repeat a point: each is run once, and matched by its place, not its values."""
    scenario = load_scenario(_csv_scenario(tmp_path, write_scenario, HEADER + "0.2,2,adam,\n" * 3))
    ran = [_row(number, number, x=0.2, y=2, opt="adam") for number in range(2)]
    assert design_change(scenario, ran) is None


def test_trials_of_no_design_point_and_unstarted_copies_are_not_compared(tmp_path: Path,
                                                                         write_scenario: WriteScenario) -> None:
    scenario = load_scenario(_csv_scenario(tmp_path, write_scenario, HEADER + "0.9,9,adam,\n"))
    rerun = _row(3, None, x=0.1, y=1, opt="sgd", mom=0.5)
    queued = TrialRow(4, Outcome.WAITING, {"epochs": 3}, None, {}, None, "", "", design_index=0)
    assert design_change(scenario, [rerun, queued]) is None


def _grid(folder: Path, write_scenario: WriteScenario, low: int, method: str = "grid", seed: int = 1) -> Scenario:
    parameters = {"a": {"type": "int", "low": low, "high": 4}, "kind": {"type": "categorical", "choices": ["p", "q"]}}
    return load_scenario(write_scenario(folder, drop=("parameters.x", "parameters.opt"), parameters=parameters,
                                        search={"method": method, "trials": 2, "seed": seed}))


def test_a_widened_grid_renumbers_its_points(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The space check allows a widened range; a grid's points are numbered in the grid's
    natural order, which the widening shifts, so the grid is refused."""
    ran = [_row(0, 2, a=2, kind="p"), _row(1, 5, a=3, kind="q")]
    assert design_change(_grid(tmp_path / "same", write_scenario, 1, seed=7), ran) is None
    assert design_change(_grid(tmp_path / "wide", write_scenario, 0), ran) == (
        f"parameters.a: the grid changed: its point 2 is now a=1 kind=p, but trial 0 ran a=2 kind=p as that point, "
        f"{GRID_HOW}")


@pytest.mark.parametrize("method", ["monte_carlo", "sobol", "lhs"])
def test_random_designs_are_not_compared(tmp_path: Path, write_scenario: WriteScenario, method: str) -> None:
    """A widened range maps the same unit points elsewhere: sound, as the space check says."""
    ran = [_row(0, 0, a=2, kind="p"), _row(1, 1, a=3, kind="q")]
    assert design_change(_grid(tmp_path, write_scenario, 0, method=method), ran) is None


def _assert_refused(result: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit 2 and exactly the one line ``error: message``, no traceback."""
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n"), (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout


def _exported(run_cli: RunCli, path: Path) -> list[tuple[str, ...]]:
    """The (number, state, x, y, opt, mom) of every trial, from ``hpo export``."""
    done = run_cli("export", path, cwd=path.parent)
    assert done.returncode == 0, done.stderr
    return [tuple(row[name] for name in ("number", "state", "x", "y", "opt", "mom"))
            for row in csv.DictReader(io.StringIO(done.stdout))]


def test_a_row_inserted_before_rows_run_is_refused_by_run_worker_and_validate(
        tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    """The user's case: two rows ran, a new first row was inserted; nothing more runs."""
    path = _csv_scenario(tmp_path, write_scenario, HEADER + RAN + "0.3,3,sgd,0.7\n", trials=2)
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    before = _exported(run_cli, path)
    assert [row[2:] for row in before] == [("0.1", "1", "sgd", "0.5"), ("0.2", "2", "adam", "")]
    _csv_scenario(tmp_path, write_scenario, HEADER + "0.9,9,adam,\n" + RAN + "0.3,3,sgd,0.7\n")
    message = (f"design.csv line 2: the row now says x=0.9 y=9 opt=adam, but trial 0 ran x=0.1 y=1 opt=sgd mom=0.5 "
               f"from it; {HOW}")
    for command in ("validate", "run", "worker"):
        _assert_refused(run_cli(command, path, cwd=tmp_path), message)
    assert _exported(run_cli, path) == before


def test_a_row_run_and_edited_in_place_is_refused(tmp_path: Path, write_scenario: WriteScenario,
                                                  run_cli: RunCli) -> None:
    path = _csv_scenario(tmp_path, write_scenario, HEADER + RAN)
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    (tmp_path / "design.csv").write_text(HEADER + "0.1,1,sgd,0.5\n0.2,2,sgd,0.5\n")
    _assert_refused(run_cli("run", path, cwd=tmp_path),
                    f"design.csv line 3: the row now says x=0.2 y=2 opt=sgd mom=0.5, but trial 1 ran x=0.2 y=2 "
                    f"opt=adam from it; {HOW}")


def test_rows_appended_run_and_only_they(tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    """Rows repeat a point (replicates) and are rewritten without changing a value; the
    appended rows run, each row once."""
    path = _csv_scenario(tmp_path, write_scenario, HEADER + RAN + RAN, trials=3)
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    _csv_scenario(tmp_path, write_scenario, HEADER + "0.10,1,sgd,5e-1\n0.2,2.0,adam,\n" + RAN + "\n0.3,3,sgd,0.7\n")
    resumed = run_cli("run", path, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert _exported(run_cli, path) == [
        ("0", "COMPLETE", "0.1", "1", "sgd", "0.5"), ("1", "COMPLETE", "0.2", "2", "adam", ""),
        ("2", "COMPLETE", "0.1", "1", "sgd", "0.5"), ("3", "COMPLETE", "0.2", "2", "adam", ""),
        ("4", "COMPLETE", "0.3", "3", "sgd", "0.7")]


def test_a_value_for_an_inactive_parameter_is_refused(tmp_path: Path, write_scenario: WriteScenario,
                                                      run_cli: RunCli) -> None:
    path = _csv_scenario(tmp_path, write_scenario, HEADER + "0.1,1,sgd,0.5\n0.2,2,adam,0.3\n")
    _assert_refused(run_cli("validate", path, cwd=tmp_path),
                    "design.csv line 3, column mom: 0.3 given, but mom is active only when opt is sgd "
                    "(this row has opt=adam); leave the cell empty")


def test_a_widened_grid_is_refused(tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    path = write_scenario(tmp_path, drop=("parameters.opt",), parameters={"x": {"type": "float", "low": 0.2,
                                                                                "high": 0.8, "step": 0.2}},
                          search={"method": "grid", "trials": 2, "seed": 1})
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    path.write_text(path.read_text().replace("low: 0.2", "low: 0.0").replace("trials: 2", "trials: 5"))
    refused = run_cli("run", path, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: scenario.yaml: parameters.x: the grid changed: its point ")
    assert refused.stderr.endswith(f", {GRID_HOW}\n")
