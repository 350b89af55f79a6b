"""Nothing is ever lost with several workers: signals to ``hpo run --workers 2``, a sequence
of stops, and a worker paused past its heartbeat."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import cli_env
from optuna.trial import TrialState
from test_signals import assert_every_point_once, hpo, rows, write

from hpo.errors import InputError
from hpo.recovery import run_info
from hpo.scenario import load_scenario
from hpo.store import SYS_STARTED, StudyStore


def test_signals_then_kill_then_resume(tmp_path: Path) -> None:
    """The sequence of the report: SIGINT, then SIGTERM, then kill -9, then a resume. Trials
    last 1 s: the next trial must still run when the settling of trial 2 sends SIGTERM (a
    design settles in the background), or a loaded machine starts trial 4 in the second run,
    and the third, which kills itself as trial 4 starts, never does."""
    path = write(tmp_path, 1, pause=1.0)
    assert hpo("run", str(path), faults="started@0=INT").returncode == 130
    assert hpo("run", str(path), faults="settled@2=TERM").returncode == 143
    assert hpo("run", str(path), faults="started@4=KILL").returncode == -9
    assert hpo("run", str(path)).returncode == 0
    assert_every_point_once(path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_workers_stop_together_and_resume(tmp_path: Path, sig: signal.Signals) -> None:
    path = write(tmp_path, 2, pause=1.0)
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--workers", "2"], env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while sum("RUNNING" == r["state"] for r in rows(path)) < 2:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.2)
    run.send_signal(sig)
    out, err = run.communicate(timeout=60)
    assert run.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -9}[sig], out + err
    if sig == signal.SIGKILL:  # the workers are signalled as hpo run dies, and stop as gracefully
        deadline = time.monotonic() + 30
        logs = sorted((tmp_path / "runs" / "sweep").glob("worker-*.log"))  # written by the worker once its pipe broke
        ended = "\ninterrupted: running trials were recorded INTERRUPTED"
        while any(r["state"] == "RUNNING" for r in rows(path)) or not all(ended in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]  # the line follows the record
            time.sleep(0.2)
        assert len(logs) == 2
    assert not [r for r in rows(path) if r["state"] == "RUNNING"]
    again = hpo("run", str(path), "--workers", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert_every_point_once(path)
    logs = sorted((tmp_path / "runs" / "sweep").glob("worker-*.log"))
    assert len(logs) == 2 and all(log.read_text().count("--- hpo worker") == 2 for log in logs)


def started_trial(path: Path) -> tuple[int, int] | None:
    """A trial of the study whose process runs, and its worker's pid, if there is one (the
    worker records the start just before it starts the process)."""
    try:
        store = StudyStore(load_scenario(path), f"sqlite:///{path.parent}/runs/sweep/study.db", create=False)
    except InputError:
        return None
    for trial in store.trials(states=(TrialState.RUNNING,)):
        if SYS_STARTED in trial.system_attrs:
            pid = int(str(run_info(trial)["worker"]).rpartition(":")[2])
            with contextlib.suppress(psutil.Error):
                if any("trial.py" in child.cmdline() for child in psutil.Process(pid).children(recursive=True)):
                    return trial.number, pid
    return None


def started_epoch(path: Path, number: int) -> float:
    """When the worker started trial ``number``'s process (epoch seconds), as it recorded it."""
    store = StudyStore(load_scenario(path), f"sqlite:///{path.parent}/runs/sweep/study.db", create=False)
    return float(store.trial(number).system_attrs[SYS_STARTED]["at"])


def run_two_workers_until_a_trial_runs(path: Path) -> tuple[subprocess.Popen[str], int, int]:
    """``hpo run --workers 2`` on ``path``, once a trial's process runs: the run, the trial's
    number and its worker's pid."""
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--workers", "2"], env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while (found := started_trial(path)) is None:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.05)
    return run, *found


def freeze_without_the_ask_lock(pid: int, lock_path: Path) -> None:
    """SIGSTOP ``pid`` at a moment it holds neither the study's ask lock nor SQLite's write
    lock (frozen with one, it would keep every other worker from judging its trial: a wait the
    sweep says, see test_lock_holder)."""
    while True:
        os.kill(pid, signal.SIGSTOP)
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            time.sleep(0.01)
        if _not_asking(pid, lock_path) and _store_writable(lock_path.with_name("study.db")):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)


def _not_asking(pid: int, lock_path: Path) -> bool:
    """Whether ``pid`` does not hold the ask lock at ``lock_path``."""
    with lock_path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            handle.seek(0)
            return handle.read().strip().rpartition(":")[2] != str(pid)


def _store_writable(database: Path) -> bool:
    """Whether no process holds the SQLite store's write lock now."""
    with contextlib.closing(sqlite3.connect(database, timeout=0.05, isolation_level=None)) as conn:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return False
        conn.execute("ROLLBACK")
        return True


def trial_processes(pid: int) -> list[psutil.Process]:
    """The trial processes (``python trial.py``) that ``pid`` started and that still run (one
    that ended is a zombie until its parent, paused, reaps it)."""
    running = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "trial.py" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                    running.append(child)
    return running


