"""Running one trial: the executor interface, the local executor, and the judge.

An :class:`Executor` takes a :class:`TrialSpec` (everything a trial needs, rendered in
memory) and a :class:`TrialControl` (the sweep's side of a running trial: intermediate
values in, stop requests out) and returns a :class:`hpo.outcome.TrialResult`. It never
raises for a trial's own failure: a crash, a timeout, a missing metric are results. The
local executor runs the trial's process tree on this machine; :mod:`hpo.dask_executor`
runs the same :func:`run_trial` inside a Dask worker.

:func:`run_trial` writes the folder, runs the command (``CUDA_VISIBLE_DEVICES`` from the
slot, ``OMP_NUM_THREADS``, the trial's token), streams its output to ``trial.log`` and the
metric parser, runs ``objective.post_process`` if set (in what is left of the trial's
timeout), judges the outcome and writes it to ``result.json`` in the folder: the backup of
record when the store cannot be reached.

A folder whose disk is full is no fault of the trial: :func:`run_trial` raises
:class:`hpo.render.FolderFull`, before the trial starts (its files) or with how it ended (its
log: INTERRUPTED, its process ended at once; ``result.json``: its result, which the sweep
records all the same).

A trial's ``duration_s`` is how long its processes are known to have run. When the worker
was paused (SIGSTOP, a stalled machine) and its trial's process ended meanwhile, the end is
not known: the duration runs to the moment the process was last seen running, and
``result.json`` notes ``paused_s``, the span it ended in.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import signal
import threading
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hpo.files import replacing
from hpo.launch import ProcessResult, Slot, run_process, this_python, trial_env
from hpo.outcome import Outcome, TrialResult, not_finite_note
from hpo.render import LOG_FILE, RESULT_FILE, FolderFull, TrialFile, folder_writes, write_files
from hpo.results import (
    SMAC_OK_STATUSES,
    MetricParser,
    Metrics,
    StepError,
    last_error_line,
    never_reported,
    out_of_gpu_memory,
)
from hpo.scenario import Objective

TAIL_LINES = 200
PAUSE_NOTED_S = 1.0  # a process found ended this long after it was last seen running: the worker was paused
EARLY_ENDS = ("timeout", "pruned", "stopped", "interrupted", "lost")  # what hpo ended before the trial's own end
CUT_SHORT = ("stopped", "interrupted", "lost")  # ends asked of a trial whose later values are not reported
ENDED_AS_LOST = "ended here: another worker had judged it lost and runs it again"
"""The reason of a trial that this worker ended, on the end request ``lost``, because another
worker had judged it lost meanwhile: the study keeps that worker's record, not this one."""
_TORCHRUN_SIGKILL = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")


@dataclass(frozen=True)
class TrialSpec:
    """One trial, ready to run anywhere.

    Args:
        number: the trial number.
        params: its parameter values (constants included).
        folder: its folder on the machine of the sweep.
        files: what the folder holds before the run (rendered templates, params.json, command.txt).
        argv: the command as an argument list (under torchrun if it has several processes).
        env: extra environment of its processes (the scenario's ``env`` and ``HPO_*`` values).
        slot: the task slot it runs on (GPUs, processes, threads).
        token: marks its processes, so that orphans can be found and killed.
        timeout: seconds its command and post_process together may run before their process
            tree is killed (None: no limit).
        objective: how its output is read and judged.
    """

    number: int
    params: Mapping[str, Any]
    folder: Path
    files: tuple[TrialFile, ...]
    argv: tuple[str, ...]
    env: Mapping[str, str]
    slot: Slot
    token: str
    timeout: float | None
    objective: Objective


class HeldStart:
    """A trial's start, held from :meth:`TrialControl.started` (which comes before its process
    is started) until the process is known to run, then told once: :meth:`release` is called
    from whatever the executor asks after the start (:func:`hpo.launch.run_process` asks
    ``end_request`` as soon as the process runs, never for one that could not start). A
    process that never ran is told of by its end alone, which says why."""

    def __init__(self, tell: Callable[[Any], None]) -> None:
        self._tell = tell
        self._held: Any = None
        self._lock = threading.Lock()

    def hold(self, start: Any) -> None:
        """Hold ``start`` (what ``tell`` is given) until :meth:`release`."""
        self._held = start

    def release(self) -> None:
        """Tell the start held, if one is (once)."""
        with self._lock:
            start, self._held = self._held, None
            if start is not None:
                self._tell(start)


