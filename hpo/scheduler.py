"""Which trial a slot runs next: claims, the budget, the design queue and re-runs.

The budget is ``search.trials`` for the whole study, all workers and runs together. A
trial uses it when it ended on its own merits (COMPLETE, FAIL, PRUNED, STOPPED, TIMEOUT)
or is claimed; a failed trial that was retried (``search.retry_failed``) and a trial whose
configuration runs again because it was LOST or INTERRUPTED do not, nor do reruns (``hpo
rerun``). Re-runs are queued as WAITING trials with the same parameters and are claimed
before anything new while the budget has room; once it is spent (``search.trials`` lowered
below what ran and was queued), they stay WAITING, unrun, until it is raised. A queued copy
of a rerun uses no budget: the next ``hpo run`` or ``hpo rerun`` of the same trial claims
it, whichever comes first, with the rerun's ``trial_seed``, never pruned. A configuration
queued again because it was LOST or INTERRUPTED runs with the ``trial_seed`` it had, and a new
configuration, or a retry of a failure, gets one that no crash moves (:meth:`Scheduler._own_seed`):
a design point's number (and retry), a proposal's place among the tries of their own, so that a
sweep that had crashes repeats one that had none. A rerun that
fails is a finding, not retried (``search.retry_failed`` is for the sweep's trials). A design's next
point is its first point that no trial covers yet, so every point runs exactly once
whatever crashed in between. A second copy of a point or of a lost configuration, which only a
worker whose ask lock was lost unseen in a store outage can queue, is recorded INTERRUPTED
instead of running, the budget spent or not, so none is left waiting.

Claims happen under the store's ask lock, so workers on any number of machines never
exceed the budget.
"""
from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import space
from hpo.errors import InputError
from hpo.faults import fault_point
from hpo.outcome import Outcome, TrialResult
from hpo.render import FolderFull, trial_folder, trial_seed
from hpo.rows import TrialRow, budget_used, repeat_of, standing
from hpo.storage import HOST
from hpo.store import (
    ATTR_DESIGN_INDEX,
    ATTR_DISK_FULL_COUNT,
    ATTR_LOST_COUNT,
    ATTR_REQUEUE_OF,
    ATTR_RERUN_OF,
    ATTR_RETRIES,
    ATTR_RETRY_OF,
    SYS_RUN,
    SYS_STARTING,
    SYS_TAKEN_BACK,
    StudyStore,
)

WAIT = "wait"


def worker_id() -> str:
    """This process as a worker: ``host:pid``."""
    return f"{HOST}:{os.getpid()}"


class OutsideSpace(Exception):
    """Trial ``number``, claimed from the queue, holds values the scenario's space does not
    (``why``: Optuna's words), as a trial queued from Optuna may."""

    def __init__(self, number: int, why: str) -> None:
        super().__init__(why)
        self.number = number
        self.why = why


@dataclass(frozen=True)
class Claim:
    """A trial a slot has claimed: its number, parameter values (constants included), the
    Optuna trial (for intermediate values), its folder, its process token, its
    ``trial_seed``, whether a pruner may end it (a rerun runs to its end), and the trial whose
    configuration it runs again (:func:`hpo.rows.repeat_of`), if any."""

    number: int
    params: dict[str, Any]
    trial: optuna.Trial
    folder: Path
    token: str
    seed: int
    prunable: bool = True
    repeat_of: int | None = None


def requeue(store: StudyStore, row: TrialRow, rows: list[TrialRow], **attrs: Any) -> bool:
    """Queue ``row``'s configuration again (once: False if a copy of it exists already).

    The copy keeps the design index, rerun mark and counts (losses, disks filled, retries) and
    records ``requeue_of`` (or the ``attrs`` given, e.g. ``retry_of``). Call under the ask lock.
    """
    if any(row.number in (r.requeue_of, r.retry_of) for r in rows):
        return False
    copy = {ATTR_REQUEUE_OF: row.number, ATTR_LOST_COUNT: row.lost_count, ATTR_DISK_FULL_COUNT: row.disk_full_count,
            ATTR_RETRIES: row.retries}
    for name, value in ((ATTR_DESIGN_INDEX, row.design_index), (ATTR_RERUN_OF, row.rerun_of)):
        if value is not None:
            copy[name] = value
    copy.update(attrs)
    store.enqueue(space.searched(store.scenario.parameters, row.params), copy)
    return True


