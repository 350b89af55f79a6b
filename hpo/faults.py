"""Fault points: where tests (and anyone checking crash safety) can make hpo signal itself.

``HPO_FAULTS=record@3=KILL,claim@1=INT`` sends this process SIGKILL when it is about to
record trial 3, and SIGINT when it has claimed trial 1. The points are ``claim`` (a trial
was asked for, before it starts), ``started`` (its process runs), ``record`` (its result
is in its folder, not yet in the store: between the attributes and the state) and
``settled`` (recorded; between trials). A point without ``@N`` fires for every trial.
Unset (the normal case), a fault point costs one dictionary lookup. The signal goes to the
main thread, as a terminal's Ctrl-C does: its handler runs at once, even while that thread
waits (sent to the process from a slot's thread, it could land in that thread and be handled
only when the main thread next woke, after the trial it was meant to catch running had ended).
"""
from __future__ import annotations

import os
import signal
import threading

FAULTS_ENV = "HPO_FAULTS"


def fault_point(name: str, number: int) -> None:
    """Signal this process if ``HPO_FAULTS`` names point ``name`` for trial ``number``."""
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    for item in spec.split(","):
        point, _, sig = item.strip().partition("=")
        where, _, trial = point.partition("@")
        if where == name and (not trial or int(trial) == number):
            signal.pthread_kill(threading.main_thread().ident, signal.Signals[f"SIG{sig.upper()}"])