@runtime_checkable
class TrialControl(Protocol):
    """The sweep's side of a running trial; called from the thread that runs it.

    The one interface of every control: the sweep's (:mod:`hpo.engine`, whichever the
    executor) and the one a Dask worker passes to :func:`run_trial`. Each has all four
    methods; a subclass that leaves one out cannot be instantiated.
    """

    @abstractmethod
    def started(self, slot: Slot) -> None:
        """The trial's process started on ``slot``: its GPU ids (empty on CPU), share of them
        and threads as the process has them (on a Dask worker, the worker's)."""

    @abstractmethod
    def intermediate(self, step: int, value: float) -> bool:
        """An intermediate objective value at ``step``; True when the trial should be pruned
        (its process is ended then, and no later value is reported)."""

    @abstractmethod
    def record(self, step: int, value: float) -> None:
        """An intermediate objective value at ``step`` that the pruner need not judge: the
        trial's process has ended."""

    @abstractmethod
    def end_request(self) -> str | None:
        """``"stopped"`` (a user asked), ``"interrupted"`` (the sweep stops), ``"lost"`` (another
        worker judged the trial lost and runs it again) or None."""


class Executor(Protocol):
    """Runs trials; :meth:`run` may be called from several slot threads at once."""

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        """Run ``spec`` to its end and judge it; a trial's failure is a result, never raised.
        Raises :class:`ExecutorUnavailable` when the executor itself is gone."""

    def close(self) -> None:
        """Release what the executor holds (called once, when the sweep ends)."""

    def slots_now(self) -> int | None:
        """How many slots the sweep may run now, where that grows while it runs (the workers
        of a Dask cluster that connect later); None: the slots it planned. Cheap: no round trip."""


class LocalExecutor:
    """Runs each trial's process tree on this machine, in the trial's folder."""

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        """See :class:`Executor`."""
        return run_trial(spec, control, spec.folder)

    def close(self) -> None:
        """Nothing to release."""

    def slots_now(self) -> None:
        """This machine's slots do not grow."""


def run_trial(spec: TrialSpec, control: TrialControl, folder: Path,
              lost_cause: Callable[[], str | None] | None = None) -> TrialResult:
    """Write ``spec``'s files into ``folder``, run it there, judge it, write ``result.json``.

    Every output line is parsed before the trial is judged. While the process runs, the
    pruner judges each of the objective's intermediate values in turn (successive halving
    enters a rung with the value of the rung's own step); once it said prune, none is reported;
    those left over after the process ended are recorded unjudged; a trial being stopped or
    interrupted reports none. A trial whose end is asked before it starts (``hpo stop`` of a
    trial claimed ahead) is not started: it is judged so ended, after 0 s. A full disk raises
    :class:`~hpo.render.FolderFull` (see the module docstring). A trial interrupted for a
    cause that ``lost_cause`` names (not the sweep's request) is LOST for it; its
    ``result.json`` is written once, with that verdict.
    """
    write_files(folder, spec.files)
    objective = spec.objective
    asked = control.end_request()
    if asked is not None:
        return save_result(folder, spec.number, _lost_if(lost_cause, not_started(spec, asked)))
    parser = MetricParser(objective.metric, objective.patterns, objective.step_pattern)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    pruned_at: int | None = None

    def on_lines(lines: list[str], running: bool) -> list[str]:
        nonlocal pruned_at
        notes = []
        for line in lines:
            tail.append(line.rstrip("\n"))
            try:
                parser.feed(line)
            except StepError as exc:
                notes.append(f"could not handle an output line: {exc}")
        values = [(step, reported[objective.metric]) for step, reported in parser.take_intermediate()
                  if objective.metric in reported]  # every update of a line a progress bar rewrote
        if pruned_at is not None or not values or control.end_request() in CUT_SHORT:
            return notes
        for step, value in values:
            if not running:
                control.record(step, value)
            elif control.intermediate(step, value):
                pruned_at = step
                break
        return notes

    def should_end() -> str | None:
        return control.end_request() or ("pruned" if pruned_at is not None else None)

    env = trial_env(spec.slot, spec.token, {**spec.env, "HPO_TRIAL_DIR": str(folder)})
    control.started(spec.slot)
    process = run_process(spec.argv, folder, env, folder / LOG_FILE, spec.timeout, on_lines, should_end)
    exit_code, ended_by = process.exit_code, process.ended_by
    duration, paused_s = _known_run(process)
    if ended_by is None and pruned_at is not None:  # it ended by itself before it was killed: the pruner's word stands
        ended_by = "pruned"
    disk_full, sigkill_after = process.disk_full, process.sigkill_after_s
    if objective.post_process and exit_code == 0 and ended_by is None:
        left = None if spec.timeout is None else max(0.0, spec.timeout - duration)
        post = run_process(this_python(objective.post_process), folder, env, folder / LOG_FILE, left,
                           on_lines, control.end_request)
        post_duration, post_paused_s = _known_run(post)
        exit_code, ended_by = post.exit_code, post.ended_by
        duration, paused_s = duration + post_duration, paused_s + post_paused_s
        disk_full, sigkill_after = post.disk_full, post.sigkill_after_s
        if exit_code != 0 and ended_by is None:
            ended_by = _with_line(f"post_process exit code {exit_code}", tail, or_last_line=True)
    if disk_full and ended_by not in EARLY_ENDS:  # ended for its log, whose disk is full: no fault of its own
        result = judge(parser.metrics(), objective, exit_code, "interrupted", list(tail), duration, spec.timeout)
        result = replace(result, reason=f"interrupted: {ended_by}; it runs again")
        with contextlib.suppress(FolderFull):  # the sweep records it: result.json is a backup
            save_result(folder, spec.number, result, paused_s)
        raise FolderFull(ended_by, result)
    result = judge(parser.metrics(), objective, exit_code, ended_by, list(tail), duration, spec.timeout, pruned_at,
                   sigkill_after)
    return save_result(folder, spec.number, _lost_if(lost_cause, result), paused_s)


