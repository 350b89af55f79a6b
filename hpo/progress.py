"""The sweep's progress: a live Rich view on a terminal, one plain line per event otherwise.

Shows trials done / running / failed / pruned of the total, the ETA, the best objective so
far with its held-out metrics, and the running trials with their elapsed time.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from hpo.engine import Observer, TrialEnd, TrialStart
from hpo.store import TrialRow, best_row, trial_rows

FAILED_STATES = ("FAIL", "TIMEOUT", "INTERRUPTED", "LOST")
PRUNED_STATES = ("PRUNED", "STOPPED")


def format_params(params: Mapping[str, Any]) -> str:
    """``lr=0.01 optimizer=adam``: short and stable, floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def format_metrics(value: float | None, metric: str, held_out: Mapping[str, float]) -> str:
    """``val_error=0.05 test_error=0.06`` for a trial's objective and held-out metrics."""
    parts = [] if value is None else [f"{metric}={value:.4g}"]
    return " ".join(parts + [f"{k}={v:.4g}" for k, v in held_out.items()])


@dataclass
class _Tally:
    total: int
    direction: str
    metric: str
    counts: dict[str, int] = field(default_factory=dict)
    running: dict[int, tuple[TrialStart, float]] = field(default_factory=dict)
    best: TrialRow | None = None
    durations: list[float] = field(default_factory=list)


class ProgressView:
    """An :class:`hpo.engine.Observer` that shows the sweep to a person."""

    def __init__(self, rows: list[TrialRow], total: int, direction: str, metric: str, slots: int,
                 console: Console | None = None) -> None:
        self._console = console or Console()
        self._slots = max(1, slots)
        self._tally = _Tally(total=total, direction=direction, metric=metric)
        for row in rows:
            self._count(row.state)
        self._tally.best = best_row(rows, direction)
        self._lock = threading.Lock()
        self._live: Live | None = None

    def _count(self, state: str) -> None:
        self._tally.counts[state] = self._tally.counts.get(state, 0) + 1

    def __enter__(self) -> "ProgressView":
        if self._console.is_terminal:
            self._live = Live(self._render(), console=self._console, refresh_per_second=2,
                              get_renderable=self._render, transient=False)
            self._live.__enter__()
        else:
            self._console.print(f"sweep: {self._finished()} of {self._tally.total} trials already finished", soft_wrap=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
        self._console.print(self.summary())

    def started(self, start: TrialStart) -> None:
        with self._lock:
            self._tally.running[start.number] = (start, time.monotonic())
        if self._live is None:
            where = f" on slot {start.slot}" if start.slot >= 0 else ""
            self._console.print(f"trial {start.number} started{where}: {format_params(start.params)}",
                                highlight=False, markup=False, soft_wrap=True)

    def finished(self, end: TrialEnd) -> None:
        with self._lock:
            self._tally.running.pop(end.number, None)
            self._count(end.state)
            self._tally.durations.append(end.duration_s)
            if end.value is not None:
                row = TrialRow(end.number, end.state, {}, end.value, end.held_out, end.duration_s, "", "")
                self._tally.best = best_row([r for r in (self._tally.best, row) if r], self._tally.direction)
        if self._live is None:
            detail = format_metrics(end.value, self._tally.metric, end.held_out) or end.reason
            self._console.print(f"trial {end.number} {end.state} in {end.duration_s:.1f} s: {detail}  "
                                f"[{self._finished()}/{self._tally.total}]{self._best_text()}",
                                highlight=False, markup=False, soft_wrap=True)

    def _finished(self) -> int:
        return sum(n for state, n in self._tally.counts.items() if state not in ("RUNNING", "INTERRUPTED"))

    def _best_text(self) -> str:
        best = self._tally.best
        if best is None:
            return ""
        return f"  best #{best.number} {format_metrics(best.value, self._tally.metric, best.held_out)}"

    def _eta(self) -> str:
        durations = self._tally.durations
        left = self._tally.total - self._finished()
        if not durations or left <= 0:
            return "-"
        seconds = sum(durations) / len(durations) * left / self._slots
        return time.strftime("%H:%M:%S", time.gmtime(seconds))

    def summary(self) -> str:
        """A one-line account of the study: counts by state and the best trial."""
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self._tally.counts.items()))
        return f"{self._finished()}/{self._tally.total} trials finished ({counts or 'none'}).{self._best_text()}"

    def _render(self) -> Group:
        with self._lock:
            counts = self._tally.counts
            failed = sum(counts.get(s, 0) for s in FAILED_STATES)
            pruned = sum(counts.get(s, 0) for s in PRUNED_STATES)
            head = (f"[bold]{self._finished()}/{self._tally.total}[/] done  "
                    f"[green]{counts.get('COMPLETE', 0)} complete[/]  [red]{failed} failed[/]  "
                    f"[yellow]{pruned} pruned/stopped[/]  {len(self._tally.running)} running  "
                    f"ETA {self._eta()}")
            table = Table(box=None, pad_edge=False)
            for column in ("trial", "slot", "elapsed", "parameters"):
                table.add_column(column)
            now = time.monotonic()
            for number, (start, since) in sorted(self._tally.running.items()):
                table.add_row(str(number), str(start.slot), f"{now - since:.0f} s", format_params(start.params))
            best = self._best_text().strip() or "best: none yet"
        return Group(head, best, table)


def follow_study(study: Any, observer: Observer, finished: Callable[[], bool], every_s: float = 1.0) -> None:
    """Turn what the store shows into observer events until ``finished()`` (then once more).

    For watching workers in other processes: a trial seen RUNNING is ``started``, a trial
    seen ended is ``finished``; each event is sent once.
    """
    started: set[int] = set()
    ended: set[int] = {row.number for row in trial_rows(study) if row.state != "RUNNING"}
    while True:
        done = finished()
        for row in trial_rows(study):
            if row.number not in started and row.number not in ended:
                started.add(row.number)
                observer.started(TrialStart(row.number, row.params, -1, Path(row.folder)))
            if row.state != "RUNNING" and row.number not in ended:
                ended.add(row.number)
                observer.finished(TrialEnd(row.number, row.state, row.value, row.held_out,
                                           row.duration_s or 0.0, row.reason))
        if done:
            return
        time.sleep(every_s)
