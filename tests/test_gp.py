"""hpo.gp: the costs the GP is told (warped) and the proposal it makes from them."""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import optuna
import pytest
from scipy import stats

from hpo.codec import Codec, keys
from hpo.gp import GPProposer, warped
from hpo.history import Observations
from hpo.scenario import Param

PARAMS = {"x": Param(type="float", low=-2.0, high=2.0), "y": Param(type="float", low=-1.0, high=3.0)}


def _rosenbrock(rows: np.ndarray) -> np.ndarray:
    return 100 * (rows[:, 1] - rows[:, 0] ** 2) ** 2 + (1 - rows[:, 0]) ** 2


def test_warping_keeps_the_order_and_tames_a_heavy_tail() -> None:
    costs = _rosenbrock(np.random.default_rng(0).uniform([-2, -1], [2, 3], size=(30, 2)))
    out = warped(costs)
    assert np.array_equal(np.argsort(out, kind="stable"), np.argsort(costs, kind="stable"))
    assert abs(stats.skew(out)) < 0.5 < stats.skew(costs)


def test_warping_ignores_the_unit_and_offset_of_the_cost() -> None:
    costs = np.random.default_rng(1).lognormal(size=20)
    assert np.allclose(warped(costs), warped(1000 * costs - 7))


@pytest.mark.parametrize("costs", [[1.0], [2.0, 1.0], [3.0, 3.0, 1.0, 1.0]])
def test_fewer_than_three_distinct_costs_are_left_as_they_are(costs: list[float]) -> None:
    assert np.array_equal(warped(np.array(costs)), np.array(costs))


def test_the_exponent_stays_at_minus_one_or_above() -> None:
    """Many costs near the optimum and a few far worse: the fitted exponent would fall below -1;
    the transform is the one at -1."""
    costs = np.concatenate([np.linspace(0.0, 0.01, 40), [5.0, 50.0, 500.0]])
    standard = (costs - costs.mean()) / costs.std()
    assert stats.yeojohnson_normmax(standard) < -1
    assert np.allclose(warped(costs), stats.yeojohnson(standard, lmbda=-1.0))


def test_the_gp_proposes_what_optunas_gp_proposes_on_the_warped_costs() -> None:
    codec = Codec(PARAMS)
    x = codec.sample(12, np.random.default_rng(2))
    points = [{name: float(value) for name, value in codec.decode(row).items()} for row in x]
    costs = _rosenbrock(np.array([[point["x"], point["y"]] for point in points]))
    observations = Observations(x, costs, np.zeros(12, dtype=bool), np.empty((0, 2)), frozenset(keys(x)))

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    distributions = codec.distributions()
    study.add_trials([optuna.trial.create_trial(params=point, distributions=distributions, value=float(value))
                      for point, value in zip(points, warped(costs))])
    trial = study.ask()
    frozen = study.trials[trial.number]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.GPSampler(seed=4, n_startup_trials=1)
        expected = sampler.sample_relative(study, frozen, dict(sorted(distributions.items())))
    proposal = GPProposer(codec, seed=4).propose(observations)
    assert proposal == expected
    assert proposal != GPProposer(codec, seed=4).propose(
        Observations(x, np.log(costs + 1), observations.crashed, observations.pending, observations.seen))


def test_importing_the_optimizer_leaves_scipy_stats_for_the_first_warp() -> None:
    """scipy.stats takes about half a second to import, which a sweep of 20 trials pays as
    25 ms a trial (bench/optimizer_cost.py); the GP imports it on its first proposal."""
    code = "import sys, hpo.optimizer; print('scipy.stats' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "False"


UNIT = {"x": Param(type="float", low=0.0, high=1.0), "y": Param(type="float", low=0.0, high=1.0)}