def _lost_if(lost_cause: Callable[[], str | None] | None, result: TrialResult) -> TrialResult:
    """``result``, or LOST where it is INTERRUPTED and ``lost_cause`` names why."""
    cause = lost_cause() if lost_cause is not None and result.outcome is Outcome.INTERRUPTED else None
    return result if cause is None else TrialResult(Outcome.LOST, duration_s=result.duration_s, reason=f"lost: {cause}")


def _known_run(process: ProcessResult) -> tuple[float, float]:
    """How long ``process`` is known to have run, and the span it ended in unseen: its
    duration and 0, unless it ended by itself long after it was last seen running (the worker
    was paused), then until that moment, and the rest."""
    unseen = process.duration_s - process.seen_running_s
    if process.ended_by is not None or unseen < PAUSE_NOTED_S:
        return process.duration_s, 0.0
    return process.seen_running_s, unseen


def _with_line(cause: str, tail: Sequence[str], or_last_line: bool = False) -> str:
    line = last_error_line(tail, or_last_line=or_last_line)
    return f"{cause}: {line}" if line else cause


def not_started(spec: TrialSpec, request: str) -> TrialResult:
    """How ``spec`` ends when ``request`` (``interrupted``, ``stopped``, ``lost``) came before it started:
    so ended, after 0 s."""
    return judge(Metrics(), spec.objective, 0, request, (), 0.0, spec.timeout)


def judge(metrics: Metrics, objective: Objective, exit_code: int, ended_by: str | None,
          tail: Sequence[str], duration_s: float, timeout: float | None,
          pruned_at: int | None = None, sigkill_after_s: float | None = None) -> TrialResult:
    """Decide how a finished trial ended (the one place where outcomes are judged).

    Held-out metrics are final results: a trial that ended early (pruned, stopped, timed out,
    interrupted) trained only in part and records none, as it records no objective. The
    result's step is an objective step: where the pruner decided, else the last reported.

    Args:
        metrics: what its output reported.
        objective: the metric, held-out metrics and direction.
        exit_code: its exit code (negative: killed by that signal).
        ended_by: what ended it early: ``timeout``, ``pruned``, ``stopped``, ``interrupted``, ``lost``;
            else a failure's reason (``cannot start ...``, ``post_process exit code ...``);
            None when it exited by itself.
        tail: its last output lines, for the reason's error line.
        duration_s: seconds it ran (with its post_process).
        timeout: the time limit it had (for the command and its post_process together).
        pruned_at: the step whose value the pruner judged when it said prune, if known.
        sigkill_after_s: where ending it early took SIGKILL (it ignored SIGTERM), how long
            after SIGTERM (:attr:`hpo.launch.ProcessResult.sigkill_after_s`); a timeout's reason says so.
    """
    kept = {} if ended_by in EARLY_ENDS else {name: metrics.final[name] for name in objective.held_out
                             if name in metrics.final and math.isfinite(metrics.final[name])}
    steps = [step for step, values in metrics.intermediate if objective.metric in values]
    step = pruned_at if pruned_at is not None and ended_by == "pruned" else (steps[-1] if steps else None)

    def ended(outcome: Outcome, reason: str, value: float | None = None, note: str = "") -> TrialResult:
        return TrialResult(outcome, value, kept, duration_s, reason, step, note)

    if ended_by == "timeout":
        late = "" if sigkill_after_s is None else f"; it ignored SIGTERM and was killed {sigkill_after_s:g} s later"
        return ended(Outcome.TIMEOUT, f"killed after {timeout:g} s (resources.timeout{late})")
    if ended_by == "pruned":
        return ended(Outcome.PRUNED, f"pruned at step {step}")
    if ended_by == "stopped":
        return ended(Outcome.STOPPED, "stopped by the user")
    if ended_by == "interrupted":
        return ended(Outcome.INTERRUPTED, "interrupted: the sweep was stopped; it runs again on resume")
    if ended_by == "lost":
        return ended(Outcome.INTERRUPTED, ENDED_AS_LOST)
    if ended_by is not None:
        return ended(Outcome.FAIL, ended_by)
    if exit_code == -signal.SIGKILL or (exit_code != 0 and any(_TORCHRUN_SIGKILL.search(x) for x in tail)):
        return ended(Outcome.FAIL, "killed by SIGKILL (out of host memory?)")
    oom = out_of_gpu_memory(tail)
    if exit_code != 0 and oom is not None:
        return ended(Outcome.FAIL, f"out of GPU memory: {oom}")
    if exit_code < 0:
        return ended(Outcome.FAIL, _with_line(f"killed by {signal.Signals(-exit_code).name}", tail))
    if metrics.smac_status is not None and metrics.smac_status not in SMAC_OK_STATUSES:
        extra = f": {metrics.smac_extra}" if metrics.smac_extra else ""
        return ended(Outcome.FAIL, f"trial reported {metrics.smac_status}{extra}")
    if exit_code != 0:
        return ended(Outcome.FAIL, _with_line(f"exit code {exit_code}", tail, or_last_line=True))
    metric = objective.metric
    if metric not in metrics.final:
        if metric in metrics.invalid:
            return ended(Outcome.FAIL, f"{metric} is not a number: {metrics.invalid[metric]}")
        cause = f"out of GPU memory: {oom}" if oom is not None else never_reported(metric, metrics)
        return ended(Outcome.FAIL, cause if oom is not None else _with_line(cause, tail))
    value = metrics.final[metric]
    if not math.isfinite(value):
        return ended(Outcome.FAIL, f"{metric} is {value}")
    note = "; ".join(not_finite_note(name, metrics.final[name]) for name in objective.held_out
                     if name in metrics.final and name not in kept)
    return ended(Outcome.COMPLETE, "", value, note)


