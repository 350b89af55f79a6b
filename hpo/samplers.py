"""One small interface for every search method: the scenario picks an Optuna sampler and pruner.

Design methods (monte_carlo, csv, grid, sobol, lhs) enqueue their points in the study
(see :mod:`hpo.designs`); their sampler only fills in what a point leaves open. Model-based
methods propose each trial from the whole history in the store: Optuna's TPE and GP, and
hpo's SMAC-style optimizer for ``smac``.
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import optuna

from hpo import space
from hpo.scenario import Param, Scenario, Search


def make_sampler(scenario: Scenario, seed: int, resumed_at: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of ``search.method``, seeded with this worker's ``seed`` and, in a study
    that already has ``resumed_at`` trials, with that count too. A seeded sampler's random
    stream starts over in every process: resumed with the seed alone, TPE's and the GP's
    random start would draw the first run's configurations again (smac's, near copies of
    them). The same resume point gives the same seed, so a resumed sweep is repeatable."""
    if resumed_at:
        seed = int(np.random.SeedSequence([seed, resumed_at]).generate_state(1)[0])
    return build_sampler(scenario.search.method, scenario.parameters, seed=seed,
                         direction=scenario.objective.direction)


def _quiet_independent_sampling() -> dict[str, bool]:
    """TPESampler's argument that silences its independent-sampling warnings, where it warns
    by default (Optuna before 4.9); later Optuna is silent by default, deprecates the argument
    (a FutureWarning) and drops it in 6."""
    parameter = inspect.signature(optuna.samplers.TPESampler).parameters.get("warn_independent_sampling")
    return {"warn_independent_sampling": False} if parameter is not None and parameter.default is True else {}


class _GPSampler(optuna.samplers.GPSampler):
    """Optuna's GPSampler, giving a float it proposes at a bound as the bound (:func:`hpo.space.at_bound`)."""

    def sample_relative(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        search_space: dict[str, optuna.distributions.BaseDistribution]) -> dict[str, Any]:
        """Optuna's proposal, with each float at a bound made that bound."""
        proposal = super().sample_relative(study, trial, search_space)
        return {name: space.at_bound(value, search_space[name].low, search_space[name].high)
                if isinstance(search_space[name], optuna.distributions.FloatDistribution) else value
                for name, value in proposal.items()}


def build_sampler(method: str, parameters: Mapping[str, Param], *, seed: int | None,
                  direction: str = "minimize") -> optuna.samplers.BaseSampler:
    """The sampler of a search method over ``parameters``.

    Args:
        method: a search method name (``tpe``, ``gp``, ``smac``; any other gets random sampling).
        parameters: the scenario's parameters, in definition order.
        seed: the worker's seed (``None``: fresh randomness).
        direction: ``minimize`` or ``maximize``, the objective's direction.
    """
    if method == "tpe":
        with warnings.catch_warnings():  # hpo's choice of TPE's options, not its caller's: no ExperimentalWarning
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                              **_quiet_independent_sampling())
    if method == "gp":
        from hpo.gp import START_TRIALS

        return _GPSampler(seed=seed, n_startup_trials=START_TRIALS, warn_independent_sampling=False)
    if method == "smac":
        from hpo.optimizer import SmacSampler

        return SmacSampler(parameters, seed=seed, direction=direction)
    return optuna.samplers.RandomSampler(seed=seed)


HYPERBAND_MAX_STEP = 81
"""Hyperband's maximum resource where ``search.max_step`` is not given (3**4: five brackets)."""


def make_pruner(scenario: Scenario) -> optuna.pruners.BasePruner:
    """The pruner of ``search.pruner`` (``none`` never prunes).

    Successive halving and Hyperband count their rungs from step 1 (Optuna's ``min_resource``
    1): a trial's value at a rung is its first report at or after the rung's step, whatever
    else runs at the time. Optuna's ``"auto"`` waits for a first trial to complete, and a
    trial already past step 1 by then would enter rung 0 with a late (better) value that
    every later trial's step-1 value loses against. Hyperband's maximum resource is
    ``search.max_step`` (default :data:`HYPERBAND_MAX_STEP`) for the same reason.
    """
    search = scenario.search
    if search.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    if search.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
    if search.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=search.max_step or HYPERBAND_MAX_STEP)
    return optuna.pruners.NopPruner()


def describe_pruner(search: Search) -> str:
    """The pruner in a few words for the sweep's plan line (empty for ``none``). Hyperband's
    says the steps its brackets span, and where ``search.max_step`` is not set that they are
    the default's: a script that reports 10 epochs gets brackets built for 81, in which a
    trial whose rungs lie past its last step is never pruned, and the line is where it is told.
    """
    if search.pruner == "none":
        return ""
    if search.pruner == "successive_halving":
        return "pruner successive_halving (rungs at steps 1, 4, 16, ...)"
    if search.pruner == "hyperband":
        if search.max_step is None:
            return (f"pruner hyperband over steps 1..{HYPERBAND_MAX_STEP} (search.max_step not set: "
                    "set it to the last step a trial reports)")
        return f"pruner hyperband over steps 1..{search.max_step} (search.max_step)"
    return f"pruner {search.pruner}"
