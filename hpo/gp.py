"""Gaussian-process proposals for hpo's optimizer: Optuna's GPSampler on SMAC's costs, warped.

SMAC3's black-box facade answers small continuous problems with a GP. hpo asks Optuna's
:class:`~optuna.samplers.GPSampler` (Matern-5/2 ARD kernel, log expected improvement, a
batched local search of it) through its public sampler interface, on a private in-memory
study that holds the finished history as the optimizer sees it
(:class:`hpo.history.Observations`): crashes at the crash cost, pruned trials at the chosen
budget.

The GP is told the costs through a Yeo-Johnson power transform fitted to them
(:func:`warped`), as HEBO warps its outputs: Optuna's GP standardizes the costs, so on a
heavy-tailed cost (Rosenbrock's, a loss that explodes for a bad learning rate) the few huge
values set the scale and the region worth refining looks flat. The transform's exponent is
kept at -1 or more: once many trials gather near the optimum the fitted exponent falls to -2
and below, which flattens everything else. On bench/optimizers.py (10 seeds, median regret
at 50 and 100 trials, against Optuna's GP on the raw costs) this took Rosenbrock-4 from 263
and 14 to 34 and 2.6, Levy-4 from 0.56 and 0.11 to 0.23 and 0.058, the mixed space from
2.2e-5 and 8.2e-6 to 1.9e-6 and 1.6e-6, Hartmann-3 and Ackley-5 down by 1.1x to 4.5x; Branin
at 50 trials and Hartmann-6 at 50 came out 1.34x and 1.04x, and over 20 more seeds (10 to
29) the warped GP was ahead there too (Branin 5.9e-5 against 7.3e-5, Hartmann-6 0.0029
against 0.0105). On the real tasks, whose tied costs soon hand over to the forest, gradient
boosting went from 1.10x and 1.13x SMAC3's regret to 0.90x and 1.00x, and the MLP on digits
lost one validation example of 797 at 50 trials; on bench/multifidelity.py, where the GP
keeps its space under Hyperband, smac + Hyperband reached 0.0034 against TPE + Hyperband's
0.0059. The exponent floor was measured: unbounded, Branin at 100 trials lost 1.2x; at 0,
Rosenbrock-4 kept less of its gain. SMAC's log-scaled costs and a normal-scores (rank)
transform were far worse on the smooth functions (Branin 500x to 2,800x at 50 trials): they
distort the costs near the optimum.

Every third proposal, once the GP has 20 costs, :mod:`hpo.optimizer` asks for
:meth:`GPProposer.mean_minimum` instead: where the posterior mean is lowest, a refinement of
the best region that expected improvement, which keeps exploring, makes only now and then.
Optuna does not expose its GP's posterior mean, so this one is scikit-learn's, fitted to the
same warped costs.

Running trials (other workers', other slots') are shown to the GP as running trials, so
Optuna's GPSampler proposes the point that best adds to them (its q-batch log EI) and
parallel workers spread out instead of proposing one point each. On the raw costs this had
left more sweeps in a local optimum than proposing from the finished trials alone, and hpo
did that, showing the running trials only to a proposal within 1 % of one of them. On the
warped costs the batch does better: bench/parallel.py --in-process (Hartmann-6, 50 trials,
each proposal made while 3 trials run, seeds 1 to 100) had 51 runs in a local optimum and a
median regret of 0.012 for the others under the 1 % rule, and 46 and 0.0086 with the running
trials always shown (45 and 0.0046 in a second run that drew other random numbers); one
worker has 35 and 0.0009. The GP refines its basin a step at a time, and each of 4 workers'
proposals lacks 3 results, which is most of what is still lost. Measured since with the mean
step (seeds 1 to 30; one worker 0.0016 with 9 runs in a local optimum, 4 workers 0.027 with
13), none of these did better, and none is kept: expected improvement from the finished trials
alone (0.073, 15), or unless its point lies within 2 % or 5 % of a running trial (0.081 and
0.029); the mean step every second trial (0.067); a mean step only once the previous one has
finished (0.033; better for the runs out of a local optimum on these seeds, 0.0051 against
0.0098, worse on seeds 31 to 60); and, while one runs, a second mean step on a GP that believes
the running trials at their mean plus 1 or 0.3 standard deviations (0.038 and 0.11); nor
Thompson sampling in place of the q-batch EI while trials run (one joint draw of the posterior
on 1,000 random and local candidates: 19 of seeds 1 to 26 in a local optimum). Through the
real CLI (bench/parallel.py, 4 workers, seeds 1 to 20), a mean step every second proposal while
trials run did no better either (median regret 0.0084 and 0.0107 on seeds 1 to 10 and 11 to 20,
against 0.0110 and 0.0056). Nor did fitting Optuna's GP afresh at every proposal instead of from
its previous fit (in process, seeds 1 to 30: one worker 11 runs in a local optimum against 9),
nor the Kriging believer: the running trials shown to Optuna's GP as finished at the posterior
mean of a scikit-learn GP fitted to the finished ones (in process, 3 workers, seeds 1 to 30: 15
runs in a local optimum with it and without, the others' median regret 0.0041 against 0.0066,
inside the spread of two runs of one rule above).
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from hpo.codec import Codec
from hpo.history import Observations

START_TRIALS = 10
"""Random trials before the GP proposes, for ``search.method: gp`` (Optuna's GPSampler's
default) and for smac on the GP's spaces alike."""

