"""Resuming a study whose search space changed: which changes are refused, which are sound."""
from __future__ import annotations

from typing import Any

import pytest

from hpo.scenario import Param
from hpo.space import describe
from hpo.spacecheck import space_change

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
