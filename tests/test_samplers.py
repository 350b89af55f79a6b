"""hpo's samplers under Optuna's own sampler contract, and the contracts of ``search.method: smac``:
no configuration proposed twice whatever the history holds, no proposal spent on enqueued
trials, Optuna's GP where the GP serves, constant ranges and indistinguishable choices
settled at validation."""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.testing.pytest_samplers import BasicSamplerTestCase, SingleOnlySamplerTestCase
from optuna.trial import TrialState

from hpo import space
from hpo.errors import InputError
from hpo.optimizer import SmacSampler, on_a_grid
from hpo.samplers import build_sampler, describe_pruner, make_pruner
from hpo.scenario import Param, load_scenario

optuna.logging.set_verbosity(optuna.logging.WARNING)

# The names Optuna's sampler test cases suggest, as a scenario would declare them.
KIT_PARAMS = {
    "x": Param(type="float", low=0.0, high=10.0),
    "y": Param(type="int", low=-1, high=1),
    "z": Param(type="float", low=-1.0, high=1.0),
    "category": Param(type="categorical", choices=("x", "y")),
    "b": Param(type="int", low=1, high=1),
    "d": Param(type="float", low=1.0, high=1.0),
}
CONDITIONAL_PARAMS = {
    "model": Param(type="categorical", choices=("mlp", "cnn")),
    "hidden": Param(type="int", low=8, high=1024, log=True, condition={"model": "mlp"}),
    "lr": Param(type="float", low=1e-4, high=1.0, log=True),
    "dropout": Param(type="float", low=0.0, high=0.5, step=0.1),
}
SMAC_SAMPLERS: list[Callable[[], optuna.samplers.BaseSampler]] = [
    lambda: build_sampler("smac", KIT_PARAMS, seed=0),
    lambda: SmacSampler(KIT_PARAMS, seed=0, n_initial=2, model="forest"),
    lambda: SmacSampler({}, seed=0),
]


class TestSmacBasicContract(BasicSamplerTestCase):
    @pytest.fixture(params=SMAC_SAMPLERS, ids=["smac", "forest", "empty-space"])
    def sampler(self, request: pytest.FixtureRequest) -> Callable[[], optuna.samplers.BaseSampler]:
        return request.param


class TestSmacSingleObjectiveOnly(SingleOnlySamplerTestCase):
    @pytest.fixture(params=SMAC_SAMPLERS, ids=["smac", "forest", "empty-space"])
    def sampler(self, request: pytest.FixtureRequest) -> Callable[[], optuna.samplers.BaseSampler]:
        return request.param


def _params(study: optuna.Study) -> list[tuple[Any, ...]]:
    return [tuple(sorted(t.params.items())) for t in study.trials]


def _suggest(params: dict[str, Param]) -> Callable[[optuna.Trial], dict[str, Any]]:
    return lambda trial: space.suggest(trial, params)


def test_on_a_small_continuous_space_smac_starts_with_optunas_gp_draws_then_its_gp_proposes() -> None:
    params = {"x": Param(type="float", low=-5.0, high=10.0), "lr": Param(type="float", low=1e-4, high=1.0, log=True),
              "units": Param(type="int", low=4, high=64, log=True)}

    def objective(trial: optuna.Trial) -> float:
        v = space.suggest(trial, params)
        return (v["x"] - 2.5) ** 2 + (math.log10(v["lr"]) + 2) ** 2 + (math.log2(v["units"]) - 4) ** 2

    found = {}
    for method in ("gp", "smac"):
        study = optuna.create_study(sampler=build_sampler(method, params, seed=3))
        study.optimize(objective, n_trials=14)
        found[method] = [t.params for t in study.trials]
    assert found["smac"][:10] == found["gp"][:10]  # the same start draws; then the GP on warped costs (test_gp)
    assert len({tuple(sorted(p.items())) for p in found["smac"]}) == 14