_warmed = False


def warm_up() -> None:
    """Prepare this process for its first GP proposal, now (once per process).

    The first proposal otherwise imports PyTorch, runs its first operations and imports
    scikit-learn's GP and scipy's optimizers (3 to 5 s on 2 cores) while its worker holds the
    study's ask lock, which every other worker waits for: four workers of a 6-D study stood
    one after another for 16 s there. A sweep calls this before its slots start, so that
    workers prepare side by side. It proposes once on a toy study of its own with Optuna's
    GPSampler (imports alone leave a second of PyTorch's first calls) and imports the rest;
    a failure is left to the first real proposal to meet and say. It runs in the caller's
    thread: importing scipy.stats on a thread of its own while a slot imported it too left
    that slot a partly imported module (an ImportError) once in a few runs."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    with contextlib.suppress(Exception):
        box = optuna.distributions.FloatDistribution(0.0, 1.0)
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                    sampler=optuna.samplers.GPSampler(seed=0, n_startup_trials=1,
                                                                      warn_independent_sampling=False))
        study.add_trials([optuna.trial.create_trial(params={"a": a, "b": b}, distributions={"a": box, "b": box},
                                                    value=(a - 0.3) ** 2 + b)
                          for a, b in ((0.1, 0.8), (0.6, 0.2), (0.9, 0.5))])
        study.ask({"a": box, "b": box})
        for module in ("scipy.optimize", "scipy.stats", "sklearn.gaussian_process"):
            importlib.import_module(module)


class GPProposer:
    """Proposes one configuration from observations with Optuna's GP.

    Args:
        codec: the encoding of the search space (no conditions).
        seed: seed of the GP sampler (``None``: fresh randomness).
    """

    def __init__(self, codec: Codec, seed: int | None) -> None:
        self._codec = codec
        self._seed = seed
        self._distributions = codec.distributions()
        self._search_space = dict(sorted(self._distributions.items()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=1, warn_independent_sampling=False)

    def propose(self, observations: Observations) -> dict[str, Any]:
        """The configuration the GP's acquisition prefers, given the observations (at least
        one). Trials are given to the GP with their exact parameter values and their
        :func:`warped` costs, the pending configurations as running trials, and the search
        space in the order Optuna's own GPSampler uses (sorted by name), so that it proposes
        exactly what ``search.method: gp`` would on that history: with running trials, the
        point that best adds to them (Optuna's q-batch log EI)."""
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                    sampler=optuna.samplers.RandomSampler(seed=0))
        observed = self._exact(observations.x, observations.params)
        trials = [optuna.trial.create_trial(params=params, distributions=self._distributions, value=float(cost))
                  for params, cost in zip(observed, warped(observations.y))]
        trials += [optuna.trial.create_trial(state=TrialState.RUNNING, params=self._params(row),
                                             distributions=self._distributions)
                   for row in self._complete(observations.pending)]
        study.add_trials(trials)
        number = study.ask().number
        trial = next(t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.number == number)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._sampler.sample_relative(study, trial, self._search_space)

    def mean_minimum(self, observations: Observations, tolerance: float = 1e-3) -> dict[str, Any] | None:
        """Where the GP's posterior mean of the :func:`warped` costs is lowest, searched from
        the best five configurations with the categorical values of the best one; None if
        fewer than the numeric parameters + 2 trials share those values or if the point lies
        within ``tolerance`` (of each unit range) of a configuration tried or running.

        The GP is scikit-learn's (a Matern-5/2 ARD kernel and a noise term, fitted by maximum
        likelihood), fitted to the trials that share the best one's categorical values: Optuna
        does not expose its own GP's posterior mean. Each fit starts afresh, from three starting
        points: the fit is most of this method's time (0.4 s at 50 costs in 6-D, 3 s at 200 in
        10-D on 2 cores), but one started from the previous fit alone, 12x faster, made worse
        steps (Levy-4 and Ackley-5 at 100 trials and Hartmann-6 at 50 ended worse on 3 of 4
        seeds each)."""
        from scipy.optimize import minimize
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        numeric, codec = self._codec.numeric, self._codec
        x, costs = self._complete(observations.x), warped(observations.y)
        best = x[int(np.argmin(costs))]
        same = np.all(x[:, ~numeric] == best[~numeric], axis=1)
        rows, costs = x[same][:, numeric], costs[same]
        dims = int(numeric.sum())
        if dims == 0 or len(rows) < dims + 2:
            return None
        kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(np.full(dims, 0.5), (1e-2, 1e2), nu=2.5) \
            + WhiteKernel(1e-5, (1e-9, 1e-1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # length scales at their bounds, L-BFGS-B's line search
            gp = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=2,
                                          random_state=self._seed).fit(rows, costs)
            found = [minimize(_with_gradient(gp.predict), start, jac=True, bounds=[(0.0, 1.0)] * dims,
                              method="L-BFGS-B") for start in rows[np.argsort(costs)[:5]]]
        point = best.copy()
        point[numeric] = min(found, key=lambda result: result.fun).x
        point = codec.canonical(point[None])[0]
        tried = np.vstack([x, self._complete(observations.pending)])
        alike = tried[np.all(tried[:, ~numeric] == point[~numeric], axis=1)][:, numeric]
        if len(alike) and np.min(np.max(np.abs(alike - point[numeric]), axis=1)) < tolerance:
            return None
        return self._params(point)

    def _exact(self, rows: np.ndarray, params: tuple[Mapping[str, Any], ...]) -> list[dict[str, Any]]:
        """Each row's searched values: the trial's own where it has every one, else decoded."""
        if len(params) != len(rows):
            params = ({},) * len(rows)
        return [{name: given[name] for name in self._distributions} if self._legal(given) else self._params(row)
                for row, given in zip(self._complete(rows), params)]

    def _legal(self, params: Mapping[str, Any]) -> bool:
        """Whether ``params`` has a legal value of every searched parameter."""
        for name, distribution in self._distributions.items():
            value = params.get(name)
            if isinstance(distribution, optuna.distributions.CategoricalDistribution):
                if not any(value == choice and type(value) is type(choice) for choice in distribution.choices):
                    return False
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not distribution.low <= value <= distribution.high:
                return False
        return True

    def _complete(self, rows: np.ndarray) -> np.ndarray:
        """Rows with the values a trial never suggested filled in (the middle of a range, the
        first choice), so they stay constant to the GP."""
        filled = np.where(np.isnan(rows), np.where(self._codec.categorical, 0.0, 0.5), rows)
        return self._codec.canonical(filled)

    def _params(self, row: np.ndarray) -> dict[str, Any]:
        """The searched values of a row, legal for their Optuna distributions."""
        values = self._codec.decode(row)
        params: dict[str, Any] = {}
        for name, distribution in self._distributions.items():
            if isinstance(distribution, (optuna.distributions.FloatDistribution,
                                         optuna.distributions.IntDistribution)):
                value = min(max(values[name], distribution.low), distribution.high)
                integer = isinstance(distribution, optuna.distributions.IntDistribution)
                params[name] = round(value) if integer else float(value)
            else:
                params[name] = values[name]
        return params


def _with_gradient(predict: Callable[[np.ndarray], np.ndarray], step: float = 1e-8
                   ) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    """``u -> (predict at u, its gradient by forward differences)`` from one call of
    ``predict`` on a batch, stepping back from the unit cube's upper face."""
    def value_and_gradient(u: np.ndarray) -> tuple[float, np.ndarray]:
        steps = np.where(u + step <= 1.0, step, -step)
        values = predict(np.vstack([u, u + np.diag(steps)]))
        return float(values[0]), (values[1:] - values[0]) / steps
    return value_and_gradient


_LOWEST_EXPONENT = -1.0


def warped(costs: np.ndarray) -> np.ndarray:
    """``costs`` standardized and put through the Yeo-Johnson transform whose exponent (at
    least -1) makes them most normal (scipy's maximum likelihood); order is kept. Costs with
    fewer than 3 distinct values are returned as they are."""
    costs = np.asarray(costs, dtype=float)
    if len(np.unique(costs)) < 3:
        return costs
    from scipy import stats  # imported when first needed: scipy.stats is slow to import (0.5 s)

    standard = (costs - costs.mean()) / costs.std()
    with np.errstate(all="ignore"):
        exponent = stats.yeojohnson_normmax(standard)
    exponent = max(float(exponent), _LOWEST_EXPONENT) if np.isfinite(exponent) else 1.0
    return stats.yeojohnson(standard, lmbda=exponent)
