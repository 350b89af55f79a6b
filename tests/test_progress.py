"""The summary line that status, the live view and the end of a sweep print, and the line per event."""
from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_hpo
from rich.console import Console

from hpo.engine import TrialEnd, TrialStart
from hpo.outcome import Outcome, TrialResult
from hpo.progress import ProgressView, Tally, end_line, eta, follow_store, summary_line, tally, unreported
from hpo.rows import TrialRow
from hpo.scenario import Scenario, load_scenario

WriteScenario = Callable[..., Path]


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


END_LINES = [
    pytest.param(TrialEnd(3, {}, TrialResult(Outcome.COMPLETE, 0.25, {"test_error": 0.5}, 3.04)),
                 "trial 3 COMPLETE in 3.0 s: val_error=0.25 test_error=0.5", id="own-trial"),
    pytest.param(TrialEnd(1, {}, TrialResult(Outcome.LOST, duration_s=2.0, reason="lost: its worker stopped"),
                          "h:12", "no heartbeat for 4.1 s", again_as=4),
                 "trial 1 (worker h:12) judged lost: no heartbeat for 4.1 s; recorded LOST after 2.0 s; "
                 "queued again as trial 4", id="another-worker-s-trial-judged-lost-here"),
    pytest.param(TrialEnd(1, {}, TrialResult(Outcome.FAIL, duration_s=2.0, reason="lost 3 times: its worker stopped"),
                          "h:12", "its process is gone"),
                 "trial 1 (worker h:12) judged lost: its process is gone; recorded FAIL after 2.0 s: lost 3 times: "
                 "its worker stopped", id="lost-for-the-third-time"),
    pytest.param(TrialEnd(1, {}, TrialResult(Outcome.COMPLETE, 0.5, {}, 3.0), "h:12", "its process is gone"),
                 "trial 1 (worker h:12) found gone: its process is gone; recorded from its folder: COMPLETE in 3.0 s: "
                 "val_error=0.5", id="its-result-was-in-its-folder"),
    pytest.param(TrialEnd(1, {}, TrialResult(Outcome.LOST, duration_s=0.0, reason="lost: its worker stopped"), "h:12",
                          again_as=4),
                 "trial 1 (worker h:12) judged lost; recorded LOST after 0.0 s; queued again as trial 4",
                 id="seen-in-the-store"),
    pytest.param(TrialEnd(1, {}, TrialResult(Outcome.LOST, duration_s=1.0, reason="lost: its worker stopped"),
                          unrecorded=TrialResult(Outcome.COMPLETE, 0.5, {}, 3.0), folder="runs/x/trial-0001",
                          again_as=4),
                 "trial 1 judged lost by another worker (this one could not beat its heartbeat in time): recorded "
                 "LOST after 1.0 s; queued again as trial 4; its end here (COMPLETE in 3.0 s: val_error=0.5) is not "
                 "recorded: it stays in runs/x/trial-0001", id="this-worker-s-trial-judged-lost-elsewhere"),
]


@pytest.mark.parametrize(("end", "line"), END_LINES)
def test_each_end_is_one_line_that_says_who_recorded_what(end: TrialEnd, line: str) -> None:
    assert end_line(end, "val_error") == line


class Store:
    """Just what the view reads: a scenario and the study's rows."""

    def __init__(self, scenario: Scenario, rows: tuple[TrialRow, ...] = ()) -> None:
        self.scenario = scenario
        self._rows = list(rows)

    def rows(self) -> list[TrialRow]:
        return self._rows


def test_a_re_run_says_whose_configuration_it_runs(tmp_path: Path, write_scenario: WriteScenario) -> None:
    out = io.StringIO()
    view = ProgressView(Store(load_scenario(write_scenario(tmp_path))), 2, "1 slot",  # type: ignore[arg-type]
                        Console(file=out, width=300))
    view.started(TrialStart(4, {"x": 0.5}, 0, "1 CPU process", tmp_path / "trial-0004", repeat_of=1))
    view.finished(END_LINES[1].values[0])
    assert out.getvalue().splitlines() == [
        "trial 4 started on slot 0 (1 CPU process): x=0.5; runs trial 1's configuration again",
        END_LINES[1].values[1]]


def test_the_live_view_gives_a_running_trials_share_of_its_gpu(tmp_path: Path, write_scenario: WriteScenario) -> None:
    running = TrialRow(number=3, outcome=Outcome.RUNNING, params={"x": 0.5}, value=None, held_out={},
                       duration_s=None, folder="trial-3", reason="", slot=1, gpus="1")
    scenario = load_scenario(write_scenario(tmp_path, resources={"gpus_per_trial": 0.5, "parallel": 2}))
    view = ProgressView(Store(scenario, (running,)), 4, "2 slots", Console(file=io.StringIO()))  # type: ignore[arg-type]
    out = io.StringIO()
    Console(file=out, width=200).print(view._render())
    assert any(line.split()[:3] == ["3", "1", "1"] and "(1/2)" in line for line in out.getvalue().splitlines())


