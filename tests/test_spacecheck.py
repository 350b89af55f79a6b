"""Resuming a study whose search space changed: which changes are refused, which are sound."""
from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpo.scenario import Param, load_scenario
from hpo.space import describe, distributions
from hpo.spacecheck import resume_refusal, space_change, stored_change

BASE: dict[str, dict[str, Any]] = {
    "hidden": {"type": "int", "low": 16, "high": 256, "log": True},
    "lr": {"type": "float", "low": 1e-3, "high": 0.1},
    "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
    "momentum": {"type": "float", "low": 0.5, "high": 0.99, "condition": {"optimizer": "sgd"}},
    "epochs": {"type": "constant", "value": 10},
}


def space(**changes: Any) -> dict[str, dict[str, Any]]:
    """The described space of BASE with ``changes`` (None removes a parameter)."""
    params = {name: dict(spec) for name, spec in BASE.items()}
    for name, spec in changes.items():
        if spec is None:
            params.pop(name)
        else:
            params[name] = spec
    return describe({name: Param(**spec) for name, spec in params.items()})


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"lr": {"type": "float", "low": 1e-4, "high": 0.5}}, None),
    ({"optimizer": {"type": "categorical", "choices": ["sgd", "adam", "rmsprop"]}}, None),
    ({"hidden": None, "width": BASE["hidden"]}, ("parameters.hidden: the study's trials have this parameter, "
                                                 "the scenario no longer (renamed to width?)")),
    ({"hidden": None}, "parameters.hidden: the study's trials have this parameter, the scenario no longer"),
    ({"depth": {"type": "int", "low": 1, "high": 4}}, "parameters.depth: a new parameter"),
    ({"lr": {"type": "float", "low": 1e-3, "high": 0.05}}, "parameters.lr: the range [0.001, 0.1] was narrowed"),
    ({"lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}}, "parameters.lr: log changed"),
    ({"hidden": {"type": "float", "low": 16, "high": 256, "log": True}}, "parameters.hidden: type changed"),
    ({"optimizer": {"type": "categorical", "choices": ["adam"]}}, "parameters.optimizer: choice 'sgd' was removed"),
    ({"epochs": {"type": "constant", "value": 20}}, "parameters.epochs: value changed from 10 to 20"),
    ({"momentum": {"type": "float", "low": 0.5, "high": 0.99}}, "parameters.momentum: condition changed"),
])
def test_space_change(changes: dict[str, Any], problem: str | None) -> None:
    found = space_change(space(), space(**changes))
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)


def params(**changes: Any) -> dict[str, Param]:
    """The parameters of BASE with ``changes`` (None removes a parameter)."""
    specs = {name: dict(spec) for name, spec in BASE.items()} | changes
    return {name: Param(**spec) for name, spec in specs.items() if spec is not None}


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"lr": {"type": "float", "low": 1e-4, "high": 0.5, "step": 1e-4}}, None),
    ({"hidden": {"type": "int", "low": 1, "high": 1024, "log": True}}, None),
    ({"epochs": {"type": "constant", "value": 20}}, None),
    ({"optimizer": {"type": "constant", "value": "sgd"}}, None),
    ({"optimizer": {"type": "categorical", "choices": ["sgd", "adam", "rms"]}},
     "parameters.optimizer: choices changed from ['sgd', 'adam'] to ['sgd', 'adam', 'rms']"),
    ({"optimizer": {"type": "categorical", "choices": ["adam"]}},
     "parameters.optimizer: choices changed from ['sgd', 'adam'] to ['adam']"),
    ({"optimizer": {"type": "categorical", "choices": ["adam", "sgd"]}},
     "parameters.optimizer: choices changed from ['sgd', 'adam'] to ['adam', 'sgd']"),
    ({"optimizer": {"type": "bool"}}, "parameters.optimizer: choices changed from ['sgd', 'adam'] to [False, True]"),
    ({"hidden": {"type": "float", "low": 16, "high": 256, "log": True}},
     "parameters.hidden: type changed from 'int' to 'float'"),
    ({"lr": {"type": "int", "low": 0, "high": 1}}, "parameters.lr: type changed from 'float' to 'int'"),
    ({"lr": {"type": "categorical", "choices": [0.001, 0.1]}},
     "parameters.lr: type changed from 'float' to 'categorical'"),
    ({"lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}}, "parameters.lr: log changed from False to True"),
])
def test_stored_change_names_what_an_optuna_study_cannot_store(changes: dict[str, Any], problem: str | None) -> None:
    assert stored_change(distributions(params()), params(**changes)) == problem


def test_stored_change_leaves_parameters_no_trial_holds_to_space_change() -> None:
    stored = distributions(params())
    del stored["optimizer"]
    assert stored_change(stored, params(optimizer={"type": "categorical", "choices": ["rms"]})) is None
    assert stored_change({}, params(hidden={"type": "float", "low": 1, "high": 2})) is None


