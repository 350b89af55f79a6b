"""The study store: one object over the Optuna study; the record of how trials ended, read and written in one place."""
from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpo import space
from hpo.errors import InputError
from hpo.outcome import Outcome, TrialResult
from hpo.rows import TrialRow, best_row, repeat_of
from hpo.scenario import Scenario, load_scenario
from hpo.storage import local_path, open_storage
from hpo.store import SYS_STARTED, StudyStore, check_resume, read_row, result_attrs

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


def test_create_reopen_and_missing(scenario: Scenario, url: str, tmp_path: Path,
                                   write_scenario: WriteScenario) -> None:
    with pytest.raises(InputError, match="no study named demo.*run `hpo run` first"):
        StudyStore(scenario, url, create=False)
    store = StudyStore(scenario, url)
    store.study.add_trial(create_trial(params={"x": 0.5}, distributions=DIST, value=0.25))
    again = StudyStore(scenario, url, create=False)
    assert [row.value for row in again.rows()] == [0.25]
    maximize = load_scenario(write_scenario(tmp_path / "b", objective={"direction": "maximize"}))
    with pytest.raises(InputError, match="objective.direction: the study demo was created to minimize, not maximize"):
        StudyStore(maximize, url)


def test_describe_makes_a_first_class_optuna_study(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    store.describe("name: demo\n")
    study = optuna.load_study(study_name="demo", storage=store.optuna_storage)
    assert study.metric_names == ["val_error"]
    assert study.user_attrs["held_out"] == ["test_error"]
    assert study.user_attrs["parameters"]["x"] == {"type": "float", "low": 0.0, "high": 1.0}
    assert study.user_attrs["scenario"] == "name: demo\n"


def _one_trial(store: StudyStore) -> None:
    """Record the scenario on the store's study and run one trial in its space."""
    store.describe("old")
    trial = store.ask()
    space.suggest(trial, store.scenario.parameters)
    store.record(trial.number, TrialResult(Outcome.COMPLETE, 0.5), "f")


UNSTORABLE = "the study demo stored its trials with the old distribution, which an Optuna study cannot change"


@pytest.mark.parametrize(("parameters", "problem"), [
    ({"opt": {"choices": ["a", "b", "c"]}}, r"parameters\.opt: choices changed from \['a', 'b'\] to \['a', 'b', 'c'\]"),
    ({"opt": {"choices": ["a"]}}, r"parameters\.opt: choices changed from \['a', 'b'\] to \['a'\]"),
    ({"x": {"type": "int", "low": 0, "high": 1}}, r"parameters\.x: type changed from 'float' to 'int'"),
], ids=["choice-added", "choice-removed", "float-to-int"])
def test_a_space_the_study_cannot_store_is_refused_before_anything_is_written(
        scenario: Scenario, url: str, tmp_path: Path, write_scenario: WriteScenario, parameters: dict[str, Any],
        problem: str) -> None:
    _one_trial(StudyStore(scenario, url))
    changed = StudyStore(load_scenario(write_scenario(tmp_path / "b", parameters=parameters)), url)
    refusal = rf"^{problem}: {UNSTORABLE}; use another name for a new study \(--allow-space-change cannot override this\)$"
    for allow in (False, True):
        with pytest.raises(InputError, match=refusal):
            changed.check_space(allow_space_change=allow)
    with pytest.raises(InputError, match=refusal):
        changed.describe("new")
    again = StudyStore(scenario, url, create=False)
    assert again.user_attrs["scenario"] == "old" and len(again.trials()) == 1
    again.check_space()


def test_a_changed_metric_is_refused_like_a_changed_direction(scenario: Scenario, url: str, tmp_path: Path,
                                                              write_scenario: WriteScenario) -> None:
    StudyStore(scenario, url).describe("old")
    loss = load_scenario(write_scenario(tmp_path / "b", objective={"metric": "loss"}))
    for create in (True, False):
        with pytest.raises(InputError, match=r"^objective\.metric: the study demo was run on val_error, not loss; "
                                             r"a new metric needs a new study \(another name\)$"):
            StudyStore(loss, url, create=create)


def _written(url: str) -> tuple[Any, ...]:
    """What the study ``demo`` at ``url`` holds, and a journal file's bytes."""
    study = optuna.load_study(study_name="demo", storage=open_storage(url, create=False))
    file = local_path(url)
    journal = file.read_bytes() if url.startswith("journal:") and file is not None else None
    return study.user_attrs, study.metric_names, [(t.number, t.state, t.params) for t in study.trials], journal


def test_check_resume_refuses_what_a_resume_would_reading_only(scenario: Scenario, url: str, tmp_path: Path,
                                                               write_scenario: WriteScenario) -> None:
    check_resume(scenario, url)
    assert not (tmp_path / "db").exists()
    _one_trial(StudyStore(scenario, url))
    other = load_scenario(write_scenario(tmp_path / "other", name="other"))
    check_resume(other, url)
    before = _written(url)
    refusals = {"narrowed": ({"parameters": {"x": {"high": 0.5}}}, r"^parameters\.x: the range \[0, 1\] was narrowed"),
                "direction": ({"objective": {"direction": "maximize"}}, r"^objective\.direction: "),
                "metric": ({"objective": {"metric": "loss"}}, r"^objective\.metric: "),
                "choice": ({"parameters": {"opt": {"choices": ["a", "b", "c"]}}}, r"^parameters\.opt: choices changed")}
    for name, (changes, refusal) in refusals.items():
        changed = load_scenario(write_scenario(tmp_path / name, **changes))
        with pytest.raises(InputError, match=refusal):
            check_resume(changed, url)
        if name in ("narrowed",):
            check_resume(changed, url, allow_space_change=True)
        else:
            with pytest.raises(InputError, match=refusal):
                check_resume(changed, url, allow_space_change=True)
    check_resume(scenario, url)
    assert _written(url) == before


def test_check_resume_of_a_store_without_optunas_tables_has_nothing_to_check(scenario: Scenario,
                                                                              tmp_path: Path) -> None:
    (tmp_path / "empty.db").touch()
    check_resume(scenario, f"sqlite:///{tmp_path}/empty.db")


@pytest.mark.parametrize("result", [
    TrialResult(Outcome.COMPLETE, 0.25, {"test_error": 0.3}, 1.5),
    TrialResult(Outcome.FAIL, None, {}, 0.2, "exit code 1: ValueError: boom"),
    TrialResult(Outcome.PRUNED, None, {}, 0.7, "pruned at step 2", 2),
    TrialResult(Outcome.STOPPED, None, {"test_error": 0.5}, 0.9, "stopped by the user", 3),
    TrialResult(Outcome.TIMEOUT, None, {}, 60.0, "killed after 60 s (resources.timeout)"),
    TrialResult(Outcome.INTERRUPTED, None, {}, 0.1, "interrupted: the sweep was stopped"),
], ids=lambda r: r.outcome.value)
def test_record_round_trips_as_flat_attributes(scenario: Scenario, url: str, result: TrialResult) -> None:
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.report(0.9, 2)
    assert store.record(trial.number, result, "/w/trial-0000")
    frozen = store.trial(trial.number)
    expected_state = {Outcome.COMPLETE: TrialState.COMPLETE, Outcome.PRUNED: TrialState.PRUNED}
    assert frozen.state == expected_state.get(result.outcome, TrialState.FAIL)
    assert frozen.user_attrs == {"outcome": result.outcome.value, "reason": result.reason,
                                 "duration_s": result.duration_s, "folder": "/w/trial-0000", **result.held_out}
    row = store.rows()[0]
    assert (row.outcome, row.value, dict(row.held_out), row.reason, row.folder) == (
        result.outcome, result.value, result.held_out, result.reason, "/w/trial-0000")
    frame = store.study.trials_dataframe()
    assert frame.loc[0, "user_attrs_outcome"] == result.outcome.value


@pytest.mark.parametrize("result", [TrialResult(Outcome.COMPLETE, 0.1), TrialResult(Outcome.TIMEOUT, reason="killed")],
                         ids=lambda r: r.outcome.value)
def test_a_record_whose_commit_went_through_before_an_outage_cut_its_answer_is_recorded(
        scenario: Scenario, url: str, monkeypatch: pytest.MonkeyPatch, result: TrialResult) -> None:
    """The server commits the state, the connection drops before it answers, and the retry
    finds the trial ended as this very result says: recorded, not 'judged lost by another worker'."""
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    tell, cut = store.study.tell, []

    def committed_then_cut(*args: Any, **kwargs: Any) -> Any:
        told = tell(*args, **kwargs)
        if not cut:
            cut.append(True)
            raise sqlalchemy.exc.OperationalError("COMMIT", None, Exception("server closed the connection unexpectedly"))
        return told

    monkeypatch.setattr(store.study, "tell", committed_then_cut)
    assert store.record(trial.number, result, "f")
    assert cut and store.rows()[0].outcome is result.outcome


def test_a_stopped_trial_has_no_value_in_optuna(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.report(0.01, 1)
    store.record(trial.number, TrialResult(Outcome.STOPPED, reason="stopped by the user", step=1), "f")
    assert store.trial(trial.number).value is None
    assert store.study.best_trials == []


@pytest.mark.parametrize("own", [TrialResult(Outcome.COMPLETE, 0.1), TrialResult(Outcome.FAIL, reason="exit code 1")],
                         ids=lambda r: r.outcome.value)
def test_recording_a_trial_someone_else_ended_is_false_not_an_error(scenario: Scenario, url: str,
                                                                    own: TrialResult) -> None:
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    assert store.beat(trial.number)
    other = StudyStore(scenario, url, create=False)
    assert other.end_other(trial.number, TrialResult(Outcome.LOST, reason="lost: its worker stopped"), "f")
    assert not store.beat(trial.number)  # what tells its worker, which still runs it, to end it
    assert not store.record(trial.number, own, "f")
    assert store.rows()[0].outcome is Outcome.LOST
    assert not other.end_other(trial.number, TrialResult(Outcome.LOST, reason="again"), "f")


def test_the_stale_marking_race_resolves_to_lost(scenario: Scenario, url: str) -> None:
    """A worker's attributes land between another worker's LOST attributes and its state change:
    Optuna's state decides, and the row says what happened."""
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    for key, value in result_attrs(TrialResult(Outcome.LOST, reason="lost: its worker stopped"), "f").items():
        store.set_attr(trial.number, key, value)
    for key, value in result_attrs(TrialResult(Outcome.COMPLETE, 0.1), "f").items():
        store.set_attr(trial.number, key, value)
    assert store._set_state(trial.number, TrialState.FAIL)
    row = store.rows()[0]
    assert row.outcome is Outcome.LOST and row.value is None and "another worker" in row.reason


def test_claimed_but_not_started_shows_waiting_and_goes_back(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    claimed = store.ask()
    claimed.suggest_float("x", 0.0, 1.0)
    started = store.ask()
    started.suggest_float("x", 0.0, 1.0)
    store.set_system(started.number, SYS_STARTED, {"slot": 0, "gpus": "1", "folder": "/w/t1"})
    rows = store.rows()
    assert [r.outcome for r in rows] == [Outcome.WAITING, Outcome.RUNNING]
    assert (rows[1].slot, rows[1].gpus, rows[1].where, rows[1].folder) == (0, "1", "", "/w/t1")  # recorded before where
    assert store.back_to_waiting(claimed.number)
    assert store.trial(claimed.number).state == TrialState.WAITING
    again = store.ask()
    assert again.number == claimed.number and again.params == claimed.params


def test_a_started_trial_s_row_says_where_it_runs_as_its_worker_recorded_it(scenario: Scenario, url: str) -> None:
    """hpo run --workers K printed its workers' start lines from the rows, which kept only the GPU ids."""
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    store.set_system(trial.number, SYS_STARTED, {"slot": 1, "gpus": "2", "where": "1 process on 1/2 of GPU 2",
                                                 "folder": "/w/t0"})
    row = store.rows()[0]
    assert (row.slot, row.gpus, row.where) == (1, "2", "1 process on 1/2 of GPU 2")


def test_queued_copies_show_the_original_parameters(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    trial = store.ask()
    x = trial.suggest_float("x", 0.0, 1.0)
    store.record(trial.number, TrialResult(Outcome.INTERRUPTED, reason="interrupted"), "f")
    store.enqueue({"x": x}, {"requeue_of": trial.number})
    copy = store.rows()[1]
    assert copy.outcome is Outcome.WAITING and copy.params == {"x": x}
    assert repeat_of(copy) == trial.number


def test_rows_add_constants_and_read_older_studies(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, parameters={"epochs": {"type": "constant", "value": 3}}))
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    store.study.add_trial(create_trial(
        state=TrialState.COMPLETE, value=0.3, params={"x": 0.5}, distributions=DIST,
        user_attrs={"run": {"folder": "/w/trial-0000"},
                    "result": {"held_out": {"test_error": 0.4}, "duration_s": 1.5, "reason": ""}}))
    store.study.add_trial(create_trial(
        state=TrialState.PRUNED, params={"x": 0.5}, distributions=DIST,
        user_attrs={"result": {"outcome": "STOPPED", "reason": "stopped by the user"}},
        system_attrs={"hpo:retry_of": 0, "hpo:design_index": 4}))
    old, stopped = store.rows()
    assert old == TrialRow(0, Outcome.COMPLETE, {"x": 0.5, "epochs": 3}, 0.3, {"test_error": 0.4}, 1.5,
                           "/w/trial-0000", "")
    assert (stopped.outcome, stopped.reason, stopped.retry_of, stopped.design_index) == (
        Outcome.STOPPED, "stopped by the user", 0, 4)


def test_duration_falls_back_to_timestamps() -> None:
    start = datetime.datetime(2024, 1, 1, 12, 0, 0)
    trial = create_trial(state=TrialState.COMPLETE, value=1.0, params={"x": 0.5}, distributions=DIST)
    trial.datetime_start = start
    trial.datetime_complete = start + datetime.timedelta(seconds=7.5)
    assert read_row(trial).duration_s == 7.5


def test_stop_requests(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    trial = store.ask()
    trial.suggest_float("x", 0.0, 1.0)
    other = StudyStore(scenario, url, create=False)
    assert not store.stop_requested(trial.number)
    other.request_stop(trial.number)
    assert store.stop_requested(trial.number)
    store.record(trial.number, TrialResult(Outcome.STOPPED, reason="stopped by the user"), "f")
    with pytest.raises(InputError, match="trial 0: it is STOPPED, not running or queued"):
        other.request_stop(trial.number)
    with pytest.raises(InputError, match="trial 9: no such trial in study demo"):
        other.request_stop(9)


def test_a_queued_trial_is_withdrawn_unless_a_worker_claimed_it_first(scenario: Scenario, url: str) -> None:
    store = StudyStore(scenario, url)
    store.enqueue({"x": 0.25, "opt": "b"}, {"requeue_of": 7})
    store.enqueue({"x": 0.75}, {"requeue_of": 8})
    store.enqueue({"x": 0.5}, {})  # queued from Optuna without "opt": withdrawn without one drawn for it
    other = StudyStore(scenario, url, create=False)
    stopped = TrialResult(Outcome.STOPPED, reason="stopped by the user before it ran")
    assert other.withdraw(0, stopped, "f0")
    claimed = store.ask()  # a worker's claim takes the next queued trial, not the withdrawn one
    assert claimed.number == 1
    assert not other.withdraw(1, stopped, "f1")
    rows = store.rows()
    assert [(r.outcome, r.reason, r.folder, r.params) for r in rows[:2]] == [
        (Outcome.STOPPED, "stopped by the user before it ran", "f0", {"x": 0.25, "opt": "b"}), (Outcome.WAITING, "", "", {})]
    assert store.trial(1).state == TrialState.RUNNING
    assert not other.withdraw(0, stopped, "f0")  # ended already
    assert other.withdraw(2, stopped, "f2")
    assert store.rows()[2].params == {"x": 0.5}


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
    rows = [TrialRow(i, Outcome.COMPLETE if v is not None else Outcome.FAIL, {}, v, {}, None, "", "")
            for i, v in enumerate(values)]
    found = best_row(rows, direction)
    assert (found.number if found else None) == best


def _drops_once(monkeypatch: pytest.MonkeyPatch, store: StudyStore, method: str, *, work_done: bool = True
                ) -> list[str]:
    """The connection drops once during the storage's ``method``: after it did its work (the
    answer is lost) or, without ``work_done``, before. The list returned holds ``method`` once
    it has dropped."""
    import sqlalchemy.exc

    real = getattr(store.optuna_storage, method)
    lost: list[str] = []

    def flaky(*args: object, **kwargs: object) -> object:
        if lost:
            return real(*args, **kwargs)
        lost.append(method)
        if work_done:
            real(*args, **kwargs)
        raise sqlalchemy.exc.OperationalError(method, None, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(store.optuna_storage, method, flaky)
    return lost


def test_a_claim_whose_answer_is_lost_takes_the_queued_trial_not_a_new_one(
        scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    store.enqueue({"lr": 0.01}, {"design_index": 0})
    _drops_once(monkeypatch, store, "set_trial_state_values")
    trial = store.ask()
    assert trial.number == 0 and trial.suggest_float("lr", 1e-4, 0.5, log=True) == 0.01
    assert [t.number for t in store.trials()] == [0]


def test_a_design_claim_whose_answer_is_lost_takes_its_queued_trial(
        scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the lock, a retried claim that finds its trial RUNNING knows that it claimed it."""
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    store.enqueue({"lr": 0.01}, {"design_index": 0})
    _drops_once(monkeypatch, store, "set_trial_state_values")
    trial = store.locked(lambda: store.ask(queued_only=True))
    assert trial.number == 0 and trial.suggest_float("lr", 1e-4, 0.5, log=True) == 0.01
    assert [(t.number, t.state) for t in store.trials()] == [(0, TrialState.RUNNING)]


def test_a_claimed_trial_whose_read_fails_once_is_read_again(
        scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking the claimed trial reads it from the store; a drop there is an outage to ride out
    (a worker died of it, StorageInternalError, while PostgreSQL was down)."""
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    store.enqueue({"lr": 0.01}, {"design_index": 0})
    dropped = _drops_once(monkeypatch, store, "get_trial", work_done=False)
    trial = store.locked(lambda: store.ask(queued_only=True))
    assert dropped and trial.number == 0 and trial.suggest_float("lr", 1e-4, 0.5, log=True) == 0.01


def test_a_queued_trial_whose_answer_is_lost_is_queued_once(
        scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    _drops_once(monkeypatch, store, "_create_new_trial")  # what the study's caching storage calls
    store.enqueue({"lr": 0.01}, {"design_index": 0})
    assert [t.state for t in store.trials()] == [TrialState.WAITING]


def test_ask_and_enqueue_read_only_the_trials_in_their_state(
        scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim on a long study must not read every trial from the storage past Optuna's cache
    (it did, to count them: 0.8 s a trial at 1,000 trials)."""
    store = StudyStore(scenario, f"sqlite:///{tmp_path}/s.db")
    store.study.add_trials([create_trial(params={"x": i / 10}, distributions=DIST, value=i) for i in range(10)])
    storage = store.optuna_storage
    real = storage.get_all_trials
    reads: list[object] = []

    def counted(*args: object, **kwargs: object) -> object:
        reads.append(kwargs.get("states"))
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "get_all_trials", counted)
    store.enqueue({"lr": 0.01}, {"design_index": 0})
    store.ask()
    assert reads and None not in reads


def test_a_completed_trial_keeps_its_note_apart_from_the_reason() -> None:
    """The results CSV's reason is empty for a completed trial: what it reported that is not
    recorded is its note, a user attribute of its own; a study written when the note was the
    reason reads the same."""
    result = TrialResult(Outcome.COMPLETE, 0.2, {}, 1.0, note="held-out test_error was nan: not recorded")
    attrs = result_attrs(result, "/f")
    assert (attrs["reason"], attrs["note"]) == ("", "held-out test_error was nan: not recorded")
    assert "note" not in result_attrs(TrialResult(Outcome.COMPLETE, 0.2, {}, 1.0), "/f")
    for user in (attrs, {**attrs, "reason": attrs["note"], "note": None}):
        trial = create_trial(value=0.2, params={}, distributions={}, user_attrs={k: v for k, v in user.items() if v is not None})
        row = read_row(trial)
        assert (row.reason, row.note) == ("", "held-out test_error was nan: not recorded")