def test_workers_start_lines_say_where_the_trial_runs_as_a_single_run_does(tmp_path: Path,
                                                                           write_scenario: WriteScenario) -> None:
    """Under ``hpo run --workers K`` they said ``(GPUs 2 (1/2))``, or nothing on the CPU; a
    record written before the placement was kept still gives its GPUs."""
    scenario = load_scenario(write_scenario(tmp_path, resources={"gpus_per_trial": 0.5, "parallel": 2}))
    running = TrialRow(number=3, outcome=Outcome.RUNNING, params={"x": 0.5}, value=None, held_out={}, duration_s=None,
                       folder="trial-3", reason="", slot=1, gpus="2", where="1 process on 1/2 of GPU 2")
    on_cpu = replace(running, number=4, slot=0, gpus="", where="2 CPU processes of 1 thread")
    older = replace(running, number=5, slot=0, where="")
    out = io.StringIO()
    view = ProgressView(Store(scenario), 8, "2 slots", Console(file=out, width=300))  # type: ignore[arg-type]
    follow_store(Store(scenario, (running, on_cpu, older)), view, lambda: True)  # type: ignore[arg-type]
    assert out.getvalue().splitlines() == ["trial 3 started on slot 1 (1 process on 1/2 of GPU 2): x=0.5",
                                           "trial 4 started on slot 0 (2 CPU processes of 1 thread): x=0.5",
                                           "trial 5 started on slot 0 (GPUs 2 (1/2)): x=0.5"]


def test_a_trial_that_ran_between_two_reads_is_said_started_then_ended(tmp_path: Path,
                                                                        write_scenario: WriteScenario) -> None:
    """hpo run --workers K read the store once a second: a trial shorter than that had no
    'started' line (about 40 % of them in a sweep of short trials)."""
    scenario = load_scenario(write_scenario(tmp_path))
    done = TrialRow(number=0, outcome=Outcome.COMPLETE, params={"x": 0.5}, value=0.25, held_out={}, duration_s=0.2,
                    folder="trial-0", reason="", slot=1, where="1 CPU process of 1 thread")
    never = replace(done, number=1, outcome=Outcome.INTERRUPTED, value=None, slot=None, where="", reason="not run")
    store = Store(scenario)
    out = io.StringIO()
    view = ProgressView(store, 8, "2 slots", Console(file=out, width=300))  # type: ignore[arg-type]
    reads = iter([False, True])

    def finished() -> bool:
        store._rows = [done, never]
        return next(reads)

    follow_store(store, view, finished, every_s=0)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert lines[0] == "trial 0 started on slot 1 (1 CPU process of 1 thread): x=0.5", lines
    assert lines[1].startswith("trial 0 COMPLETE") and lines[2].startswith("trial 1 INTERRUPTED"), lines
    assert len(lines) == 3, lines


def test_trials_done_past_a_lowered_budget_are_said_plainly() -> None:
    """``search.trials`` lowered below what ran: not ``6/2``, but the count and the budget reached."""
    rows = [_row(n, 0.3 - n / 100) for n in range(6)]
    line = summary_line(tally(rows, 2, "minimize"), "val_error")
    assert line == "6 trials done (budget 2: reached): 6 complete.  best #5 val_error=0.25"
    rows.append(_row(6, 0.1, rerun_of=5))
    line = summary_line(tally(rows, 2, "minimize"), "val_error")
    assert line.startswith("6 trials done and 1 rerun (budget 2: reached): 7 complete.")


def test_the_view_says_a_lowered_budget_plainly(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, objective={"held_out": []}))
    store = Store(scenario, tuple(_row(n, 0.3) for n in range(6)))
    out = io.StringIO()
    with ProgressView(store, 2, "1 slot", Console(file=out, width=300)):  # type: ignore[arg-type]
        pass
    assert out.getvalue().splitlines() == [
        "sweep demo: 6 trials done before this run (budget 2: reached); 1 slot",
        "6 trials done (budget 2: reached): 6 complete.  best #0 val_error=0.3"]
    live = ProgressView(store, 2, "1 slot", Console(file=io.StringIO()))  # type: ignore[arg-type]
    shown = io.StringIO()
    Console(file=shown, width=300).print(live._render())
    assert shown.getvalue().startswith("6 done (budget 2: reached)  6 complete  0 failed")
    normal = ProgressView(store, 8, "1 slot", Console(file=io.StringIO()))  # type: ignore[arg-type]
    shown = io.StringIO()
    Console(file=shown, width=300).print(normal._render())
    assert shown.getvalue().startswith("6/8 done  6 complete  0 failed")


def test_a_held_out_metric_no_completed_trial_reported_is_said_at_the_end(tmp_path: Path,
                                                                          write_scenario: WriteScenario) -> None:
    """A typo in objective.held_out was an empty column and nothing more."""
    scenario = write_scenario(tmp_path, objective={"held_out": ["test_error", "tset_error"]})
    done = run_hpo("run", scenario)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("note: no completed trial reported the held-out metric tset_error "
                                "(objective.held_out): is that the name the script prints?\n"), done.stdout
    assert "test_error (objective" not in done.stdout


