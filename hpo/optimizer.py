"""hpo's model-based optimizer (``search.method: smac``) as an Optuna sampler.

:class:`SmacSampler` proposes one whole configuration per trial and hands it out name by
name from ``sample_independent``, so define-by-run code that suggests the parameters of a
ConfigSpace space (same names, conditional parameters skipped when inactive) gets a
coherent proposal. The proposal is made on the trial's first ``sample_independent`` call,
so a trial whose parameters are all fixed (enqueued) costs no proposal. The history is read
from the study incrementally (:class:`hpo.history.History`), so any number of threads and
processes can share one storage.

Like SMAC3's facades it is a portfolio. While the space is unconditional with at most 10
searched parameters and the history short, it is Optuna's GPSampler (:mod:`hpo.gp`): the same
random start (the same draws for the same seed), then the proposals Optuna's GP makes when told
the costs through a fitted power transform, which keeps a heavy-tailed cost from hiding the
region worth refining; unlike ``gp``, ``smac`` also learns from crashes, never repeats a
configuration and turns to the forest once costs tie on a grid (below). For conditional or
larger spaces and long histories it is a scrambled Sobol design, then SMAC's random forest
(:mod:`hpo.forest`), whose cost stays flat. On bench/optimizers.py (10 seeds) the GP is far
ahead of the forest on the smooth spaces of 2 to 6 parameters and far behind it on the 20-D
Branin (median regret 0.20 against 0.056 at 50 trials, 0.011 against 0.0016 at 100). The line at
10 was drawn in that gap; Ackley and Levy in 10-D, added later, keep it there: the GP (smac with
``model='gp'``) reached 5.3 and 2.6 on Ackley-10 against the forest's 7.3 and 4.9, and 17 and
6.7 on Levy-10 against 15 and 8.1 (median regret at 50 and 100 trials). On those two smac fell
behind Optuna's GP at 100 trials, and significantly so over 20 seeds (Ackley-10 4.0 against 3.5,
Levy-10 7.2 against 3.9): the first tie of two costs, between two corners of the box, handed the
GP's space to the forest, and the GP refined from a model of 20 costs in 10 dimensions. Ties now
count only on a grid, and mean steps wait for 4 costs per parameter (both below): over the same
20 seeds Ackley-10 reached 5.4 and 2.9, Levy-10 14.9 and 4.6 (Optuna's GP 4.8 and 3.5, 20 and
3.9). Other rules did worse: the GP alone without mean steps in 8 to 10 dimensions was behind on
three of five functions added then, untuned (Rastrigin-8, Michalewicz-10, Hartmann-6 among 8
parameters); and these did not mend Levy-10: a mean step skipped while the last two failed to
beat the best cost (18 at 50 trials, 20 seeds), mean steps every fifth trial in 8 to 10
dimensions (5.0 at 100, 10 seeds) and mean steps only within 0.1 of each range of the best
configuration (6.9 at 100, 10 seeds).

A GP assumes a smooth cost. An error counted over a few hundred validation examples is a step
function instead: configurations tie exactly, and the forest, whose trees are step functions,
models that better. So once two costs below the worst tie exactly and all of them lie on one
grid (whole multiples of one step apart, as k errors of n are; :func:`on_a_grid`), the forest
proposes (the worst is left out: crashes and trials pruned below the budget share it). On
bench/optimizers.py (10 seeds; 50 and 100 trials) the rule moved smac's median regret, against
the best of TPE, Optuna's GP and SMAC3, from 1.00x to 0.77x and 0.55x on an MLP on digits, and
from 1.20x and 1.25x to 1.10x and 1.13x on gradient boosting on breast cancer (half an example
of 569). A smooth function ties where the GP's exploration has spent trials on corners of equal
cost (Michalewicz-5 is flat at its corners; Ackley-5's and Ackley-10's permuted corners tie).
Counted as ties, such corners handed over to the forest, which did better in 5 dimensions and
worse in 10 (above); off a grid they do not count, which costs Ackley-5 at 100 trials (median
regret 1.2 against 0.74, 20 seeds; Optuna's GP 2.5) and Michalewicz-5 (2.0 and 1.4 against 1.9
and 1.1; TPE 2.3 and 2.0) and takes Levy-4 at 100 trials from 0.032 to 0.00029. The rule cost
the digits CNN of bench/multifidelity.py, tuned without a pruner, one validation example (median
regret 0.0067 -> 0.0084, 10 seeds). Under a pruner (a history with trials stopped early) the GP
keeps its space: there the forest lost two examples (smac + Hyperband 0.0042 -> 0.0076 against
TPE + Hyperband's 0.0050).

Where the GP's model is wrong the GP wanders: on Michalewicz-5, narrow valleys in a flat
space, it spread its proposals over the box and 3 of 10 seeds found nothing better from
trial 30 to 100, where the forest, searching near its best configurations, went on
improving. So the forest also proposes while the best cost is older than the last 25
(``gp_patience``); once it finds a better one the GP takes over again. On bench/optimizers.py
(10 seeds) Michalewicz-5 at 100 trials went from 1.84 to 1.14 (SMAC3 1.61), Branin at 100
from 1.7e-6 to 3.8e-6 and Rosenbrock-4 at 100 from 2.3 to 4.4 (Optuna's GP: 1.5e-5 and 14),
and no other cell moved. A patience of 15 cost more: Branin at 100 trials reached 1.6e-5,
level with Optuna's GP, and gradient boosting at 50 lost half an example.

Expected improvement goes on exploring to the end: far from the trials the GP is unsure, so
it refined its best configuration only now and then, and smac stayed 1.3x behind Optuna's GP
on Branin at 50 trials and Hartmann-6 at 100. So once the GP has 20 costs, every third
proposal (``mean_every``) refines instead: the point where the GP's posterior mean is lowest
(:meth:`hpo.gp.GPProposer.mean_minimum`), unless it lies within 0.1 % of a configuration tried
or running (a parallel worker's refinement), when expected improvement proposes. On
bench/optimizers.py (10 seeds, 50 and 100 trials) median regret fell on Branin from 4.8e-5
and 4.5e-6 to 1.1e-5 and 2.7e-6, on Hartmann-6 from 0.0020 and 7.6e-5 to 0.00051 and 1.0e-5,
on Levy-4 from 0.25 and 0.034 to 0.098 and 0.017, on Rosenbrock-4 from 34 and 4.4 to 20 and
1.9, on the mixed space from 2.0e-6 to 4.6e-7 and 3.5e-7, on Michalewicz-5 from 2.5 and 1.4
to 2.0 and 1.2; gradient boosting went from 11.5 and 11.0 errors of 569 to 11.0 and 11.0 and
the MLP on digits kept its 11 and 9 of 797. Refining from the 10th cost on instead cost
gradient boosting one error: on that step-valued cost refinements tie sooner and handed the
space to the forest on a model of a dozen trials. A GP of 20 costs in 8 to 10 dimensions
knows too little for its mean's minimum to be worth a trial, so the mean steps also wait for
4 costs per searched parameter (32 in 8 dimensions, 40 in 10; Hartmann-6 and the MLP on
digits wait for 24). With ties off a grid not counted, this took Levy-10 at 100 trials from
6.1 to 4.6, Rosenbrock-8 at 50 from 2,814 to 1,629 and Ackley-10 at 100 from 2.8 to 2.9 (10
seeds); it cost Hartmann-6 at 50 trials, 0.0013 against 0.0009 (20 seeds; Optuna's GP 0.0047).

A forest that has met a choice only in bad configurations predicts it bad everywhere and may
never try it again. On the SVM of bench/optimizers.py, seed 0's start design tried ``rbf``
twice, both times with a tiny C, and the forest never came back to it; seeds 2 to 4 spent 43
to 46 of 50 trials on ``poly``, whose best is one error of 600 worse than ``rbf``'s, which
TPE, sampling every kernel, reached. SMAC3 interleaves random configurations for this (one
in five): with a random fifth the SVM stayed at 14 errors, and the 20-D Branin cost the
forest 4.7x and 7.8x at 50 and 100 trials. So every 4th forest proposal is the best
candidate by expected improvement among those with the least-tried value of an unconditional
categorical parameter (finished and running trials counted); a space without one is
untouched. On bench/optimizers.py (10 seeds, 50 and 100 trials) smac's median regret went
from 14 errors to 13 on the SVM (TPE's), from 0.167 and 0.150 to 0.159 and 0.151 on the
conditional optimizer space (TPE 0.177 and 0.152; at 100 trials 4 of smac's 10 seeds had
found SGD's basin, regret below 0.04, and none of TPE's), and cost the MLP on digits, tuned
by the forest once costs tie, one validation example of 797 when first measured.
"""
from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from hpo import forest_service, space
from hpo.codec import Codec, keys
from hpo.gp import START_TRIALS, GPProposer
from hpo.history import History, Observations
from hpo.scenario import Param

