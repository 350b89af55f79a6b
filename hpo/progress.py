"""The sweep's progress: a live Rich view on a terminal, one plain line per event otherwise.

Counters are the store's truth: :func:`tally` counts the study's rows by outcome, whoever
ran them, so the head line and the closing summary add up with several workers on one
study. Trial events (started, ended) come from this worker's slots and its watchdog (the
trials of gone workers it judged lost), or, when watching workers in other processes, from
:func:`follow_store`; :func:`end_line` says each end in one line.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from hpo.outcome import Outcome, TrialResult, reported_not_finite
from hpo.rows import TrialRow, best_row, gpu_cell, repeat_of, retried, standing

if TYPE_CHECKING:
    from hpo.engine import Observer, TrialEnd, TrialStart
    from hpo.store import StudyStore

POLL_S = 2.0
FAILURES_SHOWN = 3


def format_params(params: Mapping[str, Any], digits: int = 4) -> str:
    """``lr=0.01 optimizer=adam``: short and stable, floats to ``digits`` significant digits."""
    return " ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def format_metrics(value: float | None, metric: str, held_out: Mapping[str, float], digits: int = 4,
                   order: Sequence[str] = ()) -> str:
    """``val_error=0.05 test_error=0.06`` for a trial's objective and held-out metrics, to
    ``digits`` significant digits; the held-out metrics in ``order`` (the scenario's) first."""
    parts = [] if value is None else [f"{metric}={value:.{digits}g}"]
    return " ".join(parts + [f"{k}={v:.{digits}g}" for k, v in in_order(held_out, order).items()])


def in_order(held_out: Mapping[str, float], order: Sequence[str]) -> dict[str, float]:
    """``held_out`` with the metrics named in ``order`` first, in that order (a store keeps
    them sorted by name), then the others."""
    return {**{name: held_out[name] for name in order if name in held_out}, **held_out}


def distinct_digits(values: Iterable[float | None], least: int = 4, most: int = 10) -> int:
    """The fewest significant digits, from ``least`` to ``most``, at which the distinct finite
    ``values`` read distinct (``most`` where even that does not): a column of errors 2.0003,
    1.9995 and 2.0005 is not three 2s."""
    distinct = {v for v in values if isinstance(v, (int, float)) and math.isfinite(v)}
    return next((n for n in range(least, most) if len({f"{v:.{n}g}" for v in distinct}) == len(distinct)), most)


@dataclass(frozen=True)
class Tally:
    """The study at a glance, from its rows: ``done`` trials used the budget and ended,
    ``reruns`` are reruns (``hpo rerun``) that so ended, and ``past_budget`` of the WAITING
    trials wait past the budget (``search.trials`` was lowered): they run only if it is raised.
    ``counts`` leave out the failures that ``search.retry_failed`` ran again (``retried``) or
    queued again (``retry_waiting``: their retry waits): their retry stands for their
    configuration."""

    budget: int
    done: int
    counts: Mapping[Outcome, int]
    best: TrialRow | None
    running: tuple[TrialRow, ...]
    failures: tuple[TrialRow, ...]
    mean_duration_s: float | None
    reruns: int
    past_budget: int
    retried: int
    retry_waiting: int


def eta(t: Tally, since: Mapping[int, float], now: float) -> str:
    """The time left, ``HH:MM:SS``: each running trial's mean duration less what it has run
    (``since``: when each started, on the clock of ``now``), and the mean duration of each
    trial not started, shared among the trials running at once; ``-`` before any duration."""
    left = t.budget - t.done
    mean = t.mean_duration_s
    if mean is None or left <= 0:
        return "-"
    running = [max(0.0, mean - (now - since[row.number])) if row.number in since else mean for row in t.running]
    work = sum(running) + max(0, left - len(running)) * mean
    return time.strftime("%H:%M:%S", time.gmtime(work / max(1, len(running))))


def tally(rows: list[TrialRow], budget: int, direction: str) -> Tally:
    """Count ``rows`` by outcome (see :class:`Tally`)."""
    durations = [r.duration_s for r in rows if r.outcome.own and r.duration_s]
    failed = [r for r in rows if r.outcome.failed]
    ended = [r for r in standing(rows) if r.outcome.ended]
    again = retried(rows)
    queued_again = {r.retry_of for r in rows if r.retry_of is not None and r.outcome is Outcome.WAITING}
    done = sum(1 for r in ended if r.rerun_of is None)
    in_flight = sum(1 for r in rows if r.outcome is Outcome.RUNNING and r.rerun_of is None)
    waiting = sum(1 for r in rows if r.outcome is Outcome.WAITING and r.rerun_of is None)
    return Tally(budget=budget, done=done, counts=Counter(r.outcome for r in rows if r.number not in again),
                 best=best_row(rows, direction), running=tuple(r for r in rows if r.outcome is Outcome.RUNNING),
                 failures=tuple(failed[-FAILURES_SHOWN:]),
                 mean_duration_s=sum(durations) / len(durations) if durations else None,
                 reruns=len(ended) - done, past_budget=max(0, waiting - max(0, budget - done - in_flight)),
                 retried=len(again - queued_again), retry_waiting=len(queued_again))


LABELS = {Outcome.FAIL: "failed", Outcome.TIMEOUT: "timed out"}


def ended_text(result: TrialResult, metric: str, order: Sequence[str]) -> str:
    """``COMPLETE in 3.1 s: val_error=0.05``, or the reason of a trial that did not complete."""
    detail = format_metrics(result.value, metric, result.held_out, order=order) + \
        (f" ({result.note})" if result.note else "") if result.outcome is Outcome.COMPLETE else result.reason
    return f"{result.outcome} in {result.duration_s:.1f} s: {detail}"


def end_line(end: TrialEnd, metric: str, order: Sequence[str] = ()) -> str:
    """One line for a trial's end: ``trial 3 COMPLETE in 3.1 s: val_error=0.05`` (held-out
    metrics in ``order`` first).

    A trial of another worker found gone says so (``trial 1 (worker h:12) judged lost: no
    heartbeat for 4.1 s; recorded LOST after 0.0 s; queued again as trial 4``), and so does a
    trial of this worker that another judged lost first, with the result it reached here,
    which the study does not record.
    """
    result = end.result
    again = f"; queued again as trial {end.again_as}" if end.again_as is not None else ""
    if end.unrecorded is not None:
        return (f"trial {end.number} judged lost by another worker (this one could not beat its heartbeat "
                f"in time): recorded {result.outcome} after {result.duration_s:.1f} s{again}; its end here "
                f"({ended_text(end.unrecorded, metric, order)}) is not recorded: it stays in {end.folder}")
    if not end.worker:
        return f"trial {end.number} {ended_text(result, metric, order)}"
    why = f": {end.why}" if end.why else ""
    if result.outcome is Outcome.LOST or result.reason.startswith("lost "):
        reason = "" if result.outcome is Outcome.LOST else f": {result.reason}"
        return (f"trial {end.number} (worker {end.worker}) judged lost{why}; recorded {result.outcome} "
                f"after {result.duration_s:.1f} s{reason}{again}")
    return f"trial {end.number} (worker {end.worker}) found gone{why}; recorded from its folder: " \
           f"{ended_text(result, metric, order)}{again}"


def past_budget_note(t: Tally) -> str:
    """`` (budget 2: reached)`` when more trials are done than the budget (``search.trials``
    was lowered below what ran), else ''; where it is not empty, ``done/budget`` is not said."""
    return f" (budget {t.budget}: reached)" if t.done > t.budget else ""


def unreported(rows: list[TrialRow], held_out: tuple[str, ...]) -> list[str]:
    """The held-out metrics that no completed trial of ``rows`` reported, not even as NaN
    (:func:`hpo.outcome.reported_not_finite`); none if no trial completed."""
    done = [row for row in rows if row.outcome is Outcome.COMPLETE]
    return [name for name in held_out if done and not any(
        name in row.held_out or reported_not_finite(name, row.note) for row in done)]


def summary_line(t: Tally, metric: str, digits: int = 4, order: Sequence[str] = ()) -> str:
    """``12/16 trials done: 10 complete, 2 failed; also 1 lost (run again). best #3 ...`` (its
    metrics to ``digits`` significant digits);
    reruns (``hpo rerun``) use no budget but are counted: ``16/16 trials done and 1 rerun: 17 complete.``;
    trials waiting past the budget are said apart from those still to run; more trials done
    than the budget read ``6 trials done (budget 2: reached): 6 complete.``"""
    def count(o: Outcome) -> str:
        return f"{t.counts[o]} {LABELS.get(o, o.value.lower())}"

    parts = [count(o) for o in Outcome if o.own and t.counts.get(o)]
    again = [count(o) for o in (Outcome.LOST, Outcome.INTERRUPTED) if t.counts.get(o)]
    pending = [f"{n} {word}" for n, word in ((t.counts.get(Outcome.RUNNING, 0), "running"),
                                             (t.counts.get(Outcome.WAITING, 0) - t.past_budget, "waiting")) if n]
    reruns = f" and {t.reruns} rerun{'s' if t.reruns > 1 else ''}" if t.reruns else ""
    over = past_budget_note(t)
    done = f"{t.done} trials done{reruns}{over}" if over else f"{t.done}/{t.budget} trials done{reruns}"
    text = done + (f": {', '.join(parts)}" if parts else "")
    if pending:
        text += f"; {', '.join(pending)}"
    if again:
        text += f"; also {', '.join(again)} (not their fault: run again)"
    if t.retried:
        text += f"; {t.retried} failed {'attempts' if t.retried > 1 else 'attempt'} retried (search.retry_failed)"
    if t.retry_waiting:
        text += (f"; {t.retry_waiting} failed {'attempts' if t.retry_waiting > 1 else 'attempt'} "
                 f"{'wait' if t.retry_waiting > 1 else 'waits'} for {'their' if t.retry_waiting > 1 else 'its'} "
                 "retry (search.retry_failed)")
    if t.past_budget:
        text += f"; {t.past_budget} waiting past the budget (not run unless search.trials is raised)"
    return text + "." + best_text(t.best, metric, digits, order)


def best_text(best: TrialRow | None, metric: str, digits: int = 4, order: Sequence[str] = ()) -> str:
    """``  best #3 val_error=0.05 test_error=0.06`` or '' (held-out metrics in ``order`` first)."""
    return "" if best is None else \
        f"  best #{best.number} {format_metrics(best.value, metric, best.held_out, digits, order)}"


class ProgressView:
    """An :class:`hpo.engine.Observer` that shows the sweep to a person.

    Args:
        store: the study store; its rows are read every ``POLL_S`` seconds for the counters.
        budget: ``search.trials``.
        slots: how this worker's slots run trials, in words (e.g. ``1 slot: 2 CPU processes``).
        console: where to print (a terminal gets the live view).
    """

    def __init__(self, store: StudyStore, budget: int, slots: str, console: Console | None = None) -> None:
        self._store = store
        self._console = console or Console(soft_wrap=True)
        self._budget = budget
        self._slots = slots
        self._objective = store.scenario.objective
        self._tally = self._read()
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._live: Live | None = None
        self._done = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="hpo-progress", daemon=True)

    def _read(self, rows: list[TrialRow] | None = None) -> Tally:
        """The tally of ``rows``, or of the study's rows read now."""
        return tally(self._store.rows() if rows is None else rows, self._budget, self._objective.direction)

    def _poll(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                fresh = self._read()
            except Exception:  # the store blinked; the sweep itself reports outages
                continue
            with self._lock:
                self._tally = fresh

    def __enter__(self) -> ProgressView:
        self._poller.start()
        if self._console.is_terminal:
            self._live = Live(self._render(), console=self._console, refresh_per_second=2,
                              get_renderable=self._render, transient=False)
            self._live.__enter__()
        else:
            t, over = self._tally, past_budget_note(self._tally)
            done = f"{t.done} trials done before this run{over}" if over else \
                f"{t.done} of {t.budget} trials done before this run"
            self._print(f"sweep {self._store.scenario.name}: {done}; {self._slots}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        rows: list[TrialRow] = []
        try:
            rows = self._store.rows()
            final = self._read(rows)
        except Exception:  # the store is down: the last counts seen
            final = self._tally
        with self._lock:
            self._tally = final
            self._started.clear()
        if self._live is not None:
            self._live.__exit__(None, None, None)
        self._print(summary_line(final, self._objective.metric, order=self._objective.held_out))
        for name in unreported(rows, self._objective.held_out):
            self._print(f"note: no completed trial reported the held-out metric {name} (objective.held_out): "
                        "is that the name the script prints?")

    def _print(self, text: str) -> None:
        self._console.print(text, highlight=False, markup=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """Show ``text``, a line said elsewhere (a worker's notice), in turn with the trial
        lines, or above the live view."""
        self._print(text)

    def started(self, start: TrialStart) -> None:
        """See :class:`hpo.engine.Observer`."""
        with self._lock:
            self._started[start.number] = time.monotonic()
        if self._live is None:
            where = f" on slot {start.slot}" if start.slot >= 0 else ""
            where += f" ({start.where})" if start.where else ""
            again = "" if start.repeat_of is None else f"; runs trial {start.repeat_of}'s configuration again"
            self._print(f"trial {start.number} started{where}: {format_params(start.params)}{again}")

    def finished(self, end: TrialEnd) -> None:
        """See :class:`hpo.engine.Observer`."""
        with self._lock:
            self._started.pop(end.number, None)
        if self._live is None:
            self._print(end_line(end, self._objective.metric, self._objective.held_out))

    def _render(self) -> Group:
        with self._lock:
            t = self._tally
            since = dict(self._started)
        counts = t.counts
        failed = counts.get(Outcome.FAIL, 0) + counts.get(Outcome.TIMEOUT, 0)
        stopped = counts.get(Outcome.PRUNED, 0) + counts.get(Outcome.STOPPED, 0)
        again = counts.get(Outcome.LOST, 0) + counts.get(Outcome.INTERRUPTED, 0)
        past = f" (+{t.past_budget} past the budget)" if t.past_budget else ""
        over = past_budget_note(t)
        done = f"[bold]{t.done}[/] done{over}" if over else f"[bold]{t.done}/{t.budget}[/] done"
        head = (f"{done}  [green]{counts.get(Outcome.COMPLETE, 0)} complete[/]  "
                f"[red]{failed} failed[/]  [yellow]{stopped} pruned/stopped[/]  {len(t.running)} running  "
                f"{counts.get(Outcome.WAITING, 0) - t.past_budget} waiting{past}  "
                f"[dim]{again} lost/interrupted (run again)[/]  ETA {eta(t, since, time.monotonic())}")
        best = escape(best_text(t.best, self._objective.metric, order=self._objective.held_out).strip()
                      or "best: none yet")
        table = Table(box=None, pad_edge=False)
        for column in ("trial", "slot", "GPUs", "elapsed", "parameters"):
            table.add_column(column)
        now = time.monotonic()
        for row in t.running:
            elapsed = f"{now - since[row.number]:.0f} s" if row.number in since else ""
            table.add_row(str(row.number), "" if row.slot is None else str(row.slot),
                          gpu_cell(row.gpus, self._store.scenario.resources.share) or "-", elapsed,
                          Text(format_params(row.params)))  # text, not markup: a value may hold [...]
        parts: list[Any] = [*self._wrapped(head), *self._wrapped(best), table]
        if t.failures:
            parts.append("[red]last failures:[/]")
            for r in t.failures:
                parts += self._wrapped(f"  #{r.number} {r.state}: {escape(r.reason)}")
        return Group(*parts)

    def _wrapped(self, markup: str) -> list[Text]:
        """``markup`` (whose text from users, a failure's reason, is escaped: ``[/data/x]`` in
        one raised MarkupError in the view's thread) as lines that fit the terminal: the live
        view crops a longer line (its console keeps printed lines whole), which cut the ETA off
        the counts."""
        return list(Text.from_markup(markup).wrap(self._console, self._console.width))


def follow_store(store: StudyStore, observer: Observer, finished: Callable[[], bool], every_s: float = 1.0) -> None:
    """Turn what the store shows into observer events until ``finished()`` (then once more).

    For watching workers in other processes: a trial seen RUNNING, or seen ended that had started
    (it ran between two reads), is ``started`` (where it runs in the words its worker recorded,
    ``1 process on 1/2 of GPU 2``), a trial seen ended is ``finished`` (a LOST one with its worker and the trial queued to run it
    again); each event is sent once.
    """
    from hpo.engine import TrialEnd, TrialStart
    from hpo.recovery import queued_again, run_info
    share = store.scenario.resources.share
    started: set[int] = set()
    ended: set[int] = {row.number for row in store.rows() if row.outcome.ended}
    while True:
        done = finished()
        rows = store.rows()
        again = queued_again(rows)
        for row in rows:
            if (row.outcome is Outcome.RUNNING or row.outcome.ended and row.number not in ended and row.slot is not None) \
                    and row.number not in started:  # a trial that ran between two reads: started, then ended
                started.add(row.number)
                where = row.where or (f"GPUs {gpu_cell(row.gpus, share)}" if row.gpus else "")  # older records
                observer.started(TrialStart(row.number, row.params, -1 if row.slot is None else row.slot, where,
                                            Path(row.folder), repeat_of(row)))
            if row.outcome.ended and row.number not in ended:
                ended.add(row.number)
                result = row.result()
                worker = str(run_info(store.trial(row.number)).get("worker", "")) if row.outcome is Outcome.LOST else ""
                observer.finished(TrialEnd(row.number, row.params, result, worker, again_as=again.get(row.number)))
        if done:
            return
        time.sleep(every_s)
