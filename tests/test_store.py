"""The study store: storage URLs, the budget count, the ask lock and the rows shown to users."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.storages import JournalStorage, RDBStorage
from optuna.trial import TrialState, create_trial

from hpo.errors import InputError
from hpo.scenario import Scenario, load_scenario
from hpo.store import (RESULT_ATTR, RUN_ATTR, SYS_RETRY_OF, TrialRow, ask_lock, best_row, counted_trials,
                       display_state, open_storage, open_study, storage_url, trial_row, trial_rows)

WriteScenario = Callable[..., Path]
DIST = {"x": FloatDistribution(0.0, 1.0)}


@pytest.fixture
def scenario(tmp_path: Path, write_scenario: WriteScenario) -> Scenario:
    """The base scenario in a fresh folder."""
    return load_scenario(write_scenario(tmp_path / "sc"))


@pytest.fixture(params=["sqlite", "journal"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage URL of every file-based backend (the same contract runs against each)."""
    return {"sqlite": f"sqlite:///{tmp_path}/db/study.db", "journal": f"journal:{tmp_path}/db/study.log"}[request.param]


def test_ask_lock_leaves_optunas_journal_lock_alone(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    with ask_lock(f"journal:{journal}"):
        assert not os.path.lexists(f"{journal}.lock")
    assert not os.path.lexists(f"{journal}.lock")


def test_storage_url_default_and_overrides(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path))
    assert storage_url(scenario) == f"sqlite:///{tmp_path.resolve()}/runs/demo/study.db"
    assert storage_url(scenario, workdir=tmp_path / "w") == f"sqlite:///{tmp_path}/w/study.db"
    assert storage_url(scenario, override="journal:/x.log", workdir=tmp_path / "w") == "journal:/x.log"
    with_storage = load_scenario(write_scenario(tmp_path / "2", storage="sqlite:////tmp/other.db"))
    assert storage_url(with_storage) == "sqlite:////tmp/other.db"
    assert storage_url(with_storage, override="sqlite:////tmp/cli.db") == "sqlite:////tmp/cli.db"


def test_workdir_moves_the_default_store(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, workdir="elsewhere"))
    assert storage_url(scenario) == f"sqlite:///{tmp_path.resolve()}/elsewhere/study.db"


@pytest.mark.parametrize(
    ("url", "kind", "path"),
    [("sqlite:///{tmp}/a/study.db", RDBStorage, "a/study.db"),
     ("journal:{tmp}/b/study.log", JournalStorage, "b/study.log"),
     ("journal://{tmp}/c/study.log", JournalStorage, "c/study.log")],
)
def test_open_storage_kinds(tmp_path: Path, url: str, kind: type, path: str) -> None:
    storage = open_storage(url.format(tmp=tmp_path))
    assert isinstance(storage, kind)
    assert (tmp_path / path).is_file()


def test_bad_url_is_an_input_error() -> None:
    with pytest.raises(InputError, match="--storage: cannot open nosuchdb://x"):
        open_storage("nosuchdb://x")


def test_open_study_persists_and_loads(scenario: Scenario, url: str) -> None:
    study = open_study(scenario, url)
    study.add_trial(create_trial(params={"x": 0.5}, distributions=DIST, value=0.25))
    again = open_study(scenario, url, create=False)
    assert again.study_name == "demo"
    assert [t.value for t in again.get_trials()] == [0.25]


def test_open_study_missing_or_wrong_direction(tmp_path: Path, write_scenario: WriteScenario, url: str) -> None:
    scenario = load_scenario(write_scenario(tmp_path / "a"))
    with pytest.raises(InputError, match="no study named demo.*run `hpo run` first"):
        open_study(scenario, url, create=False)
    open_study(scenario, url)
    maximize = load_scenario(write_scenario(tmp_path / "b", objective={"direction": "maximize"}))
    with pytest.raises(InputError, match="objective.direction: the study demo was created to minimize, not maximize"):
        open_study(maximize, url)


def _add(study: optuna.Study, state: TrialState, value: float | None = None,
         user_attrs: dict[str, Any] | None = None, system_attrs: dict[str, Any] | None = None) -> None:
    """Add a finished (or waiting) trial with x=0.5 to ``study``."""
    study.add_trial(create_trial(state=state, value=value, params={"x": 0.5}, distributions=DIST,
                                 user_attrs=user_attrs, system_attrs=system_attrs))


def test_counted_trials_ignores_waiting_and_superseded(scenario: Scenario, url: str) -> None:
    study = open_study(scenario, url)
    _add(study, TrialState.COMPLETE, 0.1)
    _add(study, TrialState.FAIL)
    _add(study, TrialState.PRUNED)
    assert counted_trials(study.get_trials()) == 3
    study.enqueue_trial({"x": 0.2})
    assert counted_trials(study.get_trials()) == 3
    _add(study, TrialState.WAITING, system_attrs={SYS_RETRY_OF: 1})
    assert counted_trials(study.get_trials()) == 2
    trial = study.ask()
    assert trial.params == {} and trial.number == 3
    assert counted_trials(study.get_trials()) == 3
    retry = study.ask()
    assert retry.number == 4
    assert counted_trials(study.get_trials()) == 4
    study.tell(retry, 0.05)
    assert counted_trials(study.get_trials()) == 4