@pytest.mark.parametrize("method", ["smac", "gp"])
def test_a_log_scaled_proposal_at_a_bound_is_the_bound_itself(method: str) -> None:
    """The GP drives lr to its low end; exp(log(0.001)) is 0.0010000000000000002, which the
    trial's script and ``hpo best`` would show."""
    params = {"lr": Param(type="float", low=1e-3, high=1.0, log=True), "x": Param(type="float", low=0.0, high=1.0)}
    study = optuna.create_study(sampler=build_sampler(method, params, seed=0))
    study.optimize(lambda trial: sum(space.suggest(trial, params).values()), n_trials=16)
    low = [t.params["lr"] for t in study.trials if t.params["lr"] < 1e-3 * 1.001]
    assert low and all(lr == 1e-3 for lr in low)


@pytest.mark.parametrize("method", ["tpe", "gp", "smac", "monte_carlo"])
def test_a_sampler_is_built_without_a_warning(method: str) -> None:
    """The options hpo gives Optuna's samplers are its own choice: a program that builds one
    (a sweep, not the CLI, which silences Optuna) is not warned that TPE's ``group`` is
    experimental."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_sampler(method, CONDITIONAL_PARAMS, seed=0)


@pytest.mark.parametrize("params", [KIT_PARAMS, CONDITIONAL_PARAMS], ids=["plain", "conditional"])
def test_an_always_crashing_script_gets_a_new_configuration_every_trial(params: dict[str, Param]) -> None:
    for seed in range(4):
        study = optuna.create_study(sampler=build_sampler("smac", params, seed=seed))

        def crash(trial: optuna.Trial) -> float:
            _suggest(params)(trial)
            raise RuntimeError("out of memory")

        study.optimize(crash, n_trials=8, catch=(RuntimeError,))
        assert all(t.state == TrialState.FAIL for t in study.trials)
        assert len(set(_params(study))) == 8


def test_a_script_that_crashes_for_part_of_the_space_never_repeats_a_configuration() -> None:
    params = {"hidden": Param(type="int", low=16, high=1024, log=True), "lr": Param(type="float", low=1e-4, high=1.0,
                                                                                    log=True)}

    def train(trial: optuna.Trial) -> float:
        values = space.suggest(trial, params)
        if values["hidden"] > 256:
            raise MemoryError("CUDA out of memory")
        return (math.log10(values["lr"]) + 2) ** 2 - values["hidden"] / 256

    for seed in range(8):
        study = optuna.create_study(sampler=build_sampler("smac", params, seed=seed))
        study.optimize(train, n_trials=12, catch=(MemoryError,))
        assert len(set(_params(study))) == 12, f"seed {seed} repeated a configuration"


@pytest.mark.parametrize("state", [TrialState.PRUNED, TrialState.RUNNING])
def test_pruned_or_running_histories_get_no_repeats(state: TrialState) -> None:
    study = optuna.create_study(sampler=build_sampler("smac", CONDITIONAL_PARAMS, seed=1))
    for _ in range(12):
        trial = study.ask()
        _suggest(CONDITIONAL_PARAMS)(trial)
        if state == TrialState.PRUNED:
            study.tell(trial, state=TrialState.PRUNED)
    assert len(set(_params(study))) == 12


def test_running_trials_of_every_hyperband_bracket_are_seen() -> None:
    """Under Optuna's HyperbandPruner a sampler is handed one bracket's trials; smac's history
    still holds every running trial, so no bracket proposes what another one runs."""
    params = {"x": Param(type="float", low=0.0, high=1.0), "y": Param(type="float", low=0.0, high=1.0)}
    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9)
    sampler = SmacSampler(params, seed=0)
    study = optuna.create_study(study_name="hyperband", sampler=sampler, pruner=pruner)
    first = study.ask()
    space.suggest(first, params)
    first.report(0.5, 1)
    first.should_prune()  # the pruner makes its brackets
    study.tell(first, 0.5)
    pending: list[int] = []
    read = sampler._history.read

    def counting_read(*args: Any, **kwargs: Any) -> Any:
        observations = read(*args, **kwargs)
        pending.append(len(observations.pending))
        return observations

    sampler._history.read = counting_read  # type: ignore[method-assign]
    running = [study.ask() for _ in range(8)]
    for trial in running:
        space.suggest(trial, params)
    assert len({pruner._get_bracket_id(study, t._cached_frozen_trial) for t in running}) > 1
    assert pending == list(range(8))
    assert len(set(_params(study))) == 9


def test_enqueued_trials_cost_no_proposal() -> None:
    sampler = build_sampler("smac", KIT_PARAMS, seed=0)
    assert isinstance(sampler, SmacSampler)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: _suggest(KIT_PARAMS)(t)["x"], n_trials=3)
    proposals: list[int] = []
    propose = sampler._propose
    sampler._propose = lambda study, trial: proposals.append(trial.number) or propose(study, trial)  # type: ignore
    fixed = {"x": 1.5, "y": 0, "z": 0.25, "category": "y"}
    study.enqueue_trial(fixed, user_attrs={"rerun_of": 0})
    study.optimize(lambda t: _suggest(KIT_PARAMS)(t)["x"], n_trials=2)
    assert {k: study.trials[3].params[k] for k in fixed} == fixed
    assert proposals == [4]


def test_lost_and_interrupted_trials_are_not_crashes_but_are_seen() -> None:
    sampler = build_sampler("smac", KIT_PARAMS, seed=0)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: _suggest(KIT_PARAMS)(t)["x"], n_trials=4)
    for outcome in ("LOST", "INTERRUPTED", "TIMEOUT"):
        trial = study.ask()
        _suggest(KIT_PARAMS)(trial)
        trial.set_user_attr("outcome", outcome)
        study.tell(trial, state=TrialState.FAIL)
    observations = sampler._history.read(study)  # type: ignore[attr-defined]
    assert len(observations.y) == 5 and observations.crashed.sum() == 1
    assert len(observations.seen) == 7


def test_stopped_trial_counts_with_its_last_intermediate_value_and_pruned_trials_at_a_budget() -> None:
    """Costs are taken at the highest budget two trials reached; a trial pruned below it costs
    the worst cost there, one a user stopped below it is only seen."""
    params = {"x": Param(type="float", low=0.0, high=1.0)}
    sampler = SmacSampler(params, seed=0, n_initial=2)
    study = optuna.create_study(sampler=sampler)
    distributions = space.distributions(params)
    for x, curve, state, outcome in [
        (0.1, {1: 0.9, 2: 0.5, 3: 0.3}, TrialState.COMPLETE, "COMPLETE"),
        (0.2, {1: 0.8}, TrialState.PRUNED, "PRUNED"),
        (0.3, {1: 0.7, 2: 0.6}, TrialState.FAIL, "STOPPED"),
        (0.4, {}, TrialState.FAIL, "STOPPED"),
    ]:
        study.add_trial(optuna.trial.create_trial(
            params={"x": x}, distributions=distributions, state=state, intermediate_values=curve,
            value=0.3 if state == TrialState.COMPLETE else None, user_attrs={"outcome": outcome}))
    observations = sampler._history.read(study)
    assert observations.budget == 2 and sorted(observations.y) == [0.5, 0.6, 0.6]
    study.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions=distributions, value=0.2,
                                              intermediate_values={1: 0.6, 2: 0.4, 3: 0.2}))
    observations = sampler._history.read(study)
    assert observations.budget == math.inf and sorted(observations.y) == [0.2, 0.3, 0.3]
    assert len(observations.seen) == 5


def _scenario(tmp_path: Path, write_scenario: Callable[..., Path], parameters: dict[str, Any],
              **search: Any) -> Path:
    template = "from hpo.results import report\nreport(val_error=({{ x }} - 0.3) ** 2 + {{ b }})\n"
    return write_scenario(tmp_path, template_text=template, parameters=parameters,
                          search={"method": "smac", "trials": 3, **search})


def test_a_range_of_one_value_is_a_constant(tmp_path: Path, write_scenario: Callable[..., Path],
                                            run_cli: Callable[..., Any]) -> None:
    path = _scenario(tmp_path, write_scenario, {"x": {"type": "float", "low": 0.0, "high": 1.0},
                                                "b": {"type": "float", "low": 2.0, "high": 2.0}})
    run = run_cli("run", path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3/3 trials done: 3 complete." in run.stdout
    assert space.config_space(load_scenario(path).parameters)["b"].value == 2.0


@pytest.mark.parametrize("choices, message", [
    ([True, 1], "parameters.b.choices: true and 1 compare equal"),
    ([1, 1.0], "parameters.b.choices: 1 and 1.0 compare equal"),
    ([0, "a", False], "parameters.b.choices: 0 and false compare equal"),
])
def test_choices_that_compare_equal_are_bad_input(tmp_path: Path, write_scenario: Callable[..., Path],
                                                  run_cli: Callable[..., Any], choices: list[Any],
                                                  message: str) -> None:
    path = _scenario(tmp_path, write_scenario, {"b": {"type": "categorical", "choices": choices}})
    with pytest.raises(InputError, match=message):
        load_scenario(path)
    if choices == [True, 1]:
        run = run_cli("validate", path)
        assert run.returncode == 2 and message in run.stderr + run.stdout
        assert len((run.stderr + run.stdout).strip().splitlines()) == 1


def test_running_start_draws_count_toward_the_gps_random_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel workers draw 10 random start configurations in all, as one worker does, not
    10 plus those running when the tenth finished."""
    from hpo.gp import GPProposer

    proposals = []
    real = GPProposer.propose
    monkeypatch.setattr(GPProposer, "propose", lambda self, obs: proposals.append(len(obs.y)) or real(self, obs))
    monkeypatch.setattr(GPProposer, "mean_minimum", lambda self, obs: None)
    params = {"x": Param(type="float", low=0.0, high=1.0), "y": Param(type="float", low=0.0, high=1.0)}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=2))
    for _ in range(3):  # three other workers' trials, still running
        _suggest(params)(study.ask())
    for _ in range(10):
        trial = study.ask()
        values = _suggest(params)(trial)
        study.tell(trial, values["x"] + values["y"])
    assert proposals == [7, 8, 9]
    assert len(set(_params(study))) == 13


