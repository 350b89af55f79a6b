"""A process stopped (SIGSTOP, Ctrl-Z) while it holds the study's ask lock: commands that only
read do not wait for it, and a sweep that has to wait says who holds the lock and how to
resume it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import cli_env

from hpo.errors import StoreUnavailable
from hpo.scenario import load_scenario
from hpo.storage import LOCK_WAIT_NOTED_S, ask_lock, storage_url

HOLDER = """\
import os, signal, sys
from hpo.storage import ask_lock
with ask_lock(sys.argv[1]):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.fixture
def stopped_holder(tmp_path: Path, write_scenario: Callable[..., Path],
                   run_cli: Callable[..., subprocess.CompletedProcess[str]]) -> Iterator[tuple[Path, int]]:
    """A study of one finished trial, and the id of a stopped process that holds its ask lock."""
    path = write_scenario(tmp_path, search={"trials": 1})
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, storage_url(load_scenario(path))], env=cli_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        deadline = time.monotonic() + 10
        while psutil.Process(holder.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield path, holder.pid
    finally:
        holder.kill()  # SIGKILL ends a stopped process too
        holder.wait(10)


def test_reading_commands_do_not_wait_for_a_stopped_lock_holder(
        stopped_holder: tuple[Path, int], run_cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    path, _ = stopped_holder
    for command in ("status", "export", "best"):
        began = time.monotonic()
        result = run_cli(command, path, cwd=path.parent, timeout=30)
        assert result.returncode == 0, result.stderr
        assert time.monotonic() - began < LOCK_WAIT_NOTED_S, command


def test_a_sweep_that_waits_for_a_stopped_lock_holder_names_it_and_goes_on_once_it_resumes(
        stopped_holder: tuple[Path, int]) -> None:
    path, pid = stopped_holder
    path.write_text(path.read_text().replace("trials: 1", "trials: 2"))
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path)], cwd=path.parent, env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        said = f"process {pid} on this machine, which is stopped (SIGSTOP or Ctrl-Z): `kill -CONT {pid}` resumes it"
        lines = []
        while not lines or said not in lines[-1]:
            line = run.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert lines[-1] == f"hpo: this worker has waited {LOCK_WAIT_NOTED_S:.0f} s for the study's ask lock, held " \
                            f"by {said}; waiting for it\n"
        os.kill(pid, signal.SIGCONT)
        out, err = run.stdout.read(), run.stderr.read()  # through readline's buffer, which communicate() skips
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err
    assert "2/2 trials done: 2 complete" in out


def test_a_wait_for_the_lock_ends_when_the_sweep_gives_up(stopped_holder: tuple[Path, int]) -> None:
    """A sweep stopped (SIGINT, SIGTERM) while a slot waits for a stopped holder's lock ends."""
    path, _ = stopped_holder
    began = time.monotonic()
    waiting = ask_lock(storage_url(load_scenario(path)), give_up=lambda: time.monotonic() - began > 0.3)
    with pytest.raises(StoreUnavailable, match="the sweep is stopping; it waited for the study's ask lock"):
        waiting.__enter__()
    assert time.monotonic() - began < 2
