"""One parameter definition seen as Optuna distributions, a ConfigSpace space and unit-cube values."""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import optuna
import pytest
from ConfigSpace import (
    CategoricalHyperparameter,
    Constant,
    EqualsCondition,
    InCondition,
    NormalFloatHyperparameter,
    NormalIntegerHyperparameter,
    UniformFloatHyperparameter,
    UniformIntegerHyperparameter,
)
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hpo import space
from hpo.errors import InputError
from hpo.scenario import Param


def P(**fields: Any) -> Param:
    """A parameter from keyword fields (the YAML mapping)."""
    return Param(**fields)


# Parser table: YAML mapping -> Optuna distribution, ConfigSpace type and its checked attributes.
PARSER_CASES = [
    pytest.param({"type": "float", "low": 0.0, "high": 1.0},
                 FloatDistribution(0.0, 1.0), UniformFloatHyperparameter,
                 {"lower": 0.0, "upper": 1.0, "log": False}, id="float"),
    pytest.param({"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                 FloatDistribution(1e-4, 1.0, log=True), UniformFloatHyperparameter,
                 {"lower": 1e-4, "upper": 1.0, "log": True}, id="float-log"),
    pytest.param({"type": "float", "low": 0.0, "high": 1.0, "step": 0.25},
                 FloatDistribution(0.0, 1.0, step=0.25), UniformFloatHyperparameter,
                 {"lower": 0.0, "upper": 1.0, "log": False}, id="float-step"),
    pytest.param({"type": "int", "low": 1, "high": 8},
                 IntDistribution(1, 8), UniformIntegerHyperparameter,
                 {"lower": 1, "upper": 8, "log": False}, id="int"),
    pytest.param({"type": "int", "low": 1, "high": 1024, "log": True},
                 IntDistribution(1, 1024, log=True), UniformIntegerHyperparameter,
                 {"lower": 1, "upper": 1024, "log": True}, id="int-log"),
    pytest.param({"type": "int", "low": 0, "high": 8, "step": 2},
                 IntDistribution(0, 8, step=2), UniformIntegerHyperparameter,
                 {"lower": 0, "upper": 8, "log": False}, id="int-step"),
    pytest.param({"type": "int", "low": 2, "high": 5, "step": 1},
                 IntDistribution(2, 5), UniformIntegerHyperparameter,
                 {"lower": 2, "upper": 5}, id="int-step-1"),
    pytest.param({"type": "categorical", "choices": ["sgd", "adam"]},
                 CategoricalDistribution(["sgd", "adam"]), CategoricalHyperparameter,
                 {"choices": ("sgd", "adam")}, id="categorical"),
    pytest.param({"type": "categorical", "choices": [16, 32, 64]},
                 CategoricalDistribution([16, 32, 64]), CategoricalHyperparameter,
                 {"choices": (16, 32, 64)}, id="categorical-numbers"),
    pytest.param({"type": "constant", "value": 7},
                 CategoricalDistribution([7]), Constant, {"value": 7}, id="constant"),
    pytest.param({"type": "float", "low": 0.0, "high": 1.0, "distribution": "normal", "mean": 0.3, "std": 0.1},
                 FloatDistribution(0.0, 1.0), NormalFloatHyperparameter,
                 {"mu": 0.3, "sigma": 0.1, "lower": 0.0, "upper": 1.0}, id="float-normal"),
    pytest.param({"type": "int", "low": 0, "high": 10, "distribution": "normal", "mean": 5, "std": 2},
                 IntDistribution(0, 10), NormalIntegerHyperparameter,
                 {"mu": 5, "sigma": 2, "lower": 0, "upper": 10}, id="int-normal"),
]


@pytest.mark.parametrize(("spec", "distribution", "hp_type", "hp_attrs"), PARSER_CASES)
def test_parameter_to_distribution_and_hyperparameter(spec: dict[str, Any], distribution: Any,
                                                      hp_type: type, hp_attrs: dict[str, Any]) -> None:
    params = {"p": P(**spec)}
    assert space.distributions(params) == {"p": distribution}
    hp = space.config_space(params)["p"]
    assert type(hp) is hp_type
    for name, expected in hp_attrs.items():
        actual = getattr(hp, name)
        assert (tuple(actual) if isinstance(expected, tuple) else actual) == pytest.approx(expected), name


def test_grid_steps_name_every_stepped_number() -> None:
    params = {"f": P(type="float", low=0.0, high=1.0, step=0.25), "i": P(type="int", low=0, high=8, step=2),
              "c": P(type="float", low=0.0, high=1.0), "k": P(type="categorical", choices=["a", "b"])}
    assert space.grid_steps(params) == {"f": 0.25, "i": 2}


@pytest.mark.parametrize(("spec", "distribution", "hp_type", "hp_attrs"), PARSER_CASES)
def test_suggest_uses_the_same_distribution(spec: dict[str, Any], distribution: Any, hp_type: type,
                                            hp_attrs: dict[str, Any]) -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    values = space.suggest(trial, {"p": P(**spec)})
    assert distribution._contains(distribution.to_internal_repr(values["p"]))
    if spec["type"] == "constant":
        assert trial.distributions == {} and values == {"p": spec["value"]}  # constants are not searched
    else:
        assert trial.distributions == {"p": distribution}


def test_constants_join_values_in_definition_order() -> None:
    params = {"a": P(type="constant", value=1), "b": P(type="int", low=0, high=3),
              "c": P(type="categorical", choices=["x", "y"]),
              "d": P(type="constant", value="only-y", condition={"c": "y"})}
    assert space.with_constants(params, {"c": "x", "b": 2}) == {"a": 1, "b": 2, "c": "x"}
    assert list(space.with_constants(params, {"c": "y", "b": 2})) == ["a", "b", "c", "d"]
    assert space.searched(params, {"a": 1, "b": 2, "c": "x"}) == {"b": 2, "c": "x"}


def test_describe_is_plain_json() -> None:
    import json

    params = {"lr": P(type="float", low=1e-3, high=0.1, log=True), "opt": P(type="categorical", choices=["a", "b"])}
    described = space.describe(params)
    assert json.loads(json.dumps(described)) == described
    assert described == {"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True},
                         "opt": {"type": "categorical", "choices": ["a", "b"]}}


CONDITIONAL = {
    "opt": P(type="categorical", choices=["sgd", "adam", "rmsprop"]),
    "momentum": P(type="float", low=0.0, high=0.9, condition={"opt": "sgd"}),
    "beta": P(type="float", low=0.5, high=0.99, condition={"opt": ["adam", "rmsprop"]}),
    "nesterov": P(type="categorical", choices=[True, False], condition={"opt": "sgd"}),
}


def test_conditions_become_configspace_conditions() -> None:
    cs = space.config_space(CONDITIONAL)
    conditions = {c.child.name: c for c in cs.conditions}
    assert set(conditions) == {"momentum", "beta", "nesterov"}
    assert isinstance(conditions["momentum"], EqualsCondition)
    assert conditions["momentum"].parent.name == "opt" and conditions["momentum"].value == "sgd"
    assert isinstance(conditions["beta"], InCondition)
    assert list(conditions["beta"].values) == ["adam", "rmsprop"]
    for config in cs.sample_configuration(20):
        values = dict(config)
        assert ("momentum" in values) == (values["opt"] == "sgd")
        assert ("beta" in values) == (values["opt"] != "sgd")


def test_config_space_is_seeded() -> None:
    first = [dict(c) for c in space.config_space(CONDITIONAL, seed=3).sample_configuration(5)]
    again = [dict(c) for c in space.config_space(CONDITIONAL, seed=3).sample_configuration(5)]
    assert first == again


@pytest.mark.parametrize(
    ("values", "active"),
    [({"opt": "sgd"}, {"momentum", "nesterov"}), ({"opt": "adam"}, {"beta"}), ({}, set())],
)
def test_is_active(values: dict[str, Any], active: set[str]) -> None:
    conditional = {name for name, p in CONDITIONAL.items() if p.condition}
    assert {name for name in conditional if space.is_active(CONDITIONAL[name], values)} == active


def test_suggest_honours_conditions() -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        trial = study.ask()
        values = space.suggest(trial, CONDITIONAL)
        expected = {"opt", "momentum", "nesterov"} if values["opt"] == "sgd" else {"opt", "beta"}
        assert set(values) == expected == set(trial.params)
        study.tell(trial, 0.0)


def test_free_parameters_leave_out_constants() -> None:
    params = {"a": P(type="constant", value=1), "b": P(type="int", low=0, high=3),
              "c": P(type="categorical", choices=["x"])}
    assert space.free_parameters(params) == ["b", "c"]


@pytest.mark.parametrize(
    ("spec", "at_0", "at_half", "at_1"),
    [
        pytest.param({"type": "float", "low": -2.0, "high": 2.0}, -2.0, 0.0, 2.0, id="float"),
        pytest.param({"type": "float", "low": 1e-3, "high": 10.0, "log": True}, 1e-3, 0.1, 10.0, id="float-log"),
        pytest.param({"type": "float", "low": 0.0, "high": 1.0, "step": 0.25}, 0.0, 0.5, 1.0, id="float-step"),
        pytest.param({"type": "int", "low": 1, "high": 5}, 1, 3, 5, id="int"),
        pytest.param({"type": "int", "low": 1, "high": 100, "log": True}, 1, 7, 100, id="int-log"),
        pytest.param({"type": "int", "low": 0, "high": 8, "step": 2}, 0, 4, 8, id="int-step"),
        pytest.param({"type": "categorical", "choices": ["a", "b", "c"]}, "a", "b", "c", id="categorical"),
        pytest.param({"type": "categorical", "choices": [True, False]}, True, False, False, id="categorical-bool"),
        pytest.param({"type": "float", "low": 0.0, "high": 1.0, "distribution": "normal", "mean": 0.5, "std": 0.1},
                     0.0, 0.5, 1.0, id="normal-clipped"),
        pytest.param({"type": "float", "low": 0.0, "high": 1.0, "distribution": "normal", "mean": 3.0, "std": 1.0},
                     0.0, 1.0, 1.0, id="normal-mean-outside"),
        pytest.param({"type": "int", "low": 0, "high": 10, "distribution": "normal", "mean": 4, "std": 3},
                     0, 4, 10, id="normal-int"),
        pytest.param({"type": "int", "low": 0, "high": 10, "step": 2, "distribution": "normal", "mean": 3,
                      "std": 3}, 0, 4, 10, id="normal-int-step"),
        pytest.param({"type": "float", "low": 0.0, "high": 1.2, "step": 0.6, "distribution": "normal",
                      "mean": 0.5, "std": 5}, 0.0, 0.6, 1.2, id="normal-float-step-stays-in-range"),
    ],
)
def test_from_unit_maps_0_half_1(spec: dict[str, Any], at_0: Any, at_half: Any, at_1: Any) -> None:
    params = {"p": P(**spec)}
    got = [space.from_unit(params, np.array([u]))["p"] for u in (0.0, 0.5, 1.0)]
    expected = [at_0, at_half, at_1]
    assert got == (pytest.approx(expected, rel=1e-6, abs=1e-9) if isinstance(at_0, (int, float)) else expected)
    if spec["type"] == "int":
        assert all(type(v) is int for v in got)


@pytest.mark.parametrize("u", np.linspace(0.0, 1.0, 41))
def test_from_unit_stays_in_range(u: float) -> None:
    params = {
        "f": P(type="float", low=0.1, high=0.9),
        "fl": P(type="float", low=1e-5, high=1e-1, log=True),
        "i": P(type="int", low=3, high=7),
        "il": P(type="int", low=2, high=64, log=True),
        "n": P(type="float", low=-1.0, high=1.0, distribution="normal", mean=0.0, std=2.0),
        "ns": P(type="float", low=0.0, high=0.9, step=0.3, distribution="normal", mean=0.9, std=1.0),
    }
    values = space.from_unit(params, np.full(len(params), u))
    for name, value in values.items():
        assert params[name].low <= value <= params[name].high, name
    assert abs(values["ns"] / 0.3 - round(values["ns"] / 0.3)) < 1e-9


def test_from_unit_is_cheap_for_huge_int_ranges() -> None:
    params = {"seed": P(type="int", low=0, high=2**40), "k": P(type="int", low=0, high=2**40, step=2**20)}
    values = space.from_unit(params, np.array([0.5, 0.5]))
    assert values == {"seed": 2**39, "k": 2**39}


def test_from_unit_draws_log_ints_as_optuna_does() -> None:
    """Log-uniform over [low - 0.5, high + 0.5], rounded: each end value gets its whole half-width share."""
    params = {"p": P(type="int", low=1, high=4, log=True)}
    drawn = [space.from_unit(params, np.array([u]))["p"] for u in (np.arange(10000) + 0.5) / 10000]
    share = {k: drawn.count(k) / len(drawn) for k in (1, 2, 3, 4)}
    edges = np.log([0.5, 1.5, 2.5, 3.5, 4.5])
    expected = {k: (edges[k] - edges[k - 1]) / (edges[4] - edges[0]) for k in (1, 2, 3, 4)}
    assert share == pytest.approx(expected, abs=1e-3)


def test_from_unit_skips_constants_and_inactive_parameters() -> None:
    params = {
        "opt": P(type="categorical", choices=["sgd", "adam"]),
        "epochs": P(type="constant", value=3),
        "momentum": P(type="float", low=0.0, high=1.0, condition={"opt": "sgd"}),
        "beta": P(type="float", low=0.0, high=1.0, condition={"opt": "adam"}),
    }
    assert space.from_unit(params, np.array([0.0, 0.25, 0.75])) == {"opt": "sgd", "epochs": 3, "momentum": 0.25}
    assert space.from_unit(params, np.array([0.9, 0.25, 0.75])) == {"opt": "adam", "epochs": 3, "beta": 0.75}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"type": "int", "low": 0, "high": 3}, [0, 1, 2, 3]),
        ({"type": "int", "low": 1, "high": 9, "step": 4}, [1, 5, 9]),
        ({"type": "float", "low": 0.0, "high": 0.3, "step": 0.1}, [0.0, 0.1, 0.2, 0.3]),
        ({"type": "categorical", "choices": ["a", "b"]}, ["a", "b"]),
        ({"type": "constant", "value": "z"}, ["z"]),
    ],
)
def test_grid_values(spec: dict[str, Any], expected: list[Any]) -> None:
    assert list(space.grid_values("p", P(**spec))) == pytest.approx(expected)
    assert space.grid_size("p", P(**spec)) == len(expected)


