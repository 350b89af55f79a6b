"""The search space: one definition (the scenario's parameters) seen three ways.

* define-by-run suggestions on an Optuna trial (:func:`suggest`), which honour conditions;
* a ConfigSpace space, for SMAC3 itself (the benchmarks' baseline; :func:`config_space`);
* points of the unit cube mapped to values (:func:`from_unit`) for designs of experiments,
  and text coerced to values (:func:`coerce`) for CSV designs.

Constants are never suggested on Optuna trials (they are not searched): :func:`suggest`
and :func:`with_constants` add them to the values that templates, params.json and the CSV see.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the functions read a parameter's fields only: hpo.codec's helper copies carry no pydantic
    from hpo.scenario import Param

Params = Mapping[str, "Param"]


def is_active(param: Param, values: Mapping[str, Any]) -> bool:
    """Whether ``param``'s condition holds for the values chosen so far."""
    for parent, wanted in (param.condition or {}).items():
        allowed = wanted if isinstance(wanted, list) else [wanted]
        if parent not in values or values[parent] not in allowed:
            return False
    return True


def suggest(trial: Any, params: Params) -> dict[str, Any]:
    """Suggest every active parameter on an Optuna trial, in definition order; active
    constants join the values without being suggested."""
    values: dict[str, Any] = {}
    for name, p in params.items():
        if not is_active(p, values):
            continue
        if p.type == "constant":
            values[name] = p.value
        elif p.type == "categorical":
            values[name] = trial.suggest_categorical(name, list(p.choices or ()))
        elif p.type == "int":
            values[name] = trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            values[name] = tidy(p, trial.suggest_float(name, p.low, p.high, step=p.step, log=p.log))
    return values


def tidy(p: Param, value: Any) -> Any:
    """``value`` of ``p`` as a design writes it: a stepped float to :func:`step_decimals` (Optuna's
    ``low + k * step`` carries binary noise: 0.30000000000000004), anything else as it is."""
    if p.type == "float" and p.step is not None and isinstance(value, float):
        return round(value, step_decimals(p.step))
    return value


def at_bound(value: float, low: float, high: float) -> float:
    """``value``, or the bound it lies within a rounding error of: a log-scaled value decoded at
    its low end is ``exp(log(0.001))``, 0.0010000000000000002, which a trial's script would be given."""
    return next((bound for bound in (low, high) if math.isclose(value, bound, rel_tol=1e-12)), value)


