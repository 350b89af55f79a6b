"""The sweep: slots that claim a trial, run it on an executor and settle how it ended.

Each task slot is a thread that loops claim → build → run → settle, so a slot that frees
up takes the next trial at once (no batch barrier). The :class:`~hpo.scheduler.Scheduler`
claims (budget, design queue, re-runs), an :class:`~hpo.executor.Executor` runs the trial
(on this machine, or as a Dask task) and the :class:`~hpo.watchdog.Watchdog` beats
heartbeats, passes on stop requests and re-runs the trials of workers that are gone; the
observer hears of each trial of another worker that this one found gone.

A claim is checked before it runs and a result before it is announced: a trial that
another worker took over while this one could not beat (paused, e.g. by SIGSTOP) is not
run; one running that it judged lost is ended at this worker's next heartbeat (the other
worker runs it again), and is announced as recorded, this worker's own end noted (it stays
in the trial's folder), never as if it had counted.

:meth:`Sweep.stop` (SIGINT, SIGTERM) ends the sweep gracefully: running trials are ended
and recorded INTERRUPTED (their configuration queued again), trials claimed ahead go
back to WAITING, and nothing stays RUNNING. Every trial ends as a recorded result, never
as an exception that escapes the loop; only a store that stays down past
``resources.store_retry`` stops the worker (:class:`~hpo.storage.StoreUnavailable`). A
wait for the study's ask lock that the stop ended (its holder was stopped with SIGSTOP, say)
is part of the stop, not a store failure: :attr:`Sweep.stop_note` says so.

A trial folder whose disk is full (:class:`~hpo.render.FolderFull`) is no fault of the
trial, and is waited out as the store's full disk is (:class:`hpo.storage.Retrying`): said in
one line naming the file and the room left, and in one more once a folder is written again.
A trial whose files cannot be written keeps its claim and is tried again, with backoff; one
whose log cannot be written is ended at once and recorded INTERRUPTED (it runs again, but
the third time (across its re-runs) that its files so fill the disk it is recorded FAIL, as a configuration
lost that often is: :data:`hpo.scheduler.RUN_AGAIN_LIMIT`); one whose ``result.json`` cannot be
written is recorded as it ended (that file is the store's backup). Waiting, not stopping at
once, lets the trials of other slots run on while the user frees space, as they do through a
store outage; a disk still full after ``resources.store_retry`` seconds stops the sweep with
one line (its running trials INTERRUPTED), and ``hpo run`` resumes it.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpo import designs, space
from hpo.errors import ExecutorUnavailable, InputError, StoreUnavailable
from hpo.executor import Executor, HeldStart, LocalExecutor, TrialControl, TrialSpec, save_result
from hpo.faults import fault_point
from hpo.launch import Slot, build_argv, check_command, this_python, uses_torchrun
from hpo.outcome import Outcome, TrialResult
from hpo.recovery import Recovered, queued_again, recover_stale
from hpo.render import (
    LOG_FILE,
    PARAMS_FILE,
    FolderFull,
    Renderer,
    folder_full,
    folder_writes,
    trial_folder,
)
from hpo.rows import TrialRow
from hpo.samplers import make_pruner, make_sampler
from hpo.scenario import Param, Scenario
from hpo.scheduler import Claim, Scheduler
from hpo.storage import MAX_PAUSE_S, ask_lock_holder
from hpo.store import SYS_STARTED, StudyStore, scenario_text
from hpo.watchdog import Watchdog


def _quiet_step_warnings() -> None:
    """Keep Optuna's and NumPy's warnings about a trial's step values (a step reported twice:
    Optuna keeps its first value; NaN at a step: pruners take it as the worst) off the sweep's
    output: they are about the trial's script, not the sweep."""
    warnings.filterwarnings("ignore", message="The reported value is ignored because", category=UserWarning)
    warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)

CLAIM_POLL_S = 1.0
AHEAD_POLL_S = 0.05  # how often a slot with nothing to claim looks again while claims ahead are under way
FIRST_PAUSE_S = 0.2  # the first pause before a trial's files are written again on a full disk
STOPPING_STORE_RETRY_S = 10.0  # once stopping, how long a failing store call still retries


@dataclass(frozen=True)
class TrialStart:
    """A trial that a slot just launched: on which slot, where in words (e.g. ``1 process
    on 1/4 of GPU 0``), and the trial whose configuration it runs again, if any."""

    number: int
    params: Mapping[str, Any]
    slot: int
    where: str
    folder: Path
    repeat_of: int | None = None


@dataclass(frozen=True)
class TrialEnd:
    """A trial that just ended, and ``result``: how the study records it.

    The other fields are set only when another worker had a hand in it: ``worker`` ran it and
    this worker found it gone (``why``, in words); ``unrecorded`` is this worker's own result
    of a trial that another worker had judged lost first (it stays in ``folder``);
    ``again_as`` is the trial queued to run its configuration again.
    """

    number: int
    params: Mapping[str, Any]
    result: TrialResult
    worker: str = ""
    why: str = ""
    unrecorded: TrialResult | None = None
    folder: str = ""
    again_as: int | None = None


