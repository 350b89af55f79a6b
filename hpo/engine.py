"""The sweep: ask the store for a trial, render its folder, launch it, parse it, tell the store.

Each task slot is a thread that loops ask → render → launch → parse → tell, so a slot that
frees up takes the next trial at once (no batch barrier). Asking happens under the store's
ask lock, where the budget (``search.trials`` for the whole study) is checked, so workers
on any number of machines never run more. Every trial ends as a recorded value — COMPLETE,
FAIL, PRUNED, or STOPPED / TIMEOUT with a reason — never as an exception that escapes the
loop. A watchdog thread beats each running trial's heartbeat and picks up stop requests;
trials whose worker died are failed, cleaned up and retried by :mod:`hpo.recovery`.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Protocol

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from hpo import designs, space
from hpo.errors import InputError
from hpo.launch import Slot, build_argv, run_process, trial_env
from hpo.recovery import HOST, fail_stale_trials, retry
from hpo.render import LOG_FILE, Renderer, trial_folder
from hpo.results import MetricParser, judge
from hpo.samplers import make_pruner, make_sampler
from hpo.scenario import Scenario
from hpo.store import (RESULT_ATTR, RUN_ATTR, SYS_DESIGN_INDEX, SYS_HEARTBEAT, SYS_STOP, ask_lock,
                       counted_trials, open_study)

WATCH_INTERVAL_S = 1.0
_WAIT = object()
optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class TrialStart:
    """A trial that a slot just launched."""

    number: int
    params: Mapping[str, Any]
    slot: int
    folder: Path


@dataclass(frozen=True)
class TrialEnd:
    """How a trial ended, as recorded in the store."""

    number: int
    state: str
    value: float | None
    held_out: Mapping[str, float]
    duration_s: float
    reason: str
    overhead_s: float = 0.0


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
    worker: str = field(default_factory=lambda: f"{HOST}:{os.getpid()}")


@dataclass
class _Running:
    trial: Trial
    token: str
    end_request: str | None = None


def preflight(renderer: Renderer, workdir: Path, design: list[dict[str, Any]] | None) -> None:
    """Render a trial's templates in memory (the first design point, or the middle of the
    space); raise InputError for an undefined variable before any trial runs."""
    scenario = renderer.scenario
    sample = design[0] if design else space.from_unit(
        scenario.parameters, [0.5] * len(space.free_parameters(scenario.parameters)))
    renderer.render_texts(0, trial_folder(workdir, 0), sample)


class Sweep:
    """Runs one worker's share of a study until the study's budget is spent."""

    def __init__(self, config: SweepConfig) -> None:
        self.config = config
        self._scenario = config.scenario
        self._observer: Observer | None = None
        self._renderer = Renderer(self._scenario)
        self._budget = designs.total_trials(self._scenario)
        self._design = designs.design_points(self._scenario)
        self._study = open_study(self._scenario, config.storage,
                                 sampler=make_sampler(self._scenario, config.seed),
                                 pruner=make_pruner(self._scenario))
        self._running: dict[int, _Running] = {}
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._done = threading.Event()

    @property
    def study(self) -> optuna.Study:
        """The study this sweep asks and tells."""
        return self._study

    @property
    def budget(self) -> int:
        """Total trials of the study (all workers, all runs)."""
        return self._budget

    def prepare(self) -> None:
        """Pre-flight, then fail the trials of workers that are gone."""
        preflight(self._renderer, self.config.workdir, self._design)
        with ask_lock(self.config.storage):
            self._fail_stale_trials()

    def _enqueue_next_point(self, trials: list[FrozenTrial]) -> None:
        """Queue the design's next point, unless a retry already waits (call under the lock).

        Points are queued one at a time, each marked with its index, so the study holds few
        unfinished trials and reading it stays cheap.
        """
        if self._design is None or any(t.state == TrialState.WAITING for t in trials):
            return
        index = 1 + max((int(t.system_attrs[SYS_DESIGN_INDEX]) for t in trials
                         if SYS_DESIGN_INDEX in t.system_attrs), default=-1)
        if index >= len(self._design):
            return
        point = self._design[index]
        distributions = space.distributions(self._scenario.parameters)
        self._study.add_trial(optuna.trial.create_trial(
            state=TrialState.WAITING, params=point, distributions={k: distributions[k] for k in point},
            system_attrs={"fixed_params": point, SYS_DESIGN_INDEX: index}))

    def interrupt(self) -> None:
        """End running trials (they are retried on resume) and stop asking for more."""
        self._interrupted.set()

    def run(self, observer: Observer | None = None) -> None:
        """Run trials on every slot until the budget is spent or :meth:`interrupt` is called.

        Call :meth:`prepare` first.
        """
        self._observer = observer
        watchdog = threading.Thread(target=self._watch, name="hpo-watchdog", daemon=True)
        watchdog.start()
        slots = [threading.Thread(target=self._slot_loop, args=(slot,), name=f"hpo-slot-{slot.index}")
                 for slot in self.config.slots]
        for thread in slots:
            thread.start()
        try:
            for thread in slots:
                while thread.is_alive():
                    thread.join(timeout=0.2)
        except BaseException:
            self.interrupt()
            for thread in slots:
                thread.join()
            raise
        finally:
            self._done.set()
            watchdog.join(timeout=5)

    def _slot_loop(self, slot: Slot) -> None:
        """Run trials on ``slot`` until none is left.

        For designs (points known up front) the next trial is claimed while the current one
        runs and a finished trial is recorded in the background, so the slot idles only for
        a process start. Model-based methods claim after each result is told, so every
        proposal sees every result.
        """
        books = ThreadPoolExecutor(1, thread_name_prefix=f"hpo-books-{slot.index}") if self._design else None
        claimed = self._next_claim()
        idle_since = time.monotonic()
        try:
            while claimed is not None:
                ahead = books.submit(self._claim) if books else None
                end = self._execute(slot, *claimed)
                now = time.monotonic()
                end = replace(end, overhead_s=max(0.0, now - idle_since - end.duration_s))
                idle_since = now
                if books is None or ahead is None:
                    self._record(claimed[0], end)
                    claimed = self._next_claim()
                    continue
                recorded = books.submit(self._record, claimed[0], end)
                claimed = ahead.result()
                if claimed is None or claimed is _WAIT:
                    recorded.result()
                    claimed = self._next_claim()
        finally:
            if books:
                books.shutdown(wait=True)

    def _next_claim(self) -> tuple[Trial, dict[str, Any]] | None:
        """The next trial for a slot, waiting while other workers' last trials still run."""
        while True:
            claimed = self._claim()
            if claimed is not _WAIT:
                return claimed
            if self._interrupted.wait(WATCH_INTERVAL_S):
                return None

    def _claim(self) -> Any:
        """Ask for the next trial; None when the budget is spent and nothing else runs, or
        :data:`_WAIT` while other workers' trials still run (they may fail and be retried)."""
        with ask_lock(self.config.storage):
            if self._interrupted.is_set():
                return None
            trials = self._study.get_trials(deepcopy=False)
            if counted_trials(trials) >= self._budget:
                with self._lock:
                    mine = set(self._running)
                others = any(t.state == TrialState.RUNNING and t.number not in mine for t in trials)
                return _WAIT if others else None
            self._enqueue_next_point(trials)
            trial = self._study.ask()
            params = space.suggest(trial, self._scenario.parameters)
            token = f"{self._scenario.name}:{trial.number}:{uuid.uuid4().hex[:12]}"
            folder = trial_folder(self.config.workdir, trial.number)
            trial.set_user_attr(RUN_ATTR, {"folder": str(folder), "worker": self.config.worker,
                                           "host": HOST, "token": token, "worker_seed": self.config.seed})
            with self._lock:
                self._running[trial.number] = _Running(trial, token)
        return trial, params

    def _beat(self, trial: Trial) -> None:
        self._study._storage.set_trial_system_attr(trial._trial_id, SYS_HEARTBEAT, time.time())

    def _execute(self, slot: Slot, trial: Trial, params: dict[str, Any]) -> TrialEnd:
        """Render and run one trial and judge its outcome; records nothing but intermediate
        values. Any error becomes a FAIL with its reason."""
        number = trial.number
        folder = trial_folder(self.config.workdir, number)
        scenario = self._scenario
        start = time.monotonic()
        if self._interrupted.is_set():
            return TrialEnd(number, "INTERRUPTED", None, {}, 0.0, "interrupted before it started")
        try:
            processes = len(slot.gpus) or slot.processes
            argv = build_argv(scenario.command, params, scenario.flags, processes,
                              scenario.resources.uses_torchrun())
            self._renderer.render(folder, number, params, argv)
            if self._observer:
                self._observer.started(TrialStart(number, params, slot.index, folder))
            return self._launch(slot, trial, folder, argv)
        except InputError as exc:
            return TrialEnd(number, "FAIL", None, {}, time.monotonic() - start, str(exc))
        except Exception as exc:
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / LOG_FILE).open("a") as log:
                log.write(traceback.format_exc())
            return TrialEnd(number, "FAIL", None, {}, time.monotonic() - start,
                            f"hpo error: {type(exc).__name__}: {exc}")

    def _record(self, trial: Trial, end: TrialEnd) -> None:
        """Tell the store how ``trial`` ended, then the observer. Never raises."""
        try:
            self._finish(trial, end)
        except Exception as exc:  # the store is down: the trial goes stale and is retried
            print(f"hpo: could not record trial {trial.number}: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            with self._lock:
                self._running.pop(trial.number, None)
        if self._observer:
            self._observer.finished(end)

    def _launch(self, slot: Slot, trial: Trial, folder: Path, argv: list[str]) -> TrialEnd:
        scenario = self._scenario
        metric = scenario.objective.metric
        parser = MetricParser(metric)
        running = self._running[trial.number]
        pruning = scenario.search.pruner != "none"

        def on_line(line: str) -> None:
            reported = parser.feed(line)
            if reported is None or reported.step is None or metric not in reported.values:
                return
            trial.report(reported.values[metric], reported.step)
            if pruning and trial.should_prune():
                running.end_request = "pruned"

        def should_end() -> str | None:
            return "interrupted" if self._interrupted.is_set() else running.end_request

        env = trial_env(slot, running.token, scenario.env)
        env.update(HPO_TRIAL_NUMBER=str(trial.number), HPO_TRIAL_DIR=str(folder))
        result = run_process(argv, folder, env, folder / LOG_FILE, scenario.resources.timeout,
                             on_line, should_end)
        metrics = parser.metrics()
        verdict = judge(metrics, metric, scenario.objective.held_out, result.exit_code)
        state, value, reason = verdict.state, verdict.value, verdict.reason
        if result.ended_by == "timeout":
            state, value, reason = "TIMEOUT", None, f"TIMEOUT: killed after {scenario.resources.timeout:g} s"
        elif result.ended_by == "pruned":
            step = metrics.intermediate[-1][0] if metrics.intermediate else 0
            state, value, reason = "PRUNED", None, f"pruned at step {step}"
        elif result.ended_by == "stopped":
            state, value, reason = "STOPPED", None, "stopped by the user"
        elif result.ended_by == "interrupted":
            state, value, reason = "INTERRUPTED", None, "interrupted: the sweep was stopped"
        elif result.ended_by is not None:
            state, value, reason = "FAIL", None, result.ended_by
        return TrialEnd(trial.number, state, value, verdict.held_out, result.duration_s, reason)

    def _finish(self, trial: Trial, end: TrialEnd) -> None:
        """Record ``end`` on the trial and tell the study; schedule a retry if one is due."""
        outcome = end.state if end.state in ("TIMEOUT", "STOPPED", "INTERRUPTED") else None
        trial.set_user_attr(RESULT_ATTR, {"held_out": dict(end.held_out), "duration_s": round(end.duration_s, 3),
                                          "reason": end.reason, "outcome": outcome})
        if end.state == "COMPLETE":
            self._study.tell(trial, end.value)
        elif end.state in ("PRUNED", "STOPPED"):
            self._study.tell(trial, state=TrialState.PRUNED)
        else:
            self._study.tell(trial, state=TrialState.FAIL)
            retry(self._study, self._study._storage.get_trial(trial._trial_id),
                  self._scenario.search.retry_failed, always=end.state == "INTERRUPTED")

    def _fail_stale_trials(self) -> None:
        """Fail other workers' trials whose worker is gone (call under the ask lock)."""
        fail_stale_trials(self._study, self._scenario.resources.heartbeat, self._scenario.search.retry_failed,
                          mine=set(self._running))

    def _watch(self) -> None:
        """Beat the heartbeat of this worker's trials; pass on stop requests from the store."""
        storage = self._study._storage
        last_beat = time.monotonic()
        while not self._done.wait(WATCH_INTERVAL_S):
            with self._lock:
                running = list(self._running.values())
            beat = time.monotonic() - last_beat >= self._scenario.resources.heartbeat
            for item in running:
                try:
                    if storage.get_trial(item.trial._trial_id).system_attrs.get(SYS_STOP):
                        item.end_request = item.end_request or "stopped"
                    if beat:
                        self._beat(item.trial)
                except Exception:  # the trial just finished, or the store blinked: next round
                    continue
            if beat:
                last_beat = time.monotonic()
                try:
                    with ask_lock(self.config.storage):
                        self._fail_stale_trials()
                except Exception:  # the store blinked: next round
                    continue


def request_stop(study: optuna.Study, number: int) -> FrozenTrial:
    """Ask whichever worker runs trial ``number`` to end it; InputError if it is not running."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    if not trials:
        raise InputError(f"trial {number}: no such trial in study {study.study_name}")
    trial = trials[0]
    if trial.state != TrialState.RUNNING:
        raise InputError(f"trial {number}: it is {trial.state.name}, not running")
    study._storage.set_trial_system_attr(trial._trial_id, SYS_STOP, time.time())
    return trial
