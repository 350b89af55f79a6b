"""How a trial ended: the one :class:`Outcome` enum and the one frozen :class:`TrialResult`.

Every module that produces or reads the end of a trial (the executors, the store, status,
export, plots, the progress view) speaks in these two types; the store alone turns them
into Optuna states and user attributes and back (:mod:`hpo.store`).

An outcome is *own* when the trial ran to an end of its own merits (COMPLETE, FAIL, PRUNED,
STOPPED, TIMEOUT): it counts against ``search.trials``. LOST (its worker died) and
INTERRUPTED (the sweep was stopped) are not the trial's fault: the configuration runs
again and the row stays in the history. RUNNING and WAITING are not ends but the states a
row can show before one.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field


class Outcome(str, enum.Enum):
    """A trial's state as hpo shows it (status, CSV, charts)."""

    COMPLETE = "COMPLETE"
    FAIL = "FAIL"
    PRUNED = "PRUNED"
    STOPPED = "STOPPED"
    TIMEOUT = "TIMEOUT"
    LOST = "LOST"
    INTERRUPTED = "INTERRUPTED"
    RUNNING = "RUNNING"
    WAITING = "WAITING"

    @property
    def ended(self) -> bool:
        """Whether the trial is over (every member but RUNNING and WAITING)."""
        return self not in (Outcome.RUNNING, Outcome.WAITING)

    @property
    def own(self) -> bool:
        """Whether the trial ended on its own merits, so it counts against the budget."""
        return self in OWN_OUTCOMES

    @property
    def failed(self) -> bool:
        """Whether the trial failed on its own merits (FAIL, TIMEOUT)."""
        return self in (Outcome.FAIL, Outcome.TIMEOUT)

    @property
    def run_again(self) -> bool:
        """Whether the trial's configuration runs again (it did not fail on its own merits)."""
        return self in (Outcome.LOST, Outcome.INTERRUPTED)

    def __str__(self) -> str:
        return self.value


OWN_OUTCOMES = frozenset({Outcome.COMPLETE, Outcome.FAIL, Outcome.PRUNED, Outcome.STOPPED, Outcome.TIMEOUT})


@dataclass(frozen=True)
class TrialResult:
    """How one trial ended, as an executor judged it and as the store records it.

    Args:
        outcome: an ended :class:`Outcome`.
        value: the objective; a finite number exactly when ``outcome`` is COMPLETE.
        held_out: the held-out metrics that were reported (never seen by the optimizer).
        duration_s: seconds the trial's processes ran.
        reason: why it did not complete (``<cause>: <last error line>``); empty when COMPLETE.
        step: a step of the objective: where the pruner decided (pruned trials), else the last one
            reported, if any.
        note: of a COMPLETE trial, what it reported that is not recorded: the held-out metrics
            it reported NaN or infinite (:func:`not_finite_note`); else empty.
    """

    outcome: Outcome
    value: float | None = None
    held_out: Mapping[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    reason: str = ""
    step: int | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not self.outcome.ended:
            raise ValueError(f"a trial result needs an ended outcome, not {self.outcome}")
        complete = self.outcome is Outcome.COMPLETE
        if complete != (self.value is not None and math.isfinite(self.value)):
            raise ValueError(f"{self.outcome} with value {self.value}: only COMPLETE has a finite value")


def not_finite_note(name: str, value: float) -> str:
    """What a completed trial's note says of its held-out metric ``name`` that it reported as
    ``value``, NaN or infinite: it is not recorded (a store and the dashboard take finite numbers)."""
    return f"{_not_finite_start(name)}{value}: not recorded"


def reported_not_finite(name: str, note: str) -> bool:
    """Whether ``note`` (a completed trial's) says that it reported ``name`` NaN or infinite."""
    return any(part.startswith(_not_finite_start(name)) for part in note.split("; "))


def _not_finite_start(name: str) -> str:
    return f"held-out {name} was "
