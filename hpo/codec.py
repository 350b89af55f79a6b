"""Configurations as rows of numbers: the encoding hpo's model-based optimizer works in.

A :class:`Codec` turns parameter dicts into rows and back, samples and perturbs rows, snaps
them onto legal values and applies the parameters' conditions. A row has one column per
searched parameter, in definition order: a number's position in its range (in log space where
log-scaled) in [0, 1], the same encoding as ConfigSpace's vectors; a categorical's choice index;
NaN where the parameter is inactive. Integers and stepped floats only take their grid's values.
Constants, and ranges with ``low == high``, have no column: they are not searched. It is built
from the scenario's parameters alone (no ConfigSpace), so a sweep starts without importing it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from hpo import space

if TYPE_CHECKING:  # a codec's copy in hpo.forest_service's helper must not import pydantic or Optuna
    from optuna.distributions import BaseDistribution

    from hpo.scenario import Param

INACTIVE = -1.0


def is_searched(param: Param) -> bool:
    """Whether the optimizer chooses the parameter's value (not a constant or a one-value range)."""
    return param.type == "categorical" or (param.type in ("int", "float") and param.low != param.high)


def _constant(param: Param) -> Any:
    if param.type == "constant":
        return param.value
    return int(param.low) if param.type == "int" else float(param.low)  # type: ignore[arg-type]