@pytest.fixture
def models_used(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The model behind each of smac's model-based proposals from here on: gp or forest."""
    from hpo import forest_service
    from hpo.gp import GPProposer

    used: list[str] = []
    gp_propose, gp_mean, forest_ranked = GPProposer.propose, GPProposer.mean_minimum, forest_service.ranked
    monkeypatch.setattr(GPProposer, "propose", lambda self, obs: used.append("gp")
                        or gp_propose(self, obs))

    def mean_minimum(self: GPProposer, obs: Any) -> Any:
        point = gp_mean(self, obs)
        if point is not None:  # else the GP proposes by expected improvement
            used.append("gp")
        return point

    monkeypatch.setattr(GPProposer, "mean_minimum", mean_minimum)
    monkeypatch.setattr(forest_service, "ranked", lambda *a, **k: used.append("forest") or forest_ranked(*a, **k))
    return used


@pytest.mark.parametrize(("dims", "model"), [(10, "gp"), (11, "forest")])
def test_the_gp_serves_up_to_ten_parameters_and_the_forest_beyond(models_used: list[str], dims: int,
                                                                  model: str) -> None:
    """After its start design, smac proposes with Optuna's GP on an unconditional space of up
    to 10 searched parameters and with the random forest on a larger one."""
    used = models_used
    params = {f"x{i}": Param(type="float", low=0.0, high=1.0) for i in range(dims)}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    study.optimize(lambda trial: sum(_suggest(params)(trial).values()), n_trials=dims + 4)
    assert used and set(used) == {model}
    assert len(set(_params(study))) == dims + 4


@pytest.mark.parametrize(("cost", "models"), [
    (lambda v: round(v["x0"] + v["x1"], 1), {"forest"}),  # a validation error: steps of 0.1
    (lambda v: v["x0"] + v["x1"], {"gp"}),
    (lambda v: v["x0"] + v["x1"] if v["x0"] < 0.5 else math.inf, {"gp"}),  # crashes tie at the worst cost
])
def test_step_valued_costs_turn_the_gps_space_to_the_forest(models_used: list[str],
                                                            cost: Callable[[dict[str, Any]], float],
                                                            models: set[str]) -> None:
    """Once two costs (the worst aside) tie exactly, as errors over a finite validation set
    do, the forest proposes on a space the GP would serve; ties of crashes do not count."""
    params = {f"x{i}": Param(type="float", low=0.0, high=1.0) for i in range(2)}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    study.optimize(lambda trial: cost(_suggest(params)(trial)), n_trials=16)
    assert set(models_used[-3:]) == models
    assert len(set(_params(study))) == 16


def test_equal_costs_off_a_grid_keep_the_gp(models_used: list[str]) -> None:
    """Equal costs that do not lie on one grid with the others (the corners of a symmetric
    smooth function) are no sign of a counted error: the GP keeps its space."""
    params = {f"x{i}": Param(type="float", low=-1.0, high=1.0) for i in range(2)}

    def corners_tie(values: dict[str, Any]) -> float:
        x, y = abs(values["x0"]), abs(values["x1"])
        return 0.5 if min(x, y) > 0.8 else x * x + math.sin(3 * y) ** 2

    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    for corner in ({"x0": -1.0, "x1": -1.0}, {"x0": 1.0, "x1": 1.0}):
        study.enqueue_trial(corner)
    study.optimize(lambda trial: corners_tie(_suggest(params)(trial)), n_trials=16)
    assert study.trials[0].value == study.trials[1].value < max(t.value for t in study.trials)
    assert models_used and set(models_used) == {"gp"}


@pytest.mark.parametrize(("values", "grid"), [
    ([3 / 797, 7 / 797, 7 / 797, 30 / 797, 41 / 797], True),  # errors counted over 797 examples
    ([k / 50_000 for k in (120, 133, 133, 7_001, 49_999)], True),
    ([0.1234, 0.5678, 0.5678, 0.9], True),  # printed to 4 decimals
    ([0.0], True),
    ([0.1, math.pi / 10, math.e / 10, math.e / 10], False),  # smooth costs, two of them equal
    ([1.0, 1.0 + 1e-7, 2.0], False),  # ten million steps apart
])
def test_costs_on_a_grid(values: list[float], grid: bool) -> None:
    assert on_a_grid(np.array(values)) is grid


def test_a_history_with_pruned_trials_keeps_the_gp_whatever_ties(models_used: list[str]) -> None:
    """Under a pruner the GP keeps its space even when costs tie (bench/multifidelity: the
    forest did worse there)."""
    params = {f"x{i}": Param(type="float", low=0.0, high=1.0) for i in range(2)}

    def objective(trial: optuna.Trial) -> float:
        values = _suggest(params)(trial)
        error = round(values["x0"] + values["x1"], 1)
        trial.report(error, 1)
        if trial.number % 2:
            raise optuna.TrialPruned()
        return error

    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    study.optimize(objective, n_trials=16)
    assert models_used and set(models_used) == {"gp"}


def test_every_third_gp_proposal_is_where_its_mean_is_lowest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the GP has 20 costs (and 4 per parameter: more in 6 to 10 dimensions), every third
    trial (20, 23, ...) refines the best region (the GP's posterior mean at its lowest); the
    others are the GP's expected-improvement proposals."""
    from hpo.gp import GPProposer

    refined: dict[int, dict[str, Any]] = {}
    real = GPProposer.mean_minimum
    params = {"x": Param(type="float", low=-2.0, high=2.0), "y": Param(type="float", low=-1.0, high=3.0)}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=3))
    monkeypatch.setattr(GPProposer, "mean_minimum",
                        lambda self, obs: refined.setdefault(len(study.trials) - 1, real(self, obs)))

    def rosenbrock(trial: optuna.Trial) -> float:
        x, y = _suggest(params)(trial).values()
        return 100 * (y - x ** 2) ** 2 + (1 - x) ** 2

    study.optimize(rosenbrock, n_trials=27)
    assert sorted(refined) == [20, 23, 26] and refined[20] is not None
    for number, point in refined.items():  # None once the bottom was tried: expected improvement proposed
        assert point is None or study.trials[number].params == point


