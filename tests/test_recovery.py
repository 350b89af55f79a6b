"""Trials of workers that are gone: detection, and what becomes of them, on real SQLite studies."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpo import designs, recovery
from hpo.executor import save_result, save_result_unless_saved, saved_result
from hpo.outcome import Outcome, TrialResult
from hpo.recovery import STALE_AFTER_BEATS, BeatWatch, Recovered, gone_why, is_stale, judges_beats, recover_stale
from hpo.scenario import load_scenario
from hpo.scheduler import HOST, RUN_AGAIN_LIMIT, Claim, Scheduler, worker_id
from hpo.storage import MAX_PAUSE_S
from hpo.store import SYS_HEARTBEAT, SYS_RUN, SYS_STARTED, StudyStore

WriteScenario = Callable[..., Path]
ME = worker_id()
LIVE = f"{HOST}:1"  # a worker whose process is alive on this host (init), judged by its heartbeat


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def frozen(worker: str, beat_age: float | None, number: int = 0) -> object:
    """A RUNNING trial claimed by ``worker``, last beaten ``beat_age`` seconds ago."""
    trial = create_trial(state=TrialState.RUNNING, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
                         system_attrs={SYS_RUN: {"worker": worker}} | (
                             {} if beat_age is None else {SYS_HEARTBEAT: time.time() - beat_age}))
    trial.number = number
    trial.datetime_start = datetime.datetime.now() - datetime.timedelta(seconds=3600)
    return trial


@pytest.mark.parametrize(("worker", "beat_age", "mine", "judge", "stale"), [
    pytest.param("ME", 10_000, {0}, True, False, id="mine-never"),
    pytest.param("ME", 0, set(), True, True, id="my-orphan"),
    pytest.param("DEAD", 0, set(), False, True, id="dead-process-on-this-host"),
    pytest.param("LIVE", 1, set(), True, False, id="live-process-recent-beat"),
    pytest.param("LIVE", STALE_AFTER_BEATS + 1, set(), True, True, id="live-process-old-beat"),
    pytest.param("LIVE", STALE_AFTER_BEATS + 1, set(), False, False, id="not-judged-after-an-outage"),
    pytest.param("LIVE", None, set(), True, True, id="never-beaten-old-start"),
])
def test_is_stale(worker: str, beat_age: float | None, mine: set[int], judge: bool, stale: bool) -> None:
    worker = {"ME": ME, "DEAD": f"{HOST}:{dead_pid()}", "LIVE": LIVE}[worker]
    assert is_stale(frozen(worker, beat_age), time.time(), 1.0, ME, mine, judge) is stale  # type: ignore[arg-type]


@pytest.mark.parametrize(("worker", "beat_age", "mine", "why"), [
    pytest.param("ME", 0, set(), "no slot of this worker runs it", id="my-orphan"),
    pytest.param("DEAD", 0, set(), "its process is gone", id="dead-process-on-this-host"),
    pytest.param("LIVE", 4.3, set(), "no heartbeat for 4.3 s", id="live-process-old-beat"),
    pytest.param("LIVE", 1, set(), None, id="live-process-recent-beat"),
])
def test_how_a_worker_was_found_gone_is_said(worker: str, beat_age: float, mine: set[int], why: str | None) -> None:
    worker = {"ME": ME, "DEAD": f"{HOST}:{dead_pid()}", "LIVE": LIVE}[worker]
    now = time.time()
    trial = frozen(worker, beat_age)
    assert gone_why(trial, now, 1.0, ME, mine) == why  # type: ignore[arg-type]


@pytest.mark.parametrize("skew", [-35.0, 0.0, 100.0])
def test_a_beat_of_another_machine_is_judged_by_how_long_it_stood_still_here(
        monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    """A worker on a machine whose clock ran 35 s behind had every trial judged lost seconds
    after it started (its beats looked 35 s old), and one whose clock runs ahead would never
    have been: a beat of another machine is timed on this process's clock from when it was seen."""
    clock = [1000.0]
    monkeypatch.setattr(recovery, "BEATS", BeatWatch(lambda: clock[0]))
    trial = frozen("elsewhere:12", -skew)

    def why() -> str | None:
        return gone_why(trial, time.time(), 1.0, ME, set())  # type: ignore[arg-type]

    assert why() is None
    clock[0] += STALE_AFTER_BEATS - 0.5
    assert why() is None
    trial.system_attrs[SYS_HEARTBEAT] += 1.0  # type: ignore[attr-defined]
    assert why() is None
    clock[0] += STALE_AFTER_BEATS - 0.5
    assert why() is None
    clock[0] += 1.0
    assert why() == f"no heartbeat for {STALE_AFTER_BEATS + 0.5:.1f} s"


