"""One contract, every storage backend: SQLite, Optuna's journal file, and PostgreSQL.

PostgreSQL runs where ``HPO_TEST_POSTGRES_URL`` names a server (CI starts one); elsewhere
that backend is skipped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpo import storage
from hpo.errors import InputError, StoreUnavailable
from hpo.outcome import Outcome, TrialResult
from hpo.scenario import Scenario, load_scenario
from hpo.scheduler import Claim, Scheduler
from hpo.storage import ask_lock, server_lock_key
from hpo.store import SYS_STOP, StudyStore

REPO = Path(__file__).resolve().parents[1]
POSTGRES = os.environ.get("HPO_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", "journal", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage URL of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    if request.param == "journal":
        return f"journal:{tmp_path / 'study.log'}"
    if not POSTGRES:
        pytest.skip("HPO_TEST_POSTGRES_URL names no PostgreSQL server")
    return POSTGRES


def make_scenario(tmp_path: Path, trials: int = 4, method: str = "monte_carlo") -> Scenario:
    """A fast scenario with a study name of its own (servers outlive tests)."""
    (tmp_path / "trial.py.j2").write_text("print('val_error={{ x }}')\nprint('test_error={{ x / 2 }}')\n")
    path = tmp_path / "contract.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: contract-{uuid.uuid4().hex[:10]}
        template: trial.py.j2
        command: python trial.py
        parameters:
          x: {{type: float, low: 0, high: 1}}
        search: {{method: {method}, trials: {trials}, seed: 4}}
        objective: {{metric: val_error, held_out: [test_error]}}
        resources: {{parallel: 2, gpus_per_trial: 1}}
        """))
    return load_scenario(path)


def test_create_then_reopen(backend: str, tmp_path: Path) -> None:
    scenario = make_scenario(tmp_path)
    store = StudyStore(scenario, backend)
    trial = store.ask()
    trial.suggest_float("x", 0, 1)
    assert store.record(trial.number, TrialResult(Outcome.COMPLETE, 0.1, {"test_error": 0.2}, 1.0), "/f")
    rows = StudyStore(scenario, backend, create=False).rows()
    assert len(rows) == 1
    assert rows[0].state == "COMPLETE" and rows[0].value == 0.1
    assert rows[0].held_out == {"test_error": 0.2} and rows[0].folder == "/f"


def test_a_missing_study_is_bad_input(backend: str, tmp_path: Path) -> None:
    scenario = make_scenario(tmp_path)
    with pytest.raises(InputError, match="no study named contract-"):
        StudyStore(scenario, backend, create=False)


def test_stop_request_reaches_another_connection(backend: str, tmp_path: Path) -> None:
    scenario = make_scenario(tmp_path)
    store = StudyStore(scenario, backend)
    trial = store.ask()
    StudyStore(scenario, backend, create=False).request_stop(trial.number)
    seen = StudyStore(scenario, backend, create=False).trial(trial.number)
    assert SYS_STOP in seen.system_attrs and seen.state == TrialState.RUNNING
    assert store.stop_requested(trial.number)


def test_ask_lock_is_reentrant_across_studies(backend: str, tmp_path: Path) -> None:
    with ask_lock(backend):
        pass
    with ask_lock(backend):
        pass


HOLD_LOCK = """
import sys, time
from hpo.storage import ask_lock
with ask_lock(sys.argv[1], study=sys.argv[2]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[Any]:
    """Starts a process that holds a study's ask lock on the PostgreSQL server: ``start(url, study)``."""
    if not POSTGRES:
        pytest.skip("HPO_TEST_POSTGRES_URL names no PostgreSQL server")
    started: list[subprocess.Popen[str]] = []

    def start(url: str, study: str) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, url, study], env=env, stdout=subprocess.PIPE,
                                  text=True)
        started.append(holder)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        return holder

    yield start
    for holder in started:
        holder.kill()
        holder.wait()