class Codec:
    """The row encoding of a scenario's parameters.

    Args:
        params: the parameters, in definition order (a parent before its conditional children).
    """

    def __init__(self, params: Mapping[str, Param]) -> None:
        self.params = dict(params)
        self.searched = [name for name, p in self.params.items() if is_searched(p)]
        self.dim = len(self.searched)
        self._p = [self.params[name] for name in self.searched]
        self.categorical = np.array([p.type == "categorical" for p in self._p], dtype=bool)
        self.numeric = ~self.categorical
        self._column = {name: j for j, name in enumerate(self.searched)}
        self._choice_index = [{c: i for i, c in enumerate(p.choices or ())} for p in self._p]
        self._steps = [space.grid_steps({"p": p}).get("p") for p in self._p]
        self._conditions = [(j, self._condition_of(p)) for j, p in enumerate(self._p) if p.condition]
        self.conditional = bool(self._conditions)
        # per column: the number of choices of an always active categorical of several, else 0
        self.unconditional_choices = [len(p.choices or ()) if p.type == "categorical" and not p.condition
                              and len(p.choices or ()) > 1 else 0 for p in self._p]

    def __reduce__(self) -> tuple[type[Codec], tuple[dict[str, SimpleNamespace]]]:
        """A codec pickles as a codec of its parameters' fields, plain data: the process that
        unpickles it (:mod:`hpo.forest_service`'s helper) needs neither pydantic nor
        :mod:`hpo.scenario`, and gets each parameter as a :class:`types.SimpleNamespace` of the
        same fields."""
        return Codec, ({name: SimpleNamespace(**vars(p)) for name, p in self.params.items()},)

    def _condition_of(self, param: Param) -> list[tuple[int, list[int]]]:
        """(parent column, allowed choice indices) of each of a parameter's conditions."""
        out = []
        for parent, wanted in (param.condition or {}).items():
            allowed = wanted if isinstance(wanted, list) else [wanted]
            index = self._choice_index[self._column[parent]] if parent in self._column else {}
            out.append((self._column.get(parent, -1), [index[w] for w in allowed if w in index]))
        return out

    def features(self, x: np.ndarray) -> np.ndarray:
        """Model inputs for rows ``x``: inactive values as -1."""
        return impute(x)

    def encode(self, params: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Rows for parameter dicts; values outside the space become NaN (or are clipped)."""
        x = np.full((len(params), self.dim), np.nan)
        for j, name in enumerate(self.searched):
            rows = [i for i, p in enumerate(params) if name in p]
            if not rows:
                continue
            if self.categorical[j]:
                index = self._choice_index[j]
                x[rows, j] = [index.get(params[i][name], np.nan) for i in rows]
            else:
                values = np.array([_number(params[i][name]) for i in rows])
                x[rows, j] = np.clip(self._to_unit(j, values), 0.0, 1.0)
        return self.with_conditions(x)

    def decode(self, row: np.ndarray) -> dict[str, Any]:
        """The active values of one row (constants included), in definition order."""
        values: dict[str, Any] = {}
        for name, p in self.params.items():
            j = self._column.get(name)
            if j is None:
                if space.is_active(p, values):
                    values[name] = _constant(p)
            elif not math.isnan(row[j]):
                if self.categorical[j]:
                    values[name] = (p.choices or ())[int(row[j])]
                else:
                    value = self._from_unit(j, np.array([row[j]]))
                    if self._steps[j] is not None or p.type == "int":
                        value = self._snap(j, value)
                    number = float(value[0])
                    values[name] = round(number) if p.type == "int" else (
                        round(number, 12) if self._steps[j] is not None else number)
        return values

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of the searched parameters."""
        every = space.distributions(self.params)
        return {name: every[name] for name in self.searched}

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` configurations drawn uniformly from the space."""
        return self.from_unit(rng.random((n, self.dim)))

    def from_unit(self, u: np.ndarray) -> np.ndarray:
        """Configurations for points of the unit cube (one column per searched parameter)."""
        x = u.copy()
        for j in np.flatnonzero(self.categorical):
            count = len(self._p[j].choices or ())
            x[:, j] = np.minimum(np.floor(u[:, j] * count), count - 1)
        return self.canonical(x)

    def canonical(self, x: np.ndarray) -> np.ndarray:
        """Rows snapped onto legal values (integers and stepped values on their grid), conditions applied."""
        x = x.copy()
        for j in np.flatnonzero(self.numeric):
            col = np.clip(np.where(np.isnan(x[:, j]), 0.5, x[:, j]), 0.0, 1.0)
            if self._steps[j] is not None or self._p[j].type == "int":
                col = np.clip(self._to_unit(j, self._snap(j, self._from_unit(j, col))), 0.0, 1.0)
            x[:, j] = col
        return self.with_conditions(x)

    def _to_unit(self, j: int, values: np.ndarray) -> np.ndarray:
        p = self._p[j]
        low, high = float(p.low), float(p.high)  # type: ignore[arg-type]
        if p.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                return (np.log(values) - math.log(low)) / (math.log(high) - math.log(low))
        return (values - low) / (high - low)

    def _from_unit(self, j: int, u: np.ndarray) -> np.ndarray:
        p = self._p[j]
        low, high = float(p.low), float(p.high)  # type: ignore[arg-type]
        if p.log:
            return np.exp(math.log(low) + u * (math.log(high) - math.log(low)))
        return low + u * (high - low)

    def _snap(self, j: int, values: np.ndarray) -> np.ndarray:
        p = self._p[j]
        step = self._steps[j]
        if step is None:
            return np.clip(np.round(values), p.low, p.high)
        low = float(p.low)  # type: ignore[arg-type]
        top = math.floor((float(p.high) - low) / step + 1e-9)  # type: ignore[arg-type]
        return low + np.clip(np.round((values - low) / step), 0, top) * step

    def with_conditions(self, x: np.ndarray) -> np.ndarray:
        """``x`` with inactive values set to NaN, parents before children."""
        for j, conditions in self._conditions:
            active = np.ones(len(x), dtype=bool)
            for parent, allowed in conditions:
                active &= np.isin(x[:, parent], allowed) if parent >= 0 else False
            x[~active, j] = np.nan
        return x

    def perturb(self, x: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
        """Neighbours of rows ``x``: Gaussian steps of std ``scale`` on the numeric values (all at
        once or one at a time), categoricals resampled now and then; inactive values are drawn
        afresh, so a neighbour that activates a branch gets values there."""
        n = len(x)
        filled = np.where(np.isnan(x), rng.random(x.shape), x)
        for j in np.flatnonzero(self.categorical):
            fresh = np.floor(rng.random(n) * len(self._p[j].choices or ()))
            filled[:, j] = np.where(np.isnan(x[:, j]), fresh, filled[:, j])
        step = rng.normal(0.0, scale, size=filled.shape) * self.numeric
        one_at_a_time = rng.random(n) < 0.5
        keep = rng.integers(self.dim, size=n)
        step[one_at_a_time] *= np.arange(self.dim)[None, :] == keep[one_at_a_time, None]
        moved = filled + step
        for j in np.flatnonzero(self.categorical):
            flip = rng.random(n) < max(scale, 1.0 / self.dim)
            moved[flip, j] = rng.integers(len(self._p[j].choices or ()), size=int(flip.sum()))
        return self.canonical(moved)


def _number(value: Any) -> float:
    """``value`` as a float, or NaN if it is no number (a value of another distribution)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def impute(x: np.ndarray) -> np.ndarray:
    """``x`` with inactive (NaN) values as -1, the model's input for "not active"."""
    return np.where(np.isnan(x), INACTIVE, x)


def keys(x: np.ndarray) -> list[bytes]:
    """Identity of each row (values rounded to 1e-9), for telling configurations apart."""
    return [row.tobytes() for row in np.round(impute(x), 9)]
