"""``hpo rerun`` of a trial whose rerun fails, through the real CLI: the failure is the
check's finding, not retried (``search.retry_failed``), and leaves no WAITING trial for the next
``hpo rerun`` or ``hpo run`` to pick up. A failed rerun with ``retry_failed: 2`` used to queue
a retry that the next ``hpo rerun`` ran in place of a new rerun, and that queued another,
which ``hpo run`` of the finished sweep then ran."""
from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

from conftest import run_hpo

WriteScenario = Callable[..., Path]

FLAKY = """\
import sys
from hpo.results import report
if {{ trial_number }} > 0:
    sys.exit(3)  # every rerun fails
report(val_error={{ x }})
"""


def _rows(scenario: Path) -> list[dict[str, str]]:
    export = run_hpo("export", scenario)
    assert export.returncode == 0, export.stderr
    return list(csv.DictReader(io.StringIO(export.stdout)))


def test_a_failed_rerun_is_not_retried_and_the_next_rerun_is_a_new_one(tmp_path: Path,
                                                                       write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path, template_text=FLAKY, drop=["parameters.opt"], objective={"held_out": []},
                              search={"method": "tpe", "trials": 1, "retry_failed": 2})
    assert run_hpo("run", scenario).returncode == 0
    first = run_hpo("rerun", scenario, "0", "--seed", "5")
    assert first.returncode == 1 and "trial 1 (rerun of 0) FAIL" in first.stdout, first.stdout + first.stderr
    second = run_hpo("rerun", scenario, "0")
    assert second.returncode == 1 and "trial 2 (rerun of 0) FAIL" in second.stdout, second.stdout + second.stderr
    rows = _rows(scenario)
    assert [(r["number"], r["state"], r["repeat_of"]) for r in rows] == [
        ("0", "COMPLETE", ""), ("1", "FAIL", "0"), ("2", "FAIL", "0")]
    status = run_hpo("status", scenario)
    assert "1/1 trials done and 2 reruns: 1 complete, 2 failed." in status.stdout, status.stdout
    again = run_hpo("run", scenario)
    assert again.returncode == 0 and "trial 3" not in again.stdout and len(_rows(scenario)) == 3, again.stdout