RUN_AGAIN_LIMIT = 3
"""A configuration whose trial ended this many times (across its re-runs) for a cause that is no failure of
its own yet may be its own doing is recorded FAIL instead of being queued again, so nothing
loops: it was lost (it kills its worker: out of memory, a job's walltime), counted in
``lost_count``, or its files filled the disk, counted in ``disk_full_count``."""
LOST_TOO_OFTEN = f"lost {RUN_AGAIN_LIMIT} times: its worker stopped each time (out of memory? walltime?)"


def run_again_verdict(row: TrialRow, result: TrialResult, filled: FolderFull | None = None) -> TrialResult:
    """``result`` of ``row``'s trial as it is, or FAIL where it makes :data:`RUN_AGAIN_LIMIT`
    times (across its re-runs) that its configuration was LOST (:data:`LOST_TOO_OFTEN`) or, ``filled`` given
    (the trial ended INTERRUPTED because its files found the disk full), that its files filled
    the disk (``its files filled the disk 3 times: cannot write ...``)."""
    if result.outcome is Outcome.LOST and row.lost_count + 1 >= RUN_AGAIN_LIMIT:
        reason = LOST_TOO_OFTEN
    elif result.outcome is Outcome.INTERRUPTED and filled is not None and row.disk_full_count + 1 >= RUN_AGAIN_LIMIT:
        reason = f"its files filled the disk {RUN_AGAIN_LIMIT} times: {filled}"
    else:
        return result
    return TrialResult(Outcome.FAIL, duration_s=result.duration_s, reason=reason)


def requeue_or_fail(store: StudyStore, row: TrialRow, rows: list[TrialRow], result: TrialResult,
                    filled: FolderFull | None = None) -> TrialResult:
    """How to record ``row``'s trial, ``result``, which did not fail on its own merits (LOST or
    INTERRUPTED): as it is, its configuration queued again with one more loss or, ``filled``
    given, one more disk its files filled counted, or FAIL (:func:`run_again_verdict`). Call
    under the ask lock."""
    verdict = run_again_verdict(row, result, filled)
    if verdict.outcome is Outcome.LOST:
        requeue(store, row, rows, **{ATTR_LOST_COUNT: row.lost_count + 1})
    elif verdict.outcome.run_again and filled is not None:
        requeue(store, row, rows, **{ATTR_DISK_FULL_COUNT: row.disk_full_count + 1})
    elif verdict.outcome.run_again:
        requeue(store, row, rows)
    return verdict


