"""Gaussian-process proposals for hpo's optimizer: Optuna's GPSampler on SMAC's costs.

SMAC3's black-box facade answers small continuous problems with a GP. hpo asks Optuna's
:class:`~optuna.samplers.GPSampler` (Matern-5/2 ARD kernel, log expected improvement, a
batched local search of it) through its public sampler interface, on a private in-memory
study that holds the finished history as the optimizer sees it
(:class:`hpo.history.Observations`): crashes at the crash cost, pruned trials at the chosen
budget.

Running trials (other workers', other slots') are not shown to the GP at first. Optuna's
GPSampler would fold them into a q-batch log EI, which spreads parallel workers away from the
trials already running in the best basin; on bench/parallel.py (Hartmann-6, 4 workers, 50
trials, seeds 1 to 20) that left 8 of 20 sweeps in a local optimum (median regret 0.031), where
proposing from the finished trials alone left 3 of 20 (median regret 0.018). But workers whose
acquisitions agree then propose the same point, often a corner the GP explores, and the later
ones evaluated an unseen neighbour 0.1 % away, a wasted trial. So a proposal within 1 % of a
running configuration is made again with the running trials shown to the GP
(:class:`hpo.optimizer.SmacSampler`): over seeds 1 to 20 of the same bench, median regret
0.046 -> 0.020, runs in a local optimum 7 -> 5, and the median of the others 0.022 -> 0.011.
Runs of several workers depend on timing, so these figures move between repeats (without the
re-proposal, 3 of 20 trapped and 0.018 one day, 7 of 20 and 0.046 another).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from hpo.codec import Codec
from hpo.history import Observations


class GPProposer:
    """Proposes one configuration from observations with Optuna's GP.

    Args:
        codec: the encoding of the search space (no conditions).
        seed: seed of the GP sampler (``None``: fresh randomness).
    """

    def __init__(self, codec: Codec, seed: int | None) -> None:
        self._codec = codec
        self._distributions = codec.distributions()
        self._search_space = dict(sorted(self._distributions.items()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=1, warn_independent_sampling=False)

    def propose(self, observations: Observations, running: bool = False) -> dict[str, Any]:
        """The configuration the GP's acquisition prefers, given the observations (at least
        one). Trials are given to the GP with their exact values, and the search space in the
        order Optuna's own GPSampler uses (sorted by name), so that on the same history it
        proposes exactly what ``search.method: gp`` would. With ``running``, the pending
        configurations are shown to it as running trials (Optuna's q-batch log EI)."""
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                    sampler=optuna.samplers.RandomSampler(seed=0))
        observed = self._exact(observations.x, observations.params)
        trials = [optuna.trial.create_trial(params=params, distributions=self._distributions, value=float(cost))
                  for params, cost in zip(observed, observations.y)]
        if running:
            trials += [optuna.trial.create_trial(state=TrialState.RUNNING, params=self._params(row),
                                                 distributions=self._distributions)
                       for row in self._complete(observations.pending)]
        study.add_trials(trials)
        number = study.ask().number
        trial = next(t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.number == number)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._sampler.sample_relative(study, trial, self._search_space)

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
