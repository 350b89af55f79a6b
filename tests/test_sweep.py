"""The sweep in-process, on a fake executor: claims, settling, stop requests and graceful stops."""
from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from hpo.engine import Sweep, SweepConfig, TrialEnd, TrialStart
from hpo.errors import StoreUnavailable
from hpo.executor import ENDED_AS_LOST, TrialControl, TrialSpec, judge, saved_result
from hpo.launch import Slot
from hpo.outcome import Outcome, TrialResult
from hpo.results import Metrics
from hpo.scenario import load_scenario
from hpo.scheduler import Claim, requeue_or_fail
from hpo.store import SYS_TAKEN_BACK

WriteScenario = Callable[..., Path]


class FakeExecutor:
    """Runs no process: a trial 'reports' its steps, then completes with value x, unless the
    sweep asks it to end; ``hold`` keeps trials running until it is set."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.hold = threading.Event()
        self.hold.set()
        self.specs: list[TrialSpec] = []
        self.ended_on: list[str] = []
        self.closed = False

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        self.specs.append(spec)
        control.started(spec.slot)
        for step in range(self.steps):
            if control.intermediate(step, float(spec.params["x"]) + 1.0 / (step + 1)):
                return TrialResult(Outcome.PRUNED, reason=f"pruned at step {step}", step=step)
        while not self.hold.wait(0.01):
            request = control.end_request()
            if request is not None:
                self.ended_on.append(request)
                return judge(Metrics(), spec.objective, 0, request, (), 0.01, None)
        return TrialResult(Outcome.COMPLETE, float(spec.params["x"]), {"test_error": 1.0}, 0.01)

    def close(self) -> None:
        self.closed = True

    def slots_now(self) -> None:
        """The slots planned."""


def make(tmp_path: Path, write_scenario: WriteScenario, executor: FakeExecutor, parallel: int = 2,
         **search: object) -> Sweep:
    scenario = load_scenario(write_scenario(tmp_path, search={"method": "monte_carlo", "trials": 6, "seed": 1,
                                                              **search}, resources={"heartbeat": 1}))
    slots = tuple(Slot(i, (), 1, 1) for i in range(parallel))
    sweep = Sweep(SweepConfig(scenario, f"sqlite:///{tmp_path}/study.db", tmp_path / "w", slots, seed=1), executor)
    sweep.prepare()
    return sweep


def run_in_thread(sweep: Sweep, observer: object | None = None) -> threading.Thread:
    thread = threading.Thread(target=sweep.run, args=(observer,))
    thread.start()
    return thread


def wait_for(predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


class Recorder:
    """An observer that records what it is told."""

    def __init__(self) -> None:
        self.starts: list[TrialStart] = []
        self.ends: list[TrialEnd] = []

    def started(self, start: TrialStart) -> None:
        self.starts.append(start)

    def finished(self, end: TrialEnd) -> None:
        self.ends.append(end)


def test_a_design_runs_to_its_budget_on_every_slot(tmp_path: Path, write_scenario: WriteScenario) -> None:
    executor = FakeExecutor()
    sweep = make(tmp_path, write_scenario, executor)
    recorder = Recorder()
    sweep.run(recorder)
    rows = sweep.store.rows()
    assert [r.outcome for r in rows] == [Outcome.COMPLETE] * 6
    assert {s.slot for s in recorder.starts} == {0, 1} and len(recorder.ends) == 6
    assert all(len(sweep.store.trial(r.number).intermediate_values) == 3 for r in rows)
    assert executor.closed and {spec.folder for spec in executor.specs} == {Path(r.folder) for r in rows}


def test_a_claim_taken_back_before_it_starts_is_not_run_and_its_point_runs_once(
        tmp_path: Path, write_scenario: WriteScenario, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Another worker takes back a claim of this one (it found it gone) just before it starts:
    a slot's first claim, and a claim made ahead while the slot's last trial ran. Neither is
    run under its taken claim: the slot claims again, and every design point runs once."""
    executor = FakeExecutor()
    sweep = make(tmp_path, write_scenario, executor)
    store, claim = sweep.store, sweep.scheduler.claim
    claims: list[Claim | str | None] = []
    taken: list[str] = []

    def taken_back_at_once(mine: set[int]) -> Claim | str | None:
        claims.append(claimed := claim(mine))
        if isinstance(claimed, Claim) and len(claims) in (1, 4):  # as recovery takes back a claim never started
            store.set_system(claimed.number, SYS_TAKEN_BACK, claimed.token)
            assert store.back_to_waiting(claimed.number)
            taken.append(claimed.token)
        return claimed

    monkeypatch.setattr(sweep.scheduler, "claim", taken_back_at_once)
    sweep.run()
    rows = sweep.store.rows()
    assert [r.outcome for r in rows] == [Outcome.COMPLETE] * 6 and len(executor.specs) == 6
    assert sorted(r.design_index for r in rows) == list(range(6))
    assert len(taken) == 2 and not {spec.token for spec in executor.specs} & set(taken)
    out = capsys.readouterr().out
    assert out.count("was taken back by another worker before it started here") == 2, out


