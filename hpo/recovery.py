"""Fault tolerance: trials whose worker is gone are found, failed, cleaned up and retried.

A running trial is stale when its worker is gone: the worker's process no longer exists on
this host, or the trial's heartbeat (beaten by its worker's watchdog) stopped for
``STALE_AFTER_BEATS`` intervals. A stale trial is recorded as FAIL with outcome LOST, its
leftover processes on this host are killed, and its configuration is queued again while
``search.retry_failed`` allows.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Container

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from hpo.launch import kill_by_token
from hpo.store import RESULT_ATTR, SYS_HEARTBEAT, SYS_RETRIES, SYS_RETRY_OF, run_info

STALE_AFTER_BEATS = 3
HOST = socket.gethostname()


def retry(study: optuna.Study, failed: FrozenTrial, allowed: int, always: bool = False) -> bool:
    """Queue ``failed``'s configuration again if fewer than ``allowed`` retries were made
    (or ``always``, which does not use up a retry); return whether it was queued."""
    retries = int(failed.system_attrs.get(SYS_RETRIES, 0))
    if not always and retries >= allowed:
        return False
    system_attrs = {"fixed_params": dict(failed.params), SYS_RETRY_OF: failed.number,
                    SYS_RETRIES: retries + (0 if always else 1)}
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=failed.params, distributions=failed.distributions,
        system_attrs=system_attrs))
    return True


def is_stale(trial: FrozenTrial, now: float, heartbeat_s: float) -> bool:
    """Whether running ``trial``'s worker is gone (see the module docstring)."""
    host, _, pid = str(run_info(trial).get("worker", "")).rpartition(":")
    if host == HOST and pid.isdigit():
        if int(pid) == os.getpid():
            return False
        if not psutil.pid_exists(int(pid)):
            return True
    beat = trial.system_attrs.get(SYS_HEARTBEAT)
    if beat is None and trial.datetime_start is not None:
        beat = trial.datetime_start.timestamp()
    return beat is None or now - float(beat) > STALE_AFTER_BEATS * heartbeat_s


def fail_stale_trials(study: optuna.Study, heartbeat_s: float, retries_allowed: int,
                      mine: Container[int] = ()) -> list[int]:
    """Fail every stale running trial (except ``mine``); return their numbers.

    Call under the store's ask lock, so that two workers do not both retry one trial.
    """
    now = time.time()
    storage = study._storage
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.number in mine or not is_stale(trial, now, heartbeat_s):
            continue
        run = run_info(trial)
        if run.get("token") and run.get("host") == HOST:
            kill_by_token(str(run["token"]))
        storage.set_trial_user_attr(trial._trial_id, RESULT_ATTR, {
            "held_out": {}, "duration_s": None, "reason": "lost: its worker stopped", "outcome": "LOST"})
        if storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
            failed.append(trial.number)
            retry(study, storage.get_trial(trial._trial_id), retries_allowed)
    return failed
