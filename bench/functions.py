"""Test functions for the optimizer benchmark: a search space spec plus an objective.

Each :class:`TestFunction` describes its space once (:class:`Param` rows, in suggestion
order, a conditional row naming its parent and the parent values that activate it) and
turns it into a ConfigSpace space (for SMAC3 and ``ForestSampler``) or define-by-run
Optuna suggestions (for every Optuna sampler). Objectives are minimized; ``optimum`` is the
known global minimum, or ``None`` for a real tuning task.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import optuna
from ConfigSpace import (
    CategoricalHyperparameter,
    ConfigurationSpace,
    Constant,
    InCondition,
    UniformFloatHyperparameter,
    UniformIntegerHyperparameter,
)


@dataclass(frozen=True)
class Param:
    """One parameter: ``kind`` is float, int, categorical or constant."""

    name: str
    kind: str
    low: float = 0.0
    high: float = 1.0
    log: bool = False
    choices: tuple[Any, ...] = ()
    parent: str | None = None
    parent_values: tuple[Any, ...] = ()


@dataclass(frozen=True)
class TestFunction:
    """A named objective over a parameter spec, to be minimized."""

    name: str
    params: tuple[Param, ...]
    objective: Callable[[dict[str, Any]], float]
    optimum: float | None = None
    tags: tuple[str, ...] = field(default=())

    def config_space(self, seed: int | None = None) -> ConfigurationSpace:
        """The ConfigSpace equivalent of ``params`` (names and values identical)."""
        cs = ConfigurationSpace(seed=seed)
        for p in self.params:
            cs.add(_hyperparameter(p))
        for p in self.params:
            if p.parent is not None:
                cs.add(InCondition(cs[p.name], cs[p.parent], list(p.parent_values)))
        return cs

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Suggest every active parameter on ``trial`` in spec order; returns the values."""
        values: dict[str, Any] = {}
        for p in self.params:
            if p.parent is not None and values.get(p.parent, _INACTIVE) not in p.parent_values:
                continue
            if p.kind == "float":
                values[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.log)
            elif p.kind == "int":
                values[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high), log=p.log)
            elif p.kind == "categorical":
                values[p.name] = trial.suggest_categorical(p.name, list(p.choices))
            else:
                values[p.name] = trial.suggest_categorical(p.name, [p.choices[0]])
        return values


_INACTIVE = object()


def _hyperparameter(p: Param) -> Any:
    if p.kind == "float":
        return UniformFloatHyperparameter(p.name, p.low, p.high, log=p.log)
    if p.kind == "int":
        return UniformIntegerHyperparameter(p.name, int(p.low), int(p.high), log=p.log)
    if p.kind == "categorical":
        return CategoricalHyperparameter(p.name, list(p.choices))
    return Constant(p.name, p.choices[0])


def _branin(v: dict[str, Any]) -> float:
    x1, x2 = v["x1"], v["x2"]
    b, c = 5.1 / (4 * math.pi**2), 5 / math.pi
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10


_H_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])
_H3_A = np.array([[3.0, 10, 30], [0.1, 10, 35], [3.0, 10, 30], [0.1, 10, 35]])
_H3_P = 1e-4 * np.array(
    [[3689, 1170, 2673], [4699, 4387, 7470], [1091, 8732, 5547], [381, 5743, 8828]]
)
_H6_A = np.array(
    [
        [10, 3, 17, 3.5, 1.7, 8],
        [0.05, 10, 17, 0.1, 8, 14],
        [3, 3.5, 1.7, 10, 17, 8],
        [17, 8, 0.05, 10, 0.1, 14],
    ]
)
_H6_P = 1e-4 * np.array(
    [
        [1312, 1696, 5569, 124, 8283, 5886],
        [2329, 4135, 8307, 3736, 1004, 9991],
        [2348, 1451, 3522, 2883, 3047, 6650],
        [4047, 8828, 8732, 5743, 1091, 381],
    ]
)