def test_stop_ends_running_trials_and_puts_claims_back(tmp_path: Path, write_scenario: WriteScenario) -> None:
    executor = FakeExecutor()
    executor.hold.clear()
    sweep = make(tmp_path, write_scenario, executor)
    thread = run_in_thread(sweep)
    wait_for(lambda: len(executor.specs) == 2 and len(sweep.store.rows()) >= 4)  # 2 running, 2 claimed ahead
    sweep.stop()
    thread.join(30)
    rows = sweep.store.rows()
    outcomes = [r.outcome for r in rows]
    assert outcomes.count(Outcome.INTERRUPTED) == 2 and Outcome.RUNNING not in outcomes
    assert outcomes.count(Outcome.WAITING) == 4  # 2 claims put back, 2 copies of the interrupted trials
    again = make(tmp_path, write_scenario, FakeExecutor())
    again.run()
    done = [r for r in again.store.rows() if r.outcome is Outcome.COMPLETE]
    assert sorted(r.design_index for r in done) == list(range(6))


def test_a_stop_request_reaches_the_running_trial(tmp_path: Path, write_scenario: WriteScenario) -> None:
    executor = FakeExecutor()
    executor.hold.clear()
    sweep = make(tmp_path, write_scenario, executor, parallel=1, trials=1)
    thread = run_in_thread(sweep)
    wait_for(lambda: len(executor.specs) == 1)
    sweep.store.request_stop(0)
    thread.join(30)
    row = sweep.store.rows()[0]
    assert (row.outcome, row.reason) == (Outcome.STOPPED, "stopped by the user")


def test_a_running_trial_judged_lost_by_another_worker_is_ended_here(tmp_path: Path,
                                                                     write_scenario: WriteScenario) -> None:
    """Another worker judged this one's running trial lost (this one could not beat: paused, or
    on a stalled machine) and queued its configuration again. This worker's next heartbeat finds
    the trial ended, and its run here ends then, not beside the copy; the study keeps the other
    worker's LOST record, this worker announces it with its own end, and the copy runs."""
    executor = FakeExecutor()
    executor.hold.clear()
    sweep = make(tmp_path, write_scenario, executor, parallel=1, trials=1)
    recorder = Recorder()
    thread = run_in_thread(sweep, recorder)
    wait_for(lambda: len(executor.specs) == 1)
    store = sweep.store
    lost = TrialResult(Outcome.LOST, reason="lost: no heartbeat")
    rows = store.rows()
    store.locked(lambda: requeue_or_fail(store, rows[0], rows, lost))  # as hpo.recovery judges it, elsewhere
    assert store.end_other(0, lost, rows[0].folder)  # as recovery records another worker's trial
    wait_for(lambda: executor.ended_on == ["lost"], timeout=10)
    executor.hold.set()
    thread.join(30)
    assert [(r.number, r.outcome, r.requeue_of) for r in store.rows()] == \
        [(0, Outcome.LOST, None), (1, Outcome.COMPLETE, 0)]
    [end] = [e for e in recorder.ends if e.number == 0]
    assert end.result.outcome is Outcome.LOST and end.again_as == 1
    assert end.unrecorded is not None and (end.unrecorded.outcome, end.unrecorded.reason) == \
        (Outcome.INTERRUPTED, ENDED_AS_LOST)


