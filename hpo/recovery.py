"""Trials whose worker is gone: found, cleaned up, and run again or recorded from their folder.

A running trial is stale when its worker is gone: the worker is this very process but no
slot of it runs the trial (a claim half made before a crash), the worker's process no
longer exists on this host, or the trial's heartbeat (beaten by its worker's watchdog)
stopped for ``STALE_AFTER_BEATS`` intervals. A beat is its worker's wall-clock time: a beat
of this host is judged by this host's clock, but one of another machine, whose clock may
run behind or ahead, by how long this process has watched it stand still (:class:`BeatWatch`),
so a worker started on one machine judges another's trial lost only after watching it for
that long. What happens to a stale trial:

* its leftover processes on this host are killed;
* a result its folder holds (``result.json``: the store was down when it ended) is recorded;
* a claim that never started goes back to the queue (WAITING), marked taken back first: its
  worker, if alive after all, then does not start it (:meth:`hpo.scheduler.Scheduler.may_start`),
  and one it marked starting meanwhile is judged started;
* otherwise it is recorded LOST and its configuration queued again, unless it was lost
  :data:`hpo.scheduler.RUN_AGAIN_LIMIT` times in a row: then it is FAIL with reason ``lost 3
  times`` (:func:`hpo.scheduler.requeue_or_fail`, as for a trial its executor found lost). Either
  way its duration is what is known of its run (:func:`ran_s`).

:func:`recover_stale` returns a :class:`Recovered` for each, so the worker can say so.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from hpo.executor import save_result_unless_saved, saved_result
from hpo.launch import kill_by_token
from hpo.outcome import Outcome, TrialResult
from hpo.render import LOG_FILE, FolderFull, trial_folder
from hpo.rows import TrialRow
from hpo.scheduler import HOST, requeue_or_fail
from hpo.storage import MAX_PAUSE_S
from hpo.store import SYS_HEARTBEAT, SYS_RUN, SYS_STARTED, SYS_STARTING, SYS_TAKEN_BACK, StudyStore, has_started

STALE_AFTER_BEATS = 3


@dataclass(frozen=True)
class Recovered:
    """A stale trial and what became of it.

    Args:
        number: the trial.
        params: its parameter values.
        worker: the worker that had claimed it (``host:pid``).
        why: how its worker was found gone (``no heartbeat for 4.2 s``).
        result: how it was recorded (LOST, FAIL ``lost 3 times``, or its folder's result);
            None when it never started and went back to the queue.
        again_as: the trial queued to run its configuration again, if one was.
    """

    number: int
    params: Mapping[str, Any]
    worker: str
    why: str
    result: TrialResult | None
    again_as: int | None


class BeatWatch:
    """How long this process has seen each trial's heartbeat stand still, on its own monotonic
    clock: a trial first seen now has been silent for 0 s, whatever its beat says.

    Args:
        clock: the monotonic clock (``time.monotonic``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[tuple[str, int], tuple[float, float]] = {}
        self._lock = threading.Lock()

    def silent_s(self, trial: FrozenTrial, beat: float) -> float:
        """Seconds since this process first saw ``trial`` (its run, by token) beat ``beat``."""
        key = _run_key(trial)
        now = self._clock()
        with self._lock:
            last, since = self._seen.get(key, (None, now))
            if last != beat:
                since = now
            self._seen[key] = (beat, since)
        return now - since

    def forget_all_but(self, running: list[FrozenTrial]) -> None:
        """Forget the beats of trials that no longer run (``running``: those that do)."""
        keep = {_run_key(trial) for trial in running}
        with self._lock:
            self._seen = {key: seen for key, seen in self._seen.items() if key in keep}


def _run_key(trial: FrozenTrial) -> tuple[str, int]:
    """What tells a trial's run from another: its token (its worker's id for older studies) and number."""
    run = run_info(trial)
    return str(run.get("token") or run.get("worker", "")), trial.number


BEATS = BeatWatch()
"""The heartbeats that this process has watched (:func:`gone_why`)."""


def run_info(trial: FrozenTrial) -> dict[str, object]:
    """Who claimed ``trial``: worker, host, token, seed, trial_seed (older studies: the ``run``
    attribute)."""
    return dict(trial.system_attrs.get(SYS_RUN) or trial.user_attrs.get("run") or {})


def last_sign_of_life(trial: FrozenTrial) -> float | None:
    """When running ``trial``'s worker was last known alive: its last heartbeat or its claim,
    whichever came later (a trial claimed again keeps the heartbeats of its earlier claim),
    else its start in the store; None where none is known."""
    marks = [float(mark) for mark in (trial.system_attrs.get(SYS_HEARTBEAT), run_info(trial).get("claimed_at"))
             if mark is not None]
    if marks:
        return max(marks)
    return None if trial.datetime_start is None else trial.datetime_start.timestamp()


def ran_s(trial: FrozenTrial, folder: Path | None = None) -> float:
    """Seconds the stale ``trial`` is known to have run: from its start (``at`` in its start
    record, else its claim) to the last moment its worker is known to have been alive (when
    it was found lost tells when hpo looked): its last heartbeat, or the last write to the
    trial's log in ``folder`` (its worker writes it), whichever is later; 0 without either."""
    start = (trial.system_attrs.get(SYS_STARTED) or {}).get("at")
    if start is None and trial.datetime_start is not None:
        start = trial.datetime_start.timestamp()
    alive = [float(beat)] if (beat := trial.system_attrs.get(SYS_HEARTBEAT)) is not None else []
    if folder is not None:
        with contextlib.suppress(OSError):  # no log, or a folder on another machine
            alive.append((folder / LOG_FILE).stat().st_mtime)
    return 0.0 if not alive or start is None else max(0.0, max(alive) - float(start))


def is_stale(trial: FrozenTrial, now: float, heartbeat_s: float, me: str, mine: Container[int],
             judge_beats: bool = True) -> bool:
    """Whether running ``trial``'s worker is gone (see the module docstring).

    ``me`` is this process's worker id and ``mine`` the trials its slots run. Heartbeats
    are only judged when ``judge_beats`` (not right after a store outage, when nobody could
    beat).
    """
    return gone_why(trial, now, heartbeat_s, me, mine, judge_beats) is not None


def gone_why(trial: FrozenTrial, now: float, heartbeat_s: float, me: str, mine: Container[int],
             judge_beats: bool = True) -> str | None:
    """How running ``trial``'s worker was found gone, in words; None while it is not
    (:func:`is_stale` with the same arguments)."""
    worker = str(run_info(trial).get("worker", ""))
    if worker == me:
        return None if trial.number in mine else "no slot of this worker runs it"
    host, _, pid = worker.rpartition(":")
    if host == HOST and pid.isdigit() and not psutil.pid_exists(int(pid)):
        return "its process is gone"
    if not judge_beats:
        return None
    beat = last_sign_of_life(trial)
    if beat is None:
        return "it never beat"
    silent = now - float(beat) if host == HOST else BEATS.silent_s(trial, float(beat))
    return f"no heartbeat for {silent:.1f} s" if silent > STALE_AFTER_BEATS * heartbeat_s else None


def judges_beats(healthy_since: float | None, now: float, heartbeat_s: float) -> bool:
    """Whether heartbeats can be judged at ``now`` (``time.monotonic()``), the store having
    answered this worker since ``healthy_since`` (None: it does not answer now).

    Another worker's threads may still be pausing between tries for up to
    :data:`hpo.storage.MAX_PAUSE_S` after this one's store came back, and its next beat is then
    up to one interval away; so ``STALE_AFTER_BEATS`` intervals are counted from that moment.
    """
    return healthy_since is not None and now - healthy_since > MAX_PAUSE_S + STALE_AFTER_BEATS * heartbeat_s


def recover_stale(store: StudyStore, workdir: Path, me: str, mine: Container[int]) -> list[Recovered]:
    """Deal with every stale running trial (see the module docstring); say what became of
    each that this call ended (not one that its own worker ended meanwhile).

    Call under the store's ask lock, so that two workers do not both re-run one trial.
    Heartbeats are judged by :func:`judges_beats` once the running trials have been read, so
    an outage that the read (or the lock before it) waited out counts.
    """
    heartbeat_s = store.scenario.resources.heartbeat
    running = store.trials(states=(TrialState.RUNNING,))
    judge = judges_beats(store.call.healthy_since, time.monotonic(), heartbeat_s)
    now = time.time()
    whys = {t.number: gone_why(t, now, heartbeat_s, me, mine, judge) for t in running}
    BEATS.forget_all_but(running)
    stale = [t for t in running if whys[t.number] is not None]
    if not stale:
        return []
    rows = store.rows()
    by_number = {r.number: r for r in rows}
    ended: dict[int, TrialResult | None] = {}
    for trial in stale:
        run = run_info(trial)
        if run.get("token") and run.get("host") == HOST:
            kill_by_token(str(run["token"]))
        done, result = _settle_stale(store, trial, by_number[trial.number], rows,
                                     Path(by_number[trial.number].folder or trial_folder(workdir, trial.number)))
        if done:
            ended[trial.number] = result
    again = queued_again(store.rows()) if ended else {}
    return [Recovered(t.number, by_number[t.number].params, str(run_info(t).get("worker", "")),
                      str(whys[t.number]), ended[t.number], again.get(t.number)) for t in stale if t.number in ended]


def queued_again(rows: list[TrialRow]) -> dict[int, int]:
    """For each trial whose configuration was queued again (lost or interrupted), the copy's number."""
    return {r.requeue_of: r.number for r in rows if r.requeue_of is not None}


def _started(trial: FrozenTrial) -> bool:
    """Whether stale ``trial``'s worker started it, or marked its claim starting
    (:meth:`hpo.scheduler.Scheduler.may_start`)."""
    starting = trial.system_attrs.get(SYS_STARTING)
    return has_started(trial) or (starting is not None and starting == run_info(trial).get("token"))


def _settle_stale(store: StudyStore, trial: FrozenTrial, row: TrialRow, rows: list[TrialRow],
                  folder: Path) -> tuple[bool, TrialResult | None]:
    """End stale ``trial``: whether this call ended it (not its own worker first), and the
    result it recorded (None: back to the queue)."""
    saved = saved_result(folder, row.number)
    if saved is not None:
        if saved.outcome.run_again:  # LOST where its Dask worker found the trial cut off
            saved = requeue_or_fail(store, row, rows, saved)
        return store.end_other(row.number, saved, folder), saved
    if not _started(trial):
        token = run_info(trial).get("token")
        if token:  # marked taken back, then read again: its worker may have marked it starting meanwhile
            try:
                store.set_system(row.number, SYS_TAKEN_BACK, token)
            except optuna.exceptions.UpdateFinishedTrialError:
                return False, None
            trial = store.trial(row.number)
        if not _started(trial):
            return store.back_to_waiting(row.number), None
    result = requeue_or_fail(store, row, rows, TrialResult(Outcome.LOST, duration_s=ran_s(trial, folder),
                                                           reason="lost: its worker stopped"))
    done = store.end_other(row.number, result, folder)
    if done and folder.is_dir():  # its folder says how it ended, as every trial's does, but a result its
        with contextlib.suppress(OSError, FolderFull):  # process wrote meanwhile stays; another machine's
            save_result_unless_saved(folder, row.number, result)  # folder, or a full disk: the store has it
    return done, result