def tidied(params: Params, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each one of ``params`` :func:`tidy`."""
    return {name: tidy(params[name], value) if name in params else value for name, value in values.items()}


def with_constants(params: Params, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (suggested parameters) with the active constants added, in definition order."""
    out: dict[str, Any] = {}
    for name, p in params.items():
        if name in values:
            out[name] = values[name]
        elif p.type == "constant" and is_active(p, out):
            out[name] = p.value
    out.update({name: value for name, value in values.items() if name not in out})
    return out


def outside(params: Params, values: Mapping[str, Any]) -> str | None:
    """Why ``values``, a trial's searched parameters, is no configuration of ``params`` (the
    space changed since the trial ran: ``it has no z, which the scenario added since``), or None."""
    chosen: dict[str, Any] = {}
    for name, param in params.items():
        if param.type == "constant":
            continue
        if is_active(param, chosen):
            if name not in values:
                return f"it has no {name}, which the scenario added since"
            chosen[name] = values[name]
        elif name in values:
            return f"it ran with {name}={values[name]}, which the scenario's conditions now leave out"
    extra = next((name for name in values if name not in params), None)
    return None if extra is None else f"it ran with {extra}={values[extra]}, which the scenario no longer has"


def searched(params: Params, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the constants: what an Optuna trial records as its parameters."""
    return {name: value for name, value in values.items() if name not in params or params[name].type != "constant"}


def describe(params: Params) -> dict[str, dict[str, Any]]:
    """The parameters as plain JSON-able data (recorded on the study, compared on resume)."""
    return {name: p.model_dump(mode="json", exclude_none=True, exclude_defaults=True) | {"type": p.type}
            for name, p in params.items()}


def distributions(params: Params) -> dict[str, Any]:
    """Optuna distributions of all parameters (active or not)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for name, p in params.items():
        if p.type == "constant":
            out[name] = CategoricalDistribution([p.value])
        elif p.type == "categorical":
            out[name] = CategoricalDistribution(list(p.choices or ()))
        elif p.type == "int":
            out[name] = IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
        else:
            out[name] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    return out


def _steps(p: Param) -> tuple[float, int] | None:
    """The step and value count of a stepped float or non-log int; None otherwise."""
    if p.type == "int" and not p.log:
        step: float = int(p.step or 1)
    elif p.type == "float" and p.step is not None:
        step = p.step
    else:
        return None
    return step, math.floor((p.high - p.low) / step + 1e-9) + 1


def grid_steps(params: Params) -> dict[str, float]:
    """The grid step of every parameter on a linear grid (stepped floats, non-log ints), by name."""
    steps = {name: _steps(p) for name, p in params.items()}
    return {name: s[0] for name, s in steps.items() if s is not None}


def _on_step(p: Param, step: float, k: int) -> Any:
    """The ``k``-th value of a stepped parameter: ``low + k * step``."""
    return int(p.low) + k * int(step) if p.type == "int" else round(p.low + k * step, step_decimals(step))


def step_decimals(step: float) -> int:
    """The decimals a value on ``step`` is rounded to: 12 past the step's first digit (at
    least 12), which drops binary noise and keeps steps of any size apart."""
    return 12 - min(0, math.floor(math.log10(step)))


def _grid_steps(name: str, p: Param) -> tuple[float, int]:
    """The step and value count of a number on a grid; InputError for one a grid cannot list."""
    from hpo.errors import InputError

    steps = _steps(p)
    if steps is not None:
        return steps
    if p.log:
        middle = math.sqrt(p.low * p.high)
        examples = dict.fromkeys((p.low, round(middle) if p.type == "int" else middle, p.high))
        example = ", ".join(f"{value:g}" for value in examples)
        raise InputError(f"parameters.{name}: method grid cannot take a log-scaled {p.type}; list the values to try "
                         f"as a categorical (type: categorical, choices: [{example}])")
    raise InputError(f"parameters.{name}: method grid needs a step (or choices) for a continuous {p.type}")


def grid_size(name: str, p: Param) -> int:
    """How many values a grid design visits for ``p``, counted without listing them;
    InputError for a continuous or log-scaled number."""
    if p.type == "constant":
        return 1
    if p.type == "categorical":
        return len(p.choices or ())
    return _grid_steps(name, p)[1]


def grid_values(name: str, p: Param) -> Iterator[Any]:
    """Every value a grid design visits for ``p``, in order, each made as it is read (a range
    of millions costs nothing until then); InputError as :func:`grid_size`."""
    if p.type == "constant":
        return iter([p.value])
    if p.type == "categorical":
        return iter(p.choices or ())
    step, count = _grid_steps(name, p)
    return (_on_step(p, step, k) for k in range(count))


def config_space(params: Params, seed: int | None = None) -> Any:
    """The ConfigSpace space of ``params``, conditions included.

    A stepped parameter is its plain range here; samplers snap values onto the step grid
    (its Optuna distribution), so models see one smooth ordered dimension. A range with
    ``low == high`` is a constant (ConfigSpace has no empty ranges).
    """
    from ConfigSpace import (
        CategoricalHyperparameter,
        ConfigurationSpace,
        Constant,
        EqualsCondition,
        InCondition,
        NormalFloatHyperparameter,
        NormalIntegerHyperparameter,
        UniformFloatHyperparameter,
        UniformIntegerHyperparameter,
    )

    space = ConfigurationSpace(seed=seed)
    hps: dict[str, Any] = {}
    for name, p in params.items():
        if p.type == "constant":
            hp: Any = Constant(name, p.value)
        elif p.type in ("int", "float") and p.low == p.high:
            hp = Constant(name, int(p.low) if p.type == "int" else float(p.low))
        elif p.type == "categorical":
            hp = CategoricalHyperparameter(name, list(p.choices or ()))
        elif p.is_normal and p.type == "int":
            hp = NormalIntegerHyperparameter(name, mu=p.mean, sigma=p.std, lower=int(p.low), upper=int(p.high))
        elif p.is_normal:
            hp = NormalFloatHyperparameter(name, mu=p.mean, sigma=p.std, lower=p.low, upper=p.high)
        elif p.type == "int":
            hp = UniformIntegerHyperparameter(name, int(p.low), int(p.high), log=p.log)
        else:
            hp = UniformFloatHyperparameter(name, p.low, p.high, log=p.log)
        hps[name] = hp
    space.add(list(hps.values()))
    conditions = []
    for name, p in params.items():
        for parent, wanted in (p.condition or {}).items():
            if isinstance(wanted, list):
                conditions.append(InCondition(hps[name], hps[parent], wanted))
            else:
                conditions.append(EqualsCondition(hps[name], hps[parent], wanted))
    if conditions:
        space.add(conditions)
    return space


def free_parameters(params: Params) -> list[str]:
    """Names of the parameters that vary (not constants): the columns of a design."""
    return [name for name, p in params.items() if p.type != "constant"]


def _from_unit_one(p: Param, u: float) -> Any:
    u = min(max(u, 0.0), 1.0 - 1e-12)
    if p.type == "categorical":
        choices = p.choices or ()
        return choices[int(u * len(choices))]
    steps = _steps(p)
    if p.is_normal:
        from scipy.stats import norm

        x = float(np.clip(p.mean + p.std * norm.ppf(min(max(u, 1e-12), 1 - 1e-12)), p.low, p.high))
        if steps is None:
            return x
        step, count = steps
        return _on_step(p, step, min(max(round((x - p.low) / step), 0), count - 1))
    if steps is not None:
        step, count = steps
        return _on_step(p, step, min(int(u * count), count - 1))
    if p.log:  # an int is log-uniform over [low - 0.5, high + 0.5], then rounded (Optuna's convention)
        low, high = (p.low - 0.5, p.high + 0.5) if p.type == "int" else (p.low, p.high)
        x = math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
    else:
        x = p.low + u * (p.high - p.low)
    x = min(max(x, p.low), p.high)
    return int(round(x)) if p.type == "int" else x  # noqa: RUF046 (x may be a numpy float: numpy 1 rounds to a float)


def from_unit(params: Params, point: np.ndarray) -> dict[str, Any]:
    """Map one point of the unit cube (one coordinate per free parameter) to values.

    Conditional parameters whose condition does not hold are left out.
    """
    values: dict[str, Any] = {}
    coords = iter(point)
    for name, p in params.items():
        value = p.value if p.type == "constant" else _from_unit_one(p, float(next(coords)))
        if is_active(p, values):
            values[name] = value
    return values


def coerce(name: str, p: Param, text: str) -> Any:
    """Turn ``text`` (a CSV cell) into a value of ``p``; raise ValueError saying what is wrong.

    A cell names a choice (or constant) by its text, or, for a number, by any text of an
    equal number (``2.50`` is 2.5; ``true`` is never 1). A number within a millionth of a
    step of a stepped parameter is that step's value."""
    text = text.strip()
    if p.type in ("categorical", "constant"):
        options = list(p.choices or ()) if p.type == "categorical" else [p.value]
        for option in options:
            if str(option) == text or (isinstance(option, bool) and text.lower() == str(option).lower()):
                return option
        for option in options:
            if isinstance(option, (int, float)) and not isinstance(option, bool) and _number_text(text) == option:
                return option
        raise ValueError(f"{text!r} is not one of {', '.join(map(str, options))}")
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite number")
    if p.type == "int":
        if number != int(number):
            raise ValueError(f"{text!r} is not a whole number")
        number = int(number)
    off_step = False
    if p.step is not None:  # snapped first, at the ends of the range too
        steps = (number - p.low) / p.step
        off_step = abs(steps - round(steps)) > 1e-6
        if not off_step:
            number = _on_step(p, p.step, round(steps))
    if number < p.low or number > p.high:
        raise ValueError(f"{text} is outside [{p.low:g}, {p.high:g}]")
    if off_step:
        raise ValueError(f"{text} is not on the step {p.step:g} from {p.low:g}")
    return number


def _number_text(text: str) -> float | None:
    """``text`` as a number, or None if it is none."""
    try:
        return float(text)
    except ValueError:
        return None