SCRIPT_RESULT_FILE = "result.script.json"
"""Where a ``result.json`` that the trial's script wrote itself is kept (hpo's record takes its name)."""


def save_result(folder: Path, number: int, result: TrialResult, paused_s: float = 0.0) -> TrialResult:
    """Write ``result`` to the folder's ``result.json`` (atomically) and return it; a
    ``paused_s`` is noted (see the module docstring). A ``result.json`` that is not hpo's
    record of this trial (the script wrote one of its own) is first moved to
    :data:`SCRIPT_RESULT_FILE`. Where the disk is full, nothing is written and
    :class:`~hpo.render.FolderFull` carries ``result``."""
    with folder_writes(folder / RESULT_FILE, result):
        if (folder / RESULT_FILE).exists() and saved_result(folder, number) is None:  # the script's own
            (folder / RESULT_FILE).replace(folder / SCRIPT_RESULT_FILE)
        with replacing(folder / RESULT_FILE) as temporary:
            temporary.write_text(_result_text(number, result, paused_s))
    return result


def save_result_unless_saved(folder: Path, number: int, result: TrialResult) -> bool:
    """Write ``result`` to the folder's ``result.json`` only where it has none, in one step (a
    link), so that the result its own process writes meanwhile is never replaced; whether it
    was written. OSError (and :class:`~hpo.render.FolderFull`) as writing fails."""
    temporary = folder / f".{RESULT_FILE}.{os.getpid()}.once"
    with folder_writes(folder / RESULT_FILE, result):
        try:
            temporary.write_text(_result_text(number, result))
            os.link(temporary, folder / RESULT_FILE)
        except FileExistsError:
            return False
        finally:
            temporary.unlink(missing_ok=True)
    return True


def _result_text(number: int, result: TrialResult, paused_s: float = 0.0) -> str:
    """``result.json``'s text for trial ``number``."""
    record = {"trial": number, **asdict(result), "outcome": result.outcome.value}
    if paused_s:
        record["paused_s"] = round(paused_s, 3)
    return json.dumps(record, indent=2) + "\n"


def saved_result(folder: Path, number: int) -> TrialResult | None:
    """The result that trial ``number`` wrote to its folder, or None (absent, other trial, unreadable)."""
    try:
        record = json.loads((folder / RESULT_FILE).read_text())
        if record.pop("trial") != number:
            return None
        record.pop("paused_s", None)
        record["outcome"] = Outcome(record["outcome"])
        return TrialResult(**record)
    except (OSError, ValueError, KeyError, TypeError):
        return None
