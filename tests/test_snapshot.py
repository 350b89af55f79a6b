"""Reading a long study whole: the finished rows from the row cache, the rest from the storage."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from hpo import rowcache
from hpo.outcome import Outcome, TrialResult
from hpo.scenario import Scenario, load_scenario
from hpo.snapshot import count_trials, snapshot
from hpo.store import StudyStore

WriteScenario = Callable[..., Path]


@pytest.fixture
def scenario(tmp_path: Path, write_scenario: WriteScenario) -> Scenario:
    """The base scenario in a fresh folder."""
    return load_scenario(write_scenario(tmp_path / "sc"))


def test_snapshot_reads_what_is_new_and_matches_rows(scenario: Scenario, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/snap.db"
    store = StudyStore(scenario, url)
    store.describe("name: demo\n")
    for value in (0.3, 0.2, 0.1):
        trial = store.ask()
        trial.suggest_float("x", 0.0, 1.0)
        store.record(trial.number, TrialResult(Outcome.COMPLETE, value, {"test_error": value}), "f")
    running = store.ask()
    running.suggest_float("x", 0.0, 1.0)
    store.enqueue({"x": 0.5}, {"requeue_of": 0})
    reader = StudyStore(scenario, url, create=False)
    assert snapshot(reader) == store.rows()
    cache = tmp_path / "snap.db.demo.hpo-rows.json"
    cached = rowcache.load(cache)
    assert cached is not None and [row.number for row in cached.finished] == [0, 1, 2]
    store.record(running.number, TrialResult(Outcome.FAIL, reason="exit code 1"), "f")
    for value in (0.05, 0.04):
        trial = store.ask()
        trial.suggest_float("x", 0.0, 1.0)
        store.record(trial.number, TrialResult(Outcome.COMPLETE, value), "f")
    fresh = StudyStore(scenario, url, create=False)
    assert snapshot(fresh) == store.rows()
    assert [r.outcome for r in snapshot(fresh)][3:] == [Outcome.FAIL, Outcome.COMPLETE, Outcome.COMPLETE]


def test_a_recreated_study_does_not_read_the_old_cache(scenario: Scenario, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/snap.db"
    store = StudyStore(scenario, url)
    store.describe("x")
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    store.record(trial.number, TrialResult(Outcome.COMPLETE, 0.5), "f")
    assert [r.value for r in snapshot(StudyStore(scenario, url, create=False))] == [0.5]
    optuna.delete_study(study_name="demo", storage=url)
    again = StudyStore(scenario, url)
    again.describe("x")
    assert snapshot(StudyStore(scenario, url, create=False)) == []


@pytest.mark.parametrize("trials", [0, 1, 2, 7, 8, 9, 500])
@pytest.mark.parametrize("known", [0, 1, 5, 8, 9, 600])
def test_counting_trials_probes_from_the_highest_known_in_few_reads(trials: int, known: int) -> None:
    """A study's trials are numbered 0..n-1: the count is found from ``known`` (one past the highest
    number a cache holds) by doubling then bisecting, in O(log n) reads of single trials."""
    probed: list[int] = []

    def exists(number: int) -> bool:
        probed.append(number)
        return number < trials

    assert count_trials(exists, known) == (0 if known > trials else trials)
    assert len(probed) <= 2 * max(trials - known, 1).bit_length() + 2
