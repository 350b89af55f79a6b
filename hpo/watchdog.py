"""The watchdog of one worker: heartbeats, stop requests, and trials of workers that are gone.

Every second it reads the stop requests (``hpo stop``) of the trials this worker claimed;
every ``resources.heartbeat`` seconds it beats their heartbeats (a trial found ended there was
judged lost by another worker while this one could not beat, a pause or a stall: its process is
ended here, since the other worker runs it again) and, under the ask lock,
re-runs the trials of workers that are gone (:mod:`hpo.recovery`), and says which. After a store outage it
judges no heartbeat until every worker has had time to beat again
(:func:`hpo.recovery.judges_beats`),
since no worker could beat while the store was down.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpo.errors import StoreUnavailable
from hpo.recovery import Recovered, recover_stale
from hpo.store import StudyStore

WATCH_INTERVAL_S = 1.0


class Watchdog:
    """A thread that looks after one worker's claimed trials (see the module docstring).

    Args:
        store: the study store.
        workdir: where trial folders are (results a lost trial left there are recorded).
        worker: this worker's id (``host:pid``).
        claimed: the numbers of the trials this worker claimed, started or not.
        end_trial: called with a trial's number and why it should end: ``stopped`` (a user
            asked: ``hpo stop``) or ``lost`` (another worker judged it lost and ended it).
        found_gone: called with what became of the trials of gone workers, when there were any.
    """

    def __init__(self, store: StudyStore, workdir: Path, worker: str, claimed: Callable[[], list[int]],
                 end_trial: Callable[[int, str], None],
                 found_gone: Callable[[list[Recovered]], None] = lambda gone: None) -> None:
        self._store = store
        self._workdir = workdir
        self._worker = worker
        self._claimed = claimed
        self._end_trial = end_trial
        self._found_gone = found_gone
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_fatal: Callable[[BaseException], None]) -> None:
        """Start watching; ``on_fatal`` receives a :class:`StoreUnavailable` that ends the worker."""
        self._done.clear()
        self._thread = threading.Thread(target=self._loop, args=(on_fatal,), name="hpo-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (waits for the current round)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self, on_fatal: Callable[[BaseException], None]) -> None:
        heartbeat_s = self._store.scenario.resources.heartbeat
        last_beat = time.monotonic()
        while not self._done.wait(WATCH_INTERVAL_S):
            try:
                beat = time.monotonic() - last_beat >= heartbeat_s
                self.round(beat)
                if beat:
                    last_beat = time.monotonic()
            except StoreUnavailable as exc:
                on_fatal(exc)
                return

    def round(self, beat: bool) -> None:
        """One round: stop requests; with ``beat``, heartbeats and the trials of gone workers."""
        store = self._store
        for number in self._claimed():
            if store.stop_requested(number):
                self._end_trial(number, "stopped")
            if beat and not store.beat(number):
                self._end_trial(number, "lost")
        if beat:
            gone = store.locked(lambda: recover_stale(store, self._workdir, self._worker, set(self._claimed())))
            if gone:
                self._found_gone(gone)