def test_grid_values_of_a_huge_range_are_counted_not_listed() -> None:
    huge = P(type="int", low=0, high=10**15)
    assert space.grid_size("p", huge) == 10**15 + 1
    assert list(itertools.islice(space.grid_values("p", huge), 3)) == [0, 1, 2]


@pytest.mark.parametrize("spec", [{"type": "float", "low": 0, "high": 1},
                                  {"type": "float", "low": 0, "high": 1, "distribution": "normal", "mean": 0,
                                   "std": 1}])
def test_grid_values_need_a_step(spec: dict[str, Any]) -> None:
    with pytest.raises(InputError, match="parameters.p: method grid needs a step"):
        space.grid_size("p", P(**spec))


@pytest.mark.parametrize(("spec", "message"), [
    ({"type": "int", "low": 1, "high": 64, "log": True},
     ("parameters.p: method grid cannot take a log-scaled int; list the values to try as a categorical "
      "(type: categorical, choices: [1, 8, 64])")),
    ({"type": "float", "low": 1e-4, "high": 1, "log": True},
     ("parameters.p: method grid cannot take a log-scaled float; list the values to try as a categorical "
      "(type: categorical, choices: [0.0001, 0.01, 1])")),
])
def test_grid_refuses_log_scale_without_asking_for_a_step(spec: dict[str, Any], message: str) -> None:
    """A step is refused on a log-scaled parameter, so the refusal must not ask for one."""
    with pytest.raises(InputError) as info:
        space.grid_values("p", P(**spec))
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("spec", "text", "expected"),
    [
        ({"type": "float", "low": 0, "high": 1}, "0.25", 0.25),
        ({"type": "float", "low": 0, "high": 1}, " 1e-1 ", 0.1),
        ({"type": "float", "low": 0, "high": 1}, "1", 1.0),
        ({"type": "int", "low": 0, "high": 10}, "7", 7),
        ({"type": "int", "low": 0, "high": 10}, "7.0", 7),
        ({"type": "int", "low": 0, "high": 10, "step": 5}, "5", 5),
        ({"type": "float", "low": 0, "high": 1, "step": 0.1}, "0.3", 0.3),
        ({"type": "categorical", "choices": ["sgd", "adam"]}, "adam", "adam"),
        ({"type": "categorical", "choices": [16, 32]}, "32", 32),
        ({"type": "categorical", "choices": [True, False]}, "true", True),
        ({"type": "categorical", "choices": [True, False]}, "False", False),
        ({"type": "constant", "value": 3}, "3", 3),
        ({"type": "categorical", "choices": [16, 32]}, "16.0", 16),
        ({"type": "categorical", "choices": [1, 2.5, -3]}, "2.50", 2.5),
        ({"type": "categorical", "choices": [1, 2.5, -3]}, "-3e0", -3),
        ({"type": "categorical", "choices": ["1.0", 1]}, "1.0", "1.0"),
        ({"type": "constant", "value": 7}, "7.0", 7),
    ],
)
def test_coerce_good_cells(spec: dict[str, Any], text: str, expected: Any) -> None:
    value = space.coerce("p", P(**spec), text)
    assert value == pytest.approx(expected)
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("spec", "text", "message"),
    [
        ({"type": "float", "low": 0, "high": 1}, "abc", "'abc' is not a number"),
        ({"type": "float", "low": 0, "high": 1}, "", "'' is not a number"),
        ({"type": "float", "low": 0, "high": 1}, "nan", "'nan' is not a finite number"),
        ({"type": "float", "low": 0, "high": 1}, "inf", "'inf' is not a finite number"),
        ({"type": "float", "low": 0, "high": 1}, "1.5", "1.5 is outside [0, 1]"),
        ({"type": "float", "low": 0, "high": 1}, "-0.1", "-0.1 is outside [0, 1]"),
        ({"type": "int", "low": 0, "high": 10}, "2.5", "'2.5' is not a whole number"),
        ({"type": "int", "low": 0, "high": 10}, "11", "11 is outside [0, 10]"),
        ({"type": "int", "low": 0, "high": 10, "step": 5}, "4", "4 is not on the step 5 from 0"),
        ({"type": "float", "low": 0, "high": 1, "step": 0.25}, "0.3", "0.3 is not on the step 0.25 from 0"),
        ({"type": "categorical", "choices": ["sgd", "adam"]}, "rmsprop", "'rmsprop' is not one of sgd, adam"),
        ({"type": "categorical", "choices": [16, 32]}, "16.5", "'16.5' is not one of 16, 32"),
        ({"type": "categorical", "choices": [1, 0]}, "true", "'true' is not one of 1, 0"),
        ({"type": "categorical", "choices": [True, False]}, "1", "'1' is not one of True, False"),
        ({"type": "categorical", "choices": ["1", "2"]}, "1.0", "'1.0' is not one of 1, 2"),
        ({"type": "constant", "value": 3}, "4", "'4' is not one of 3"),
    ],
)
def test_coerce_bad_cells(spec: dict[str, Any], text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        space.coerce("p", P(**spec), text)
    assert str(info.value) == message


@pytest.mark.parametrize(("spec", "text", "expected"), [
    ({"type": "float", "low": 0, "high": 1, "step": 0.25}, "0.25000001", 0.25),
    ({"type": "float", "low": 0, "high": 1, "step": 0.25}, "1.00000001", 1.0),
    ({"type": "float", "low": 0, "high": 1, "step": 0.25}, "-0.00000001", 0.0),
    ({"type": "float", "low": 0, "high": 1, "step": 0.1}, "0.29999999", 0.3),
    ({"type": "float", "low": -1, "high": 1, "step": 0.5}, "-0.4999999999", -0.5),
])
def test_coerce_snaps_a_value_next_to_a_step_onto_it(spec: dict[str, Any], text: str, expected: float) -> None:
    """A value accepted as on the step runs as the step point, as the grid would give it."""
    assert space.coerce("p", P(**spec), text) == expected


def test_float_values_are_finite_after_from_unit() -> None:
    params = {"lr": P(type="float", low=1e-6, high=1.0, log=True)}
    for u in np.linspace(0, 1, 11):
        assert math.isfinite(space.from_unit(params, np.array([u]))["lr"])


def test_a_configuration_from_before_a_space_change_is_said_to_be_outside_it() -> None:
    from hpo.space import outside

    params = {"opt": Param(type="categorical", choices=("sgd", "adam")),
              "mom": Param(type="float", low=0.0, high=1.0, condition={"opt": "sgd"}),
              "epochs": Param(type="constant", value=3)}
    assert outside(params, {"opt": "sgd", "mom": 0.5}) is None
    assert outside(params, {"opt": "adam"}) is None
    assert outside(params, {"opt": "sgd"}) == "it has no mom, which the scenario added since"
    assert outside(params, {"opt": "adam", "mom": 0.5}) == \
        "it ran with mom=0.5, which the scenario's conditions now leave out"
    assert outside(params, {"opt": "adam", "lr": 0.1}) == "it ran with lr=0.1, which the scenario no longer has"


def test_a_stepped_float_that_a_sampler_suggests_has_no_binary_noise() -> None:
    """tpe, gp and smac handed templates and the CSV 0.30000000000000004 where designs gave 0.3."""
    params = {"x": Param(type="float", low=0.0, high=1.5, step=0.1),
              "y": Param(type="float", low=-0.005, high=0.01, step=0.0005)}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(200):
        values = space.suggest(study.ask(), params)
        assert all(repr(values[name]) == repr(round(values[name], 12)) for name in values)
        assert all(len(repr(value)) < 12 for value in values.values()), values


def test_values_of_a_tiny_step_stay_apart() -> None:
    """Rounded to 12 decimals, 3e-13 and 4e-13 on a step of 1e-13 were both 0.0."""
    p = Param(type="float", low=0.0, high=1e-12, step=1e-13)
    assert space.tidy(p, 3e-13) == 3e-13 and space.tidy(p, 4.000000000000001e-13) == 4e-13
    assert space.tidy(Param(type="float", low=0.0, high=1000.0, step=100.0), 300.0000000000001) == 300.0


@pytest.mark.parametrize(("value", "low", "high", "expected"), [
    (math.exp(math.log(1e-3)), 1e-3, 1.0, 1e-3),  # 0.0010000000000000002: a log scale's low end
    (0.1 + 1.0 * (0.3 - 0.1), 0.1, 0.3, 0.3),  # 0.30000000000000004: a linear one's high end
    (0.0010001, 1e-3, 1.0, 0.0010001),  # near, but not a rounding error away
    (1e-300, 0.0, 1.0, 1e-300),
])
def test_a_value_a_rounding_error_from_a_bound_is_the_bound(value: float, low: float, high: float,
                                                            expected: float) -> None:
    assert space.at_bound(value, low, high) == expected
