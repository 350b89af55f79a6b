"""hpo's model-based optimizer: the encoding (hpo.codec), the forest (hpo.forest) and the
SmacSampler that proposes from them and from the GP (hpo.optimizer)."""
from __future__ import annotations

import math
import statistics
import threading
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from hpo.codec import Codec
from hpo.optimizer import SmacSampler
from hpo.scenario import Param

optuna.logging.set_verbosity(optuna.logging.WARNING)


def branin(x1: float, x2: float) -> float:
    """Branin-Hoo; global minimum 0.397887 at (pi, 2.275) and two other points."""
    b, c = 5.1 / (4 * math.pi**2), 5 / math.pi
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10


BRANIN_MIN = 0.397887357729739


Space = dict[str, Param]


def branin_space() -> Space:
    return {"x1": Param(type="float", low=-5.0, high=10.0), "x2": Param(type="float", low=0.0, high=15.0)}


def branin_objective(trial: optuna.Trial) -> float:
    return branin(trial.suggest_float("x1", -5.0, 10.0), trial.suggest_float("x2", 0.0, 15.0))


def mixed_space() -> Space:
    return {
        "dropout": Param(type="float", low=0.0, high=0.8),
        "lr": Param(type="float", low=1e-4, high=1.0, log=True),
        "layers": Param(type="int", low=1, high=6),
        "units": Param(type="int", low=8, high=512, log=True),
        "act": Param(type="categorical", choices=("relu", "tanh")),
        "batch": Param(type="categorical", choices=(16, 32, 64)),
        "bias": Param(type="categorical", choices=(True, False)),
        "epochs": Param(type="constant", value=10),
    }


def mixed_objective(trial: optuna.Trial) -> float:
    dropout = trial.suggest_float("dropout", 0.0, 0.8)
    lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
    layers = trial.suggest_int("layers", 1, 6)
    units = trial.suggest_int("units", 8, 512, log=True)
    act = trial.suggest_categorical("act", ["relu", "tanh"])
    batch = trial.suggest_categorical("batch", [16, 32, 64])
    bias = trial.suggest_categorical("bias", [True, False])
    epochs = trial.suggest_categorical("epochs", [10])
    assert epochs == 10 and isinstance(bias, bool) and batch in (16, 32, 64)
    return (
        (math.log10(lr) + 2) ** 2
        + (layers - 3) ** 2 / 4
        + (math.log2(units) - 6) ** 2 / 9
        + (dropout - 0.2) ** 2
        + (act == "tanh") * 0.5
        + (batch != 32) * 0.2
        + (not bias) * 0.1
    )


def conditional_space() -> Space:
    return {
        "optimizer": Param(type="categorical", choices=("sgd", "adam")),
        "momentum": Param(type="float", low=0.0, high=0.99, condition={"optimizer": "sgd"}),
        "lr": Param(type="float", low=1e-4, high=1.0, log=True),
    }


def conditional_objective(trial: optuna.Trial) -> float:
    optimizer = trial.suggest_categorical("optimizer", ["sgd", "adam"])
    penalty = 0.3
    if optimizer == "sgd":
        penalty = (trial.suggest_float("momentum", 0.0, 0.99) - 0.9) ** 2
    return (math.log10(trial.suggest_float("lr", 1e-4, 1.0, log=True)) + 1.5) ** 2 + penalty


def forest(space: Space, **options: Any) -> SmacSampler:
    """hpo's optimizer with the random forest as its model."""
    return SmacSampler(space, model="forest", **options)


def run(sampler: optuna.samplers.BaseSampler, objective: Any, n_trials: int, study: optuna.Study | None = None) -> optuna.Study:
    study = study or optuna.create_study(sampler=sampler)
    study.optimize(objective, n_trials=n_trials)
    return study


def test_encodes_every_parameter_type() -> None:
    codec = Codec(mixed_space())
    params = {"dropout": 0.25, "lr": 0.003, "layers": 4, "units": 100, "act": "tanh", "batch": 64, "bias": False}
    row = codec.encode([params])[0]
    assert np.all((row >= 0) & (row <= 2))
    assert codec.decode(row) == pytest.approx({**params, "epochs": 10})


def test_suggests_legal_values_of_every_type() -> None:
    study = run(forest(mixed_space(), seed=0), mixed_objective, 25)
    for trial in study.trials:
        p = trial.params
        assert 0.0 <= p["dropout"] <= 0.8 and 1e-4 <= p["lr"] <= 1.0
        assert isinstance(p["layers"], int) and 1 <= p["layers"] <= 6
        assert isinstance(p["units"], int) and 8 <= p["units"] <= 512
        assert p["act"] in ("relu", "tanh") and type(p["batch"]) is int and type(p["bias"]) is bool
    assert study.best_value < 1.0


