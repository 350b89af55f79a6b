"""The study store: the one object that owns a sweep's Optuna study and its storage.

An hpo study is a first-class Optuna study. The objective carries its metric name
(``set_metric_names``); how a trial ended is recorded as flat scalar user attributes
(``outcome``, ``reason``, ``duration_s``, ``folder``, each held-out metric under its own
name, and the bookkeeping of re-runs: ``requeue_of``, ``retry_of``, ``rerun_of``,
``retries``, ``lost_count``, ``disk_full_count``, ``design_index``), so ``optuna.load_study``,
optuna-dashboard and ``trials_dataframe()`` show them as they are. Optuna's state is
COMPLETE (with the value), PRUNED, or FAIL for every other outcome (STOPPED, TIMEOUT,
LOST and INTERRUPTED included: none of them has an objective value). The scenario's
parameters and the scenario file itself are study user attributes, so a resumed study
whose space changed can be refused (:mod:`hpo.spacecheck`), before anything is written.

:func:`read_row` is the only reader of those attributes and :func:`result_attrs` the only
writer. Every call into the storage goes through :class:`hpo.storage.Retrying`, so the
store rides out an outage of ``resources.store_retry`` seconds.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import rowcache, space
from hpo.errors import InputError
from hpo.faults import fault_point
from hpo.files import utf8_text
from hpo.outcome import Outcome, TrialResult
from hpo.results import RESERVED_ATTRS
from hpo.rows import TrialRow, presented
from hpo.scenario import Scenario
from hpo.spacecheck import resume_refusal
from hpo.storage import LockLost, NoStudy, Retrying, ask_lock, local_path, open_storage, reach

ATTR_OUTCOME, ATTR_REASON, ATTR_DURATION, ATTR_FOLDER = "outcome", "reason", "duration_s", "folder"
ATTR_REQUEUE_OF, ATTR_RETRY_OF, ATTR_RERUN_OF = "requeue_of", "retry_of", "rerun_of"
ATTR_RETRIES, ATTR_LOST_COUNT, ATTR_DESIGN_INDEX = "retries", "lost_count", "design_index"
ATTR_DISK_FULL_COUNT, ATTR_NOTE = "disk_full_count", "note"
SYS_RUN, SYS_STARTED, SYS_HEARTBEAT, SYS_STOP = "hpo:run", "hpo:started", "hpo:heartbeat", "hpo:stop"
SYS_STARTING, SYS_TAKEN_BACK = "hpo:starting", "hpo:taken_back"
"""The token of the claim that its worker is about to start, and of the claim that another worker
takes back because it found that worker gone (:meth:`hpo.scheduler.Scheduler.may_start`)."""
STUDY_PARAMETERS, STUDY_SCENARIO, STUDY_HELD_OUT, STUDY_CREATED = "parameters", "scenario", "held_out", "created"
T = TypeVar("T")
_LEGACY_RUN, _LEGACY_RESULT = "run", "result"
_LEGACY_SYS = {ATTR_RETRY_OF: "hpo:retry_of", ATTR_RETRIES: "hpo:retries", ATTR_DESIGN_INDEX: "hpo:design_index"}
_STATE_OUTCOMES = {TrialState.COMPLETE: {Outcome.COMPLETE}, TrialState.PRUNED: {Outcome.PRUNED, Outcome.STOPPED},
                   TrialState.FAIL: {Outcome.FAIL, Outcome.STOPPED, Outcome.TIMEOUT, Outcome.LOST,
                                     Outcome.INTERRUPTED}}


class _Holder(NamedTuple):
    """Who holds a store's ask lock: the thread, whether the lock is still its
    (:func:`hpo.storage.ask_lock`), and the trials claimed under it."""

    thread: int
    held: Callable[[], bool]
    claimed: list[int]


class _AskLock:
    """The study-wide ask lock (:func:`hpo.storage.ask_lock`) as one store holds it: which
    thread holds it, whether the lock is still its, and the trials claimed under it.

    Args:
        url: the storage URL.
        on_outage: receives a line when the lock is long in coming.
    """

    def __init__(self, url: str, on_outage: Callable[[str], None]) -> None:
        self._url = url
        self._on_outage = on_outage
        self._holder: _Holder | None = None
        self.scope = ""  # the whole store's lock while its tables may be made, then the study's

    @contextlib.contextmanager
    def held(self, call: Retrying, claimed: list[int]) -> Iterator[None]:
        """Hold the lock, taken through an outage by ``call``; the numbers of the trials claimed
        under it (:meth:`note_claim`) are appended to ``claimed``."""
        def enter() -> Any:
            context = ask_lock(self._url, self._on_outage, call.gave_up, self.scope)
            return context, context.__enter__()

        context, held = call(enter)
        outer, self._holder = self._holder, _Holder(threading.get_ident(), held, claimed)
        try:
            yield
        finally:
            self._holder = outer
            context.__exit__(None, None, None)

    def mine(self) -> _Holder | None:
        """The lock's holder if it is this thread (as far as it knows: see :meth:`check`), else None."""
        holder = self._holder
        return holder if holder is not None and holder.thread == threading.get_ident() else None

    def check(self) -> None:
        """Raise :class:`LockLost` in the thread that holds the lock if it is lost."""
        holder = self.mine()
        if holder is not None and not holder.held():
            raise LockLost("the ask lock was lost in an outage")

    def note_claim(self, number: int) -> None:
        """Note a trial claimed by the thread that holds the lock: :meth:`StudyStore.locked`
        puts it back in the queue if the lock turns out lost before its section ends."""
        holder = self.mine()
        if holder is not None:
            holder.claimed.append(number)


