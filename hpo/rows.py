"""Trials as users see them: :class:`TrialRow` and what is computed from a list of rows.

Nothing here touches Optuna: the store (:mod:`hpo.store`) reads rows from the study, the
row cache (:mod:`hpo.rowcache`) keeps them between commands, and status, export, best,
plots and the live view only read them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from hpo import space
from hpo.outcome import Outcome, TrialResult
from hpo.scenario import Param


@dataclass(frozen=True)
class TrialRow:
    """One trial as status, export, plots and the progress view show it.

    ``params`` include the scenario's constants; ``slot``/``gpus`` say where a running
    trial runs, and ``where`` says it in the words of the plan (``1 process on 1/2 of GPU 2``;
    '' in records written before it was kept); ``requeue_of``, ``retry_of`` and ``rerun_of``
    name the trial whose configuration this one runs again (lost or interrupted, failed and retried, rerun);
    ``lost_count``, ``disk_full_count`` and ``retries`` count how often its configuration was
    lost, filled the disk and failed before (:data:`hpo.scheduler.RUN_AGAIN_LIMIT`);
    ``reason`` says why it did not complete (empty when it did) and ``note``, of a completed
    trial, what it reported that is not recorded (:attr:`hpo.outcome.TrialResult.note`).
    """

    number: int
    outcome: Outcome
    params: Mapping[str, Any]
    value: float | None
    held_out: Mapping[str, float]
    duration_s: float | None
    folder: str
    reason: str
    slot: int | None = None
    gpus: str = ""
    where: str = ""
    requeue_of: int | None = None
    retry_of: int | None = None
    rerun_of: int | None = None
    design_index: int | None = None
    lost_count: int = 0
    disk_full_count: int = 0
    retries: int = 0
    note: str = ""

    @property
    def state(self) -> str:
        """The outcome's name, as the CSV's ``state`` column writes it."""
        return self.outcome.value

    def result(self) -> TrialResult:
        """How the trial ended, as the store recorded it (its row is of an ended trial)."""
        return TrialResult(self.outcome, self.value, self.held_out, self.duration_s or 0.0, self.reason, note=self.note)


FIELDS = tuple(f.name for f in dataclasses.fields(TrialRow))
_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


def row_to_list(row: TrialRow) -> list[Any]:
    """``row`` as plain data, its fields in the order of :data:`FIELDS`."""
    return [row.outcome.value if name == "outcome" else getattr(row, name) for name in FIELDS]


def row_from_list(values: list[Any]) -> TrialRow:
    """The row that :func:`row_to_list` wrote."""
    if len(values) != len(FIELDS):
        raise ValueError(f"a row has {len(values)} fields, not {len(FIELDS)}")
    return TrialRow(values[0], _OUTCOMES[values[1]], *values[2:])


def repeat_of(row: TrialRow) -> int | None:
    """The trial whose configuration ``row`` runs again (re-run, retry or rerun), or None."""
    for number in (row.requeue_of, row.retry_of, row.rerun_of):
        if number is not None:
            return number
    return None


def best_row(rows: list[TrialRow], direction: str) -> TrialRow | None:
    """The completed row with the best objective value, or None."""
    done = [r for r in rows if r.value is not None and math.isfinite(r.value)]
    if not done:
        return None
    pick = min if direction == "minimize" else max
    return pick(done, key=lambda r: r.value)  # type: ignore[arg-type, return-value]


def standing(rows: list[TrialRow]) -> list[TrialRow]:
    """The rows that stand for their configuration: they ended on their own merits, run or
    wait, and are not failures that were retried (``search.retry_failed``: the copy stands)."""
    gone = retried(rows)
    return [r for r in rows if r.number not in gone and (r.outcome.own or not r.outcome.ended)]


def retried(rows: list[TrialRow]) -> set[int]:
    """The numbers of the failed trials that ``search.retry_failed`` ran again."""
    return {r.retry_of for r in rows if r.retry_of is not None}


def budget_used(rows: list[TrialRow], queued: Container[int] = ()) -> int:
    """How much of ``search.trials`` the rows use: the standing trials but reruns and the
    trials ``queued`` (WAITING in the store: they use it once claimed; see :mod:`hpo.scheduler`)."""
    return sum(1 for r in standing(rows) if r.rerun_of is None and r.number not in queued)


def presented(raw: list[TrialRow], parameters: Mapping[str, Param]) -> list[TrialRow]:
    """Rows as users see them: stepped floats as designs write them (:func:`hpo.space.tidy`),
    the scenario's constants added, a queued copy with its original's parameters."""
    constant = any(p.type == "constant" for p in parameters.values())
    stepped = any(p.type == "float" and p.step is not None for p in parameters.values())
    rows = [dataclasses.replace(row, params=space.with_constants(parameters, space.tidied(parameters, row.params)))
            for row in raw] if constant or stepped else list(raw)
    by_number = {r.number: r for r in rows}
    for index, row in enumerate(rows):
        original = by_number.get(repeat_of(row) if row.outcome is Outcome.WAITING else None)  # type: ignore[arg-type]
        if original is not None and not raw[index].params:
            rows[index] = dataclasses.replace(row, params=original.params)
    return rows


def gpu_cell(gpus: str, share: int) -> str:
    """The GPUs a trial ran on (``0,1``), with the fraction of the GPU it had where
    ``share`` trials share each (``1 (1/2)``, as the plan says ``1/2 of GPU 1``)."""
    return f"{gpus} (1/{share})" if gpus and share > 1 else gpus