def test_conditional_parameters_are_left_out_when_inactive() -> None:
    codec = Codec(conditional_space())
    rows = codec.encode([{"optimizer": "adam", "lr": 0.01}, {"optimizer": "sgd", "momentum": 0.5, "lr": 0.01}])
    assert "momentum" not in codec.decode(rows[0]) and codec.decode(rows[1])["momentum"] == pytest.approx(0.5)
    assert "momentum" not in codec.decode(codec.canonical(np.where(np.isnan(rows), 0.3, rows))[0])
    studies = [run(forest(conditional_space(), seed=seed), conditional_objective, 40) for seed in range(3)]
    for study in studies:
        assert {t.params["optimizer"] for t in study.trials} == {"sgd", "adam"}
        assert all(("momentum" in t.params) == (t.params["optimizer"] == "sgd") for t in study.trials)
    assert statistics.median(study.best_value for study in studies) < 0.05


def test_failed_trials_steer_away_from_their_region() -> None:
    study = optuna.create_study(sampler=forest(branin_space(), seed=3))
    for _ in range(40):
        trial = study.ask()
        x1, x2 = trial.suggest_float("x1", -5.0, 10.0), trial.suggest_float("x2", 0.0, 15.0)
        if x1 < 2.0:  # two of Branin's three minima lie here: crashes, not values
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, branin(x1, x2))
    late = [t for t in study.trials[15:]]
    crashed = sum(t.state == TrialState.FAIL for t in late)
    assert crashed <= 0.25 * len(late)
    assert study.best_value < BRANIN_MIN + 0.1


def test_crashes_and_trials_pruned_below_the_budget_cost_the_worst_cost() -> None:
    sampler = forest(branin_space(), seed=0)
    study = optuna.create_study(sampler=sampler)
    dists = {"x1": FloatDistribution(-5.0, 10.0), "x2": FloatDistribution(0.0, 15.0)}
    for x, value in ((0.0, 5.0), (1.0, 9.0), (1.5, 7.5)):
        study.add_trial(optuna.trial.create_trial(params={"x1": x, "x2": x}, distributions=dists, value=value))
    study.add_trial(optuna.trial.create_trial(params={"x1": 2.0, "x2": 2.0}, distributions=dists,
                                              state=TrialState.PRUNED, intermediate_values={0: 8.0, 3: 7.0}))
    study.add_trial(optuna.trial.create_trial(params={"x1": 3.0, "x2": 3.0}, distributions=dists,
                                              state=TrialState.FAIL))
    observations = sampler._history.read(study)
    assert list(observations.y) == [5.0, 9.0, 7.5, 9.0, 9.0] and list(observations.crashed) == [False] * 4 + [True]
    assert len(observations.seen) == 5


@pytest.mark.parametrize("suggested", [True, False])
def test_running_trial_of_another_worker_is_avoided(suggested: bool) -> None:
    study = run(forest(branin_space(), seed=5), branin_objective, 20)
    first = study.ask()
    if suggested:
        first.suggest_float("x1", -5.0, 10.0), first.suggest_float("x2", 0.0, 15.0)
    second = study.ask()
    a = first._cached_frozen_trial.params if suggested else None
    b = np.array([second.suggest_float("x1", -5.0, 10.0), second.suggest_float("x2", 0.0, 15.0)])
    if a is None:
        a = {"x1": first.suggest_float("x1", -5.0, 10.0), "x2": first.suggest_float("x2", 0.0, 15.0)}
    distance = np.linalg.norm((b - np.array([a["x1"], a["x2"]])) / 15.0)
    assert distance > 0.02


def test_same_seed_gives_the_same_sequence() -> None:
    def sequence(seed: int) -> list[dict[str, Any]]:
        return [t.params for t in run(forest(mixed_space(), seed=seed), mixed_objective, 20).trials]

    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)


def test_no_duplicates_on_a_small_discrete_space() -> None:
    cs = {"a": Param(type="int", low=0, high=4), "b": Param(type="int", low=1, high=5),
          "c": Param(type="categorical", choices=("x", "y", "z", "w"))}

    def objective(trial: optuna.Trial) -> float:
        a, b = trial.suggest_int("a", 0, 4), trial.suggest_int("b", 1, 5)
        return (a - 2) ** 2 + (b - 4) ** 2 + (trial.suggest_categorical("c", ["x", "y", "z", "w"]) != "z")

    study = run(forest(cs, seed=0), objective, 60)
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == 60


def test_stepped_parameters_stay_on_their_grid_without_duplicates() -> None:
    cs = {"a": Param(type="int", low=0, high=9, step=3), "b": Param(type="float", low=0.0, high=1.0, step=0.1)}

    def objective(trial: optuna.Trial) -> float:
        a, b = trial.suggest_int("a", 0, 9, step=3), trial.suggest_float("b", 0.0, 1.0, step=0.1)
        return (a - 5) ** 2 + 10 * (b - 0.55) ** 2

    study = run(forest(cs, seed=0), objective, 44)
    grid = {(a, round(b, 9)) for a in (0, 3, 6, 9) for b in np.arange(11) / 10}
    points = [(t.params["a"], round(t.params["b"], 9)) for t in study.trials]
    assert set(points) == grid


