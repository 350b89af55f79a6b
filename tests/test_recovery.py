"""Stale-trial detection, LOST records and retries, on in-memory studies."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from hpo.recovery import HOST, STALE_AFTER_BEATS, fail_stale_trials, is_stale, retry
from hpo.store import RUN_ATTR, SYS_HEARTBEAT, SYS_RETRIES, SYS_RETRY_OF, counted_trials, trial_rows


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def running(study: optuna.Study, worker: str, beat: float | None) -> optuna.trial.Trial:
    """A RUNNING trial owned by ``worker`` with its last heartbeat at ``beat``."""
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    trial.set_user_attr(RUN_ATTR, {"worker": worker, "host": worker.rpartition(":")[0]})
    if beat is not None:
        study._storage.set_trial_system_attr(trial._trial_id, SYS_HEARTBEAT, beat)
    return trial


@pytest.mark.parametrize(("worker", "beat_age", "stale"), [
    pytest.param("HOST:SELF", 10_000, False, id="this-process-never"),
    pytest.param("HOST:DEAD", 0, True, id="dead-process-on-this-host"),
    pytest.param("elsewhere:12", 1, False, id="other-host-recent-beat"),
    pytest.param("elsewhere:12", STALE_AFTER_BEATS * 2 + 1, True, id="other-host-old-beat"),
])
def test_is_stale(worker: str, beat_age: float, stale: bool) -> None:
    study = optuna.create_study()
    worker = worker.replace("HOST", HOST).replace("SELF", str(os.getpid())).replace("DEAD", str(dead_pid()))
    trial = running(study, worker, time.time() - beat_age)
    frozen = study.get_trials(deepcopy=False)[trial.number]
    assert is_stale(frozen, time.time(), heartbeat_s=2.0) is stale


def test_fail_stale_trials_records_lost_and_retries_once() -> None:
    study = optuna.create_study()
    lost = running(study, f"{HOST}:{dead_pid()}", None)
    alive = running(study, f"{HOST}:{os.getpid()}", time.time())
    assert fail_stale_trials(study, heartbeat_s=1.0, retries_allowed=1) == [lost.number]
    rows = {row.number: row for row in trial_rows(study)}
    assert rows[lost.number].state == "LOST" and rows[lost.number].reason == "lost: its worker stopped"
    assert rows[alive.number].state == "RUNNING"
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].system_attrs[SYS_RETRY_OF] == lost.number
    assert waiting[0].params == study.get_trials(deepcopy=False)[lost.number].params
    assert counted_trials(study.get_trials(deepcopy=False)) == 1


def test_retry_respects_the_allowance_and_always_does_not_count() -> None:
    study = optuna.create_study()
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    study.tell(trial, state=TrialState.FAIL)
    failed = study.get_trials(deepcopy=False)[0]
    assert not retry(study, failed, allowed=0)
    assert retry(study, failed, allowed=0, always=True)
    assert study.get_trials(deepcopy=False)[-1].system_attrs[SYS_RETRIES] == 0
    assert retry(study, failed, allowed=1)
    assert study.get_trials(deepcopy=False)[-1].system_attrs[SYS_RETRIES] == 1