def _hartmann(a: np.ndarray, p: np.ndarray) -> Callable[[dict[str, Any]], float]:
    def f(v: dict[str, Any]) -> float:
        x = np.array([v[f"x{i}"] for i in range(a.shape[1])])
        return float(-np.sum(_H_ALPHA * np.exp(-np.sum(a * (x - p) ** 2, axis=1))))

    return f


def _rosenbrock(v: dict[str, Any]) -> float:
    x = np.array([v[f"x{i}"] for i in range(4)])
    return float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))


_ACTIVATION_PENALTY = {"relu": 0.0, "tanh": 0.3, "sigmoid": 1.0}


def _mixed(v: dict[str, Any]) -> float:
    """A network-tuning caricature, optimum 0 at lr 1e-3, 64 units, 3 layers, relu, dropout 0.3."""
    lr_term = (math.log10(v["lr"]) + 3) ** 2 / 4
    width_term = (math.log2(v["units"]) - 6) ** 2 / 8
    depth_term = (v["layers"] - 3) ** 2 / 4
    dropout_term = 4 * (v["dropout"] - 0.1 * v["layers"]) ** 2
    coupling = 0.5 * (1 - math.exp(-(math.log10(v["lr"]) + 3) ** 2)) * (v["layers"] > 4)
    return lr_term + width_term + depth_term + dropout_term + coupling + _ACTIVATION_PENALTY[v["act"]]


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))[:600]
    return x[order] / 16.0, y[order]


def _svm_error(v: dict[str, Any]) -> float:
    """3-fold cross-validated error of an SVM on 600 digits (deterministic)."""
    from sklearn.model_selection import cross_val_score
    from sklearn.svm import SVC

    x, y = _digits()
    model = SVC(
        C=v["C"], gamma=v["gamma"], kernel=v["kernel"], degree=v.get("degree", 3), coef0=v.get("coef0", 0.0)
    )
    return float(1.0 - cross_val_score(model, x, y, cv=3).mean())


def _unit_floats(n: int) -> tuple[Param, ...]:
    return tuple(Param(f"x{i}", "float", 0.0, 1.0) for i in range(n))


FUNCTIONS: dict[str, TestFunction] = {
    f.name: f
    for f in (
        TestFunction(
            "branin",
            (Param("x1", "float", -5.0, 10.0), Param("x2", "float", 0.0, 15.0)),
            _branin,
            0.397887357729739,
        ),
        TestFunction("hartmann3", _unit_floats(3), _hartmann(_H3_A, _H3_P), -3.86278214782076),
        TestFunction("hartmann6", _unit_floats(6), _hartmann(_H6_A, _H6_P), -3.32236801141551),
        TestFunction(
            "rosenbrock4",
            tuple(Param(f"x{i}", "float", -5.0, 10.0) for i in range(4)),
            _rosenbrock,
            0.0,
        ),
        TestFunction(
            "mixed",
            (
                Param("lr", "float", 1e-5, 1.0, log=True),
                Param("units", "int", 4, 1024, log=True),
                Param("layers", "int", 1, 8),
                Param("act", "categorical", choices=("relu", "tanh", "sigmoid")),
                Param("dropout", "float", 0.0, 0.9),
                Param("batch", "constant", choices=(32,)),
            ),
            _mixed,
            0.0,
        ),
        TestFunction(
            "svm_digits",
            (
                Param("kernel", "categorical", choices=("rbf", "poly", "sigmoid")),
                Param("C", "float", 1e-3, 1e4, log=True),
                Param("gamma", "float", 1e-5, 1e1, log=True),
                Param("degree", "int", 2, 5, parent="kernel", parent_values=("poly",)),
                Param("coef0", "float", 0.0, 1.0, parent="kernel", parent_values=("poly", "sigmoid")),
            ),
            _svm_error,
            None,
            tags=("real",),
        ),
    )
}
