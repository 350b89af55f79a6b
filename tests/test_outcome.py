"""The one enum of how a trial ended and the one record of it."""
from __future__ import annotations

import math

import pytest

from hpo.outcome import OWN_OUTCOMES, Outcome, TrialResult


@pytest.mark.parametrize(("outcome", "ended", "own", "run_again"), [
    (Outcome.COMPLETE, True, True, False),
    (Outcome.FAIL, True, True, False),
    (Outcome.PRUNED, True, True, False),
    (Outcome.STOPPED, True, True, False),
    (Outcome.TIMEOUT, True, True, False),
    (Outcome.LOST, True, False, True),
    (Outcome.INTERRUPTED, True, False, True),
    (Outcome.RUNNING, False, False, False),
    (Outcome.WAITING, False, False, False),
])
def test_outcome_properties(outcome: Outcome, ended: bool, own: bool, run_again: bool) -> None:
    assert (outcome.ended, outcome.own, outcome.run_again) == (ended, own, run_again)
    assert (outcome in OWN_OUTCOMES) == own
    assert str(outcome) == outcome.value == outcome.name


def test_only_a_complete_result_has_a_finite_value() -> None:
    assert TrialResult(Outcome.COMPLETE, 0.5).value == 0.5
    for bad in (None, math.nan, math.inf):
        with pytest.raises(ValueError, match="only COMPLETE has a finite value"):
            TrialResult(Outcome.COMPLETE, bad)
    with pytest.raises(ValueError, match="only COMPLETE has a finite value"):
        TrialResult(Outcome.FAIL, 0.5, reason="exit code 1")
    with pytest.raises(ValueError, match="needs an ended outcome"):
        TrialResult(Outcome.RUNNING)


def test_a_result_is_frozen() -> None:
    result = TrialResult(Outcome.FAIL, reason="exit code 1")
    with pytest.raises(AttributeError):
        result.reason = "other"  # type: ignore[misc]