def _hold_lock(url: str, held: Any, release: Any) -> None:
    """In another process: take the ask lock, say so, and keep it until told to let go."""
    with ask_lock(url):
        held.set()
        release.wait(60)


def _wait_for(event: Any, process: Any, timeout_s: float = 60) -> bool:
    """Wait for ``event`` while ``process`` lives; False if it died or time ran out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.is_alive():
        if event.wait(0.05):
            return True
    return event.is_set()


def test_ask_lock_serialises_processes(url: str) -> None:
    open_storage(url)
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    other = context.Process(target=_hold_lock, args=(url, held, release))
    other.start()
    try:
        assert _wait_for(held, other), "the other process never took the lock"
        acquired = threading.Event()

        def take() -> None:
            with ask_lock(url):
                acquired.set()

        taker = threading.Thread(target=take)
        taker.start()
        assert not acquired.wait(0.5)
        release.set()
        taker.join(30)
        assert acquired.is_set()
    finally:
        release.set()
        other.join(30)
    assert other.exitcode == 0


def test_ask_lock_serialises_threads(url: str) -> None:
    open_storage(url)
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        with ask_lock(url):
            with guard:
                inside += 1
                most = max(most, inside)
            time.sleep(0.02)
            with guard:
                inside -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most == 1


def test_ask_lock_is_released_on_error(url: str) -> None:
    open_storage(url)
    with pytest.raises(RuntimeError):
        with ask_lock(url):
            raise RuntimeError("boom")
    with ask_lock(url):
        pass


def test_trial_rows_and_display_state(scenario: Scenario, url: str) -> None:
    study = open_study(scenario, url)
    _add(study, TrialState.COMPLETE, 0.3, user_attrs={
        RUN_ATTR: {"folder": "/w/trial-0000"},
        RESULT_ATTR: {"held_out": {"test_error": 0.4}, "duration_s": 1.5, "reason": ""}})
    _add(study, TrialState.FAIL, user_attrs={RESULT_ATTR: {"reason": "exit code 1"}})
    _add(study, TrialState.PRUNED, user_attrs={RESULT_ATTR: {"outcome": "STOPPED", "reason": "stopped by the user"}})
    study.enqueue_trial({"x": 0.9})
    _add(study, TrialState.FAIL, user_attrs={RESULT_ATTR: {"outcome": "TIMEOUT"}}, system_attrs={SYS_RETRY_OF: 1})
    running = study.ask()
    rows = trial_rows(study)
    assert [row.number for row in rows] == [0, 1, 2, 3, 4]
    by_number = {row.number: row for row in rows}
    assert by_number[0] == TrialRow(0, "COMPLETE", {"x": 0.5}, 0.3, {"test_error": 0.4}, 1.5, "/w/trial-0000", "")
    assert (by_number[1].state, by_number[1].value, by_number[1].reason) == ("FAIL", None, "exit code 1")
    assert (by_number[2].state, by_number[2].reason) == ("STOPPED", "stopped by the user")
    assert (by_number[4].state, by_number[4].retry_of) == ("TIMEOUT", 1)
    assert by_number[running.number].state == "RUNNING"
    assert by_number[running.number].value is None
    states = {t.number: display_state(t) for t in study.get_trials()}
    assert states[2] == "STOPPED" and states[1] == "FAIL" and states[0] == "COMPLETE"


def test_trial_rows_are_ordered_by_number(scenario: Scenario, url: str) -> None:
    study = open_study(scenario, url)
    for value in (0.3, 0.1, 0.2):
        _add(study, TrialState.COMPLETE, value)
    assert [row.number for row in trial_rows(study)] == [0, 1, 2]


def test_trial_row_duration_falls_back_to_timestamps() -> None:
    start = datetime.datetime(2024, 1, 1, 12, 0, 0)
    trial = create_trial(state=TrialState.COMPLETE, value=1.0, params={"x": 0.5}, distributions=DIST)
    trial.datetime_start = start
    trial.datetime_complete = start + datetime.timedelta(seconds=7.5)
    assert trial_row(trial).duration_s == 7.5


@pytest.mark.parametrize(
    ("values", "direction", "best"),
    [
        ([0.3, 0.1, None, 0.2], "minimize", 1),
        ([0.3, 0.1, None, 0.2], "maximize", 0),
        ([None, float("nan"), 0.5], "minimize", 2),
        ([None, None], "minimize", None),
        ([], "maximize", None),
    ],
)
def test_best_row(values: list[float | None], direction: str, best: int | None) -> None:
    rows = [TrialRow(i, "COMPLETE" if v is not None else "FAIL", {}, v, {}, None, "", "") for i, v in enumerate(values)]
    found = best_row(rows, direction)
    assert (found.number if found else None) == best
