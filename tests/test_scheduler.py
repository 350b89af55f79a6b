"""Claims, the budget, the design queue and re-runs, in-process on a real SQLite study."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpo import designs, space
from hpo.outcome import Outcome, TrialResult
from hpo.render import FolderFull
from hpo.rows import budget_used
from hpo.scenario import load_scenario
from hpo.scheduler import RUN_AGAIN_LIMIT, WAIT, Claim, Scheduler, requeue
from hpo.store import StudyStore

WriteScenario = Callable[..., Path]


def make(tmp_path: Path, write_scenario: WriteScenario, method: str = "monte_carlo", trials: int = 4,
         retry_failed: int = 0) -> Scheduler:
    """A scheduler over a fresh SQLite study of the base scenario."""
    scenario = load_scenario(write_scenario(tmp_path, search={"method": method, "trials": trials, "seed": 3,
                                                              "retry_failed": retry_failed}))
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/study.db")
    return Scheduler(store, designs.design_points(scenario), designs.total_trials(scenario), tmp_path / "w", 3)


def claim(scheduler: Scheduler, mine: set[int] | None = None) -> Claim:
    """Claim a trial, which must be there."""
    with scheduler.store.lock():
        found = scheduler.claim(mine or set())
    assert isinstance(found, Claim)
    return found


def complete(scheduler: Scheduler, c: Claim, value: float = 0.5) -> None:
    assert scheduler.settle(c, TrialResult(Outcome.COMPLETE, value, {"test_error": value}))


def run_to_end(scheduler: Scheduler) -> list[dict[str, Any]]:
    """Claim and complete trials until the scheduler has none left; their parameters, in order."""
    ran = []
    while True:
        with scheduler.store.lock():
            c = scheduler.claim(set())
        if c is None:
            return ran
        assert isinstance(c, Claim)
        ran.append(c.params)
        complete(scheduler, c)


def lose_with_two_copies(scheduler: Scheduler) -> tuple[Claim, Claim]:
    """Claim a trial, queue its configuration twice (as a worker whose ask lock was lost
    unseen in an outage can), record it LOST, and claim again: (the lost claim, the claim of
    its first copy)."""
    store = scheduler.store
    first = claim(scheduler)
    rows = store.rows()
    with store.lock():
        assert requeue(store, rows[0], rows)
        store.enqueue(space.searched(store.scenario.parameters, first.params), {"requeue_of": first.number})
    store.end_other(first.number, TrialResult(Outcome.LOST, reason="lost"), "f")
    return first, claim(scheduler)


def test_a_design_runs_its_points_in_order_then_stops(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    points = designs.design_points(scheduler.store.scenario)
    assert points is not None
    for index in range(4):
        c = claim(scheduler)
        assert c.params == points[index] and c.folder == tmp_path / "w" / f"trial-{c.number:04d}"
        assert c.seed == 3 + c.number
        complete(scheduler, c)
    with scheduler.store.lock():
        assert scheduler.claim(set()) is None
    assert [r.design_index for r in scheduler.store.rows()] == [0, 1, 2, 3]


def test_a_design_point_whose_trial_was_lost_runs_again_exactly_once(tmp_path: Path,
                                                                     write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario, trials=3)
    first, second = claim(scheduler), claim(scheduler)
    store = scheduler.store
    store.end_other(first.number, TrialResult(Outcome.LOST, reason="lost"), "f")
    assert scheduler.settle(second, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    run_to_end(scheduler)
    rows = store.rows()
    points = [p["x"] for p in designs.design_points(store.scenario) or []]
    done = [r for r in rows if r.outcome is Outcome.COMPLETE]
    assert sorted(r.params["x"] for r in done) == sorted(points)
    assert budget_used(rows) == 3


def test_a_design_point_queued_twice_runs_once(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Two copies of point 0 in the queue, as a worker whose ask lock was lost unseen in an
    outage can leave: the second copy is recorded INTERRUPTED, never run, and every point
    runs exactly once within the budget."""
    scheduler = make(tmp_path, write_scenario, trials=3)
    store = scheduler.store
    points = designs.design_points(store.scenario) or []
    with store.lock():
        for _ in range(2):
            store.enqueue(points[0], {"design_index": 0})
    assert run_to_end(scheduler) == points
    rows = store.rows()
    assert [(r.number, r.design_index, r.outcome) for r in rows] == [
        (0, 0, Outcome.COMPLETE), (1, 0, Outcome.INTERRUPTED), (2, 1, Outcome.COMPLETE), (3, 2, Outcome.COMPLETE)]
    assert rows[1].reason == "not run: it was queued twice in a store outage, and trial 0 runs it"
    assert budget_used(rows) == 3