def _bowl(codec: Codec, x: np.ndarray, pending: np.ndarray | None = None) -> Observations:
    costs = (x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2
    pending = np.empty((0, codec.dim)) if pending is None else pending
    return Observations(x, costs, np.zeros(len(x), dtype=bool), pending, frozenset(keys(np.vstack([x, pending]))))


def test_the_mean_minimum_lies_at_the_bottom_of_a_smooth_bowl() -> None:
    codec = Codec(UNIT)
    point = GPProposer(codec, seed=0).mean_minimum(_bowl(codec, codec.sample(20, np.random.default_rng(3))))
    assert point is not None and abs(point["x"] - 0.3) < 0.03 and abs(point["y"] - 0.6) < 0.03


@pytest.mark.parametrize("where", ["tried", "running"])
def test_no_mean_minimum_where_that_point_was_tried_or_is_running(where: str) -> None:
    """Refining on a point already tried teaches nothing, and parallel workers must not pile
    onto one point: the GP then proposes by expected improvement."""
    codec = Codec(UNIT)
    x = codec.sample(20, np.random.default_rng(3))
    bottom = codec.encode([{"x": 0.3, "y": 0.6}])
    observations = _bowl(codec, np.vstack([x, bottom])) if where == "tried" else _bowl(codec, x, pending=bottom)
    assert GPProposer(codec, seed=0).mean_minimum(observations) is None


def test_the_mean_minimum_keeps_the_best_trials_choices_and_needs_enough_of_them() -> None:
    params = {**UNIT, "kind": Param(type="categorical", choices=["a", "b"])}
    codec = Codec(params)
    x = codec.sample(30, np.random.default_rng(4))
    costs = (x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2 + np.where(x[:, 2] == 1, 0.0, 0.5)  # "b" is better
    observations = Observations(x, costs, np.zeros(30, dtype=bool), np.empty((0, 3)), frozenset(keys(x)))
    point = GPProposer(codec, seed=0).mean_minimum(observations)
    assert point is not None and point["kind"] == "b"
    few = Observations(x[:4], costs[:4], np.zeros(4, dtype=bool), np.empty((0, 3)), frozenset(keys(x[:4])))
    assert GPProposer(codec, seed=0).mean_minimum(few) is None


def test_the_warm_up_leaves_the_gp_ready_and_runs_once_a_process() -> None:
    """Once it returns, PyTorch (Optuna's GP) and scikit-learn's GP (the mean step) are
    imported, so the first proposal, made while its worker holds the study's ask lock, does
    not import them; asked again, it does nothing."""
    code = ("import sys, optuna; from hpo import gp; made = []; create = optuna.create_study; "
            "optuna.create_study = lambda *a, **k: made.append(1) or create(*a, **k); gp.warm_up(); "
            "print('torch' in sys.modules, 'sklearn.gaussian_process' in sys.modules); gp.warm_up(); print(len(made))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=360)
    assert shown.stdout == "True True\n1\n"


class _WarmUpAsked(BaseException):
    """Raised by the stand-in for :func:`hpo.gp.warm_up`: the sweep asked for it."""


@pytest.mark.parametrize(("search", "parameters", "asked"), [
    ({"method": "smac", "trials": 11}, None, True),  # the GP proposes the 11th trial
    ({"method": "gp", "trials": 11}, None, True),
    ({"method": "gp", "trials": 10}, None, False),  # Optuna's random start trials only
    ({"method": "smac", "trials": 10}, None, False),  # the initial design only
    ({"method": "tpe", "trials": 11}, None, False),
    ({"method": "smac", "trials": 11}, {"opt": {"type": "categorical", "choices": ["a", "b"]},  # the forest's
                                        "m": {"type": "float", "low": 0.0, "high": 0.9, "condition": {"opt": "a"}}},
     False),
])
def test_a_sweep_warms_the_gp_up_where_the_gp_will_propose(search, parameters, asked, write_scenario, tmp_path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hpo import cli, forest_service, gp

    def stand_in() -> None:
        raise _WarmUpAsked

    monkeypatch.setattr(gp, "warm_up", stand_in)
    monkeypatch.setenv("HPO_GPUS", "")
    overrides = {"search": search} if parameters is None else {"search": search, "parameters": parameters}
    scenario = write_scenario(tmp_path, **overrides)
    try:
        if asked:
            with pytest.raises(_WarmUpAsked):
                cli.main(["run", str(scenario)])
        else:
            assert cli.main(["run", str(scenario)]) == 0
    finally:
        forest_service.stop()


def test_the_gp_proposes_from_the_end_of_the_initial_design_to_its_most_points() -> None:
    """What decides a sweep's warm-up: a study going on from ``n_done`` trials to ``n_trials``."""
    from hpo.optimizer import SmacSampler

    sampler = SmacSampler(UNIT, seed=0)
    assert (sampler.uses_gp_within(10), sampler.uses_gp_within(11)) == (False, True)  # 10 start draws
    assert (sampler.uses_gp_within(1020, 200), sampler.uses_gp_within(1020, 1000)) == (True, False)  # the forest's
    assert not sampler.uses_gp_within(1020, 1020)
    assert SmacSampler(UNIT, seed=0, model="gp").uses_gp_within(1020, 1000)
    assert not SmacSampler(UNIT, seed=0, model="forest").uses_gp_within(50)