if TYPE_CHECKING:
    from optuna.study import Study

MODELS = ("auto", "forest", "gp")


class SmacSampler(BaseSampler):
    """SMAC-style Bayesian optimization over a scenario's parameters.

    Each trial gets one configuration from the study's history: an initial design (random
    draws as Optuna's GPSampler makes them where the GP may be used, else scrambled Sobol)
    until ``n_initial`` trials have a cost (crashes count: they cost the worst cost seen; the
    GP's random start also counts running trials, so parallel workers draw no more of it than
    one worker does), then the configuration of highest expected improvement under the model
    (and, if ``random_every`` > 0, a random configuration every ``random_every``-th trial);
    while the GP proposes, every ``mean_every``-th trial goes where its posterior mean is lowest. A
    configuration already in the history (whatever its outcome) or running is never proposed
    while an unseen one can be found; the GP is shown the running trials (q-batch EI, :mod:`hpo.gp`).
    Every ``balance_every``-th proposal of the forest is its best candidate among those that
    take the least-tried value (finished and running trials counted) of a categorical
    parameter without a condition, so a choice that started badly is tried again.
    Parameters must be suggested under their names and values (as :func:`hpo.space.suggest`
    does); a name outside ``params`` is sampled at random.

    Args:
        params: the parameters, in definition order (conditions, steps and log scales included);
            integers and stepped floats are proposed, and told apart, on their grid.
        seed: with a seed, one worker repeats its sequence exactly.
        direction: ``minimize`` or ``maximize``, the objective's direction.
        n_initial: size of the initial design (default: 10 where the GP may be used, as
            Optuna's GPSampler starts; else searched parameters + 1).
        model: ``gp``, ``forest``, or ``auto``: the GP for unconditional spaces of at most
            ``gp_max_dims`` searched parameters while at most ``gp_max_points`` trials have a
            cost and, in a history without trials stopped early, no two costs below the worst
            tie on a grid and the best cost is among the last ``gp_patience``; the forest
            otherwise.
        gp_max_dims: the most searched parameters the GP takes on.
        gp_max_points: the most observations the GP takes on (its cost grows as their cube).
        random_every: interleave a random configuration every this many trials (0: never).
        n_trees: trees of the forest.
        n_random: random candidates of each forest search.
        n_starts: best configurations the forest's local search starts from.
        max_points: the most observations the forest is fitted to (the better half, a quarter
            of the latest, the rest at random); beyond 100 observations it is refitted once the
            history has grown by 1 % or by :data:`hpo.forest.REFIT_AFTER` observations.
        balance_every: every this many trials, the forest proposes the least-tried choice
            (0: never).
        gp_patience: with ``auto``, the forest proposes while the best cost is older than
            this many trials (0: never for that reason).
        mean_every: once the GP has twice ``n_initial`` costs and 4 per searched parameter,
            every this many trials it proposes where its posterior mean is lowest instead of
            where its expected improvement is highest, unless that point was tried or is
            running (0: never).
    """

    def __init__(
        self,
        params: Mapping[str, Param],
        *,
        seed: int | None = None,
        direction: str = "minimize",
        n_initial: int | None = None,
        model: str = "auto",
        gp_max_dims: int = 10,
        gp_max_points: int = 200,
        random_every: int = 0,
        n_trees: int = 10,
        n_random: int = 500,
        n_starts: int = 5,
        max_points: int = 256,
        balance_every: int = 4,
        gp_patience: int = 25,
        mean_every: int = 3,
    ) -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"direction must be 'minimize' or 'maximize', not {direction!r}")
        if model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, not {model!r}")
        self._codec = Codec(params)
        self._model = model
        self._seed = seed
        self._searched = searched = self._codec.dim
        self._gp_allowed = model == "gp" or (model == "auto" and not self._codec.conditional
                                              and 0 < searched <= gp_max_dims)
        default_initial = START_TRIALS if self._gp_allowed else searched + 1
        self._n_initial = max(2, n_initial if n_initial is not None else default_initial)
        self._history = History(self._codec, 1.0 if direction == "minimize" else -1.0, self._n_initial)
        self._gp_max_points = math.inf if model == "gp" else gp_max_points
        self._gp: GPProposer | None = None
        self._random_every = random_every
        self._n_trees = n_trees
        self._n_random = n_random
        self._n_starts = n_starts
        self._max_points = max_points
        self._balance_every = balance_every
        self._gp_patience = gp_patience
        self._mean_every = mean_every
        self._fallback = RandomSampler(seed=seed)
        self._start = RandomSampler(seed=seed)
        self._lock = threading.Lock()
        self._proposals: dict[tuple[str, int], dict[str, Any]] = {}
        self._key = uuid.uuid4().hex  # names this sampler's fitted forests (hpo.forest.ranked)
        self._single_objective: set[str] = set()

    def uses_gp_within(self, n_trials: int, n_done: int = 0) -> bool:
        """Whether the GP may propose a trial of a study that goes on from ``n_done`` trials to
        ``n_trials``: on a small space without conditions (or with ``model='gp'``), once the
        initial design is done, while the history is within the GP's ``gp_max_points``."""
        return (self._searched > 0 and self._gp_allowed and max(n_done, self._n_initial) < n_trials
                and n_done <= self._gp_max_points)

    def uses_forest_within(self, n_trials: int) -> bool:
        """Whether the forest makes proposals in a study of ``n_trials`` trials whatever its
        costs; costs that turn out step-valued may bring it in on the GP's spaces too."""
        return self._searched > 0 and (not self._gp_allowed or n_trials > self._gp_max_points)

    def reseed_rng(self) -> None:
        """Forget the seed: later proposals draw fresh randomness."""
        self._seed = None
        self._fallback.reseed_rng()
        self._start.reseed_rng()
        self._gp = None

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        """Nothing is sampled relatively; see ``sample_independent``."""
        return {}

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        """Nothing is sampled relatively; see ``sample_independent``."""
        self._check_single_objective(study)
        return {}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        """The trial's proposed value for ``param_name``, converted to ``param_distribution``;
        the proposal is made on the trial's first call."""
        self._check_single_objective(study)
        key = (study.study_name, trial.number)
        with self._lock:
            proposal = self._proposals.get(key)
            if proposal is None:
                proposal = self._proposals[key] = self._propose(study, trial)
        if param_name in proposal:
            value = _to_distribution(proposal[param_name], param_distribution)
            if value is not None:
                return value
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def _check_single_objective(self, study: Study) -> None:
        """Raise ValueError for a multi-objective study (its directions are read once per study)."""
        if study.study_name not in self._single_objective:
            self._raise_error_if_multi_objective(study)
            self._single_objective.add(study.study_name)

    def after_trial(
        self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        """Forget the finished trial's proposal."""
        with self._lock:
            self._proposals.pop((study.study_name, trial.number), None)

    def _propose(self, study: Study, trial: FrozenTrial) -> dict[str, Any]:
        if self._searched == 0:
            return self._codec.decode(np.zeros(0))
        rng = np.random.default_rng(None if self._seed is None else [self._seed, trial.number])
        mine = {number: p for (name, number), p in self._proposals.items() if name == study.study_name}
        observations = self._history.read(study, trial.number, mine)
        finished = self._history.finished(study.study_name)
        for number in [n for n in mine if n in finished]:
            del self._proposals[(study.study_name, number)]
        started = len(observations.y) + len(observations.pending)  # running start draws count (SMAC's too)
        if self._gp_allowed and (started < self._n_initial or not len(observations.y)):
            return self._unseen_or_first({name: self._start.sample_independent(study, trial, name, distribution)
                                          for name, distribution in self._codec.distributions().items()},
                                         observations.seen, rng)
        if len(observations.y) < self._n_initial and not self._gp_allowed:
            design = self._initial_design(len(observations.seen) + self._n_initial)
            candidates = np.vstack([design[len(observations.seen):], design])
        elif self._random_every > 0 and trial.number % self._random_every == self._random_every - 1:
            candidates = self._codec.sample(self._n_random, rng)
        elif self._gp_serves(observations):
            self._gp = self._gp or GPProposer(self._codec, self._seed)
            refined = (self._mean_every > 0 and trial.number % self._mean_every == self._mean_every - 1
                       and len(observations.y) >= max(2 * self._n_initial, 4 * self._searched))
            params = self._gp.mean_minimum(observations) if refined else None
            return self._unseen_or_first(params or self._gp.propose(observations), observations.seen, rng)
        else:
            candidates = forest_service.ranked(self._codec, observations.x, observations.y, observations.pending,
                                               f"{self._key}:{study.study_name}", rng,
                                               n_trees=self._n_trees, max_points=self._max_points,
                                               n_random=self._n_random, n_starts=self._n_starts)
            if self._balance_every > 0 and trial.number % self._balance_every == self._balance_every - 1:
                candidates = self._least_tried(candidates, np.vstack([observations.x, observations.pending]))
        return self._codec.decode(self._first_unseen(candidates, observations.seen, rng))

    def _least_tried(self, candidates: np.ndarray, tried: np.ndarray) -> np.ndarray:
        """The ``candidates`` (in their order) that take the value of an unconditional
        categorical parameter that the fewest ``tried`` rows take; all of them if there is none."""
        counts = [(np.sum(tried[:, j] == value), j, value)
                  for j, n in enumerate(self._codec.unconditional_choices) for value in range(n)]
        if not counts:
            return candidates
        _, j, value = min(counts)
        chosen = candidates[candidates[:, j] == value]
        return chosen if len(chosen) else candidates

    def _gp_serves(self, observations: Observations) -> bool:
        """Whether the GP makes this proposal: on its spaces, while the history is short and,
        unless ``model='gp'`` or a trial was stopped early, no two costs tie on a grid and the
        GP has not stalled (the best cost is among the last ``gp_patience``)."""
        if not self._gp_allowed or len(observations.y) > self._gp_max_points:
            return False
        if self._model == "gp":
            return True
        return observations.stopped_early or not (_step_valued(observations.y) or self._stalled(observations.y))

    def _stalled(self, costs: np.ndarray) -> bool:
        """Whether the best of ``costs`` (in the order they came) is older than the last ``gp_patience``."""
        return self._gp_patience > 0 and len(costs) - 1 - int(np.argmin(costs)) >= self._gp_patience

    def _unseen_or_first(self, params: dict[str, Any], seen: frozenset[bytes], rng: np.random.Generator
                         ) -> dict[str, Any]:
        """``params`` with its values as they are, if it is not in ``seen``; else the first
        unseen configuration close to it (within 0.1 % of each range), else at random."""
        row = self._codec.canonical(self._codec.encode([params]))
        if keys(row)[0] not in seen:
            return {**self._codec.decode(row[0]), **params}
        return self._codec.decode(self._first_unseen(self._codec.perturb(np.repeat(row, 20, axis=0), 0.001, rng),
                                                     seen, rng))

    def _first_unseen(self, candidates: np.ndarray, seen: frozenset[bytes], rng: np.random.Generator) -> np.ndarray:
        """The first candidate not in ``seen``, else the first unseen random configuration,
        else (the space is used up) the first candidate."""
        for batch in (candidates, self._codec.sample(self._n_random, rng)):
            for row, key in zip(batch, keys(batch)):
                if key not in seen:
                    return row
        return candidates[0]

    def _initial_design(self, n: int) -> np.ndarray:
        from scipy.stats import qmc  # imported when first needed: scipy.stats is slow to import

        sobol = qmc.Sobol(self._codec.dim, scramble=True, seed=self._seed)
        return self._codec.from_unit(sobol.random_base2(max(1, math.ceil(math.log2(n)))))


def _step_valued(costs: np.ndarray) -> bool:
    """Whether two of ``costs`` below the worst one are equal and all of them lie on one grid,
    as errors counted over a finite validation set do (crashes and trials pruned below the
    budget share the worst); a smooth function's equal costs (corners of a symmetric one) do not."""
    measured = costs[costs < costs.max()] if len(costs) else costs
    return len(np.unique(measured)) < len(measured) and on_a_grid(measured)


def on_a_grid(values: np.ndarray, most_steps: float = 1e6) -> bool:
    """Whether ``values`` are whole multiples of one step apart, with at most ``most_steps``
    steps between the least and the greatest: their differences' greatest common divisor
    (Euclid's algorithm, exact to a billionth of their span) is that large."""
    distinct = np.unique(values)
    span = float(distinct[-1] - distinct[0]) if len(distinct) else 0.0
    if span == 0.0:
        return True
    tolerance, step = span * 1e-9, 0.0
    for difference in np.diff(distinct):
        a, b = max(step, float(difference)), min(step, float(difference))
        while b > tolerance:
            remainder = math.fmod(a, b)
            a, b = b, (0.0 if b - remainder <= tolerance else remainder)
        step = a
    return span / step <= most_steps


def _to_distribution(value: Any, distribution: BaseDistribution) -> Any:
    """``value`` as a legal value of ``distribution`` (a float within a rounding error of a bound
    is the bound: :func:`hpo.space.at_bound`), or None if it has no such value."""
    if isinstance(distribution, CategoricalDistribution):
        for choice in distribution.choices:
            if choice == value and type(choice) is type(value):
                return choice
        return next((c for c in distribution.choices if c == value), None)
    if isinstance(distribution, (FloatDistribution, IntDistribution)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        low, high = distribution.low, distribution.high
        if distribution.step is not None:
            value = low + round((value - low) / distribution.step) * distribution.step
        value = min(max(value, low), high)
        if isinstance(distribution, IntDistribution):
            return round(value)
        return space.at_bound(float(value), low, high)
    return None