@pytest.mark.parametrize("copy_of", ["finished", "running"])
def test_a_design_point_queued_twice_with_the_budget_spent_is_withdrawn(tmp_path: Path, write_scenario: WriteScenario,
                                                                       copy_of: str) -> None:
    """A second copy of the last point, queued (in an outage, unseen) once the budget is
    spent, with that point's trial finished or claimed by another slot: the copy is recorded
    INTERRUPTED when a slot next asks, and nothing is left waiting past the budget."""
    scheduler = make(tmp_path, write_scenario, trials=2)
    store = scheduler.store
    first, last = claim(scheduler), claim(scheduler)
    complete(scheduler, first)
    if copy_of == "finished":
        complete(scheduler, last)
    with store.lock():
        store.enqueue(last.params, {"design_index": 1})
        assert scheduler.claim(set()) == (None if copy_of == "finished" else WAIT)
    rows = store.rows()
    assert [(r.number, r.design_index, r.outcome) for r in rows] == [
        (0, 0, Outcome.COMPLETE), (1, 1, Outcome.COMPLETE if copy_of == "finished" else Outcome.WAITING),
        (2, 1, Outcome.INTERRUPTED)]
    assert rows[2].reason == "not run: it was queued twice in a store outage, and trial 1 runs it"
    assert budget_used(rows) == 2