class Scheduler:
    """Claims trials for one worker's slots and settles how they ended.

    Args:
        store: the study store.
        design: every point of a design of experiments, or None for model-based methods.
        budget: ``search.trials``.
        workdir: where trial folders go.
        seed: this worker's seed (recorded on its claims).
        numbers: the number each design point is recorded under (``design_index``:
            :func:`hpo.designs.design_numbers`); by default its place in ``design``.
    """

    def __init__(self, store: StudyStore, design: list[dict[str, Any]] | None, budget: int,
                 workdir: Path, seed: int, numbers: list[int] | None = None) -> None:
        self.store = store
        self.budget = budget
        self._design = design
        self._numbers = numbers if numbers is not None or design is None else list(range(len(design)))
        self._workdir = workdir
        self._seed = seed
        self.worker = worker_id()

    def claim(self, mine: Container[int]) -> Claim | str | None:
        """The next trial for a slot (see :meth:`_claim`); a queued trial whose values the
        scenario's space does not hold (queued from Optuna: ``study.enqueue_trial``) is recorded
        FAIL, with why, and the next is claimed."""
        while True:
            try:
                return self._claim(mine)
            except OutsideSpace as exc:
                self._not_run(exc.number, Outcome.FAIL, f"its values are not of the scenario's search space (queued "
                                                        f"from outside hpo?): {exc.why}")

    def _claim(self, mine: Container[int]) -> Claim | str | None:
        """The next trial for a slot; :data:`WAIT` while only other workers' running trials
        stand between the study and its budget (they may need a re-run); None when done.
        Queued trials come first, in the order of the trials they stand for (a copy queued
        again goes where its first trial went: a design's interrupted points before its later
        ones): any while the budget has room, else only queued reruns.
        Call under the ask lock; ``mine`` are this worker's running trials."""
        store = self.store
        trials = store.trials()
        rows = store.rows(trials)
        by_number = {r.number: r for r in rows}
        queued = sorted((t.number for t in trials if t.state == TrialState.WAITING),
                        key=lambda number: (_origin(by_number, number), number))
        room = budget_used(rows, queued) < self.budget
        # with the budget spent: queued reruns, and copies queued twice in an outage, to be withdrawn
        runnable = [n for n in queued if room or by_number[n].rerun_of is not None
                    or _twin_in(rows, n, by_number[n].design_index, by_number[n].requeue_of) is not None]
        others = any(t.state == TrialState.RUNNING and t.number not in mine for t in trials)
        if runnable:
            try:
                trial = store.claim_waiting(runnable[0])
            except InputError:  # another worker took it, which only an ask lock lost unseen allows
                return self._claim(mine)
        else:
            if not room:
                return WAIT if others else None
            if self._design is not None:
                index = self._next_point(rows)
                if index is None:
                    return WAIT if others else None
                point = self._design[index]
                store.enqueue(space.searched(store.scenario.parameters, point),
                              {ATTR_DESIGN_INDEX: self._numbers[index]})
            trial = store.ask(queued_only=self._design is not None)
        attrs = trial.user_attrs
        twin = self._twin(trial, attrs)
        if twin is not None:
            self._not_run(trial.number, Outcome.INTERRUPTED,
                          f"not run: it was queued twice in a store outage, and trial {twin} runs it")
            return self._claim(mine)
        row = by_number.get(trial.number)
        if not room and (row is None or row.rerun_of is None):  # claimed to be withdrawn, and no copy after all
            store.back_to_waiting(trial.number)
            return WAIT if others else None
        if row is not None and row.rerun_of is not None:
            source = row.number if row.requeue_of is None else row.requeue_of
            return self._claimed(trial, self._recorded_seed(trials, source, row.rerun_of), prunable=False,
                                 repeats=repeat_of(row))
        repeats = None if row is None else repeat_of(row)
        if row is not None and row.requeue_of is not None and row.retry_of is None:  # no fault of its own
            return self._claimed(trial, self._recorded_seed(trials, row.requeue_of, None), repeats=repeats)
        point = attrs.get(ATTR_DESIGN_INDEX) if row is None else row.design_index
        return self._claimed(trial, self._own_seed(point, 0 if row is None else row.retries, rows, trial.number),
                             repeats=repeats)

    def _not_run(self, number: int, outcome: Outcome, reason: str) -> None:
        """Record claimed trial ``number``, which will not run, as ``outcome`` for ``reason``."""
        self.store.record(number, TrialResult(outcome, reason=reason), trial_folder(self._workdir, number))

    def _own_seed(self, point: int | None, retries: int, rows: list[TrialRow], number: int) -> int:
        """The ``trial_seed`` of trial ``number``, a try of its own: of design point ``point``
        (its ``retries``-th retry), the study's seed plus the point's number plus ``retries``
        times the design's size, whatever order trials running at once end in; of a search
        method's proposal, the study's seed plus its place among the study's tries of their own
        (:func:`_place`)."""
        seed = self.store.scenario.search.seed
        if point is not None and self._numbers:
            return trial_seed(seed, int(point) + retries * (max(self._numbers) + 1))
        return trial_seed(seed, _place(rows, number))

    def _claimed(self, trial: optuna.Trial, seed: int, prunable: bool = True,
                 repeats: int | None = None) -> Claim:
        store = self.store
        try:
            with warnings.catch_warnings():  # Optuna's "Fixed parameter ... out of range": said as the trial's reason
                warnings.filterwarnings("ignore", message="Fixed parameter", category=UserWarning)
                params = store.call(space.suggest, trial, store.scenario.parameters)
            optuna.trial.create_trial(params=trial.params, distributions=trial.distributions, value=0.0)
        except ValueError as exc:  # values queued from outside hpo (study.enqueue_trial) that the space lacks
            raise OutsideSpace(trial.number, str(exc)) from None
        token = f"{store.scenario.name}:{trial.number}:{uuid.uuid4().hex[:12]}"
        store.set_system(trial.number, SYS_RUN, {"worker": self.worker, "host": HOST, "token": token,
                                                 "seed": self._seed, "trial_seed": seed, "claimed_at": time.time()})
        fault_point("claim", trial.number)
        return Claim(trial.number, params, trial, trial_folder(self._workdir, trial.number), token, seed, prunable,
                     repeats)

    def _recorded_seed(self, trials: list[FrozenTrial], source: int, original: int | None,
                       default: int | None = None) -> int:
        """The ``trial_seed`` recorded on trial ``source`` or, where it has none (never claimed,
        or a study that did not record it), on the trials it was queued again from
        (``requeue_of``, back to the first that recorded one); where none did, ``default`` if
        given, else the default of ``original`` (the trial a rerun reruns), else of the first
        trial of that line."""
        by_number = {t.number: t for t in trials}
        number, seed = source, None
        while True:
            trial = by_number.get(number)
            if trial is None:
                break
            seed = (trial.system_attrs.get(SYS_RUN) or {}).get("trial_seed")
            back = trial.user_attrs.get(ATTR_REQUEUE_OF)
            if seed is not None or back is None:
                break
            number = int(back)
        if seed is not None:
            return int(seed)
        if default is not None:
            return default
        return trial_seed(self.store.scenario.search.seed, number if original is None else original)

    def seed_of(self, number: int) -> int:
        """The ``trial_seed`` that trial ``number``'s claim recorded (see :meth:`_recorded_seed`)."""
        return self._recorded_seed(self.store.trials(), number, None)

    def claim_rerun(self, original: TrialRow, seed: int | None, default_seed: int) -> Claim:
        """A trial that runs ``original``'s configuration again, marked ``rerun_of`` (it uses
        no budget, is never pruned): the first queued rerun of ``original`` (one that was
        interrupted or lost), else a new one. Its ``trial_seed`` is ``seed``; where None, a
        queued rerun's own (the ``--seed`` of the rerun interrupted), as ``hpo run`` would run
        it, else ``default_seed``. Call under the ask lock."""
        store = self.store

        def queued() -> list[int]:
            return sorted(t.number for t in store.trials(states=(TrialState.WAITING,))
                          if t.user_attrs.get(ATTR_RERUN_OF) == original.number)

        waiting = queued()
        if waiting and seed is None:
            seed = self._recorded_seed(store.trials(), waiting[0], original.number, default_seed)
        if not waiting:
            store.enqueue(space.searched(store.scenario.parameters, original.params), {ATTR_RERUN_OF: original.number})
            waiting = queued()
        try:
            return self._claimed(store.claim_waiting(waiting[0]), default_seed if seed is None else seed,
                                 prunable=False, repeats=original.number)
        except OutsideSpace as exc:
            self._not_run(exc.number, Outcome.FAIL, f"not run: {exc.why}")
            raise InputError(f"trial {original.number}: {exc.why}; hpo rerun runs a configuration of the "
                             "scenario's search space") from None

    def _twin(self, trial: optuna.Trial, attrs: Mapping[str, Any]) -> int | None:
        """A standing trial (:func:`hpo.rows.standing`) numbered below the claimed queued
        ``trial`` that covers what it was queued for (the same design point, else the same lost
        or failed trial's configuration), read after the claim; None if there is none.

        Two copies exist only when a worker queued one while its ask lock had been lost in an
        outage unseen: the higher-numbered copy must not run, whatever the interleaving. The
        trial a copy was requeued from is no twin: it is being ended. ``attrs``: its user attributes.
        A search method's new trial was queued for nothing: the study is not read again for it."""
        index, origin = attrs.get(ATTR_DESIGN_INDEX), attrs.get(ATTR_REQUEUE_OF)
        if index is None and origin is None:
            return None
        return _twin_in(self.store.rows(), trial.number, index, origin)

    def _next_point(self, rows: list[TrialRow]) -> int | None:
        """The place of the first design point whose number no standing trial
        (:func:`hpo.rows.standing`) covers."""
        covered = {r.design_index for r in standing(rows) if r.design_index is not None}
        assert self._numbers is not None
        return next((i for i, number in enumerate(self._numbers) if number not in covered), None)

    def settle(self, claim: Claim, result: TrialResult, filled: FolderFull | None = None) -> bool:
        """Record how a claimed trial ended, queueing its configuration again first when it
        did not fail on its own merits (unless :func:`run_again_verdict` says FAIL), or failed
        with retries left. ``filled``: the trial ended INTERRUPTED because its files found the
        disk full, as :meth:`verdict` was told. False when another worker had already ended it
        (judged lost)."""
        store = self.store
        retry = result.outcome.failed and result.reason != LOST_TOO_OFTEN \
            and filled is None
        if result.outcome.run_again or retry:
            def section() -> TrialResult:
                rows = store.rows(store.trials())
                row = next(r for r in rows if r.number == claim.number)
                if result.outcome.run_again:
                    return requeue_or_fail(store, row, rows, result, filled)
                if row.retries < store.scenario.search.retry_failed and row.rerun_of is None:  # a rerun is a check
                    requeue(store, row, rows, **{ATTR_RETRY_OF: row.number, ATTR_RETRIES: row.retries + 1})
                return result

            result = store.locked(section)
        return store.record(claim.number, result, claim.folder)

    def verdict(self, claim: Claim, result: TrialResult, filled: FolderFull | None = None) -> TrialResult:
        """How :meth:`settle` records ``result`` of ``claim``, as it is told before it is
        recorded: a LOST one, or one whose files ``filled`` the disk, may be FAIL
        (:func:`run_again_verdict`)."""
        if result.outcome is not Outcome.LOST and filled is None:
            return result
        return run_again_verdict(self.store.rows([self.store.trial(claim.number)])[0], result, filled)

    def may_start(self, claim: Claim) -> bool:
        """Mark ``claim`` as starting (:data:`hpo.store.SYS_STARTING`), then say whether it is
        still this worker's to start: its trial runs under the claim's token, and no other worker
        that found this one gone has taken it back (ended it, put it back in the queue, claimed
        it again, or marked it :data:`hpo.store.SYS_TAKEN_BACK` on the way).

        A take-back marks first and reads after too (:mod:`hpo.recovery`), so of a
        start and a take-back made at once, at least one sees the other's mark: the take-back
        then judges the trial started (LOST, queued again), or the start does not happen. A
        claim is never run by both."""
        try:
            self.store.set_system(claim.number, SYS_STARTING, claim.token)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        trial = self.store.trial(claim.number)
        system = trial.system_attrs
        return trial.state == TrialState.RUNNING and (system.get(SYS_RUN) or {}).get("token") == claim.token \
            and system.get(SYS_TAKEN_BACK) != claim.token

    def release(self, claim: Claim) -> None:
        """Put a claimed trial that never started back in the queue (the sweep is stopping)."""
        self.store.back_to_waiting(claim.number)


