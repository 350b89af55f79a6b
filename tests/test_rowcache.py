"""The row cache: finished rows kept beside the study, and whole answers from it while the
SQLite store has not been written since (real SQLite studies, real CLI)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import cli_env, run_hpo_process

from hpo import rowcache
from hpo.outcome import Outcome, TrialResult
from hpo.rows import TrialRow, presented, row_from_list, row_to_list
from hpo.scenario import Scenario, load_scenario
from hpo.snapshot import snapshot
from hpo.store import StudyStore

WriteScenario = Callable[..., Path]


@pytest.fixture
def scenario(tmp_path: Path, write_scenario: WriteScenario) -> Scenario:
    return load_scenario(write_scenario(tmp_path / "sc"))


def age(url: str, seconds: float = 30.0) -> None:
    """Make the SQLite store's files look written ``seconds`` ago (as after a finished sweep)."""
    database = rowcache.sqlite_path(url)
    assert database is not None
    then = time.time() - seconds
    for path in (database, database.with_name(database.name + "-wal")):
        if path.exists():
            os.utime(path, (then, then))


def study(scenario: Scenario, url: str) -> StudyStore:
    """A study with three finished trials, one asked and one queued."""
    store = StudyStore(scenario, url)
    store.describe("name: demo\n")
    for value in (0.3, 0.2):
        trial = store.ask()
        trial.suggest_float("lr", 1e-4, 0.5, log=True)
        store.record(trial.number, TrialResult(Outcome.COMPLETE, value, {"test_error": value}), "f")
    store.record(store.ask().number, TrialResult(Outcome.FAIL, reason="exit code 1: boom"), "f")
    store.ask()
    store.enqueue({"lr": 0.01}, {"requeue_of": 0})
    return store


def test_rows_survive_the_round_trip_through_plain_data() -> None:
    row = TrialRow(7, Outcome.STOPPED, {"lr": 0.1, "opt": "adam"}, None, {"test_error": 0.5}, 1.5, "/f", "stopped",
                   slot=1, gpus="0,1", where="2 processes on GPUs 0,1", requeue_of=3, design_index=2, lost_count=1,
                   retries=2)
    assert row_from_list(row_to_list(row)) == row


def test_a_quiet_store_answers_from_the_file_alone(scenario: Scenario, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    writer = study(scenario, url)
    assert rowcache.quiet_rows(url, "demo", "minimize val_error") is None  # nothing cached yet
    age(url)
    read = snapshot(StudyStore(scenario, url, create=False))
    quiet = rowcache.quiet_rows(url, "demo", "minimize val_error")
    assert quiet is not None and presented(quiet, scenario.parameters) == read == writer.rows()
    assert [r.outcome for r in quiet] == [Outcome.COMPLETE, Outcome.COMPLETE, Outcome.FAIL, Outcome.WAITING,
                                          Outcome.WAITING]
    assert rowcache.quiet_rows(url, "demo", "maximize val_error") is None  # the scenario's direction changed
    assert rowcache.quiet_rows(url, "demo", "minimize loss") is None  # the scenario's metric changed


def test_any_write_since_the_cache_sends_readers_to_the_store(scenario: Scenario, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    writer = study(scenario, url)
    age(url)
    snapshot(StudyStore(scenario, url, create=False))
    writer.record(3, TrialResult(Outcome.COMPLETE, 0.1), "f")
    assert rowcache.quiet_rows(url, "demo", "minimize val_error") is None  # written just now: not quiet
    age(url)  # the same age as before, but the files are not as they were
    assert rowcache.quiet_rows(url, "demo", "minimize val_error") is None
    fresh = snapshot(StudyStore(scenario, url, create=False))
    assert [r.value for r in fresh][:4] == [0.3, 0.2, None, 0.1]
    quiet = rowcache.quiet_rows(url, "demo", "minimize val_error")
    assert quiet is not None and presented(quiet, scenario.parameters) == fresh


def test_status_of_a_quiet_store_opens_no_storage(scenario: Scenario, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    study(scenario, url)
    age(url)
    path = tmp_path / "sc" / "scenario.yaml"
    slow = run_hpo_process("status", path, "--storage", url)
    assert slow.returncode == 0, slow.stderr
    probe = ("import sys; from hpo.cli import main; code = main(sys.argv[1:]); "
             "print('optuna imported' if 'optuna' in sys.modules else 'optuna not imported'); sys.exit(code)")
    fast = subprocess.run([sys.executable, "-c", probe, "status", str(path), "--storage", url], env=cli_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout.splitlines()[-1] == "optuna not imported"
    assert fast.stdout.rsplit("\n", 2)[0] == slow.stdout.rstrip("\n")
    assert "exit code 1: boom" in fast.stdout