def test_the_eta_counts_down_while_trials_run() -> None:
    """It stayed at the mean duration from a trial's start to its end (hours, for hour-long trials)."""
    running = tuple(replace(_row(n, 0.5), outcome=Outcome.RUNNING) for n in (2, 3))
    t = Tally(budget=6, done=2, counts={}, best=None, running=running, failures=(), mean_duration_s=12.0, reruns=0,
              past_budget=0, retried=0, retry_waiting=0)
    assert eta(t, {2: 100.0, 3: 100.0}, now=100.0) == "00:00:24"
    assert eta(t, {2: 100.0, 3: 100.0}, now=106.0) == "00:00:18"
    assert eta(t, {2: 100.0, 3: 100.0}, now=130.0) == "00:00:12"
    assert eta(replace(t, mean_duration_s=None), {}, now=0.0) == "-"


def test_a_failure_whose_retry_waits_is_not_said_retried() -> None:
    """With search.trials lowered, retries waited past the budget and the summary said their
    failures '3 failed attempts retried' though none ran again."""
    waiting_retry = replace(_failed(2, retry_of=1), outcome=Outcome.WAITING, reason="")
    rows = [_row(0, 0.3), _failed(1), waiting_retry, _failed(3), _row(4, 0.2), _failed(5, retry_of=3)]
    line = summary_line(tally(rows, 3, "minimize"), "val_error")
    assert ("; 1 failed attempt retried (search.retry_failed); 1 failed attempt waits for its retry "
            "(search.retry_failed)") in line, line


def test_the_live_view_wraps_its_counts_to_the_terminal(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The live view crops lines wider than the terminal: on 80 columns the counts of a long
    sweep lost their ETA (and on 120, ETA 00: was cut mid-value)."""
    scenario = load_scenario(write_scenario(tmp_path, objective={"held_out": []}))
    store = Store(scenario, tuple(_row(n, 0.3) for n in range(2234)))
    terminal = io.StringIO()
    view = ProgressView(store, 2280, "1 slot", Console(file=terminal, width=80, soft_wrap=True,  # type: ignore[arg-type]
                                                         force_terminal=True))
    with view:
        pass
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())
    assert "ETA 00:00:00" in shown or re.search(r"ETA \d\d:\d\d:\d\d\n", shown), shown
    assert max(len(line) for line in shown.splitlines() if "done" in line and "best" not in line) <= 80


def test_a_held_out_metric_reported_as_nan_is_not_called_unreported() -> None:
    """A held-out NaN is not recorded (a store takes finite numbers); the end note then asked
    'is that the name the script prints?' of a name the script did print."""
    nan_row = replace(_row(0, 0.3), note="held-out test_error was nan: not recorded")
    assert unreported([nan_row, _row(1, 0.2)], ("test_error", "tset_error")) == ["tset_error"]


def test_a_completed_trial_s_end_line_names_a_held_out_metric_not_recorded() -> None:
    result = TrialResult(Outcome.COMPLETE, 0.25, {}, 3.04, note="held-out test_error was nan: not recorded")
    assert end_line(TrialEnd(3, {}, result), "val_error") == (
        "trial 3 COMPLETE in 3.0 s: val_error=0.25 (held-out test_error was nan: not recorded)")


def test_the_live_view_shows_brackets_in_reasons_and_values_as_they_are(tmp_path: Path,
                                                                          write_scenario: WriteScenario) -> None:
    """A reason holding [/data/x] raised MarkupError in the live view (ending hpo run), and one
    holding [rank1]: lost that text."""
    scenario = load_scenario(write_scenario(tmp_path, objective={"held_out": []}))
    failed = replace(_row(0, 0.3), outcome=Outcome.FAIL, value=None, reason="[rank1]: cannot open [/data/x]")
    running = replace(_row(1, 0.3), outcome=Outcome.RUNNING, value=None, params={"x": "[bold]"})
    view = ProgressView(Store(scenario, (failed, running)), 4, "1 slot", Console(file=io.StringIO(), width=100))
    shown = io.StringIO()
    Console(file=shown, width=100).print(view._render())
    assert "#0 FAIL: [rank1]: cannot open [/data/x]" in shown.getvalue() and "x=[bold]" in shown.getvalue()


def test_held_out_metrics_are_said_in_the_scenarios_order() -> None:
    """The store keeps held-out metrics sorted by name: the summary, the best and the end lines
    said 'extra=1 test_error=2' for held_out: [test_error, extra], where the table and the CSV
    follow the scenario."""
    row = TrialRow(number=2, outcome=Outcome.COMPLETE, params={}, value=3.0, held_out={"extra": 1.0, "test_error": 2.0},
                   duration_s=1.0, folder="", reason="")
    summary = tally([row], 1, "minimize")
    assert summary_line(summary, "val_error", order=("test_error", "extra")).endswith(
        "best #2 val_error=3 test_error=2 extra=1")
    end = TrialEnd(2, {}, TrialResult(Outcome.COMPLETE, 3.0, {"extra": 1.0, "test_error": 2.0}, 1.0))
    assert end_line(end, "val_error", ("test_error", "extra")) == \
        "trial 2 COMPLETE in 1.0 s: val_error=3 test_error=2 extra=1"
