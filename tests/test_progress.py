"""The summary line that status, the live view and the end of a sweep print."""
from __future__ import annotations

import pytest

from hpo.outcome import Outcome
from hpo.progress import summary_line, tally
from hpo.rows import TrialRow


def _row(number: int, value: float, rerun_of: int | None = None) -> TrialRow:
    return TrialRow(number=number, outcome=Outcome.COMPLETE, params={"x": 0.5}, value=value, held_out={},
                    duration_s=1.0, folder=f"trial-{number}", reason="", rerun_of=rerun_of)


def test_a_study_without_reruns_counts_its_budget() -> None:
    line = summary_line(tally([_row(0, 0.3), _row(1, 0.2)], 2, "minimize"), "val_error")
    assert line == "2/2 trials done: 2 complete.  best #1 val_error=0.2"


def test_reruns_are_said_beside_the_budget_they_do_not_use() -> None:
    rows = [_row(0, 0.3), _row(1, 0.2), _row(2, 0.21, rerun_of=1), _row(3, 0.19, rerun_of=1)]
    line = summary_line(tally(rows, 2, "minimize"), "val_error")
    assert line.startswith("2/2 trials done and 2 reruns: 4 complete.")


def _interrupted(number: int, rerun_of: int | None = None) -> TrialRow:
    return TrialRow(number=number, outcome=Outcome.INTERRUPTED, params={"x": 0.5}, value=None, held_out={},
                    duration_s=1.0, folder=f"trial-{number}", reason="interrupted", rerun_of=rerun_of)


def _waiting(number: int, requeue_of: int) -> TrialRow:
    return TrialRow(number=number, outcome=Outcome.WAITING, params={"x": 0.5}, value=None, held_out={},
                    duration_s=None, folder="", reason="", requeue_of=requeue_of)


@pytest.mark.parametrize(("budget", "pending"), [
    (1, ("; also 2 interrupted (not their fault: run again); 2 waiting past the budget (not run unless "
         "search.trials is raised).")),
    (2, ("; 1 waiting; also 2 interrupted (not their fault: run again); 1 waiting past the budget (not run unless "
         "search.trials is raised).")),
    (3, "; 2 waiting; also 2 interrupted (not their fault: run again)."),
])
def test_copies_waiting_past_a_lowered_budget_are_not_pending_work(budget: int, pending: str) -> None:
    rows = [_row(0, 0.3), _interrupted(1), _interrupted(2), _waiting(3, 1),
            _waiting(4, 2)]
    line = summary_line(tally(rows, budget, "minimize"), "val_error")
    assert line == f"1/{budget} trials done: 1 complete{pending}  best #0 val_error=0.3"


def test_an_interrupted_rerun_is_not_counted_as_a_rerun() -> None:
    rows = [_row(0, 0.3), _interrupted(1, rerun_of=0), _row(2, 0.31, rerun_of=0)]
    line = summary_line(tally(rows, 1, "minimize"), "val_error")
    assert line.startswith("1/1 trials done and 1 rerun: 2 complete; also 1 interrupted")


def _failed(number: int, retry_of: int | None = None) -> TrialRow:
    return TrialRow(number=number, outcome=Outcome.FAIL, params={"x": 0.9}, value=None, held_out={},
                    duration_s=1.0, folder=f"trial-{number}", reason="exit code 3", retry_of=retry_of)


def test_failures_that_were_retried_are_said_apart_from_the_budget() -> None:
    rows = [_row(0, 0.3), _failed(1), _row(2, 0.2), _failed(3, retry_of=1), _failed(4, retry_of=3)]
    line = summary_line(tally(rows, 3, "minimize"), "val_error")
    assert line.startswith("3/3 trials done: 2 complete, 1 failed; 2 failed attempts retried (search.retry_failed).")