def test_pruning_ends_bad_trials_in_process(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario_search = {"trials": 10, "pruner": "median"}
    sweep = make(tmp_path, write_scenario, FakeExecutor(steps=4), parallel=1, **scenario_search)
    sweep.run()
    outcomes = [r.outcome for r in sweep.store.rows()]
    assert Outcome.PRUNED in outcomes and Outcome.COMPLETE in outcomes


def test_a_store_that_stays_down_stops_the_sweep(tmp_path: Path, write_scenario: WriteScenario,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = make(tmp_path, write_scenario, FakeExecutor(), parallel=1)
    failed = StoreUnavailable("the store sqlite:///x has not answered for 300 s (resources.store_retry): down")

    def down(*args: object) -> bool:
        raise failed

    executor = sweep._executor
    monkeypatch.setattr(sweep.store, "record", down)
    with pytest.raises(StoreUnavailable, match="has not answered"):
        sweep.run()
    # a design settles in the background while the next trial starts: the slot stops at the first
    # failure it sees, after one or two trials; nothing was recorded, all is left for a resume
    assert sweep.stopping and 1 <= len(executor.specs) <= 2
    assert {r.outcome for r in sweep.store.rows()} <= {Outcome.RUNNING, Outcome.WAITING}
    # the unrecorded trial stays this worker's until it exits: its own watchdog, had it a round
    # left before it stopped, does not judge it lost
    sweep.watchdog.round(beat=True)
    assert {r.outcome for r in sweep.store.rows()} <= {Outcome.RUNNING, Outcome.WAITING}


def test_a_trial_whose_templates_do_not_render_leaves_its_folder_and_reason(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    template = "{% if x < 0.5 %}{{ nothere }}{% endif %}x = {{ x }}\n"  # the middle of the space renders
    scenario = load_scenario(write_scenario(tmp_path, template_text=template,  # (a design's points all render first)
                                            search={"method": "tpe", "trials": 6, "seed": 1}))
    slots = (Slot(0, (), 1, 1),)
    sweep = Sweep(SweepConfig(scenario, f"sqlite:///{tmp_path}/study.db", tmp_path / "w", slots, seed=1),
                  FakeExecutor())
    sweep.prepare()
    sweep.run()
    failed = [r for r in sweep.store.rows() if r.outcome is Outcome.FAIL]
    assert failed and all("'nothere' is undefined" in r.reason for r in failed)
    for row in failed:
        folder = Path(row.folder)
        assert "'nothere' is undefined" in (folder / "trial.log").read_text()
        assert saved_result(folder, row.number).reason == row.reason


class RepeatingExecutor(FakeExecutor):
    """Reports NaN, then a value, at one step, then completes."""

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        control.started(spec.slot)
        control.intermediate(1, float("nan"))
        control.intermediate(1, 0.5)
        return TrialResult(Outcome.COMPLETE, float(spec.params["x"]), {}, 0.01)


def test_a_repeated_or_nan_step_warns_nothing(tmp_path: Path, write_scenario: WriteScenario) -> None:
    sweep = make(tmp_path, write_scenario, RepeatingExecutor(), parallel=1, pruner="median")
    with warnings.catch_warnings(record=True) as caught:
        sweep.run()
    assert [r.outcome for r in sweep.store.rows()] == [Outcome.COMPLETE] * 6
    assert math.isnan(sweep.store.trial(0).intermediate_values[1])
    assert not [w.message for w in caught if issubclass(w.category, (UserWarning, RuntimeWarning))]


def test_a_slot_announces_a_trial_s_end_before_its_next_start(tmp_path: Path, write_scenario: WriteScenario) -> None:
    events: list[str] = []

    class Ordered:
        def started(self, start: TrialStart) -> None:
            events.append(f"start {start.number}")

        def finished(self, end: TrialEnd) -> None:
            events.append(f"end {end.number}")

    sweep = make(tmp_path, write_scenario, FakeExecutor(), parallel=1)
    sweep.run(Ordered())
    assert events == [f"{what} {n}" for n in range(6) for what in ("start", "end")]


class UnevenExecutor(FakeExecutor):
    """Trial 0 runs ``long_s``, the others at once; keeps when each ran, on which slot."""

    def __init__(self, long_s: float) -> None:
        super().__init__(steps=0)
        self.long_s = long_s
        self.spans: dict[int, tuple[int, float, float]] = {}

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        start = time.monotonic()
        control.started(spec.slot)
        time.sleep(self.long_s if spec.number == 0 else 0.02)
        self.spans[spec.number] = (spec.slot.index, start, time.monotonic())
        return TrialResult(Outcome.COMPLETE, float(spec.params["x"]), {"test_error": 1.0}, 0.01)


@pytest.mark.parametrize("parallel", [2, 4])
def test_a_design_trial_claimed_ahead_runs_on_a_slot_that_frees_up(tmp_path: Path, write_scenario: WriteScenario,
                                                                   parallel: int) -> None:
    """A design's slot claims its next trial while its trial runs; a slot that found nothing
    left to claim ended, and that trial waited for the long trial to end before it started."""
    executor = UnevenExecutor(long_s=2.0)
    sweep = make(tmp_path, write_scenario, executor, parallel=parallel)
    sweep.run()
    assert sorted(executor.spans) == list(range(6))
    long_end = executor.spans[0][2]
    assert all(end < long_end for number, (_, _, end) in executor.spans.items() if number), executor.spans
    assert {row.outcome for row in sweep.store.rows()} == {Outcome.COMPLETE}