def test_removing_a_choice_no_longer_says_adding_one_is_allowed() -> None:
    found = space_change(space(), space(optimizer={"type": "categorical", "choices": ["adam"]}))
    assert found == "parameters.optimizer: choice 'sgd' was removed"


def test_resume_refusal_says_what_cannot_be_stored_first_and_reads_only_what_it_needs(
        tmp_path: Path, write_scenario: Callable[..., Path]) -> None:
    import optuna

    scenario = load_scenario(write_scenario(tmp_path))  # x in [0, 1], opt in [a, b]
    ran = optuna.trial.create_trial(params={"opt": "a"}, value=0.5,
                                    distributions={"opt": optuna.distributions.CategoricalDistribution(["a", "c"])})
    read: list[str] = []

    def recorded() -> dict[str, Any]:
        read.append("recorded")
        return describe({**scenario.parameters, "x": Param(type="float", low=0.0, high=2.0)})

    def rows() -> list[Any]:
        read.append("rows")
        return []

    stored = resume_refusal(scenario, [ran], recorded, rows, allow_space_change=True)
    assert stored is not None and stored.startswith("parameters.opt: choices changed from ['a', 'c'] to ['a', 'b']: ")
    assert stored.endswith("(--allow-space-change cannot override this)") and read == []
    assert resume_refusal(scenario, [], recorded, rows) == (
        "parameters.x: the range [0, 2] was narrowed to [0, 1] (widening is allowed): the study demo was run in another "
        "search space (resume with --allow-space-change to accept it, or use a new name)")
    assert read == ["recorded"]  # a Monte Carlo design's rows are not compared
    assert resume_refusal(scenario, [], recorded, rows, allow_space_change=True) is None
    assert resume_refusal(scenario, [], lambda: None, rows) is None  # nothing recorded yet: a new study


@pytest.mark.parametrize("method", ["monte_carlo", "tpe"])
def test_a_changed_choice_is_refused_before_the_study_is_touched(
        tmp_path: Path, write_scenario: Callable[..., Path], run_cli: Callable[..., Any], method: str) -> None:
    """Adding a choice crashed inside Optuna after the new space was recorded, which wedged
    the study and left a WAITING trial per attempt; the flag cannot make Optuna store it."""
    def write(choices: list[str], trials: int) -> Path:
        return write_scenario(tmp_path, parameters={"opt": {"choices": choices}},
                              search={"method": method, "trials": trials})

    old = write(["a", "b"], 2)
    assert run_cli("run", old).returncode == 0
    added = write(["a", "b", "c"], 3)
    expected = ("error: scenario.yaml: parameters.opt: choices changed from ['a', 'b'] to ['a', 'b', 'c']: the study "
                "demo stored its trials with the old distribution, which an Optuna study cannot change; use another "
                "name for a new study (--allow-space-change cannot override this)")
    for flags in ((), ("--allow-space-change",)):
        refused = run_cli("run", added, *flags)
        assert (refused.returncode, refused.stderr.strip()) == (2, expected)
    old = write(["a", "b"], 3)
    resumed = run_cli("run", old)
    assert resumed.returncode == 0, resumed.stderr
    rows = list(csv.DictReader(io.StringIO(run_cli("export", old).stdout)))
    assert [row["state"] for row in rows] == ["COMPLETE"] * 3 and all(row["opt"] in ("a", "b") for row in rows)


def test_a_study_whose_choices_yaml_now_reads_as_text_is_told_how_to_resume(
        tmp_path: Path, write_scenario: Callable[..., Path], run_cli: Callable[..., Any]) -> None:
    """A study begun while hpo read [yes, no] as true and false was refused on resume with
    'use another name for a new study', without a word on why its choices changed."""
    scenario = tmp_path / "scenario.yaml"
    write_scenario(tmp_path, parameters={"opt": {"choices": [True, False]}})
    assert run_cli("run", scenario).returncode == 0
    scenario.write_text(scenario.read_text().replace("- true\n    - false", "- yes\n    - no"))
    refused = run_cli("run", scenario)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.rstrip().endswith("; hpo now reads parameters as YAML 1.2 does (opt's choices yes, no are "
                                            "text): write [true, false] to resume the study"), refused.stderr


def test_a_csv_row_that_ran_before_its_cell_was_snapped_to_the_step_is_not_an_edit() -> None:
    """A cell 0.25000001 ran as itself before cells near a step were snapped; the design now
    reads 0.25, and resuming called the row edited."""
    from hpo.scenario import Param
    from hpo.spacecheck import _same
    stepped = Param(type="float", low=0.0, high=1.0, step=0.25)
    assert _same(stepped, 0.25, 0.25000001) and not _same(stepped, 0.25, 0.2501)
    assert not _same(Param(type="float", low=0.0, high=1.0), 0.25, 0.25000001)