@pytest.mark.parametrize(("healthy_since", "judged"), [
    pytest.param(float("-inf"), True, id="no-outage"),
    pytest.param(None, False, id="store-down"),
    pytest.param(100.0 - STALE_AFTER_BEATS * 2.0, False, id="back-3-beats-ago-others-may-still-pause"),
    pytest.param(100.0 - STALE_AFTER_BEATS * 2.0 - MAX_PAUSE_S + 0.1, False, id="within-the-last-pause"),
    pytest.param(100.0 - STALE_AFTER_BEATS * 2.0 - MAX_PAUSE_S - 0.1, True, id="every-worker-had-time-to-beat"),
])
def test_heartbeats_are_judged_only_once_every_worker_could_beat_after_an_outage(healthy_since: float | None,
                                                                                 judged: bool) -> None:
    assert judges_beats(healthy_since, now=100.0, heartbeat_s=2.0) is judged


def make(tmp_path: Path, write_scenario: WriteScenario) -> Scheduler:
    scenario = load_scenario(write_scenario(tmp_path, search={"method": "monte_carlo", "trials": 3, "seed": 1},
                                            resources={"heartbeat": 1}))
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/study.db")
    return Scheduler(store, designs.design_points(scenario), 3, tmp_path / "w", 1)


def claim_as(scheduler: Scheduler, worker: str, started: bool) -> Claim:
    """Claim a trial, then make it look claimed by ``worker`` (started or not)."""
    with scheduler.store.lock():
        c = scheduler.claim(set())
    assert isinstance(c, Claim)
    scheduler.store.set_system(c.number, SYS_RUN, {"worker": worker, "host": worker.rpartition(":")[0],
                                                   "token": c.token})
    if started:
        scheduler.store.set_system(c.number, SYS_STARTED, {"slot": 0, "folder": str(c.folder)})
    return c


def recover(scheduler: Scheduler, tmp_path: Path) -> list[int]:
    return [r.number for r in recover_all(scheduler, tmp_path)]


def recover_all(scheduler: Scheduler, tmp_path: Path) -> list[Recovered]:
    with scheduler.store.lock():
        return recover_stale(scheduler.store, tmp_path / "w", ME, set())


@pytest.mark.parametrize("outage", ["none", "while-reading", "lock-lost"])
def test_no_heartbeat_is_judged_right_after_an_outage_that_the_recovery_waited_out(
        tmp_path: Path, write_scenario: WriteScenario, monkeypatch: pytest.MonkeyPatch, outage: str) -> None:
    """A trial whose worker (alive) could not beat through an outage is not taken for lost when
    the outage ended while the recovery read the running trials, or when it showed only as a
    lost ask lock."""
    scheduler = make(tmp_path, write_scenario)
    store = scheduler.store
    c = claim_as(scheduler, LIVE, started=True)
    store.set_system(c.number, SYS_HEARTBEAT, time.time() - 10 * STALE_AFTER_BEATS)
    if outage == "while-reading":
        read = store.study.get_trials
        failures = [sqlalchemy.exc.OperationalError("SELECT", None, Exception("server closed the connection"))]

        def flaky(*args: object, **kwargs: object) -> object:
            if failures:
                raise failures.pop()
            return read(*args, **kwargs)

        monkeypatch.setattr(store.study, "get_trials", flaky)
    elif outage == "lock-lost":
        store.call.note_outage()
    assert recover(scheduler, tmp_path) == ([c.number] if outage == "none" else [])