class Observer(Protocol):
    """Receives sweep events (the progress display); called from slot threads."""

    def started(self, start: TrialStart) -> None: ...

    def finished(self, end: TrialEnd) -> None: ...


@dataclass(frozen=True)
class SweepConfig:
    """Where and how this worker runs the scenario's sweep."""

    scenario: Scenario
    storage: str
    workdir: Path
    slots: tuple[Slot, ...]
    seed: int
    allow_space_change: bool = False
    store_reached: bool = False  # a worker that hpo run --workers started: its store answered hpo run


def recorded_seed(folder: Path, recorded: Callable[[], int]) -> int:
    """The ``trial_seed`` the trial in ``folder`` ran with: its params.json's, else
    ``recorded()`` (what its claim recorded in the store: the folder may be gone, or on a Dask
    worker's machine)."""
    try:
        return int(json.loads((folder / PARAMS_FILE).read_text())["trial_seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return recorded()


PREFLIGHT_SAMPLES = 100  # the most configurations preflight renders


def preflight(renderer: Renderer, workdir: Path, design: list[dict[str, Any]] | None) -> None:
    """Render a trial's templates in memory for each of :func:`preflight_samples` and check
    the command and post_process; raise InputError for an undefined variable (naming the
    values it was met with), a missing program or script, before any trial runs."""
    scenario = renderer.scenario
    for sample in preflight_samples(scenario.parameters, design):
        try:
            renderer.render_texts(0, trial_folder(workdir, 0), sample)
        except InputError as exc:
            values = " ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                              for name, value in sample.items())
            raise InputError(f"{exc} (with {values})") from None
    check_command(scenario.command, renderer.names, unexecutable=renderer.unexecutable)
    if scenario.objective.post_process:
        check_command(scenario.objective.post_process, renderer.names, field="objective.post_process",
                      unexecutable=renderer.unexecutable)


def preflight_samples(params: Mapping[str, Param], design: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """What :func:`preflight` renders: one configuration for each set of active parameters
    (what a template may be missing), :data:`PREFLIGHT_SAMPLES` at most. The first of the
    design's points with each set; else the middle of the space with each combination of the
    choices that conditions name."""
    if not design:
        free = space.free_parameters(params)
        parents = [name for name in free if any(name in (p.condition or {}) for p in params.values())]
        design = []
        for picks in itertools.islice(itertools.product(*(range(len(params[name].choices or ())) for name in parents)),
                                      PREFLIGHT_SAMPLES):
            point = [0.5] * len(free)
            for name, pick in zip(parents, picks):
                point[free.index(name)] = (pick + 0.5) / len(params[name].choices or ())
            design.append(space.from_unit(params, np.array(point)))
    samples: dict[frozenset[str], dict[str, Any]] = {}
    for point in design:
        samples.setdefault(frozenset(point), point)
        if len(samples) == PREFLIGHT_SAMPLES:
            break
    return list(samples.values())


class _FullFolders:
    """Trial folders whose disk is full, as one outage of the sweep (the module docstring):
    it starts, said in one line, when a write first fails, and ends, said too, when a trial's
    files are written again. A slot waiting for room gives up once the outage has lasted
    ``deadline_s`` (``resources.store_retry``)."""

    def __init__(self, workdir: Path, deadline_s: float, say: Callable[[str], None]) -> None:
        self._workdir = workdir
        self._deadline_s = deadline_s
        self._say = say
        self._lock = threading.Lock()
        self._since: float | None = None
        self._where: str | None = None  # the folders of the outage in words, where not this machine's
        self._waiting: set[int] = set()  # trials whose files were refused, waiting for room

    def failed(self, full: FolderFull) -> float:
        """A write failed with ``full``: the outage starts (said) unless it is under way;
        ``time.monotonic()`` of its start."""
        with self._lock:
            since = self._since
            if since is None:
                self._since = now = time.monotonic()
                self._where = full.where
        if since is not None:
            return since
        self._say(f"{full}; free space there and the sweep goes on: trials wait for room for up to "
                  f"{self._deadline_s:g} s")
        return now

    def written(self, number: int) -> None:
        """Trial ``number``'s files were written: the outage, if any, ends (said) where that
        trial waited for room, or no trial waits (as :class:`hpo.storage.Retrying` ends the
        store's: a small write that goes through beside a larger one refused ends nothing)."""
        with self._lock:
            if number not in self._waiting and self._waiting:
                return
            self._waiting.discard(number)
            since, self._since = self._since, None
        if since is not None:
            self._say(f"{self._where or f'the trial folders in {self._workdir}'} can be written again after "
                      f"{time.monotonic() - since:.0f} s")

    def done(self, number: int) -> None:
        """Trial ``number`` waits for room no more (it ran, or its sweep stops)."""
        with self._lock:
            self._waiting.discard(number)

    def wait(self, number: int, full: FolderFull, pause_s: float, stopping: threading.Event) -> None:
        """Wait ``pause_s`` (less if ``stopping`` is set) before trial ``number``'s write that
        raised ``full`` is tried again; :class:`ExecutorUnavailable` once the outage has lasted
        ``deadline_s``."""
        with self._lock:
            self._waiting.add(number)
        since = self.failed(full)
        left = since + self._deadline_s - time.monotonic()
        if left <= 0:
            raise ExecutorUnavailable(f"the trial folders could not be written for {time.monotonic() - since:.0f} s "
                                      f"(resources.store_retry): {full}")
        stopping.wait(min(pause_s, left))


class _Running:
    """A trial this worker claimed: started or not, why it should end early, if it should, and
    the full disk that ended it, if one did (:meth:`_TrialRunner.execute`)."""

    def __init__(self) -> None:
        self.started = False
        self.end_request: str | None = None
        self.ended_elsewhere = False
        self.filled_disk: FolderFull | None = None


class _Claims:
    """The trials this worker's slots hold (:class:`_Running`), from their claim, made under the
    study's ask lock, until they are recorded or released. A design's next trial may be claimed
    ahead for a slot while its current trial runs (:meth:`submit_ahead`). Thread-safe: the slots,
    the watchdog and each trial's control share it."""

    def __init__(self, store: StudyStore, scheduler: Scheduler, stopping: threading.Event,
                 say: Callable[[str], None]) -> None:
        self._store = store
        self._scheduler = scheduler
        self._stopping = stopping
        self._say = say
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._ahead: dict[int, Claim] = {}  # slot index: a design's trial claimed ahead, not started yet
        self._ahead_claims = 0  # claims ahead under way

    def numbers(self) -> list[int]:
        """The trials this worker's slots claimed (started or not)."""
        with self._lock:
            return list(self._running)

    def get(self, number: int) -> _Running | None:
        """What is known of trial ``number``, if this worker holds it."""
        with self._lock:
            return self._running.get(number)

    def hold(self, claim: Claim) -> None:
        """Hold ``claim``, made outside :meth:`next` (``hpo rerun``)."""
        with self._lock:
            self._running[claim.number] = _Running()

    def drop(self, number: int) -> None:
        """Hold trial ``number`` no more (it is recorded, or another worker took it back)."""
        with self._lock:
            self._running.pop(number, None)

    def request_end(self, number: int, request: str) -> None:
        """End trial ``number`` early, for ``request`` (:class:`hpo.watchdog.Watchdog`'s
        ``end_trial``); the first request stands."""
        with self._lock:
            running = self._running.get(number)
            if running is not None and running.end_request is None:
                running.end_request = request

    def next(self) -> Claim | None:
        """The next trial for a slot, waiting while other workers' last trials still run."""
        while not self._stopping.is_set():
            claimed = self._claim()
            if isinstance(claimed, Claim):
                return claimed
            if claimed is None:
                return self._take_any_ahead()
            self._stopping.wait(CLAIM_POLL_S)
        return None

    def submit_ahead(self, books: ThreadPoolExecutor, slot: Slot) -> Future[Claim | str | None]:
        """:meth:`_claim_ahead` on the slot's books thread, counted from now (it may wait there
        behind the settling of the slot's last trial, which may queue a trial to run again)."""
        with self._lock:
            self._ahead_claims += 1
        try:
            return books.submit(self._claim_ahead, slot)
        except BaseException:
            with self._lock:
                self._ahead_claims -= 1
            raise

    def _claim_ahead(self, slot: Slot) -> Claim | str | None:
        """A design's next trial for ``slot``, claimed while its current trial runs; until
        the slot takes it (:meth:`take_ahead`), a slot that frees up with nothing left to
        claim may take it (:meth:`_take_any_ahead`) and run it at once. Counted in
        ``_ahead_claims`` by :meth:`submit_ahead`, until it is claimed."""
        claimed: Claim | str | None = None
        try:
            claimed = self._claim()
        finally:
            with self._lock:
                self._ahead_claims -= 1
                if isinstance(claimed, Claim):
                    self._ahead[slot.index] = claimed
        return claimed

    def take_ahead(self, slot: Slot, claimed: Claim | str | None) -> Claim | str | None:
        """What :meth:`_claim_ahead` returned for ``slot``: None where another slot took it."""
        if not isinstance(claimed, Claim):
            return claimed
        with self._lock:
            return self._ahead.pop(slot.index, None)

    def _take_any_ahead(self) -> Claim | None:
        """A trial that another slot claimed ahead and has not started (waiting for the claims
        ahead under way), for a slot that found nothing left to claim; None where there is none."""
        while True:
            with self._lock:
                if self._ahead:
                    claim = self._ahead.pop(next(iter(self._ahead)))
                    break
                if not self._ahead_claims or self._stopping.is_set():
                    return None
            time.sleep(AHEAD_POLL_S)
        return claim

    def _claim(self) -> Claim | str | None:
        def section() -> Claim | str | None:
            if self._stopping.is_set():
                return None
            with self._lock:
                mine = set(self._running)
            claimed = self._scheduler.claim(mine)
            if isinstance(claimed, Claim):
                with self._lock:
                    self._running[claimed.number] = _Running()
            return claimed

        return self._store.locked(section)

    def release(self, claim: Claim) -> None:
        """Give ``claim`` back to the study (it goes back to WAITING) and hold it no more."""
        try:
            self._scheduler.release(claim)
        finally:
            self.drop(claim.number)

    def may_start(self, claim: Claim) -> bool:
        """Whether this worker may start ``claim`` now (:meth:`Scheduler.may_start`, which marks
        it starting: call it just before the start); if another worker found this one gone since
        the claim and took it back, it is dropped."""
        if self._scheduler.may_start(claim):
            return True
        self.drop(claim.number)
        self._say(f"trial {claim.number} was taken back by another worker before it started here "
                  "(this worker had not beaten its heartbeat in time): not run here")
        return False


def _ends_lock_wait(error: BaseException, stopping: threading.Event, store: StudyStore) -> bool:
    """Whether ``error`` is a wait for the ask lock that the stop ended: once ``stopping``, a
    StoreUnavailable while the store answers (:func:`hpo.storage.ask_lock` gives up then)."""
    return isinstance(error, StoreUnavailable) and stopping.is_set() and store.call.healthy_since is not None


class _TrialRunner:
    """Runs a claimed trial on the executor and records how it ended: builds its files, waits
    out a full disk under its folder (the module docstring), judges the result
    (:meth:`verdict`), tells the observer (:meth:`announce`) and records it (:meth:`settle`).
    ``observer`` is set by :meth:`Sweep.run`."""

    def __init__(self, config: SweepConfig, renderer: Renderer, store: StudyStore, scheduler: Scheduler,
                 claims: _Claims, executor: Executor, stopping: threading.Event,
                 on_fatal: Callable[[BaseException], None], say: Callable[[str], None]) -> None:
        self.scenario = config.scenario
        self.store = store
        self.claims = claims
        self.stopping = stopping
        self.full = _FullFolders(config.workdir, config.scenario.resources.store_retry, say)
        self.observer: Observer | None = None
        self._renderer = renderer
        self._scheduler = scheduler
        self._executor = executor
        self._on_fatal = on_fatal
        self._say = say
        self._lock = threading.Lock()
        self._unrecorded: list[int] = []  # trials whose end the stop kept from the store (the ask lock)

    @property
    def unrecorded(self) -> list[int]:
        """The trials whose end the stop kept from the store (it needed the ask lock)."""
        with self._lock:
            return sorted(self._unrecorded)

    def spec(self, slot: Slot, claim: Claim) -> TrialSpec:
        """Everything the executor needs to run ``claim`` on ``slot``."""
        scenario = self.scenario
        argv = build_argv(scenario, claim.params, slot.processes, uses_torchrun(scenario.resources, slot), claim.seed)
        post = this_python(scenario.objective.post_process) if scenario.objective.post_process else []
        files = self._renderer.files(claim.number, claim.folder, claim.params, argv, claim.seed, post)
        env = {**scenario.env, "HPO_TRIAL_NUMBER": str(claim.number)}
        return TrialSpec(claim.number, claim.params, claim.folder, files, tuple(argv), env, slot, claim.token,
                         scenario.resources.timeout, scenario.objective)

    def execute(self, slot: Slot, claim: Claim) -> TrialResult:
        """Build and run one trial; any error of hpo's own becomes a FAIL with its reason, and
        a full disk under its folder is waited out (the module docstring)."""
        start = time.monotonic()
        try:
            spec = self.spec(slot, claim)
        except InputError as exc:  # its templates do not render for these values: the folder says why
            result = TrialResult(Outcome.FAIL, duration_s=time.monotonic() - start, reason=str(exc))
            try:
                with folder_writes(claim.folder / LOG_FILE):
                    claim.folder.mkdir(parents=True, exist_ok=True)
                    (claim.folder / LOG_FILE).write_text(f"hpo: {exc}\n")
                return save_result(claim.folder, claim.number, result)
            except FolderFull as full:  # the store records why all the same
                self.full.failed(full)
                return result
        control = _Control(self, claim, slot)
        try:
            return self._run_waiting_for_room(claim, spec, control, start)
        finally:
            self.full.done(claim.number)

    def _run_waiting_for_room(self, claim: Claim, spec: TrialSpec, control: _Control, start: float) -> TrialResult:
        """Run ``claim`` on its executor, its files tried again while a full disk refuses them."""
        pause = FIRST_PAUSE_S
        while True:
            try:
                result = self._executor.run(spec, control)
            except StoreUnavailable:
                raise
            except ExecutorUnavailable as exc:
                self._on_fatal(exc)
                return exc.result or TrialResult(Outcome.INTERRUPTED, duration_s=time.monotonic() - start,
                                                 reason=f"interrupted: {exc}")
            except Exception as exc:
                full = _folder_full(exc, claim.folder)
                if full is None:
                    return self._hpo_error(claim, exc, start)
                if self._waited_for_room(claim, full, pause):
                    pause = min(2 * pause, MAX_PAUSE_S)
                    continue
                return full.result or TrialResult(Outcome.INTERRUPTED, duration_s=time.monotonic() - start,
                                                  reason=f"interrupted: {full}; it runs again")
            return result

    def _waited_for_room(self, claim: Claim, full: FolderFull, pause_s: float) -> bool:
        """Whether ``claim`` is to be run again after ``full``: its files could not be written
        (it never started) and its slot waited ``pause_s`` for room. False where it started or
        ended (the outage is noted, unless it is a Dask worker's own disk that ended the trial,
        which its executor said, and so is ``full`` as the end of a trial that started, unless it
        ended otherwise or the sweep stops: :meth:`verdict`), or once the sweep stops, the wait's
        deadline included."""
        started = not self._never_started(claim, None)
        if full.result is not None or started:
            if full.where is None or full.result is None:  # a Dask worker's own disk is no outage of the sweep's
                self.full.failed(full)
            ended_by_it = full.result is None or full.result.outcome is Outcome.INTERRUPTED
            running = self.claims.get(claim.number)
            if started and ended_by_it and running is not None and not self.stopping.is_set():
                running.filled_disk = full
            return False
        try:
            self.full.wait(claim.number, full, pause_s, self.stopping)
        except ExecutorUnavailable as exc:
            self._on_fatal(exc)
        return not self.stopping.is_set()

    def _hpo_error(self, claim: Claim, exc: Exception, start: float) -> TrialResult:
        """A FAIL for ``exc``, an error of hpo's own; its traceback goes to the trial's log."""
        claim.folder.mkdir(parents=True, exist_ok=True)
        with (claim.folder / LOG_FILE).open("a") as log:
            log.write(traceback.format_exc())
        return TrialResult(Outcome.FAIL, duration_s=time.monotonic() - start,
                           reason=f"hpo error: {type(exc).__name__}: {exc}")

    def verdict(self, claim: Claim, result: TrialResult) -> TrialResult:
        """How :meth:`settle` records ``result`` of ``claim`` (:meth:`Scheduler.verdict`, told
        of the full disk that ended it, if one did: :meth:`_waited_for_room`)."""
        running = self.claims.get(claim.number)
        return self._scheduler.verdict(claim, result, None if running is None else running.filled_disk)

    def _never_started(self, claim: Claim, result: TrialResult | None) -> bool:
        """Whether ``claim`` never started: its executor did not start it, and ``result``, if
        any, is INTERRUPTED (a Dask task still queued when the sweep stopped or its scheduler
        went away, files that a full disk refused): it goes back to WAITING."""
        running = self.claims.get(claim.number)
        return (result is None or result.outcome is Outcome.INTERRUPTED) and running is not None \
            and not running.started

    def announce(self, claim: Claim, result: TrialResult) -> None:
        """Tell the observer how ``claim`` ended (its record follows: :meth:`settle`), or how
        the study records it if another worker judged it lost first."""
        if self._never_started(claim, result):
            return
        end = self._ended_elsewhere(claim, result) or TrialEnd(claim.number, claim.params, result)
        if self.observer:
            self.observer.finished(end)

    def _ended_elsewhere(self, claim: Claim, result: TrialResult) -> TrialEnd | None:
        """How the study records ``claim`` if another worker ended it otherwise than ``result``
        (judged it lost while this worker could not beat), marking it so: None while it runs,
        or when that worker recorded ``result`` itself from the trial's folder."""
        store = self.store
        try:
            row = store.rows([store.trial(claim.number)])[0]
        except StoreUnavailable:  # it is announced as it ended here; recording it will meet the outage
            return None
        if not row.outcome.ended or (row.outcome, row.reason) == (result.outcome, result.reason):
            return None
        running = self.claims.get(claim.number)
        if running is not None:
            running.ended_elsewhere = True
        return TrialEnd(claim.number, claim.params, row.result(), unrecorded=result, folder=str(claim.folder),
                        again_as=queued_again(store.rows()).get(claim.number))

    def settle(self, claim: Claim, result: TrialResult) -> None:
        """Record how ``claim`` ended (back to WAITING if it never started; nothing if another
        worker ended it first: :meth:`_ended_elsewhere`); a record that the stop left undone
        (it needed the ask lock: :func:`_ends_lock_wait`) is said. A record that the store's
        outage kept undone leaves the trial held until the worker exits, so that its own watchdog
        does not judge it lost: a resume records it from its folder."""
        if self._never_started(claim, result):
            self.claims.release(claim)
            return
        running = self.claims.get(claim.number)
        filled = None if running is None else running.filled_disk
        try:
            if (running is None or not running.ended_elsewhere) and not self._scheduler.settle(claim, result, filled):
                self._say(f"trial {claim.number} was judged lost by another worker just before its "
                          f"{result.outcome} could be recorded: the study keeps that worker's record; this "
                          f"result stays in {claim.folder}")
        except StoreUnavailable as exc:
            if _ends_lock_wait(exc, self.stopping, self.store):
                with self._lock:
                    self._unrecorded.append(claim.number)
                self._say(f"trial {claim.number} could not be recorded {result.outcome}: that needs the study's ask "
                          f"lock, which the sweep stopped waiting for; it shows RUNNING until the study is resumed, "
                          f"which records it from {claim.folder}")
            raise
        except BaseException:
            self.claims.drop(claim.number)
            raise
        self.claims.drop(claim.number)
        fault_point("settled", claim.number)


class Sweep:
    """Runs one worker's share of a study until the study's budget is spent: a thread per slot
    claims trials (:class:`_Claims`) and runs each (:class:`_TrialRunner`)."""

    def __init__(self, config: SweepConfig, executor: Executor | None = None) -> None:
        _quiet_step_warnings()
        self.config = config
        scenario = config.scenario
        self._scenario = scenario
        self._renderer = Renderer(scenario, config.workdir)
        self._design = designs.design_points(scenario)
        self.store = StudyStore(scenario, config.storage, pruner=make_pruner(scenario), on_outage=self._say,
                                reached=config.store_reached)
        self._trials_at_start = len(self.store.trials())
        self.store.use_sampler(make_sampler(scenario, config.seed, resumed_at=self._trials_at_start))
        self.scheduler = Scheduler(self.store, self._design, designs.total_trials(scenario), config.workdir,
                                   config.seed, designs.design_numbers(scenario))
        self._executor = executor or LocalExecutor()
        self._stopping = threading.Event()
        self._fatal: BaseException | None = None
        self._lock_wait_ended = False
        self._gone: list[Recovered] = []  # found before the observer came
        self._claims = _Claims(self.store, self.scheduler, self._stopping, self._say)
        self._trials = _TrialRunner(config, self._renderer, self.store, self.scheduler, self._claims, self._executor,
                                    self._stopping, self._on_fatal, self._say)
        self.watchdog = Watchdog(self.store, config.workdir, self.scheduler.worker, self._claims.numbers,
                                 self._claims.request_end, self._found_gone)

    @property
    def uses_forest(self) -> bool:
        """Whether smac's forest may propose trials of this sweep (see :mod:`hpo.forest_service`)."""
        if self._scenario.search.method != "smac":
            return False
        from hpo.optimizer import SmacSampler

        sampler = self.store.study.sampler
        return isinstance(sampler, SmacSampler) and sampler.uses_forest_within(self.scheduler.budget)

    @property
    def uses_gp(self) -> bool:
        """Whether a Gaussian process may propose trials of this sweep: ``gp`` past its
        :data:`~hpo.gp.START_TRIALS` random ones, or ``smac`` on a space its GP takes,
        from the trials the study held when the sweep began to its budget
        (:meth:`hpo.optimizer.SmacSampler.uses_gp_within`)."""
        from optuna.samplers import GPSampler

        from hpo.gp import START_TRIALS
        from hpo.optimizer import SmacSampler

        sampler = self.store.study.sampler
        if isinstance(sampler, SmacSampler):
            return sampler.uses_gp_within(self.scheduler.budget, self._trials_at_start)
        return isinstance(sampler, GPSampler) and self.scheduler.budget > START_TRIALS

    @property
    def budget(self) -> int:
        """Total trials of the study (all workers, all runs)."""
        return self.scheduler.budget

    def _say(self, message: str) -> None:
        print(f"hpo: {message}", flush=True)

    def _found_gone(self, gone: list[Recovered]) -> None:
        """Tell the observer how the trials of gone workers were recorded (:meth:`run` tells
        it of those found before it came)."""
        observer = self._trials.observer
        if observer is None:
            self._gone += gone
            return
        for trial in gone:
            if trial.result is not None:
                observer.finished(TrialEnd(trial.number, trial.params, trial.result, trial.worker, trial.why,
                                           again_as=trial.again_as))

    def prepare(self) -> None:
        """Pre-flight the templates, check the space of a resumed study, record the
        scenario on the study, and deal with the trials of workers that are gone."""
        preflight(self._renderer, self.config.workdir, self._design)
        store = self.store

        def section() -> list[Recovered]:
            store.describe(scenario_text(self._scenario.path), self.config.allow_space_change)
            return recover_stale(store, self.config.workdir, self.scheduler.worker, ())

        self._found_gone(store.locked(section))

    def stop(self) -> None:
        """End running trials (they run again on resume) and claim no more; a store call
        failing through an outage gives up within :data:`STOPPING_STORE_RETRY_S`."""
        self._stopping.set()
        self.store.call.hurry(STOPPING_STORE_RETRY_S)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (or the store stayed down)."""
        return self._stopping.is_set()

    @property
    def stop_note(self) -> str:
        """'' unless the stop ended a wait for the study's ask lock: then that it stopped
        while waiting for it, naming its holder."""
        if not self._lock_wait_ended:
            return ""
        holder = ask_lock_holder(self.config.storage)
        return "stopped while waiting for the study's ask lock" + (f", held by {holder}" if holder else "")

    @property
    def stop_ended(self) -> str | None:
        """How the stop left the running trials, where some could not be recorded (their end
        needed the ask lock that the stop gave up waiting for); None where all were."""
        unrecorded = self._trials.unrecorded
        if not unrecorded:
            return None
        trials = ", ".join(map(str, unrecorded))
        return (f"trial{'s' if len(unrecorded) > 1 else ''} {trials} could not be recorded and show"
                f"{'' if len(unrecorded) > 1 else 's'} RUNNING until the study is resumed, which records "
                f"{'them' if len(unrecorded) > 1 else 'it'} from the trial folder and runs it again; other running "
                "trials were recorded INTERRUPTED and queued again; run the same command to resume")

    def run(self, observer: Observer | None = None) -> None:
        """Run trials on every slot until the budget is spent or :meth:`stop` is called.

        Call :meth:`prepare` first. Raises :class:`StoreUnavailable` if the store stayed
        down past ``resources.store_retry`` (the slots were stopped first).
        """
        self._trials.observer = observer
        gone, self._gone = self._gone, []
        self._found_gone(gone)
        self.watchdog.start(self._on_fatal)
        slots: list[Slot] = []
        threads: list[threading.Thread] = []
        self._add_slots(slots, threads, self.config.slots)
        try:
            while running := [thread for thread in threads if thread.is_alive()]:
                running[0].join(0.2)  # short joins: the signal handlers run in this thread
                self._grow(slots, threads)
        finally:
            self.watchdog.stop()
            self._executor.close()
        if self._fatal is not None:
            raise self._fatal

    def _add_slots(self, slots: list[Slot], threads: list[threading.Thread], more: Sequence[Slot]) -> None:
        """Start a thread for each slot of ``more``."""
        for slot in more:
            thread = threading.Thread(target=self._slot_loop, args=(slot,), name=f"hpo-slot-{slot.index}")
            thread.start()
            slots.append(slot)
            threads.append(thread)

    def _grow(self, slots: list[Slot], threads: list[threading.Thread]) -> None:
        """Add the slots that the executor has room for now (a Dask cluster's workers that
        connected later), as many as the budget's trials at most, while the sweep runs."""
        want = min(self._executor.slots_now() or 0, self.budget)
        if want > len(slots) and not self._stopping.is_set():
            self._add_slots(slots, threads, [replace(slots[0], index=index) for index in range(len(slots), want)])

    def _on_fatal(self, error: BaseException) -> None:
        """Stop the sweep for ``error``, which :meth:`run` raises, unless it is a wait for the
        ask lock that the stop ended (:func:`_ends_lock_wait`)."""
        if _ends_lock_wait(error, self._stopping, self.store):
            self._lock_wait_ended = True
        elif self._fatal is None:
            self._fatal = error
        self.stop()

    def _slot_loop(self, slot: Slot) -> None:
        """Run trials on ``slot`` until none is left; a store outage past its deadline stops
        the whole sweep."""
        try:
            self._slot_trials(slot)
        except StoreUnavailable as exc:
            self._on_fatal(exc)
        except Exception as exc:  # a bug of hpo's own: stop cleanly, say what it was
            traceback.print_exc()
            self._on_fatal(exc)

    def _slot_trials(self, slot: Slot) -> None:
        """For designs (points known up front) the next trial is claimed while the current
        one runs and a finished trial is settled in the background, so the slot idles only
        for a process start. Model-based methods claim after each result is settled, so
        every proposal sees every result."""
        claims, trials = self._claims, self._trials
        books = ThreadPoolExecutor(1, thread_name_prefix=f"hpo-books-{slot.index}") if self._design else None
        claimed = claims.next()
        settled: Future[None] | None = None
        try:
            while claimed is not None and not self._stopping.is_set():
                if not claims.may_start(claimed):
                    if settled is not None:
                        settled.result()  # the claim to come may be a trial that this settling queues again
                    claimed = claims.next()
                    continue
                ahead = claims.submit_ahead(books, slot) if books else None
                result = trials.verdict(claimed, trials.execute(slot, claimed))
                trials.announce(claimed, result)  # before the next trial starts on this slot
                if ahead is None:
                    trials.settle(claimed, result)
                    claimed = claims.next()
                    continue
                if settled is not None:
                    settled.result()  # the last trial's settling, done (the claim ahead waited behind it)
                settled = books.submit(trials.settle, claimed, result)
                following = claims.take_ahead(slot, ahead.result())
                if not isinstance(following, Claim) or self._stopping.is_set():
                    settled.result()
                    if isinstance(following, Claim):
                        claims.release(following)
                    following = claims.next()
                claimed = following
                if settled.done():
                    settled.result()  # a failure to record stops the slot now, not after its next trial
            if claimed is not None:
                claims.release(claimed)
        finally:
            if books:
                books.shutdown(wait=True)
        if settled is not None:
            settled.result()

    def rerun(self, number: int, seed: int | None = None) -> tuple[TrialRow, TrialResult]:
        """Run trial ``number``'s configuration again as a new trial on the first slot
        (``hpo rerun``); ``seed`` is its ``trial_seed`` (default: an interrupted rerun's own,
        else the original's)."""
        store = self.store
        original = store.rows([store.trial(number)])[0]
        if not original.params or original.outcome is Outcome.WAITING:
            raise InputError(f"trial {number}: it has no configuration to run again yet")
        changed = space.outside(self._scenario.parameters, space.searched(self._scenario.parameters, original.params))
        if changed is not None:
            raise InputError(f"trial {number}: {changed}; hpo rerun runs a configuration of the scenario's search "
                             "space as it is: rerun a trial run since the change")
        default_seed = recorded_seed(Path(original.folder), lambda: self.scheduler.seed_of(number))
        def claimed() -> Claim:
            claim = self.scheduler.claim_rerun(original, seed, default_seed)
            self.scheduler.may_start(claim)  # True under the ask lock, which a take-back holds too
            return claim

        claim = store.locked(claimed)
        self._claims.hold(claim)
        self.watchdog.start(self._on_fatal)
        trials = self._trials
        try:
            result = trials.verdict(claim, trials.execute(self.config.slots[0], claim))
            trials.announce(claim, result)
            try:
                trials.settle(claim, result)
            except StoreUnavailable as exc:  # as a sweep's slot's: raised below unless the stop ended a lock wait
                self._on_fatal(exc)
        finally:
            self.watchdog.stop()
        if self._fatal is not None:
            raise self._fatal
        return store.rows([store.trial(claim.number)])[0], result


def _folder_full(exc: Exception, folder: Path) -> FolderFull | None:
    """``exc`` as a :class:`FolderFull` where it says that the disk of the trial's ``folder``
    is full (a write the executor made outside :mod:`hpo.render`'s helpers names its file, or
    else the folder), else None."""
    if isinstance(exc, FolderFull):
        return exc
    filename = getattr(exc, "filename", None)
    return folder_full(exc, Path(filename) if filename else folder)


class _Control(TrialControl):
    """The sweep's side of one running trial (see :class:`hpo.executor.TrialControl`); the
    observer hears of its start once its process runs (:class:`hpo.executor.HeldStart`)."""

    def __init__(self, trials: _TrialRunner, claim: Claim, slot: Slot) -> None:
        self._trials = trials
        self._claim = claim
        self._slot = slot
        self._pruning = trials.scenario.search.pruner != "none" and claim.prunable
        self._pruned = False
        self._start = HeldStart(self._announce)

    def started(self, slot: Slot) -> None:
        claim, trials = self._claim, self._trials
        parameters = trials.scenario.parameters
        constants = {name: value for name, value in claim.params.items()
                     if name in parameters and parameters[name].type == "constant"}
        where = slot.describe()
        trials.store.set_system(claim.number, SYS_STARTED, {
            "slot": self._slot.index, "gpus": ",".join(map(str, slot.gpus)), "where": where, "folder": str(claim.folder),
            "pid": os.getpid(), "at": time.time(), "constants": constants})
        running = trials.claims.get(claim.number)
        if running is not None:
            running.started = True
        trials.full.written(claim.number)  # its files were
        self._start.hold(TrialStart(claim.number, claim.params, self._slot.index, where,
                                    claim.folder, claim.repeat_of))
        fault_point("started", claim.number)

    def _announce(self, start: TrialStart) -> None:
        if self._trials.observer:
            self._trials.observer.started(start)

    def intermediate(self, step: int, value: float) -> bool:
        """Report ``value`` at ``step`` and ask the pruner; once it said prune, report nothing
        more and answer True (:meth:`record` tells the start held)."""
        self.record(step, value)
        self._pruned = self._pruned or (self._pruning and bool(self._trials.store.call(self._claim.trial.should_prune)))
        return self._pruned

    def record(self, step: int, value: float) -> None:
        """Report ``value`` at ``step`` (a step's first value is kept, as Optuna keeps it)
        without asking the pruner; nothing once it said prune."""
        self._start.release()
        if not self._pruned:
            self._trials.store.call(self._claim.trial.report, value, step)

    def end_request(self) -> str | None:
        self._start.release()
        if self._trials.stopping.is_set():
            return "interrupted"
        running = self._trials.claims.get(self._claim.number)
        return running.end_request if running is not None else None