def result_attrs(result: TrialResult, folder: Path | str) -> dict[str, Any]:
    """The user attributes that record ``result`` (the only writer of them)."""
    attrs: dict[str, Any] = {ATTR_OUTCOME: result.outcome.value, ATTR_REASON: result.reason,
                             ATTR_DURATION: round(result.duration_s, 3), ATTR_FOLDER: str(folder)}
    attrs.update({name: float(value) for name, value in result.held_out.items()})
    if result.note:
        attrs[ATTR_NOTE] = result.note
    return attrs


def optuna_state(outcome: Outcome) -> TrialState:
    """The Optuna state an ended trial of ``outcome`` is recorded in (the module docstring)."""
    return {Outcome.COMPLETE: TrialState.COMPLETE, Outcome.PRUNED: TrialState.PRUNED}.get(outcome, TrialState.FAIL)


def has_started(trial: FrozenTrial) -> bool:
    """Whether the worker that claimed ``trial`` recorded its start (:data:`SYS_STARTED`; studies
    made before it: the ``run`` attribute)."""
    return SYS_STARTED in trial.system_attrs or _LEGACY_RUN in trial.user_attrs


def _outcome(trial: FrozenTrial, recorded: str | None) -> Outcome:
    if trial.state == TrialState.RUNNING:
        return Outcome.RUNNING if has_started(trial) else Outcome.WAITING
    if trial.state == TrialState.WAITING:
        return Outcome.WAITING
    try:
        outcome = Outcome(recorded) if recorded else None
    except ValueError:
        outcome = None
    if outcome is not None and outcome in _STATE_OUTCOMES[trial.state]:
        return outcome
    if trial.state == TrialState.FAIL and outcome is not None:
        return Outcome.LOST  # judged lost by another worker while its own worker recorded it
    return Outcome(trial.state.name)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_row(trial: FrozenTrial, constants: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> TrialRow:
    """The :class:`TrialRow` of one Optuna trial (the only reader of hpo's attributes).

    Reads this round's flat attributes and, for studies made before it, the nested
    ``run``/``result`` attributes. The params hold the constants the trial started with;
    ``constants`` adds the scenario's for those it did not record (it never started, or
    started before they were recorded).
    """
    user = trial.user_attrs
    legacy = dict(user.get(_LEGACY_RESULT) or {})
    recorded = user.get(ATTR_OUTCOME, legacy.get("outcome"))
    outcome = _outcome(trial, recorded)
    held_out = {k: float(v) for k, v in (legacy.get("held_out") or {}).items()}
    held_out.update({k: float(v) for k, v in user.items() if k not in RESERVED_ATTRS and k not in
                     (_LEGACY_RUN, _LEGACY_RESULT) and isinstance(v, (int, float)) and not isinstance(v, bool)})
    duration = user.get(ATTR_DURATION, legacy.get("duration_s"))
    if duration is None and trial.datetime_start and trial.datetime_complete:
        duration = (trial.datetime_complete - trial.datetime_start).total_seconds()
    started = trial.system_attrs.get(SYS_STARTED) or {}
    folder = user.get(ATTR_FOLDER) or started.get("folder") or (user.get(_LEGACY_RUN) or {}).get("folder", "")
    reason = str(user.get(ATTR_REASON, legacy.get("reason", "")) or "")
    if outcome is Outcome.LOST and recorded not in (None, Outcome.LOST.value):
        reason = f"lost: another worker judged its worker gone ({reason or recorded})"
    note = str(user.get(ATTR_NOTE, "") or "")
    if outcome is Outcome.COMPLETE:  # studies made before notes were kept apart kept them as the reason
        note, reason = note or reason, ""
    value = trial.value if outcome is Outcome.COMPLETE else None
    params = {**trial.params, **(started.get("constants") or {})}
    return TrialRow(
        number=trial.number, outcome=outcome, params=constants(params) if constants else params,
        value=value, held_out=held_out, duration_s=duration, folder=str(folder), reason=reason,
        slot=_int(started.get("slot")), gpus=str(started.get("gpus", "")), where=str(started.get("where", "")),
        requeue_of=_int(user.get(ATTR_REQUEUE_OF)), retry_of=_int(_attr(trial, ATTR_RETRY_OF)),
        rerun_of=_int(user.get(ATTR_RERUN_OF)), design_index=_int(_attr(trial, ATTR_DESIGN_INDEX)),
        lost_count=_int(user.get(ATTR_LOST_COUNT)) or 0, disk_full_count=_int(user.get(ATTR_DISK_FULL_COUNT)) or 0,
        retries=_int(_attr(trial, ATTR_RETRIES)) or 0, note=note)


def _attr(trial: FrozenTrial, name: str) -> Any:
    """A bookkeeping attribute, or its system-attribute twin in studies made before this round."""
    value = trial.user_attrs.get(name)
    return value if value is not None else trial.system_attrs.get(_LEGACY_SYS.get(name, ""))


class StudyStore:
    """Owns the scenario's Optuna study and storage; every storage call is retried. A study
    made to another ``objective.direction`` or on another ``objective.metric`` is an InputError.

    Args:
        scenario: the validated scenario (its name, direction, parameters, store_retry).
        url: the storage URL.
        create: create the study if missing (``hpo run``); else a missing study is :class:`NoStudy`.
        pruner: what ``report`` uses (a sweep's sampler comes with :meth:`use_sampler`).
        on_outage: receives one-line messages when the store stops and starts answering, and when
            the ask lock is long in coming (:func:`hpo.storage.ask_lock`).
        reached: the store has answered this sweep before (a worker that ``hpo run --workers``
            started), so its first contact is skipped: a refused connection is an outage.
        reader: for a command that reads the study (``hpo status``): a full disk is not waited
            out (:class:`hpo.storage.Retrying`), as no sweep's outage of it ends by waiting.

    ``study_id`` is the storage's id of the study, and ``quiet_stamp`` the SQLite store's files
    as they were before it was opened (:func:`hpo.rowcache.quiet_stamp`), for :mod:`hpo.snapshot`.
    """

    def __init__(self, scenario: Scenario, url: str, *, create: bool = True,
                 pruner: optuna.pruners.BasePruner | None = None,
                 on_outage: Callable[[str], None] | None = None, reached: bool = False,
                 reader: bool = False) -> None:
        self.scenario = scenario
        self.url = url
        self._on_outage = on_outage or (lambda message: logging.getLogger("hpo.store").warning("%s", message))
        self._ask_lock = _AskLock(url, self._on_outage)
        self.call = Retrying(url, scenario.resources.store_retry, self._on_outage, before_attempt=self._ask_lock.check,
                             full_disk_waits=not reader)
        self._ids: dict[int, int] = {}
        self._finished: dict[int, TrialRow] = {}
        self.quiet_stamp = rowcache.quiet_stamp(url)  # before the store is opened: opening creates SQLite's log
        local = local_path(url)
        if not create and local is not None and not local.exists():
            raise NoStudy(f"no study named {scenario.name}: {local} does not exist (run `hpo run` first)")
        def open_study() -> None:
            self._storage = self.call(open_storage, url, create)
            if create:
                self.study = self.call(optuna.create_study, storage=self._storage, study_name=scenario.name,
                                       pruner=pruner, load_if_exists=True,
                                       direction=scenario.objective.direction)

        if not reached:
            reach(url, create)  # bad input fails here; past it, what fails is an outage and is retried
        if create:  # creating the tables of a new store must not race another process, of any study
            self.locked(open_study)
        else:  # a reader does not wait for a worker that holds the lock (one stopped with SIGSTOP holds it on)
            open_study()
        self._ask_lock.scope = scenario.name
        if not create:
            try:
                self.study = self.call(optuna.load_study, study_name=scenario.name, storage=self._storage,
                                       pruner=pruner)
            except KeyError:
                raise NoStudy(f"no study named {scenario.name} in {url}: run `hpo run` first") from None
        if self.study.direction.name.lower() != scenario.objective.direction:
            raise InputError(f"objective.direction: the study {scenario.name} was created to "
                             f"{self.study.direction.name.lower()}, not {scenario.objective.direction}")
        metrics = self.call(lambda: self.study.metric_names)
        if metrics is not None and metrics != [scenario.objective.metric]:
            raise InputError(f"objective.metric: the study {scenario.name} was run on {', '.join(metrics)}, not "
                             f"{scenario.objective.metric}; a new metric needs a new study (another name)")
        self.study_id = self.call(self._storage.get_study_id_from_name, scenario.name)

    def use_sampler(self, sampler: optuna.samplers.BaseSampler) -> None:
        """Propose the study's new trials with ``sampler`` from now on (:meth:`ask`)."""
        self.study.sampler = sampler

    @contextlib.contextmanager
    def lock(self, claimed: list[int] | None = None) -> Iterator[None]:
        """The study-wide ask lock (see :func:`hpo.storage.ask_lock`), taken through an outage.
        A store call under it raises :class:`LockLost` instead of running when the lock was
        lost meanwhile; :meth:`locked` runs a section again then. The numbers of the trials
        claimed under it are appended to ``claimed``."""
        with self._ask_lock.held(self.call, [] if claimed is None else claimed):
            yield

    def locked(self, section: Callable[[], T]) -> T:
        """``section()`` under the ask lock; when the lock was lost in an outage (another
        process may have held it since), ``section()`` runs again from the start under the
        lock taken anew, so it must read what it decides on inside and be safe to redo."""
        while True:
            claimed: list[int] = []
            try:
                with self.lock(claimed):
                    return section()
            except LockLost:
                self.call.note_outage()
                self._on_outage("the store lost this worker's ask lock in the outage: taking it again "
                                "and doing over what it was held for")
                for number in claimed:  # never started: back in the queue for whoever is next
                    self.back_to_waiting(number)

    @property
    def optuna_storage(self) -> optuna.storages.BaseStorage:
        """The Optuna storage itself, for Optuna's own tools (optuna-dashboard)."""
        return self._storage

    @property
    def user_attrs(self) -> dict[str, Any]:
        """The study's user attributes."""
        return self.call(lambda: self.study.user_attrs)

    def set_study_attr(self, key: str, value: Any) -> None:
        """Set one study user attribute."""
        self.call(self.study.set_user_attr, key, value)

    def check_space(self, allow_space_change: bool = False) -> None:
        """Raise InputError, writing nothing, unless the scenario's space and design may resume
        the study (:func:`hpo.spacecheck.resume_refusal`)."""
        problem = resume_refusal(self.scenario, self.trials(), lambda: self.user_attrs.get(STUDY_PARAMETERS),
                                 self.rows, allow_space_change)
        if problem is not None:
            raise InputError(problem)

    def describe(self, scenario_text: str, allow_space_change: bool = False) -> None:
        """Record the metric name, held-out metrics, parameters and scenario on the study,
        after :meth:`check_space` (which refuses a space, writing nothing)."""
        self.check_space(allow_space_change)
        if self.call(lambda: self.study.metric_names) != [self.scenario.objective.metric]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.call(self.study.set_metric_names, [self.scenario.objective.metric])
        if STUDY_CREATED not in self.user_attrs:
            self.set_study_attr(STUDY_CREATED, f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {uuid.uuid4().hex[:8]}")
        self.set_study_attr(STUDY_HELD_OUT, list(self.scenario.objective.held_out))
        self.set_study_attr(STUDY_PARAMETERS, space.describe(self.scenario.parameters))
        self.set_study_attr(STUDY_SCENARIO, scenario_text)

    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
        """A snapshot of the study's trials (Optuna caches the finished ones)."""
        return self.call(self.study.get_trials, deepcopy=False, states=states)

    def rows(self, trials: list[FrozenTrial] | None = None) -> list[TrialRow]:
        """Every trial (or every one of ``trials``) as a :class:`TrialRow`, by number.

        The rows of finished trials are kept in memory: they never change.
        """
        found = self.trials() if trials is None else trials
        raw = []
        for trial in sorted(found, key=lambda t: t.number):
            row = self._finished.get(trial.number) if trial.state.is_finished() else None
            if row is None:
                row = read_row(trial)
                if trial.state.is_finished():
                    self._finished[trial.number] = row
            raw.append(row)
        return presented(raw, self.scenario.parameters)

    def constants(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with the scenario's constants that apply to them added."""
        return space.with_constants(self.scenario.parameters, params)

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number``; KeyError if there is no such trial."""
        if number not in self._ids:
            self._ids[number] = self.call(self._storage.get_trial_id_from_study_id_trial_number,
                                          self.study_id, number)
        return self._ids[number]

    def trial(self, number: int) -> FrozenTrial:
        """The trial numbered ``number``, read now; InputError if there is none."""
        try:
            return self.call(self._storage.get_trial, self.trial_id(number))
        except KeyError:
            raise InputError(f"trial {number}: no such trial in study {self.scenario.name}") from None

    def ask(self, queued_only: bool = False) -> optuna.Trial:
        """A new trial: the first WAITING one, else a proposal of the sampler (call under the lock).

        When an attempt's claim of a WAITING trial (or its new trial) reached the store but
        the answer was lost in an outage, the retry takes that trial instead of another.
        With ``queued_only`` (design methods, whose every trial is a queued point) no trial
        is made: the first queued trial is claimed, and if another worker took it, which only
        a lost lock allows, :class:`LockLost` is raised."""
        if queued_only:
            waiting = sorted(self._numbers(TrialState.WAITING))
            if waiting:
                with contextlib.suppress(InputError):
                    return self.claim_waiting(waiting[0])
            self._ask_lock.check()
            raise RuntimeError("the queued trial was taken while this worker held the ask lock")
        running = self._numbers(TrialState.RUNNING)

        def landed() -> optuna.Trial | None:
            return next((optuna.trial.Trial(self.study, self.trial_id(number))
                         for number in sorted(self._numbers(TrialState.RUNNING, retried=False) - running)), None)

        trial = self._once(self.study.ask, landed)
        self._ask_lock.note_claim(trial.number)
        return trial

    def claim_waiting(self, number: int) -> optuna.Trial:
        """Claim the WAITING trial ``number`` itself (not the first in the queue); InputError
        when another worker claimed it first. Under the lock, a retry through an outage finds
        the trial RUNNING only if an earlier attempt claimed it."""
        trial_id = self.trial_id(number)

        def landed() -> bool | None:
            if self._ask_lock.mine() is None:
                return None
            state = self._storage.get_trial(trial_id).state  # read once: this runs inside a retried call
            return True if state == TrialState.RUNNING else None

        try:
            claimed = self._once(lambda: self._storage.set_trial_state_values(trial_id, TrialState.RUNNING), landed)
        except optuna.exceptions.UpdateFinishedTrialError:
            claimed = False
        if not claimed:
            raise InputError(f"trial {number}: someone else claimed it first")
        self._ask_lock.note_claim(number)
        return self.call(optuna.trial.Trial, self.study, trial_id)  # its constructor reads the trial

    def enqueue(self, params: Mapping[str, Any], attrs: Mapping[str, Any]) -> None:
        """Queue a WAITING trial with fixed ``params`` and user ``attrs`` (call under the lock),
        once, even when an attempt reached the store but its answer was lost in an outage."""
        waiting = self._numbers(TrialState.WAITING)
        self._once(lambda: self.study.enqueue_trial(dict(params), user_attrs=dict(attrs)),
                   lambda: True if self._numbers(TrialState.WAITING, retried=False) - waiting else None)

    def _numbers(self, state: TrialState, retried: bool = True) -> set[int]:
        """The numbers of the trials in ``state`` now (read through an outage if ``retried``);
        the storage filters them, so this costs those trials, not the whole study."""
        read = self.call if retried else (lambda fn, *args, **kwargs: fn(*args, **kwargs))
        return {t.number for t in read(self._storage.get_all_trials, self.study_id, deepcopy=False, states=(state,))}

    def _once(self, make: Callable[[], T], landed: Callable[[], T | None]) -> T:
        """``make()`` through an outage, made once: before each retry ``landed()`` returns
        what an earlier attempt made in the store though its answer was lost, or None (call
        under the lock, so that what changed in the store is this process's doing)."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            made = landed() if attempts > 1 else None
            return made if made is not None else make()

        return self.call(attempt)

    def set_attr(self, number: int, key: str, value: Any) -> None:
        """Set one user attribute of an unfinished trial."""
        self.call(self._storage.set_trial_user_attr, self.trial_id(number), key, value)

    def set_system(self, number: int, key: str, value: Any) -> None:
        """Set one of hpo's system attributes (claims, starts, heartbeats, stop requests)."""
        self.call(self._storage.set_trial_system_attr, self.trial_id(number), key, value)

    def beat(self, number: int) -> bool:
        """Mark trial ``number`` alive now; False (nothing marked) if it has ended."""
        try:
            self.set_system(number, SYS_HEARTBEAT, time.time())
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        return True

    def stop_requested(self, number: int) -> bool:
        """Whether someone asked (``hpo stop``) for trial ``number`` to end."""
        return bool(self.trial(number).system_attrs.get(SYS_STOP))

    def back_to_waiting(self, number: int) -> bool:
        """Put a claimed trial that never started back in the queue; False if it had ended."""
        return self._set_state(number, TrialState.WAITING)

    def record(self, number: int, result: TrialResult, folder: Path | str) -> bool:
        """Record how trial ``number`` ended: attributes first, then the state (the commit).

        Returns False, recording nothing more, when the trial had already ended otherwise:
        another worker judged it lost (its result stays in its folder). A trial found ended
        as this result says was recorded by this very call: an outage cut the connection
        after the server had committed the state, and the retry found it done.
        """
        state = optuna_state(result.outcome)
        try:
            for key, value in result_attrs(result, folder).items():
                self.set_attr(number, key, value)
            fault_point("record", number)
            if state == TrialState.COMPLETE:
                self.call(self.study.tell, number, result.value)
            else:
                self.call(self.study.tell, number, state=state)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            trial = self.trial(number)
            if trial.state.is_finished():
                return trial.state == state and trial.user_attrs.get(ATTR_OUTCOME) == result.outcome.value
            raise
        return True

    def end_other(self, number: int, result: TrialResult, folder: Path | str) -> bool:
        """Record the end of a trial this worker does not run (lost, or recorded from its
        folder); False when its own worker ended it first."""
        try:
            for key, value in result_attrs(result, folder).items():
                self.set_attr(number, key, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        state = optuna_state(result.outcome)
        values = [result.value] if result.value is not None else None
        return self._set_state(number, state, values)

    def _set_state(self, number: int, state: TrialState, values: list[float] | None = None) -> bool:
        try:
            return bool(self.call(self._storage.set_trial_state_values, self.trial_id(number), state, values))
        except optuna.exceptions.UpdateFinishedTrialError:
            return False

    def withdraw(self, number: int, result: TrialResult, folder: Path | str) -> bool:
        """Record the queued (WAITING) trial ``number`` as ``result`` without running it, with
        the values it was queued with: it is claimed under the ask lock, so no worker starts it.
        False, recording nothing, when a worker claimed it first (or it was not queued)."""
        def claim() -> bool:
            # read through Optuna's cache, which writes only the trials it has read
            waiting = next((t for t in self.trials(states=(TrialState.WAITING,)) if t.number == number), None)
            if waiting is None:
                return False
            try:
                trial = self.claim_waiting(number)
            except InputError:
                return False
            queued = waiting.system_attrs.get("fixed_params", {}).keys() | waiting.params.keys()  # none drawn here
            with warnings.catch_warnings(), contextlib.suppress(ValueError):  # values from outside hpo: none
                warnings.filterwarnings("ignore", message="Fixed parameter", category=UserWarning)
                self.call(space.suggest, trial, {name: param for name, param in self.scenario.parameters.items()
                                                 if name in queued or param.type == "constant"})
            return True

        return self.locked(claim) and self.record(number, result, folder)

    def request_stop(self, number: int) -> FrozenTrial:
        """Ask whichever worker runs trial ``number`` to end it; InputError unless it runs
        (:meth:`withdraw` ends a queued one)."""
        trial = self.trial(number)
        if trial.state != TrialState.RUNNING:
            raise InputError(f"trial {number}: it is {read_row(trial).state}, not running or queued")
        self.set_system(number, SYS_STOP, time.time())
        return trial


def check_resume(scenario: Scenario, url: str, allow_space_change: bool = False) -> str | None:
    """Raise InputError where resuming the scenario's study at ``url`` would be refused
    (objective direction or metric, search space: :meth:`StudyStore.check_space`), reading
    only; with no study there yet, there is nothing to check. The study's ``created`` id
    (:data:`STUDY_CREATED`), None where it has none (not made yet)."""
    try:
        store = StudyStore(scenario, url, create=False)
    except NoStudy:
        return None
    store.check_space(allow_space_change)
    return store.user_attrs.get(STUDY_CREATED)


def scenario_text(path: Path) -> str:
    """The scenario file's text, as recorded on the study (read as :func:`load_scenario` reads it)."""
    try:
        return utf8_text(path)
    except (OSError, InputError):
        return json.dumps({"path": str(path)})