def test_the_server_lock_is_one_whatever_the_host_name_and_one_per_study(lock_holder: Any) -> None:
    """Workers that named the server 127.0.0.1 and localhost took the lock both at once (one
    crashed: the queued trial was taken while this worker held the ask lock), and a worker of
    another study in the database waited for it."""
    assert POSTGRES is not None and "127.0.0.1" in POSTGRES
    study = f"lock-{uuid.uuid4().hex[:10]}"
    lock_holder(POSTGRES, study)
    with ask_lock(POSTGRES.replace("127.0.0.1", "localhost"), study=f"{study}-other"):
        pass
    began = time.monotonic()
    with pytest.raises(StoreUnavailable), ask_lock(POSTGRES.replace("127.0.0.1", "localhost"), study=study,
                                                   give_up=lambda: time.monotonic() - began > 0.5):
        pass


def test_a_long_wait_for_the_server_lock_names_its_holder(lock_holder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped worker of a study held its lock, and the others waited without a word."""
    monkeypatch.setattr(storage, "LOCK_WAIT_NOTED_S", 0.2)
    study = f"lock-{uuid.uuid4().hex[:10]}"
    holder = lock_holder(POSTGRES, study)
    holder.send_signal(signal.SIGSTOP)
    notes: list[str] = []
    try:
        with pytest.raises(StoreUnavailable), ask_lock(POSTGRES, notes.append, lambda: bool(notes), study=study):
            pass
    finally:
        holder.send_signal(signal.SIGCONT)
    assert notes == [(f"this worker has waited 0 s for the ask lock of study {study}, held by process {holder.pid} "
                      f"on this machine, which is stopped (SIGSTOP or Ctrl-Z): `kill -CONT {holder.pid}` resumes it; "
                      "waiting for it")]


@pytest.mark.parametrize("method", ["monte_carlo", "tpe"])
def test_two_workers_run_exactly_the_budget(backend: str, tmp_path: Path, method: str) -> None:
    scenario = make_scenario(tmp_path, trials=9, method=method)
    env = dict(os.environ, HPO_GPUS="", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [subprocess.Popen([sys.executable, "-m", "hpo", "worker", str(scenario.path), "--storage", backend,
                                 "--seed", str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for seed in (1, 2)]
    outputs = [worker.communicate(timeout=180)[0] for worker in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    rows = StudyStore(scenario, backend, create=False).rows()
    assert len(rows) == 9 and all(r.state == "COMPLETE" for r in rows)
    assert len({r.params["x"] for r in rows}) == 9
    assert all(r.held_out["test_error"] == pytest.approx(r.value / 2, rel=1e-6) for r in rows)
    assert optuna.load_study(study_name=scenario.name, storage=backend if not backend.startswith("journal:")
                             else optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
                                 backend[len("journal:"):]))).best_value == min(r.value for r in rows)


@pytest.fixture
def admin() -> Iterator[Any]:
    """An engine on the PostgreSQL server outside every worker (skips without a server)."""
    if not POSTGRES:
        pytest.skip("HPO_TEST_POSTGRES_URL names no PostgreSQL server")
    import sqlalchemy

    engine = sqlalchemy.create_engine(POSTGRES, poolclass=sqlalchemy.pool.NullPool)
    yield engine
    engine.dispose()


def design_workers(tmp_path: Path) -> tuple[Scheduler, Scheduler]:
    """Workers A and B of one study of a 4-point design on the PostgreSQL server."""
    scenario = make_scenario(tmp_path)
    design = [{"x": 0.1}, {"x": 0.2}, {"x": 0.3}, {"x": 0.4}]
    a = Scheduler(StudyStore(scenario, POSTGRES), design, 4, tmp_path / "a", 1)
    b = Scheduler(StudyStore(scenario, POSTGRES, create=False), design, 4, tmp_path / "b", 2)
    return a, b


def end_lock_session(admin: Any, study: str) -> None:
    """End the server session that holds ``study``'s ask lock, as a server restart does."""
    import sqlalchemy

    assert POSTGRES
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                                     "AND objid = :key AND granted"), {"key": server_lock_key(POSTGRES, study)})


