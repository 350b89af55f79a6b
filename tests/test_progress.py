"""The summary line that status, the live view and the end of a sweep print."""
from __future__ import annotations

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
