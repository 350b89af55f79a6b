"""The benchmark's test functions reach their stated optimum at their known minimizers, and no
random point of their space goes below it (bench/functions.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from bench.functions import FUNCTIONS


def _unit(point: list[float]) -> dict[str, Any]:
    """``x0``, ``x1``, ... set to ``point``."""
    return {f"x{i}": value for i, value in enumerate(point)}


MINIMIZERS: dict[str, list[dict[str, Any]]] = {
    "branin": [{"x1": -math.pi, "x2": 12.275}, {"x1": math.pi, "x2": 2.275}, {"x1": 9.42478, "x2": 2.475}],
    "hartmann3": [_unit([0.114614, 0.555649, 0.852547])],
    "hartmann6": [_unit([0.20169, 0.150011, 0.476874, 0.275332, 0.311652, 0.6573])],
    "rosenbrock4": [_unit([1.0] * 4)],
    "ackley5": [_unit([0.0] * 5)],
    "ackley10": [_unit([0.0] * 10)],
    "levy4": [_unit([1.0] * 4)],
    "levy10": [_unit([1.0] * 10)],
    "rosenbrock8": [_unit([1.0] * 8)],
    "styblinski8": [_unit([-2.903534048514011] * 8)],
    "rastrigin8": [_unit([0.0] * 8)],
    "michalewicz10": [_unit([2.202906, 1.570796, 1.284992, 1.923058, 1.72047, 1.570796, 1.454414, 1.756087,
                             1.655717, 1.570796])],
    "hartmann6in8": [_unit([0.20169, 0.150011, 0.476874, 0.275332, 0.311652, 0.6573, 0.0, 1.0])],
    "branin20": [{**_unit([0.5] * 20), "x3": (math.pi + 5) / 15, "x11": 2.275 / 15}],
}


@pytest.mark.parametrize("name", sorted(MINIMIZERS))
def test_a_function_reaches_its_optimum_at_its_minimizers_and_nowhere_lower(name: str) -> None:
    function = FUNCTIONS[name]
    assert function.optimum is not None
    for point in MINIMIZERS[name]:
        assert set(point) == set(function.params)
        assert function.objective(point) == pytest.approx(function.optimum, abs=1e-5)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        point = {key: rng.uniform(param.low, param.high) for key, param in function.params.items()}
        assert function.objective(point) >= function.optimum - 1e-9