def test_a_started_trial_of_a_dead_worker_is_lost_and_queued_again(tmp_path: Path,
                                                                   write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    worker = f"{HOST}:{dead_pid()}"
    c = claim_as(scheduler, worker, started=True)
    [found] = recover_all(scheduler, tmp_path)
    assert (found.number, found.worker, found.why, found.again_as) == (c.number, worker, "its process is gone", 1)
    assert found.result is not None and found.result.outcome is Outcome.LOST and found.params == c.params
    rows = scheduler.store.rows()
    assert rows[0].outcome is Outcome.LOST and rows[0].reason == "lost: its worker stopped"
    assert rows[1].outcome is Outcome.WAITING and rows[1].requeue_of == 0 and rows[1].lost_count == 1
    assert rows[1].params == rows[0].params and rows[1].design_index == 0
    assert recover(scheduler, tmp_path) == []


def test_a_claim_that_never_started_goes_back_to_the_queue(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    c = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=False)
    [found] = recover_all(scheduler, tmp_path)
    assert (found.number, found.result, found.again_as) == (c.number, None, None)
    assert scheduler.store.trial(c.number).state == TrialState.WAITING
    assert len(scheduler.store.rows()) == 1


def test_a_claim_taken_back_is_not_started_by_its_worker_and_one_started_is_not_taken_back(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A worker frozen between its claim and its start: the claim is taken back (queued again)
    and the worker, thawed, does not start it; claimed again, the new claim starts. A claim
    its worker marked starting first is judged started instead: LOST, its configuration queued
    again, never back in the queue under its own number for a second worker to run."""
    scheduler = make(tmp_path, write_scenario)
    store = scheduler.store
    taken = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=False)
    [found] = recover_all(scheduler, tmp_path)
    assert found.result is None and store.trial(taken.number).state == TrialState.WAITING
    assert not scheduler.may_start(taken)
    with store.lock():
        again = scheduler.claim(set())
    assert isinstance(again, Claim) and again.number == taken.number and scheduler.may_start(again)
    assert store.record(again.number, TrialResult(Outcome.COMPLETE, 0.5), again.folder)

    started = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=False)
    assert scheduler.may_start(started)
    [found] = recover_all(scheduler, tmp_path)
    assert found.result is not None and found.result.outcome is Outcome.LOST and found.again_as is not None
    assert not scheduler.may_start(started)


@pytest.mark.parametrize("order", ["start-before-the-take-back-marks", "start-after-the-take-back-marks"])
def test_a_start_and_a_take_back_made_at_once_never_both_go_ahead(
        tmp_path: Path, write_scenario: WriteScenario, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """Another worker read a claim ahead as never started (its worker frozen past its heartbeats)
    and put it back in the queue just after the worker, thawed, had found it still its own and
    started it: both workers ran the trial. Now each marks first and reads after, so the
    take-back sees the start (LOST, its configuration queued again as a new trial) whenever
    the start went ahead, and the start sees the take-back otherwise."""
    scheduler = make(tmp_path, write_scenario)
    store = scheduler.store
    c = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=False)
    went_ahead: list[bool] = []
    if order == "start-before-the-take-back-marks":  # the take-back has read the trial; its mark is not written yet
        monkeypatch.setattr(recovery, "kill_by_token", lambda token: went_ahead.append(scheduler.may_start(c)))
    else:  # its mark is written; it has not read the trial again yet
        read = store.trial

        def thaw_then_read(number: int) -> object:
            monkeypatch.setattr(store, "trial", read)
            went_ahead.append(scheduler.may_start(c))
            return read(number)

        monkeypatch.setattr(recovery, "kill_by_token", lambda token: monkeypatch.setattr(store, "trial", thaw_then_read))
    [found] = recover_all(scheduler, tmp_path)
    assert went_ahead == [order == "start-before-the-take-back-marks"]
    assert found.result is not None and found.result.outcome is Outcome.LOST
    rows = store.rows()
    assert [(r.number, r.outcome, r.requeue_of) for r in rows] == [
        (c.number, Outcome.LOST, None), (found.again_as, Outcome.WAITING, c.number)]


def test_a_result_left_in_the_folder_is_recorded(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    c = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=True)
    c.folder.mkdir(parents=True)
    save_result(c.folder, c.number, TrialResult(Outcome.COMPLETE, 0.125, {"test_error": 0.25}, 3.0))
    recover(scheduler, tmp_path)
    row = scheduler.store.rows()[0]
    assert (row.outcome, row.value, dict(row.held_out), row.duration_s) == (
        Outcome.COMPLETE, 0.125, {"test_error": 0.25}, 3.0)
    assert len(scheduler.store.rows()) == 1


def test_a_configuration_lost_three_times_fails(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    for _ in range(RUN_AGAIN_LIMIT):
        claim_as(scheduler, f"{HOST}:{dead_pid()}", started=True)
        recover(scheduler, tmp_path)
    rows = scheduler.store.rows()
    assert [r.outcome for r in rows] == [Outcome.LOST, Outcome.LOST, Outcome.FAIL]
    assert rows[2].reason.startswith("lost 3 times")
    assert len({r.params["x"] for r in rows}) == 1


@pytest.mark.parametrize(("start", "beat_after", "duration"), [
    pytest.param("recorded", 7.0, 7.0, id="start-record-to-last-beat"),
    pytest.param("claim", 7.0, 7.0, id="claim-to-last-beat-in-older-studies"),
    pytest.param("recorded", -1.0, 0.0, id="beaten-only-before-it-started"),
    pytest.param("recorded", None, 0.0, id="never-beaten"),
])
def test_a_lost_trial_records_how_long_it_ran_until_its_last_heartbeat(
        tmp_path: Path, write_scenario: WriteScenario, start: str, beat_after: float | None, duration: float) -> None:
    scheduler = make(tmp_path, write_scenario)
    store = scheduler.store
    c = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=True)
    started_at = time.time() - 3600
    if start == "recorded":
        store.set_system(c.number, SYS_STARTED, {"slot": 0, "folder": str(c.folder), "at": started_at})
    else:
        started_at = store.trial(c.number).datetime_start.timestamp()  # type: ignore[union-attr]
    if beat_after is not None:
        store.set_system(c.number, SYS_HEARTBEAT, started_at + beat_after)
    recover(scheduler, tmp_path)
    row = store.rows()[0]
    assert row.outcome is Outcome.LOST and row.duration_s == pytest.approx(duration, abs=1e-3)


def test_a_trial_claimed_again_is_not_judged_by_its_earlier_claims_heartbeat(tmp_path: Path,
                                                                             write_scenario: WriteScenario) -> None:
    """A trial claimed ahead and beaten, put back to WAITING by a stopped sweep and claimed
    again on resume kept its old heartbeat: another worker judged it gone before the new
    claim's first beat ('no heartbeat for 9.0 s') and killed the trial just started."""
    scheduler = make(tmp_path, write_scenario)
    first = claim_as(scheduler, LIVE, started=False)
    scheduler.store.set_system(first.number, SYS_HEARTBEAT, time.time() - 60)
    assert gone_why(scheduler.store.trial(first.number), time.time(), 1.0, ME, set()) == "no heartbeat for 60.0 s"
    assert scheduler.store.back_to_waiting(first.number)
    with scheduler.store.lock():
        again = scheduler.claim(set())
    assert isinstance(again, Claim) and again.number == first.number
    trial = scheduler.store.trial(again.number)
    assert trial.system_attrs[SYS_HEARTBEAT] < time.time() - 59  # the earlier claim's beat is still there
    assert gone_why(trial, time.time(), 1.0, "another-worker", set()) is None
    assert (gone_why(trial, time.time() + 10, 1.0, "another-worker", set()) or "").startswith("no heartbeat for 1")


def test_a_trial_judged_lost_says_so_in_its_folder(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Every trial folder holds result.json, how it ended; a trial whose worker was killed had
    none: the worker that judged it lost recorded it in the store only."""
    scheduler = make(tmp_path, write_scenario)
    c = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=True)
    c.folder.mkdir(parents=True)
    assert recover(scheduler, tmp_path) == [c.number]
    saved = saved_result(c.folder, c.number)
    assert saved is not None and saved.outcome is Outcome.LOST and saved.reason == "lost: its worker stopped"
    gone = claim_as(scheduler, f"{HOST}:{dead_pid()}", started=True)  # its folder is on another machine
    assert recover(scheduler, tmp_path) == [gone.number] and not gone.folder.exists()


def test_a_result_its_own_process_wrote_is_never_replaced_by_lost(tmp_path: Path) -> None:
    """The worker that judged a trial lost wrote LOST over a COMPLETE result.json that the
    trial's own worker (alive, but late with its heartbeats) had written meanwhile."""
    folder = tmp_path / "trial-0003"
    folder.mkdir()
    save_result(folder, 3, TrialResult(Outcome.COMPLETE, 0.5, {}, 2.0))
    assert not save_result_unless_saved(folder, 3, TrialResult(Outcome.LOST, reason="lost: its worker stopped"))
    saved = saved_result(folder, 3)
    assert saved is not None and saved.outcome is Outcome.COMPLETE and sorted(p.name for p in folder.iterdir()) == [
        "result.json"]
    empty = tmp_path / "trial-0004"
    empty.mkdir()
    assert save_result_unless_saved(empty, 4, TrialResult(Outcome.LOST, reason="lost: its worker stopped"))
    assert saved_result(empty, 4) == TrialResult(Outcome.LOST, reason="lost: its worker stopped")


def test_a_trial_lost_before_its_first_heartbeat_ran_until_its_log_was_last_written(tmp_path: Path) -> None:
    """A trial lost in its first heartbeat interval (10 s) was recorded LOST after 0.0 s though
    it had reported steps, and hpo status had shown 2.6 s a moment before."""
    started = time.time() - 30
    trial = create_trial(state=TrialState.RUNNING, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
                         system_attrs={SYS_STARTED: {"at": started}})
    assert recovery.ran_s(trial, tmp_path) == 0.0  # no beat, no log: nothing known
    log = tmp_path / "trial.log"
    log.write_text("step 1\nstep 2\n")
    os.utime(log, (started + 2.6, started + 2.6))
    assert recovery.ran_s(trial, tmp_path) == pytest.approx(2.6)
    beaten = create_trial(state=TrialState.RUNNING, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
                          system_attrs={SYS_STARTED: {"at": started}, SYS_HEARTBEAT: started + 12.0})
    assert recovery.ran_s(beaten, tmp_path) == pytest.approx(12.0)  # the later of the two
    assert recovery.ran_s(beaten) == pytest.approx(12.0)
