"""A store on a full disk: one line that says so and names the disk, no flapping while reads
go on answering, a wait for space that ends when a write goes through, and a journal that a
refused write leaves readable. The disk is a real one, a tiny tmpfs, so the errors are the
real ones (SQLite's ``database or disk is full``, ENOSPC); mounting it needs root."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from conftest import Disk, cli_env

from hpo.scenario import load_scenario
from hpo.storage import ask_lock, open_storage
from hpo.store import StudyStore

WriteScenario = Callable[..., Path]


def _wait_until(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.05)


def test_a_full_disk_is_said_once_and_waited_out_until_a_write_goes_through(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, resources={"store_retry": 60}))
    url = f"sqlite:///{disk.mount}/study.db"
    said: list[str] = []
    store = StudyStore(scenario, url, on_outage=said.append)
    disk.fill()
    writer = threading.Thread(target=store.set_study_attr, args=("note", "x" * 10_000))
    writer.start()
    _wait_until(lambda: bool(said))
    for _ in range(10):  # reads answer on a full disk: they end no outage
        assert store.rows() == [] and "note" not in store.user_attrs
        time.sleep(0.1)
    assert writer.is_alive() and len(said) == 1
    assert said[0] == (f"the store {url} cannot be written: database or disk is full (0 bytes free on "
                       f"{disk.mount}); free space there: retrying for up to 60 s")
    disk.free()
    writer.join(30)
    assert not writer.is_alive()
    assert len(said) == 2 and re.fullmatch(rf"the store {re.escape(url)} can be written again after \d+ s", said[1])
    assert store.user_attrs["note"] == "x" * 10_000


def test_a_journal_write_that_the_disk_refuses_part_way_leaves_the_journal_readable(disk: Disk) -> None:
    url = f"journal:{disk.mount}/study.log"
    study = optuna.create_study(storage=open_storage(url), study_name="s")
    disk.fill()  # the journal's last page still has room for the start of a record
    with pytest.raises(OSError, match="No space left on device"):
        study.set_user_attr("big", "x" * 20_000)
    disk.free()
    study.set_user_attr("after", 1)
    assert optuna.load_study(study_name="s", storage=open_storage(url)).user_attrs == {"after": 1}


def test_the_ask_lock_is_taken_and_released_on_a_full_disk(disk: Disk) -> None:
    disk.fill()
    with ask_lock(f"sqlite:///{disk.mount}/study.db"):
        pass


def _run_freed_when_said(path: Path, url: str, disk: Disk, cause: str) -> str:
    """Run ``hpo run`` on the full ``disk``: its first line must say that the store cannot be
    written for ``cause``; then free the disk, and return all it printed once it ended (exit 0)."""
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--storage", url], env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.stdout is not None
    first = run.stdout.readline()
    assert first == (f"hpo: the store {url} cannot be written: {cause} (0 bytes free on {disk.mount}); "
                     "free space there: retrying for up to 60 s\n"), first + run.stdout.read()
    disk.free()
    out = first + run.stdout.read()  # through readline's buffer, which communicate() would skip
    assert run.wait(timeout=60) == 0, out
    return out


def test_hpo_run_on_a_full_disk_waits_for_space_then_runs_the_sweep(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, resources={"store_retry": 60})
    url = f"sqlite:///{disk.mount}/study.db"
    disk.fill()
    out = _run_freed_when_said(path, url, disk, "database or disk is full")
    assert re.search(rf"^hpo: the store {re.escape(url)} can be written again after \d+ s$", out, re.MULTILINE), out
    assert out.count("the store") == 2 and "2/2 trials done: 2 complete" in out, out


def test_hpo_run_stops_with_one_line_when_no_space_comes(disk: Disk, tmp_path: Path,
                                                        write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, resources={"store_retry": 1})
    url = f"sqlite:///{disk.mount}/study.db"
    disk.fill()
    done = subprocess.run([sys.executable, "-m", "hpo", "run", str(path), "--storage", url], env=cli_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert re.fullmatch(rf"error: the store {re.escape(url)} could not be written for \d+ s \(resources.store_retry\): "
                        rf"database or disk is full \(0 bytes free on {re.escape(str(disk.mount))}\); results of "
                        r"finished trials are kept in their folders and recorded on resume\n", done.stderr)


def test_a_study_resumed_on_a_full_disk_waits_for_space_instead_of_calling_its_store_bad_input(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """SQLite cannot make the shared-memory file of WAL mode on a full disk and says only
    'disk I/O error' (SQLITE_IOERR_SHMSIZE): the first contact took that for a bad --storage,
    exit 2; now the store's calls wait for room, as for any full disk."""
    path = write_scenario(tmp_path, search={"trials": 1}, resources={"store_retry": 60})
    url = f"sqlite:///{disk.mount}/study.db"
    first = subprocess.run([sys.executable, "-m", "hpo", "run", str(path), "--storage", url], env=cli_env(),
                           capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    (disk.mount / "study.db-shm").unlink(missing_ok=True)  # as after a reboot: a process that exits unclosed keeps it
    disk.fill()
    out = _run_freed_when_said(path, url, disk, "disk I/O error")
    assert "1/1 trials done: 1 complete." in out, out