def _twin_in(rows: list[TrialRow], number: int, index: int | None, origin: int | None) -> int | None:
    """The standing trial among ``rows`` numbered below queued trial ``number`` that covers
    what it was queued for: design point ``index``, else the configuration of trial
    ``origin`` (which is no twin: it is being ended); None if there is none."""
    if index is None and origin is None:
        return None

    def same(row: TrialRow) -> bool:
        return row.design_index == index if index is not None else row.requeue_of == origin

    return next((r.number for r in standing(rows) if r.number < number and same(r) and r.number != origin), None)


def _place(rows: list[TrialRow], number: int) -> int:
    """How many of ``rows`` before trial ``number`` are tries of their own (new configurations
    and retries of failures), leaving out copies queued again for no fault of their own and
    reruns: the same in a sweep that had crashes as in one that had none."""
    return sum(1 for r in rows if r.number < number and r.rerun_of is None
               and (r.requeue_of is None or r.retry_of is not None))


def _origin(by_number: dict[int, TrialRow], number: int) -> int:
    """The trial that trial ``number`` stands for: back through the copies queued again
    (``requeue_of``) to the first."""
    row = by_number.get(number)
    while row is not None and row.requeue_of is not None and row.requeue_of in by_number:
        number = row.requeue_of
        row = by_number[number]
    return number
