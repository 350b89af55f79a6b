"""SIGINT or SIGTERM to a sweep that waits for the study's ask lock, held by a process stopped
with SIGSTOP: once the stop's grace is over the sweep ends as an interrupted sweep does (exit
128 + the signal, the closing ``interrupted:`` line), saying that it stopped while waiting for
the lock and who holds it; not as if the store had failed.

In-process (the CLI's own signal handlers), with the stop's grace cut to half a second."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import cli_env

from hpo import cli
from hpo.scenario import load_scenario
from hpo.storage import storage_url

WriteScenario = Callable[..., Path]

HOLDER = """\
import os, signal, sys
from hpo.storage import ask_lock
with ask_lock(sys.argv[1]):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""

TRIAL = """\
import pathlib, time
from hpo.results import report
pathlib.Path("began").touch()
time.sleep({{ nap }})
report(val_error={{ x }})
"""

GO = 'while {{ trial_number }} == 0 and not pathlib.Path("go").exists():\n    time.sleep(0.01)\n'
ENDED = ("running trials were recorded INTERRUPTED and queued again, trials claimed ahead went back to the queue; "
         "run the same command to resume")


def wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def holders() -> Iterator[Callable[[str], int]]:
    """Factory: start a process that takes the ask lock of the store at a URL and stops
    itself (SIGSTOP) holding it; its id. Each is killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def hold(url: str) -> int:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], env=cli_env(), stdout=subprocess.PIPE,
                                  text=True)
        started.append(holder)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        wait_for(lambda: psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED)
        return holder.pid

    yield hold
    for holder in started:
        holder.kill()  # SIGKILL ends a stopped process too
        holder.wait(10)


@pytest.mark.parametrize(("sig", "nap", "waiting"), [
    pytest.param(signal.SIGINT, 0.2, "to claim", id="SIGINT-claiming-the-next-trial"),
    pytest.param(signal.SIGTERM, 30, "to record", id="SIGTERM-recording-the-interrupted-trial"),
])
def test_a_stop_that_ends_a_wait_for_the_ask_lock_exits_as_interrupted(
        tmp_path: Path, write_scenario: WriteScenario, holders: Callable[[str], int],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        sig: signal.Signals, nap: float, waiting: str) -> None:
    """The lock is taken while trial 0 runs. ``to claim``: the signal comes once trial 0 has
    ended and the slot waits to claim the next; ``to record``: it comes while trial 0 runs,
    whose INTERRUPTED record (queued again under the lock) must then wait."""
    monkeypatch.setattr("hpo.engine.STOPPING_STORE_RETRY_S", 0.5)
    monkeypatch.setenv("HPO_GPUS", "")
    path = write_scenario(tmp_path, template_text=TRIAL.replace("time.sleep", GO + "time.sleep"), drop=["parameters.opt"],
                          parameters={"nap": {"type": "constant", "value": nap}},
                          search={"method": "tpe", "trials": 3}, objective={"held_out": []})
    url = storage_url(load_scenario(path), workdir=tmp_path / "w")
    first = tmp_path / "w" / "trial-0000"
    holder: list[int] = []

    def interrupt() -> None:
        try:
            wait_for(lambda: (first / "began").exists())
            holder.append(holders(url))
        finally:  # trial 0 ends only now that the lock is held (the next claim must wait for it), or this failed
            (first / "go").touch()
        if waiting == "to claim":
            wait_for(lambda: (first / "result.json").exists())
            time.sleep(0.3)
        if not returned.is_set():  # a signal after the sweep would end this test process
            os.kill(os.getpid(), sig)

    returned = threading.Event()
    signaller = threading.Thread(target=interrupt)
    signaller.start()
    began = time.monotonic()
    try:
        code = cli.main(["run", str(path), "--workdir", str(tmp_path / "w")])
    finally:
        returned.set()
    signaller.join()
    out, err = capsys.readouterr()
    assert code == 128 + sig, err
    pid = holder[0]
    ended = ENDED if waiting == "to claim" else (
        "trial 0 could not be recorded and shows RUNNING until the study is resumed, which records it from the trial "
        "folder and runs it again; other running trials were recorded INTERRUPTED and queued again; run the same "
        "command to resume")
    assert err.splitlines()[-1] == (
        f"interrupted: stopped while waiting for the study's ask lock, held by process {pid} on this machine, which is "
        f"stopped (SIGSTOP or Ctrl-Z): `kill -CONT {pid}` resumes it; {ended}")
    unrecorded = (f"hpo: trial 0 could not be recorded INTERRUPTED: that needs the study's ask lock, which the sweep "
                  f"stopped waiting for; it shows RUNNING until the study is resumed, which records it from {first}")
    assert (unrecorded in out.splitlines()) == (waiting == "to record")
    assert time.monotonic() - began < 30


def test_a_stop_that_ends_a_reruns_wait_for_the_ask_lock_exits_as_interrupted(
        tmp_path: Path, write_scenario: WriteScenario, holders: Callable[[str], int],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """hpo rerun met the same wait when recording its interrupted trial, and exited 1 as if
    the store had failed."""
    monkeypatch.setattr("hpo.engine.STOPPING_STORE_RETRY_S", 0.5)
    monkeypatch.setenv("HPO_GPUS", "")
    path = write_scenario(tmp_path, template_text=TRIAL.replace("{{ nap }}", "30 if {{ trial_number }} else 0"),
                          drop=["parameters.opt"], search={"method": "tpe", "trials": 1}, objective={"held_out": []})
    workdir = tmp_path / "w"
    assert cli.main(["run", str(path), "--workdir", str(workdir)]) == 0
    url = storage_url(load_scenario(path), workdir=workdir)
    rerun = workdir / "trial-0001"

    def interrupt() -> None:
        wait_for(lambda: (rerun / "began").exists())
        holders(url)
        os.kill(os.getpid(), signal.SIGTERM)

    signaller = threading.Thread(target=interrupt)
    signaller.start()
    code = cli.main(["rerun", str(path), "0", "--workdir", str(workdir)])
    signaller.join()
    _, err = capsys.readouterr()
    assert code == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1].startswith("interrupted: stopped while waiting for the study's ask lock, held by ")
    assert err.splitlines()[-1].endswith("; trial 1 could not be recorded and shows RUNNING until the study is resumed, "
                                         "which records it from the trial folder and runs it again; other running "
                                         "trials were recorded INTERRUPTED and queued again; run the same command to "
                                         "resume")