@pytest.mark.parametrize("a_notices", [True, False], ids=["a-call-fails", "a-reconnects-unaware"])
def test_a_claim_whose_lock_is_lost_in_an_outage_is_done_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 admin: Any, a_notices: bool) -> None:
    """A server restart ends the session that holds the ask lock while worker A is in the
    middle of a claim: A has queued design point 0, and before A takes it, worker B takes the
    lock and the queued point. A's claim starts again and takes point 1; no trial runs a
    random point in place of the design's, and none runs twice. A's own call meets the
    outage, or does not (its pool reconnects unseen): either way A learns before its next
    store call that the lock is gone."""
    import sqlalchemy

    a, b = design_workers(tmp_path)
    storage = a.store.optuna_storage
    real_create, real_read = storage._create_new_trial, storage.get_all_trials
    claimed_by_b: list[Claim] = []

    def create(*args: object, **kwargs: object) -> object:
        created = real_create(*args, **kwargs)
        monkeypatch.setattr(storage, "_create_new_trial", real_create)
        monkeypatch.setattr(storage, "get_all_trials", restart)  # A's next read meets the outage
        return created

    def restart(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(storage, "get_all_trials", real_read)
        if claimed_by_b:  # a retry of the call that met the outage
            return real_read(*args, **kwargs)
        end_lock_session(admin, a.store.scenario.name)
        claimed_by_b.append(b.store.locked(lambda: b.claim(set())))  # B gets the lock A lost
        if not a_notices:
            return real_read(*args, **kwargs)
        raise sqlalchemy.exc.OperationalError("get_all_trials", None, Exception("terminating connection"))

    monkeypatch.setattr(storage, "_create_new_trial", create)
    began = time.monotonic()
    claimed_by_a = a.store.locked(lambda: a.claim(set()))
    assert isinstance(claimed_by_a, Claim) and isinstance(claimed_by_b[0], Claim)
    assert (claimed_by_b[0].params, claimed_by_a.params) == ({"x": 0.1}, {"x": 0.2})
    healthy_since = a.store.call.healthy_since  # the lost lock counts as an outage: no heartbeat judged yet
    assert healthy_since is not None and healthy_since > began
    rows = a.store.rows()
    assert sorted((r.design_index, r.params["x"]) for r in rows) == [(0, 0.1), (1, 0.2)]


def test_a_design_claim_never_makes_a_trial_when_its_queued_point_is_taken(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        admin: Any) -> None:
    """The lock is lost while worker A takes the design point it queued, and worker B takes
    that point first (A's pool reconnects unseen). A makes no trial of its own, which would
    run a random point in place of the design's: its claim starts again and takes point 1."""
    a, b = design_workers(tmp_path)
    storage = a.store.optuna_storage
    real_set_state = storage.set_trial_state_values
    claimed_by_b: list[Claim] = []

    def set_state(trial_id: int, state: TrialState, values: object = None) -> bool:
        if state == TrialState.RUNNING and not claimed_by_b:
            end_lock_session(admin, a.store.scenario.name)
            claimed_by_b.append(b.store.locked(lambda: b.claim(set())))
        return real_set_state(trial_id, state, values)

    monkeypatch.setattr(storage, "set_trial_state_values", set_state)
    claimed_by_a = a.store.locked(lambda: a.claim(set()))
    assert (claimed_by_b[0].params, claimed_by_a.params) == ({"x": 0.1}, {"x": 0.2})
    trials = a.store.trials()
    assert [(t.params.get("x"), t.state) for t in trials] == [(0.1, TrialState.RUNNING), (0.2, TrialState.RUNNING)]


def test_a_trial_made_before_the_lock_is_found_lost_goes_back_to_the_queue(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            admin: Any) -> None:
    """The lock is lost after a model-based claim made its trial but before the proposal: the
    claim starts again and takes that very trial from the queue, so no trial is left running
    without a worker (until recovery, three heartbeats later, would put it back)."""
    scenario = make_scenario(tmp_path, method="tpe")
    a = Scheduler(StudyStore(scenario, POSTGRES), None, 4, tmp_path / "a", 1)
    storage = a.store.optuna_storage
    real_create = storage._create_new_trial
    made: list[int] = []

    def create(*args: object, **kwargs: object) -> object:
        created = real_create(*args, **kwargs)
        if not made:
            made.append(created.number)
            end_lock_session(admin, scenario.name)
        return created

    monkeypatch.setattr(storage, "_create_new_trial", create)
    claimed = a.store.locked(lambda: a.claim(set()))
    assert isinstance(claimed, Claim) and claimed.number == made[0]
    assert [(t.number, t.state) for t in a.store.trials()] == [(made[0], TrialState.RUNNING)]
    assert 0 <= claimed.params["x"] <= 1