def test_a_lost_configuration_queued_twice_runs_once(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Two copies of a lost trial's configuration in the queue of a model-based sweep: the
    first runs, the second is recorded INTERRUPTED, never run, and the sampler proposes next."""
    scheduler = make(tmp_path, write_scenario, method="tpe", trials=3)
    store = scheduler.store
    first, copy = lose_with_two_copies(scheduler)
    assert (copy.number, copy.params) == (1, first.params)
    proposed = claim(scheduler, {copy.number})
    assert proposed.number == 3 and proposed.params != first.params
    rows = store.rows()
    assert [r.outcome for r in rows[::2]] == [Outcome.LOST, Outcome.INTERRUPTED] and rows[2].requeue_of == 0
    assert not rows[1].outcome.ended and not rows[3].outcome.ended


def test_a_lost_configuration_queued_twice_with_the_budget_spent_is_withdrawn(tmp_path: Path,
                                                                             write_scenario: WriteScenario) -> None:
    """Two copies of a lost trial's configuration, and a budget of one trial: the first copy
    runs and spends it; the second is recorded INTERRUPTED when a slot next asks, not left waiting."""
    scheduler = make(tmp_path, write_scenario, method="tpe", trials=1)
    store = scheduler.store
    _, copy = lose_with_two_copies(scheduler)
    with store.lock():
        assert scheduler.claim({copy.number}) is None
    rows = store.rows()
    assert [(r.number, r.outcome) for r in rows] == [(0, Outcome.LOST), (1, Outcome.WAITING), (2, Outcome.INTERRUPTED)]
    assert rows[2].reason == "not run: it was queued twice in a store outage, and trial 1 runs it"


def test_a_requeued_copy_runs_while_its_lost_original_is_being_ended(tmp_path: Path,
                                                                      write_scenario: WriteScenario) -> None:
    """A lost trial's configuration is queued before the trial is recorded LOST; a worker
    that claims the copy in between runs it: the original is no twin of its own copy."""
    scheduler = make(tmp_path, write_scenario, trials=2)
    store = scheduler.store
    original = claim(scheduler)
    rows = store.rows()
    with store.lock():
        assert requeue(store, rows[0], rows)
    copy = claim(scheduler, {original.number})
    assert (copy.number, copy.params) == (1, original.params)


def test_the_budget_waits_for_other_workers_trials(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario, method="tpe", trials=2)
    first, second = claim(scheduler), claim(scheduler)
    with scheduler.store.lock():
        assert scheduler.claim({first.number}) == WAIT
        assert scheduler.claim({first.number, second.number}) is None
    complete(scheduler, first)
    scheduler.settle(second, TrialResult(Outcome.LOST, reason="lost"))
    third = claim(scheduler)
    assert third.params == second.params
    assert scheduler.store.rows()[third.number].requeue_of == second.number


def test_retry_failed_runs_a_failure_again_without_using_budget(tmp_path: Path,
                                                                write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario, trials=1, retry_failed=1)
    first = claim(scheduler)
    scheduler.settle(first, TrialResult(Outcome.FAIL, reason="exit code 1"))
    retry = claim(scheduler)
    assert retry.params == first.params
    scheduler.settle(retry, TrialResult(Outcome.TIMEOUT, reason="killed after 1 s"))
    with scheduler.store.lock():
        assert scheduler.claim(set()) is None
    rows = scheduler.store.rows()
    assert (rows[1].retry_of, rows[1].retries) == (0, 1) and budget_used(rows) == 1


def test_requeue_is_idempotent(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario)
    claim(scheduler)
    store = scheduler.store
    with store.lock():
        row = store.rows()[0]
        assert requeue(store, row, store.rows())
        assert not requeue(store, row, store.rows())
    assert len(store.rows()) == 2


def test_a_rerun_uses_no_budget_and_keeps_the_configuration(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario, trials=1)
    c = claim(scheduler)
    complete(scheduler, c, 0.2)
    store = scheduler.store
    store.enqueue({"x": 0.9, "opt": "a"}, {})  # a queued trial must not be claimed by the rerun
    with store.lock():
        rerun = scheduler.claim_rerun(store.rows()[0], seed=77, default_seed=5)
    assert rerun.params == c.params and rerun.seed == 77 and rerun.number == 2
    complete(scheduler, rerun, 0.25)
    rows = store.rows()
    assert rows[2].rerun_of == 0 and budget_used(rows) == 2  # trial 0 and the queued trial 1, not the rerun
    assert rows[1].outcome is Outcome.WAITING


def test_a_configuration_run_again_for_no_fault_of_its_own_keeps_its_trial_seed(tmp_path: Path,
                                                                                 write_scenario: WriteScenario) -> None:
    """Queued again, a configuration ran with its new trial number's seed: a sweep that had a
    crash did not repeat one that had none. Lost or interrupted, and lost again, it keeps the
    seed it first had; a retry of a failure gets its own, whatever ran before it."""
    scheduler = make(tmp_path, write_scenario, trials=2, retry_failed=1)
    first = claim(scheduler)
    scheduler.settle(first, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    again = claim(scheduler)
    scheduler.settle(again, TrialResult(Outcome.LOST, reason="lost"))
    third = claim(scheduler)
    assert (first.seed, again.seed, third.seed) == (3, 3, 3) and third.params == first.params
    scheduler.settle(third, TrialResult(Outcome.FAIL, reason="exit code 1"))
    retry = claim(scheduler)
    assert retry.params == first.params and retry.seed == 3 + 0 + 1 * 2  # point 0, retry 1 of a design of 2


def test_a_sweep_that_had_crashes_gives_each_configuration_the_seed_it_has_without(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Each later design point shifted one trial number after an interruption, and
    trial_seed (seed + trial number) with it: the same configurations ran with other seeds."""
    def seeds(folder: Path, crash: bool) -> list[tuple[float, int]]:
        scheduler = make(folder, write_scenario, trials=3)
        ran = []
        while True:
            with scheduler.store.lock():
                found = scheduler.claim(set())
            if found is None:
                return sorted(ran, key=lambda pair: pair[1])
            assert isinstance(found, Claim)
            if crash and found.number == 0:
                scheduler.settle(found, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
                continue
            complete(scheduler, found)
            ran.append((found.params["x"], found.seed))

    assert seeds(tmp_path / "crashed", crash=True) == seeds(tmp_path / "calm", crash=False)


def test_seeds_of_design_points_and_retries_do_not_depend_on_which_trial_ends_first(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """With retry_failed and trials running at once, two calm sweeps of one scenario gave 4 to
    9 of 60 points other seeds: a retry took its place among new tries in whatever order
    trials ended."""
    def seeds(folder: Path, fail_first: bool) -> set[tuple[float, int, int]]:
        scheduler = make(folder, write_scenario, trials=3, retry_failed=1)
        first, second = claim(scheduler, set()), claim(scheduler, {0})
        ran = {(first.params["x"], first.seed, first.number == 0), (second.params["x"], second.seed, False)}
        ends = [(first, Outcome.FAIL), (second, Outcome.COMPLETE)]
        for c, outcome in ends if fail_first else ends[::-1]:
            scheduler.settle(c, TrialResult(outcome, 0.5 if outcome is Outcome.COMPLETE else None,
                                            {"test_error": 0.5} if outcome is Outcome.COMPLETE else {}, reason="x"))
            nxt = claim(scheduler)
            ran.add((nxt.params["x"], nxt.seed, False))
            complete(scheduler, nxt)
        return {(x, seed) for x, seed, _ in ran}

    assert seeds(tmp_path / "a", fail_first=True) == seeds(tmp_path / "b", fail_first=False)


def test_a_trial_queued_from_optuna_outside_the_space_fails_with_why_and_the_sweep_goes_on(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """study.enqueue_trial with a value that is no choice made every hpo run crash with a
    traceback (exit 1), the trial RUNNING for ever; one outside a range ran without a word."""
    import warnings

    scheduler = make(tmp_path, write_scenario, trials=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler.store.study.enqueue_trial({"x": 0.5, "opt": "c"})
        scheduler.store.study.enqueue_trial({"x": 7.0, "opt": "a"})
    ran = claim(scheduler)
    rows = scheduler.store.rows()
    assert [(r.outcome, r.reason.split(": ", 1)[1]) for r in rows[:2]] == [
        (Outcome.FAIL, "'c' not in ('a', 'b')."),
        (Outcome.FAIL, ("The value 7.0 of parameter 'x' isn't contained in the distribution "
                       "FloatDistribution(high=1.0, log=False, low=0.0, step=None)."))]
    assert ran.number == 2 and 0 <= ran.params["x"] <= 1


def test_a_trials_recorded_seed_is_its_claims_when_its_folder_is_gone(tmp_path: Path,
                                                                       write_scenario: WriteScenario) -> None:
    """hpo rerun N of a trial whose folder was gone took seed + N, which is not the seed a
    trial ran with once a copy queued again came before it."""
    from hpo.engine import recorded_seed

    scheduler = make(tmp_path, write_scenario, trials=3)
    scheduler.settle(claim(scheduler), TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    copy, later = claim(scheduler), claim(scheduler)
    assert (copy.number, copy.seed, later.number, later.seed) == (1, 3, 2, 4)
    assert recorded_seed(tmp_path / "gone", lambda: scheduler.seed_of(later.number)) == 4


def test_interrupted_design_points_run_again_before_later_ones(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """After a Ctrl-C, the copies of the interrupted points 0 and 1 queued behind point 2,
    claimed ahead for the next slot and put back: a lowered budget, or a CSV design's 'first
    rows first', ran point 2 before them."""
    scheduler = make(tmp_path, write_scenario, trials=4)
    first, second, ahead = claim(scheduler), claim(scheduler), claim(scheduler)
    for c in (first, second):
        scheduler.settle(c, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    scheduler.release(ahead)
    order = [claim(scheduler) for _ in range(3)]
    assert [c.params for c in order] == [first.params, second.params, ahead.params]
    assert [c.seed for c in order] == [first.seed, second.seed, ahead.seed]


@pytest.mark.parametrize("retry_failed", [0, 2])
def test_interrupted_and_lost_do_not_use_retries(tmp_path: Path, write_scenario: WriteScenario,
                                                 retry_failed: int) -> None:
    scheduler = make(tmp_path, write_scenario, trials=1, retry_failed=retry_failed)
    c = claim(scheduler)
    scheduler.settle(c, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    again = claim(scheduler)
    rows: list[Any] = scheduler.store.rows()
    assert again.params == c.params and rows[1].retries == 0 and rows[1].requeue_of == 0


@pytest.mark.parametrize("method", ["monte_carlo", "tpe"])
def test_queued_copies_wait_past_a_lowered_budget(tmp_path: Path, write_scenario: WriteScenario,
                                                  method: str) -> None:
    """Copies of interrupted trials stay WAITING, unrun, once search.trials (lowered after
    the interruption) is spent, and run as far as it is raised again."""
    scheduler = make(tmp_path, write_scenario, method=method, trials=3)
    store = scheduler.store
    first, second, third = claim(scheduler), claim(scheduler), claim(scheduler)
    complete(scheduler, first)
    for c in (second, third):
        assert scheduler.settle(c, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    design = designs.design_points(store.scenario)
    lowered = Scheduler(store, design, 1, tmp_path / "w", 3)
    with store.lock():
        assert lowered.claim(set()) is None
    assert [(r.outcome, r.requeue_of) for r in store.rows()[3:]] == [(Outcome.WAITING, 1), (Outcome.WAITING, 2)]
    raised = Scheduler(store, design, 2, tmp_path / "w", 3)
    again = claim(raised)
    assert (again.number, again.params) == (3, second.params)
    with store.lock():
        assert raised.claim({again.number}) is None
        assert raised.claim(set()) == WAIT  # another worker's trial may yet be lost
    complete(raised, again)
    with store.lock():
        assert raised.claim(set()) is None
    assert store.rows()[4].outcome is Outcome.WAITING


@pytest.mark.parametrize("how", ["interrupted", "never-started"])
def test_a_queued_rerun_is_resumed_by_the_next_rerun_of_its_trial(tmp_path: Path, write_scenario: WriteScenario,
                                                                  how: str) -> None:
    """hpo rerun N runs the queued rerun of N (interrupted, or a claim that went back to the
    queue) instead of a new one, so nothing is left for hpo run to run a second time; without
    --seed, with the seed the interrupted rerun had (as hpo run does), not the original's."""
    scheduler = make(tmp_path, write_scenario, trials=1)
    complete(scheduler, claim(scheduler))
    store = scheduler.store
    with store.lock():
        rerun = scheduler.claim_rerun(store.rows()[0], seed=77, default_seed=5)
    if how == "interrupted":
        assert scheduler.settle(rerun, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    else:
        assert store.back_to_waiting(rerun.number)
    queued = len(store.rows()) - 1
    with store.lock():
        resumed = scheduler.claim_rerun(store.rows()[0], seed=None, default_seed=5)  # hpo rerun N without --seed
    assert (resumed.number, resumed.seed, resumed.prunable) == (queued, 77, False)  # the interrupted rerun's seed
    complete(scheduler, resumed)
    with store.lock():
        assert scheduler.claim(set()) is None
    assert all(r.outcome.ended for r in store.rows())


def test_hpo_run_runs_a_queued_rerun_with_its_seed_past_the_budget(tmp_path: Path,
                                                                   write_scenario: WriteScenario) -> None:
    scheduler = make(tmp_path, write_scenario, method="tpe", trials=1)
    original = claim(scheduler)
    complete(scheduler, original)
    store = scheduler.store
    with store.lock():
        rerun = scheduler.claim_rerun(store.rows()[0], seed=77, default_seed=5)
    assert scheduler.settle(rerun, TrialResult(Outcome.INTERRUPTED, reason="interrupted"))
    resumed = claim(scheduler)
    assert (resumed.number, resumed.params, resumed.seed, resumed.prunable) == (2, original.params, 77, False)
    complete(scheduler, resumed)
    with store.lock():
        assert scheduler.claim(set()) is None


def test_a_configuration_its_executor_found_lost_three_times_is_a_fail(tmp_path: Path,
                                                                      write_scenario: WriteScenario) -> None:
    """A Dask trial that kills its worker ends LOST through its executor, not through recovery:
    it was queued again without counting the loss, and ran 60 times in 150 s until stopped."""
    scheduler = make(tmp_path, write_scenario, trials=1, retry_failed=1)
    told = []
    for _ in range(RUN_AGAIN_LIMIT):
        lost = claim(scheduler)
        result = scheduler.verdict(lost, TrialResult(Outcome.LOST, duration_s=2.0,
                                                     reason="lost: its Dask worker tcp://w:1 is gone"))
        told.append(result.outcome)  # as the sweep announces it, before it is recorded
        assert scheduler.settle(lost, result)
    assert told == [Outcome.LOST, Outcome.LOST, Outcome.FAIL]
    with scheduler.store.lock():
        assert scheduler.claim(set()) is None
    rows = scheduler.store.rows()
    assert [(r.outcome, r.lost_count) for r in rows] == [(Outcome.LOST, 0), (Outcome.LOST, 1), (Outcome.FAIL, 2)]
    assert rows[-1].reason == "lost 3 times: its worker stopped each time (out of memory? walltime?)"
    assert rows[-1].duration_s == 2.0 and len({repr(r.params) for r in rows}) == 1


def test_a_configuration_whose_files_filled_the_disk_three_times_is_a_fail(tmp_path: Path,
                                                                           write_scenario: WriteScenario) -> None:
    """A trial that fills the disk itself (its log refused: INTERRUPTED, no fault of its own) ran
    again each time space was freed, with no bound; losses and disks filled count apart, and an
    interruption of another cause (the sweep stopped) does not count."""
    scheduler = make(tmp_path, write_scenario, trials=1, retry_failed=1)
    full = FolderFull(f"cannot write {tmp_path}/w/trial-0000/trial.log: No space left on device (0 bytes free on /)")
    told = []
    for cause in ("disk", "lost", "stop", "disk", "disk"):
        c = claim(scheduler)
        if cause == "lost":
            result = TrialResult(Outcome.LOST, reason="lost: its Dask worker tcp://w:1 is gone")
        else:
            result = TrialResult(Outcome.INTERRUPTED, duration_s=1.0, reason=f"interrupted: {full}; it runs again")
        filled = full if cause == "disk" else None
        result = scheduler.verdict(c, result, filled)
        told.append(result.outcome)
        assert scheduler.settle(c, result, filled)
    assert told == [Outcome.INTERRUPTED, Outcome.LOST, Outcome.INTERRUPTED, Outcome.INTERRUPTED, Outcome.FAIL]
    with scheduler.store.lock():
        assert scheduler.claim(set()) is None
    rows = scheduler.store.rows()
    assert [(r.lost_count, r.disk_full_count) for r in rows] == [(0, 0), (0, 1), (1, 1), (1, 1), (1, 2)]
    assert rows[-1].reason == f"its files filled the disk {RUN_AGAIN_LIMIT} times: {full}"
    assert rows[-1].duration_s == 1.0 and len({repr(r.params) for r in rows}) == 1