def test_in_eight_dimensions_the_first_mean_step_waits_for_32_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GP of 20 costs in 8 dimensions knows too little for its mean's minimum to be worth a
    trial: the mean steps wait for 4 costs per parameter."""
    from hpo.gp import GPProposer

    asked: list[int] = []
    real = GPProposer.mean_minimum
    monkeypatch.setattr(GPProposer, "mean_minimum", lambda self, obs: asked.append(len(obs.y)) or real(self, obs))
    params = {f"x{i}": Param(type="float", low=0.0, high=1.0) for i in range(8)}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    study.optimize(lambda trial: sum((v - 0.3) ** 2 for v in _suggest(params)(trial).values()), n_trials=36)
    assert asked == [32, 35]


def test_the_gp_is_shown_the_running_trials() -> None:
    """Other workers' running trials go to the GP as running trials (q-batch EI, see hpo.gp),
    so its proposal is not the one it makes from the finished trials alone."""
    from hpo.codec import Codec, keys
    from hpo.gp import GPProposer
    from hpo.history import Observations

    params = {"x": Param(type="float", low=0.0, high=1.0), "y": Param(type="float", low=0.0, high=1.0)}
    codec = Codec(params)
    rng = np.random.default_rng(0)
    x = codec.sample(12, rng)
    y = (x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2
    alone = Observations(x, y, np.zeros(12, dtype=bool), np.empty((0, 2)), frozenset(keys(x)))
    first = GPProposer(codec, seed=5).propose(alone)
    pending = codec.encode([first])
    beside = Observations(x, y, np.zeros(12, dtype=bool), pending, frozenset(keys(np.vstack([x, pending]))))
    assert GPProposer(codec, seed=5).propose(beside) != first


def test_a_second_worker_with_the_same_model_proposes_away_from_the_first() -> None:
    """Two workers whose acquisitions agree: the second sees the first's proposal running and
    evaluates somewhere else instead of beside it."""
    params = {"x": Param(type="float", low=0.0, high=1.0), "y": Param(type="float", low=0.0, high=1.0)}
    distributions = space.distributions(params)
    start = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    study = optuna.create_study(sampler=SmacSampler(params, seed=5))
    for _ in range(12):
        values = space.suggest(start.ask(), params)
        value = (values["x"] - 0.3) ** 2 + (values["y"] - 0.6) ** 2
        study.add_trial(optuna.trial.create_trial(params=values, distributions=distributions, value=value))

    running = space.suggest(study.ask(), params)  # worker A's proposal, left running
    study.sampler = SmacSampler(params, seed=5)  # worker B: the same model and seed
    beside = space.suggest(study.ask(), params)
    assert max(abs(running[name] - beside[name]) for name in params) > 0.01


def test_every_fourth_forest_proposal_takes_the_least_tried_choice() -> None:
    """A choice that started badly is not given up for good: every 4th proposal of the forest
    is its best candidate with the value of an unconditional categorical parameter that the
    fewest trials (finished or running) have, here the kernels the costs make it shun."""
    params = {"kernel": Param(type="categorical", choices=("rbf", "poly", "sigmoid")),
              "c": Param(type="float", low=0.0, high=1.0),
              "degree": Param(type="int", low=2, high=5, condition={"kernel": "poly"})}
    penalty = {"rbf": 0.0, "poly": 5.0, "sigmoid": 10.0}
    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))

    def cost(trial: optuna.Trial) -> float:
        values = _suggest(params)(trial)
        return values["c"] + penalty[values["kernel"]]

    study.optimize(cost, n_trials=40)
    kernels = [t.params["kernel"] for t in study.trials]
    for number in range(7, 40, 4):  # trials 0 to 3 are the start design
        counts = {k: kernels[:number].count(k) for k in penalty}
        assert counts[kernels[number]] == min(counts.values()), f"trial {number}: {counts}"
    assert min(kernels.count(k) for k in penalty) >= 40 // 4 // 3
    assert kernels[4:].count("rbf") > 20  # the others still exploit the best choice


def test_only_unconditional_choices_of_several_values_are_balanced() -> None:
    from hpo.codec import Codec

    assert Codec(CONDITIONAL_PARAMS).unconditional_choices == [2, 0, 0, 0]
    assert Codec({"lr": Param(type="float", low=0.0, high=1.0),
                  "model": Param(type="categorical", choices=("mlp", "cnn", "rnn")),
                  "act": Param(type="categorical", choices=("relu", "tanh"), condition={"model": "mlp"}),
                  "fixed": Param(type="categorical", choices=("a",))}).unconditional_choices == [0, 3, 0, 0]


BASES = (0.5, 0.4, 0.3)  # trial i's learning curve: BASES[i] + 1 / step, for steps 1..9


def _pruned_and_rungs(pruner: optuna.pruners.BasePruner, interleaved: bool) -> list[tuple[bool, dict[str, float]]]:
    """Trials 0 and 1 run nine steps, together (``interleaved``: trial 0 completes while trial 1
    is at step 9) or one after the other; then trial 2 reports step 1. Each trial's pruning
    decision and its recorded rung values."""
    study = optuna.create_study(study_name="rungs", pruner=pruner)
    first, second = study.ask(), study.ask()
    pruned = {0: False, 1: False}

    def step(trial: optuna.Trial, at: int) -> None:
        if not pruned[trial.number]:
            trial.report(BASES[trial.number] + 1 / at, at)
            pruned[trial.number] = trial.should_prune()

    order = [(t, at) for at in range(1, 10) for t in (first, second)] if interleaved else \
        [(t, at) for t in (first, second) for at in range(1, 10)]
    for trial, at in order:
        step(trial, at)
        if trial is first and at == 9:
            study.tell(first, BASES[0] + 1 / 9)
    third = study.ask()
    third.report(BASES[2] + 1, 1)
    decisions = [*pruned.values(), third.should_prune()]
    return [(decision, {key: value for key, value in trial.system_attrs.items() if key.startswith("completed_rung")})
            for decision, trial in zip(decisions, study.get_trials(deepcopy=False))]


@pytest.mark.parametrize("search", [
    pytest.param({"pruner": "successive_halving"}, id="successive-halving"),
    pytest.param({"pruner": "hyperband"}, id="hyperband"),
    pytest.param({"pruner": "hyperband", "max_step": 9}, id="hyperband-max-step"),
])
def test_rungs_compare_values_at_the_same_step_whatever_runs_at_once(
        tmp_path: Path, write_scenario: Callable[..., Path], search: dict[str, Any]) -> None:
    """A trial that is past step 1 when the first trial completes enters rung 0 with its
    step-1 value (Optuna's min_resource "auto" recorded its late value, and every later
    step-1 value lost against it): trials running together are pruned as one after another."""
    scenario = load_scenario(write_scenario(tmp_path, search={"method": "monte_carlo", "trials": 3, **search}))
    together = _pruned_and_rungs(make_pruner(scenario), interleaved=True)
    assert together == _pruned_and_rungs(make_pruner(scenario), interleaved=False)
    if search["pruner"] == "successive_halving":
        assert together[1][1]["completed_rung_0"] == BASES[1] + 1
        assert [pruned for pruned, _ in together] == [False, False, False]  # each the best step-1 value so far



@pytest.mark.parametrize(("search", "said"), [
    pytest.param({}, "", id="none"),
    pytest.param({"pruner": "median"}, "pruner median", id="median"),
    pytest.param({"pruner": "successive_halving"}, "pruner successive_halving (rungs at steps 1, 4, 16, ...)",
                 id="successive-halving"),
    pytest.param({"pruner": "hyperband"}, "pruner hyperband over steps 1..81 (search.max_step not set: "
                 "set it to the last step a trial reports)", id="hyperband-default"),
    pytest.param({"pruner": "hyperband", "max_step": 10}, "pruner hyperband over steps 1..10 (search.max_step)",
                 id="hyperband-max-step"),
])
def test_the_plan_says_which_steps_the_pruner_plans_for(tmp_path: Path, write_scenario: Callable[..., Path],
                                                         search: dict[str, Any], said: str) -> None:
    """A script reporting 10 epochs under Hyperband's default of 81 is told so before it runs."""
    scenario = load_scenario(write_scenario(tmp_path, search={"method": "tpe", "trials": 3, **search}))
    assert describe_pruner(scenario.search) == said


def test_a_stalled_gp_hands_its_space_to_the_forest(models_used: list[str]) -> None:
    """On Michalewicz-5 the GP wandered the box for 70 trials without a better cost; once the
    best cost is older than the last 25, the forest proposes."""
    params = {f"x{i}": Param(type="float", low=0.0, high=1.0) for i in range(2)}
    def cost(trial: optuna.Trial) -> float:  # the first configuration is the best there is
        values = _suggest(params)(trial)
        return 0.0 if trial.number == 0 else 1.0 + values["x0"] + math.sqrt(2) * values["x1"]  # no ties

    study = optuna.create_study(sampler=build_sampler("smac", params, seed=0))
    study.enqueue_trial({"x0": 0.5, "x1": 0.5})
    study.optimize(cost, n_trials=30)
    assert models_used[:16] == ["gp"] * 16 and models_used[16:] == ["forest"] * 4
    assert len(set(_params(study))) == 30
