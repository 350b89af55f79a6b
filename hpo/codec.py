"""Configurations as rows of numbers: the encoding hpo's model-based optimizer works in.

A :class:`Codec` turns parameter dicts into ConfigSpace vector rows and back, samples and
perturbs rows, snaps them onto legal values and applies the space's conditions. Rows hold
each hyperparameter's ConfigSpace vector value in the space's order (floats and integers
scaled to [0, 1], log-scaled where declared; categoricals as choice indices); NaN marks an
inactive value. A numeric hyperparameter with a grid step only takes the values
``lower + k * step``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from ConfigSpace import CategoricalHyperparameter, ConfigurationSpace, Constant, UniformIntegerHyperparameter
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

INACTIVE = -1.0


class Codec:
    """The vector encoding of one ConfigSpace space.

    Args:
        space: the ConfigSpace space (conditions included).
        steps: grid step of numeric hyperparameters by name (from the lower bound).
    """

    def __init__(self, space: ConfigurationSpace, steps: Mapping[str, float] | None = None) -> None:
        self.space = space
        self.hps = list(space.values())
        self.steps = [(steps or {}).get(hp.name) for hp in self.hps]
        self.names = [hp.name for hp in self.hps]
        self.dim = len(self.hps)
        self.categorical = np.array([isinstance(hp, CategoricalHyperparameter) for hp in self.hps], dtype=bool)
        self.constant = np.array([isinstance(hp, Constant) for hp in self.hps], dtype=bool)
        self.numeric = ~(self.categorical | self.constant)
        self.conditional = bool(space.conditions)
        self._choice_index = [
            {c: i for i, c in enumerate(hp.choices)} if self.categorical[j] else {} for j, hp in enumerate(self.hps)
        ]
        self._conditions = [
            (j, list(space.parent_conditions_of[hp.name]), [space.index_of[p.name] for p in space.parents_of[hp.name]])
            for j, hp in enumerate(self.hps)
            if space.parent_conditions_of[hp.name]
        ]

    def features(self, x: np.ndarray) -> np.ndarray:
        """Model inputs for rows ``x``: constants dropped, inactive values as -1."""
        return impute(x[:, ~self.constant])

    def encode(self, params: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Rows for parameter dicts; values outside the space become NaN (or are clipped)."""
        x = np.full((len(params), self.dim), np.nan)
        for j, hp in enumerate(self.hps):
            rows = [i for i, p in enumerate(params) if hp.name in p]
            if not rows or self.constant[j]:
                continue
            if self.categorical[j]:
                index = self._choice_index[j]
                x[rows, j] = [index.get(params[i][hp.name], np.nan) for i in rows]
            else:
                values = np.array([_number(params[i][hp.name]) for i in rows])
                x[rows, j] = np.clip(hp.to_vector(values), 0.0, 1.0)
        return self.with_conditions(x, fill_constants=True)

    def decode(self, row: np.ndarray) -> dict[str, Any]:
        """The active values of one row, as plain Python values of the space's choices."""
        values: dict[str, Any] = {}
        for j, hp in enumerate(self.hps):
            if math.isnan(row[j]):
                continue
            if self.categorical[j]:
                values[hp.name] = hp.choices[int(row[j])]
            elif self.constant[j]:
                values[hp.name] = hp.value
            else:
                value = hp.to_value(np.array([row[j]]))[0]
                values[hp.name] = value.item() if hasattr(value, "item") else value
        return values

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of the searched (non-constant) hyperparameters."""
        out: dict[str, BaseDistribution] = {}
        for j, hp in enumerate(self.hps):
            step = self.steps[j]
            if self.categorical[j]:
                out[hp.name] = CategoricalDistribution(list(hp.choices))
            elif isinstance(hp, UniformIntegerHyperparameter) or (self.numeric[j] and type(hp.lower) is int):
                out[hp.name] = IntDistribution(int(hp.lower), int(hp.upper), log=bool(hp.log), step=int(step or 1))
            elif self.numeric[j]:
                out[hp.name] = FloatDistribution(float(hp.lower), float(hp.upper), log=bool(hp.log), step=step)
        return out

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` configurations drawn uniformly from the space."""
        return self.from_unit(rng.random((n, self.dim)))

    def from_unit(self, u: np.ndarray) -> np.ndarray:
        """Configurations for points of the unit cube (one column per hyperparameter)."""
        x = u.copy()
        for j in np.flatnonzero(self.categorical):
            count = len(self.hps[j].choices)
            x[:, j] = np.minimum(np.floor(u[:, j] * count), count - 1)
        return self.canonical(x)

    def canonical(self, x: np.ndarray) -> np.ndarray:
        """Rows snapped onto legal values (integers and stepped values on their grid), conditions applied."""
        x = x.copy()
        for j in np.flatnonzero(self.numeric):
            hp = self.hps[j]
            col = np.clip(np.nan_to_num(x[:, j], nan=0.5), 0.0, 1.0)
            if self.steps[j] is not None or isinstance(hp, UniformIntegerHyperparameter):
                col = np.clip(hp.to_vector(self._on_step(j, hp.to_value(col))), 0.0, 1.0)
            x[:, j] = col
        return self.with_conditions(x, fill_constants=True)

    def _on_step(self, j: int, values: np.ndarray) -> np.ndarray:
        step = self.steps[j]
        if step is None:
            return values
        low = float(self.hps[j].lower)
        top = math.floor((float(self.hps[j].upper) - low) / step + 1e-9)
        snapped = low + np.clip(np.round((values - low) / step), 0, top) * step
        return snapped.astype(values.dtype) if np.issubdtype(values.dtype, np.integer) else snapped

    def with_conditions(self, x: np.ndarray, fill_constants: bool = False) -> np.ndarray:
        """``x`` with inactive values set to NaN, parents before children."""
        if fill_constants:
            for j in np.flatnonzero(self.constant):
                x[:, j] = self.hps[j].to_vector(self.hps[j].value)
        for j, conditions, parents in self._conditions:
            active = ~np.isnan(x[:, parents]).any(axis=1)
            for condition in conditions:
                active &= condition.satisfied_by_vector_array(x.T)
            x[~active, j] = np.nan
        return x

    def perturb(self, x: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
        """Neighbours of rows ``x``: Gaussian steps of std ``scale`` on the numeric values (all at
        once or one at a time), categoricals resampled now and then; inactive values are drawn
        afresh, so a neighbour that activates a branch gets values there."""
        n = len(x)
        filled = np.where(np.isnan(x), rng.random(x.shape), x)
        for j in np.flatnonzero(self.categorical):
            fresh = np.floor(rng.random(n) * len(self.hps[j].choices))
            filled[:, j] = np.where(np.isnan(x[:, j]), fresh, filled[:, j])
        step = rng.normal(0.0, scale, size=filled.shape) * self.numeric
        one_at_a_time = rng.random(n) < 0.5
        keep = rng.integers(self.dim, size=n)
        step[one_at_a_time] *= np.arange(self.dim)[None, :] == keep[one_at_a_time, None]
        moved = filled + step
        for j in np.flatnonzero(self.categorical):
            flip = rng.random(n) < max(scale, 1.0 / self.dim)
            moved[flip, j] = rng.integers(len(self.hps[j].choices), size=int(flip.sum()))
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