def test_a_worker_paused_past_its_heartbeat_says_its_trial_was_judged_lost(tmp_path: Path) -> None:
    """kill -STOP a worker while its trial runs, until the other worker judges the trial LOST,
    then kill -CONT: the paused worker announces the LOST record, not its own COMPLETE, its
    result.json does not count the pause as run time, it does not run the trial it had claimed
    ahead and lost meanwhile, and the other worker's log says whom it judged lost and which
    trial runs the configuration again."""
    path = write(tmp_path, 2, pause=1.0)
    run, number, pid = run_two_workers_until_a_trial_runs(path)
    deadline = time.monotonic() + 60
    freeze_without_the_ask_lock(pid, path.parent / "runs" / "sweep" / "study.db.hpo-lock")
    frozen_at = time.time()
    try:  # paused until the trial is judged lost and its process has ended (slow to start on a loaded machine)
        while not ((lost := any(r["number"] == str(number) and r["state"] == "LOST" for r in rows(path)))
                   and not trial_processes(pid)):
            assert time.monotonic() < deadline + 60, (lost, [p.cmdline() for p in trial_processes(pid)])
            time.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, out + err
    assert_every_point_once(path)
    logs = {log.name: log.read_text() for log in (tmp_path / "runs" / "sweep").glob("worker-*.log")}
    [paused] = [text for text in logs.values() if re.search(rf"^trial {number} started", text, re.MULTILINE)]
    [other] = [text for text in logs.values() if text != paused]
    starts = re.findall(r"^trial (\d+) started", "".join(logs.values()), re.MULTILINE)
    assert len(starts) == len(set(starts)), logs  # a claim taken back while paused is not run by both workers
    assert not re.search(rf"^trial {number} (COMPLETE|FAIL)", paused, re.MULTILINE), paused
    assert re.search(rf"^trial {number} judged lost by another worker .*: recorded LOST after .*; queued again as "
                     rf"trial \d+; its end here \(COMPLETE in .*\) is not recorded: it stays in ", paused, re.MULTILINE), paused
    judged = re.search(rf"^trial {number} \(worker \S+:{pid}\) judged lost: no heartbeat for [0-9.]+ s; recorded "
                       rf"LOST after [0-9.]+ s; queued again as trial (\d+)$", other, re.MULTILINE)
    assert judged, other
    assert f"runs trial {number}'s configuration again" in "".join(logs.values())
    record = json.loads((tmp_path / "runs" / "sweep" / f"trial-{number:04d}" / "result.json").read_text())
    started_at = started_epoch(path, number)  # the run time known ends where the worker was frozen, however loaded
    assert record["outcome"] == "COMPLETE" and record["duration_s"] < frozen_at - started_at + 0.5 \
        and record["paused_s"] > 1.0, (record, frozen_at - started_at)


def test_a_worker_killed_mid_sweep_is_said_at_once_and_its_trial_runs_again(tmp_path: Path) -> None:
    """kill -9 of one of hpo run's workers: nothing was said until the end, which said only
    'worker-0 (exit -9) ended with an error'; then hpo run exited 1 though the other worker had
    finished the sweep."""
    path = write(tmp_path, 2, pause=1.0)
    run, _, pid = run_two_workers_until_a_trial_runs(path)
    os.kill(pid, signal.SIGKILL)
    out, err = run.communicate(timeout=120)
    folder = tmp_path / "runs" / "sweep"
    said = re.findall(rf"^hpo: worker-(\d) was killed by SIGKILL \(its log: {folder}/worker-(\d).log\); a trial it was "
                      r"running is judged lost once its heartbeat stops, and runs again$", out, re.MULTILINE)
    assert len(said) == 1 and said[0][0] == said[0][1], out
    index = said[0][0]
    assert (run.returncode, err) == (0, ""), out  # the other worker finished the sweep: nothing is missing
    assert out.rstrip().endswith(f"hpo: the other workers finished the sweep; worker-{index} was killed by SIGKILL: "
                                 f"see {folder}/worker-*.log"), out
    assert_every_point_once(path)


def test_a_sweep_whose_workers_all_die_exits_1_and_resumes(tmp_path: Path) -> None:
    """Every worker of hpo run --workers killed (the OOM killer): the sweep is not finished,
    which exit 1 says, naming each worker; hpo run again finishes it."""
    path = write(tmp_path, 2, pause=1.0)
    run, _, _ = run_two_workers_until_a_trial_runs(path)
    workers = [child for child in psutil.Process(run.pid).children() if "worker" in child.cmdline()]
    assert len(workers) == 2
    for worker in workers:
        worker.kill()
    out, err = run.communicate(timeout=120)
    folder = tmp_path / "runs" / "sweep"
    assert run.returncode == 1, out + err
    assert re.fullmatch(rf"error: worker-\d was killed by SIGKILL, worker-\d was killed by SIGKILL: see "
                        rf"{folder}/worker-\*.log\n", err), err
    again = hpo("run", str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert_every_point_once(path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_sweep_one_of_whose_workers_is_stopped(tmp_path: Path, sig: signal.Signals) -> None:
    """One worker stopped (kill -STOP, Ctrl-Z on it, a debugger), then Ctrl-C to hpo run: it
    waited for that worker for as long as it stayed stopped, without a word."""
    path = write(tmp_path, 2, pause=1.0)
    run, _, pid = run_two_workers_until_a_trial_runs(path)
    freeze_without_the_ask_lock(pid, path.parent / "runs" / "sweep" / "study.db.hpo-lock")
    run.send_signal(sig)
    try:
        out, err = run.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a worker left stopped would outlive the test
            os.kill(pid, signal.SIGCONT)
    assert run.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], out + err
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [r for r in rows(path) if r["state"] == "RUNNING"]