def test_warm_starts_from_existing_trials() -> None:
    rng = np.random.default_rng(0)
    dists = {"x1": FloatDistribution(-5.0, 10.0), "x2": FloatDistribution(0.0, 15.0)}
    study = optuna.create_study(sampler=forest(branin_space(), seed=0))
    warm = []
    for _ in range(30):
        params = {"x1": float(rng.uniform(-5, 10)), "x2": float(rng.uniform(0, 15))}
        warm.append(branin(**params))
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=warm[-1]))
    study.optimize(branin_objective, n_trials=6)
    proposed = [t.value for t in study.trials[30:]]
    assert statistics.median(proposed) < statistics.median(warm) / 4
    assert min(proposed) < min(warm)


def test_enqueued_trials_keep_their_values() -> None:
    study = optuna.create_study(sampler=forest(branin_space(), seed=0))
    study.enqueue_trial({"x1": 1.5, "x2": 2.5})
    study.optimize(branin_objective, n_trials=3)
    assert study.trials[0].params == {"x1": 1.5, "x2": 2.5}


def test_unknown_parameter_is_sampled_at_random() -> None:
    study = optuna.create_study(sampler=forest(branin_space(), seed=0))
    trial = study.ask()
    assert 0.0 <= trial.suggest_float("other", 0.0, 1.0) <= 1.0
    assert trial.suggest_categorical("kind", ["a", "b"]) in ("a", "b")


def test_maximize_direction() -> None:
    sampler = forest(branin_space(), seed=2, direction="maximize")
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(lambda trial: -branin_objective(trial), n_trials=30)
    assert -study.best_value < BRANIN_MIN + 0.5


def test_threads_sharing_one_sampler_and_storage() -> None:
    """Threads share one sampler (its lock orders proposals); across processes the
    engine's ask lock does the same (tests/test_workers.py)."""
    storage = optuna.storages.InMemoryStorage()
    sampler = forest(branin_space(), seed=1)
    studies = [
        optuna.create_study(storage=storage, study_name="shared", sampler=sampler, load_if_exists=True)
        for _ in (1, 2)
    ]
    threads = [threading.Thread(target=s.optimize, args=(branin_objective,), kwargs={"n_trials": 15, "n_jobs": 2}) for s in studies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trials = studies[0].trials
    assert len(trials) == 30 and all(t.state == TrialState.COMPLETE for t in trials)
    assert len({(t.params["x1"], t.params["x2"]) for t in trials}) == 30
    values = [t.value for t in trials]
    assert statistics.median(values[10:]) < statistics.median(values[:10])


@pytest.mark.parametrize("model, n_trials", [("forest", 40), ("gp", 30)])
def test_beats_random_search_on_branin(model: str, n_trials: int) -> None:
    def regret(sampler: optuna.samplers.BaseSampler, n: int) -> float:
        return run(sampler, branin_objective, n).best_value - BRANIN_MIN  # type: ignore[arg-type]

    random = statistics.median(regret(optuna.samplers.RandomSampler(seed=s), 40) for s in range(3))
    found = statistics.median(regret(SmacSampler(branin_space(), seed=s, model=model), n_trials) for s in range(3))
    assert found < min(0.05, 0.2 * random)


def test_a_long_history_s_forest_is_fitted_to_its_latest_observations() -> None:
    """Past max_points rows the forest saw the better half and a random rest: a 2,000-trial
    study's latest proposals, all worse than the better half, were hardly ever among them,
    and it went on proposing the region they had failed in."""
    from hpo.forest import _subsample
    y = np.random.default_rng(0).random(2000)
    y[-20:] = 2.0  # the latest observations are the worst
    keep = _subsample(y, 2003, 256, np.random.default_rng(1))
    assert len(keep) == 259 and len(set(keep.tolist())) == 259
    assert set(range(1980, 2003)) <= set(keep.tolist())  # the latest 20 and the 3 pending rows
    assert set(np.argsort(y)[:128].tolist()) <= set(keep.tolist())


def test_a_long_history_s_forest_is_fitted_again_every_few_observations() -> None:
    """It was reused until the history grew by 1 %: 20 proposals from one forest at 2,000 trials."""
    from hpo import forest
    codec = Codec(branin_space())
    rng = np.random.default_rng(0)
    x = codec.sample(2100, rng)
    y = x.sum(axis=1)
    pending = np.zeros((0, 2))
    settings = {"n_trees": 4, "max_points": 64, "n_random": 50, "n_starts": 2}
    fitted = []
    for n in range(2000, 2000 + 2 * forest.REFIT_AFTER + 1):
        forest.ranked(codec, x[:n], y[:n], pending, "cadence", rng, **settings)
        fitted.append(forest._fitted["cadence"].n_observed)
    assert fitted == [2000] * forest.REFIT_AFTER + [2000 + forest.REFIT_AFTER] * forest.REFIT_AFTER + [2008]
