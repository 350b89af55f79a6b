"""Trial folders on a full disk: no traceback, one line naming the file and the room left, a
wait for space that ends when a trial's files are written again, and nothing lost or counted
against the budget. The disk is a real one, a tiny tmpfs (:class:`conftest.Disk`), so the
errors are the real ones; mounting it needs root."""
from __future__ import annotations

import csv
import io
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
from conftest import Disk, cli_env, run_hpo, run_hpo_process

from hpo.engine import _FullFolders
from hpo.render import FolderFull
from hpo.scheduler import RUN_AGAIN_LIMIT

WriteScenario = Callable[..., Path]

FILL = """\
import os
x = {{{{ x }}}}
{before}
if {fills}:  # it fills the disk, as a runaway checkpoint would
    fd = os.open("{mount}/filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\\0" * 4096)
    except OSError:
        pass
{after}
"""
REPORT = 'print(f"val_error={x / 2}")'
# the report, then a wait until hpo has logged it: the disk filled after it cannot refuse its line
REPORT_LOGGED = REPORT[:-1] + """, flush=True)
import threading
import time
while "val_error" not in open("trial.log").read():
    time.sleep(0.01)"""
PLAIN = "x = {{ x }}\n" + REPORT + "\n"
FIRST_TRIAL = "{{ trial_number }} == 0"


def _filling(disk: Disk, before: str = "", after: str = "", fills: str = FIRST_TRIAL) -> str:
    """A template whose trials that ``fills`` says fill ``disk`` (the first, by default)."""
    return FILL.format(mount=disk.mount, before=before, after=after, fills=fills)


def _scenario(folder: Path, write_scenario: WriteScenario, trials: int, template: str, store_retry: float = 60,
              parallel: int = 1) -> Path:
    return write_scenario(folder, template_text=template, drop=["parameters.opt"],
                          search={"trials": trials}, objective={"held_out": []},
                          resources={"store_retry": store_retry, "parallel": parallel})


def _start(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpo", "run", *map(str, args)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _free_when_said(run: subprocess.Popen[str], disk: Disk, said: str) -> tuple[str, str]:
    """Read ``run``'s output until a line starts with ``said``, free the disk, and return
    all that it printed (stdout, stderr) once it ended."""
    assert run.stdout is not None
    lines = []
    while not (lines and lines[-1].startswith(said)):
        line = run.stdout.readline()
        assert line, "".join(lines) + run.communicate(timeout=30)[1]
        lines.append(line)
    disk.free()
    out = run.stdout.read()  # through the buffer that readline filled: communicate() would skip what it holds
    assert run.stderr is not None
    err = run.stderr.read()
    run.wait(timeout=60)
    return "".join(lines) + out, err


def _rows(scenario: Path, *args: str | Path) -> list[tuple[str, ...]]:
    exported = run_hpo("export", scenario, *args)
    assert exported.returncode == 0, exported.stderr
    return [(row["number"], row["state"], row["reason"]) for row in csv.DictReader(io.StringIO(exported.stdout))]


def test_files_that_a_full_disk_refuses_wait_for_room_and_the_trial_then_runs(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Before a trial starts, its files cannot be written: it keeps its claim (WAITING), and
    runs once there is room. A workdir that a full disk left unmarked is marked later."""
    scenario = _scenario(tmp_path, write_scenario, 1, PLAIN)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    disk.fill()
    run = _start(scenario, "--workdir", workdir, "--storage", store)
    out, err = _free_when_said(run, disk, "hpo: cannot write")
    assert (run.returncode, err) == (0, ""), out + err
    said = (f"hpo: cannot write {workdir}/trial-0000/train.py: No space left on device (0 bytes free on "
            f"{disk.mount}); free space there and the sweep goes on: trials wait for room for up to 60 s\n")
    assert said in out and out.count("cannot write") == 1, out
    assert re.search(rf"^hpo: the trial folders in {workdir} can be written again after \d+ s$", out, re.MULTILINE)
    assert "1/1 trials done: 1 complete." in out, out
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [("0", "COMPLETE", "")]
    again = run_hpo("run", scenario, "--workdir", workdir, "--storage", store)
    assert again.returncode == 0, again.stderr
    assert (workdir / ".hpo-study").read_text().startswith("demo\n")


def test_a_trial_whose_log_a_full_disk_refuses_is_interrupted_and_runs_again(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The default layout, study and trial folders on one disk: the trial ended at once is
    recorded INTERRUPTED, not FAIL (the disk is no fault of its own), and its configuration
    runs again once there is room; the budget counts the run that completed."""
    scenario = _scenario(tmp_path, write_scenario, 1, _filling(disk, after=REPORT))
    workdir = disk.mount / "w"
    run = _start(scenario, "--workdir", workdir)
    out, err = _free_when_said(run, disk, "hpo: cannot write")
    assert (run.returncode, err) == (0, ""), out + err
    line = f"cannot write {workdir}/trial-0000/trial.log: No space left on device (0 bytes free on {disk.mount})"
    assert f"hpo: {line}; free space there and the sweep goes on: trials wait for room for up to 60 s\n" in out
    assert "1/1 trials done: 1 complete; also 1 interrupted" in out, out
    assert _rows(scenario, "--workdir", workdir) == [("0", "INTERRUPTED", f"interrupted: {line}; it runs again"),
                                                     ("1", "COMPLETE", "")]


def test_a_trial_whose_files_fill_the_disk_each_time_it_runs_fails_the_third_time(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Its configuration ran again each time space was freed, with no bound (as a trial that
    kills its worker did before losses were bounded): now the third time is a FAIL that says so,
    not run again, and the sweep moves on."""
    scenario = _scenario(tmp_path, write_scenario, 1, _filling(disk, after=REPORT, fills="True"), store_retry=10)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    run = _start(scenario, "--workdir", workdir, "--storage", store)
    assert run.stdout is not None and run.stderr is not None
    out = ""
    for line in run.stdout:  # the disk is freed each time it is said full, RUN_AGAIN_LIMIT times at most
        out += line
        if line.startswith("hpo: cannot write") and out.count("hpo: cannot write") <= RUN_AGAIN_LIMIT:
            disk.free()
    err = run.stderr.read()
    assert (run.wait(timeout=60), err) == (1, ("error: study demo: no trial completed: all 3 ended otherwise "
                                               "(2 INTERRUPTED, 1 FAIL); hpo status gives their reasons\n")), out + err
    assert "1/1 trials done: 1 failed; also 2 interrupted" in out, out
    full = [f"cannot write {workdir}/trial-{n:04d}/trial.log: No space left on device (0 bytes free on {disk.mount})"
            for n in range(RUN_AGAIN_LIMIT)]
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [
        ("0", "INTERRUPTED", f"interrupted: {full[0]}; it runs again"),
        ("1", "INTERRUPTED", f"interrupted: {full[1]}; it runs again"),
        ("2", "FAIL", f"its files filled the disk 3 times: {full[2]}")]


def test_a_result_that_a_full_disk_keeps_out_of_result_json_is_recorded_all_the_same(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The trial ended on its own: its result, in memory, is recorded in the store (the file
    is only its backup), and is not run again; the next trial waits for room."""
    template = _filling(disk, before=REPORT_LOGGED)
    scenario = _scenario(tmp_path, write_scenario, 2, template)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    run = _start(scenario, "--workdir", workdir, "--storage", store)
    out, err = _free_when_said(run, disk, "hpo: cannot write")
    assert (run.returncode, err) == (0, ""), out + err
    assert f"hpo: cannot write {workdir}/trial-0000/result.json: No space left on device" in out, out
    assert re.search(r"^trial 0 COMPLETE in [0-9.]+ s: val_error=", out, re.MULTILINE), out
    assert "2/2 trials done: 2 complete." in out, out
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [("0", "COMPLETE", ""), ("1", "COMPLETE", "")]
    assert not (workdir / "trial-0000" / "result.json").exists()


def test_a_disk_that_stays_full_stops_the_sweep_with_one_line_and_it_resumes(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = _scenario(tmp_path, write_scenario, 2, PLAIN, store_retry=1)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    disk.fill()
    began = time.monotonic()
    done = run_hpo("run", scenario, "--workdir", workdir, "--storage", store)
    assert time.monotonic() - began < 20
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.fullmatch(rf"error: the trial folders could not be written for \d+ s \(resources.store_retry\): cannot "
                        rf"write {workdir}/trial-0000/train.py: No space left on device \(0 bytes free on {disk.mount}\)"
                        r"; run the same command to resume \(trials that were running were recorded INTERRUPTED and "
                        r"run again\)\n", done.stderr)
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [("0", "WAITING", ""), ("1", "WAITING", "")]
    disk.free()
    resumed = run_hpo("run", scenario, "--workdir", workdir, "--storage", store)
    assert resumed.returncode == 0, resumed.stderr
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [("0", "COMPLETE", ""), ("1", "COMPLETE", "")]


def test_worker_logs_that_a_full_disk_refuses_wait_for_room_and_every_worker_runs_on(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """hpo run --workers 2 writes its workers' logs: on a full disk it stopped at once with
    'error: OSError: [Errno 28] No space left on device' (and a worker whose own log writes
    failed died, its log unable to say why). Now that is said in one line, the logs' lines wait
    for room, and the workers' notices (their trial folders wait for room) reach the screen."""
    scenario = _scenario(tmp_path, write_scenario, 2, PLAIN, parallel=2)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    disk.fill()
    run = _start(scenario, "--workdir", workdir, "--storage", store, "--workers", "2")
    out, err = _free_when_said(run, disk, "hpo: worker-")
    assert (run.returncode, err) == (0, ""), out + err
    assert out.startswith(f"hpo: cannot write {workdir}/worker-0.log: No space left on device (0 bytes free on "
                          f"{disk.mount}); the workers' output waits for room (the sweep goes on)\n"), out
    assert re.search(rf"^hpo: worker-[01]: cannot write {workdir}/trial-000[01]/train.py: No space left on device ",
                     out, re.MULTILINE), out
    assert f"hpo: the worker logs in {workdir} can be written again\n" in out, out
    assert "2/2 trials done: 2 complete." in out and "Traceback" not in out, out
    assert _rows(scenario, "--workdir", workdir, "--storage", store) == [("0", "COMPLETE", ""), ("1", "COMPLETE", "")]
    logs = [(workdir / f"worker-{index}.log").read_text() for index in (0, 1)]
    assert all(log.startswith(f"--- hpo worker {index} started") and "2/2 trials done" in log
               for index, log in enumerate(logs)), logs
    assert "hpo: cannot write " in "".join(logs), logs


def _swept_store(disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> tuple[Path, str]:
    """(scenario, store URL) of a one-trial sweep run to its end with its store on ``disk``,
    the store's row cache deleted: hpo status would answer from it, the store unopened."""
    scenario = _scenario(tmp_path, write_scenario, 1, PLAIN)
    store = f"sqlite:///{disk.mount / 'study.db'}"
    assert run_hpo_process("run", scenario, "--storage", store).returncode == 0  # its exit closes the store
    for cache in disk.mount.glob("*.hpo-rows.json"):
        cache.unlink()
    return scenario, store


def test_reading_a_store_whose_disk_is_full_fails_at_once(disk: Disk, tmp_path: Path,
                                                          write_scenario: WriteScenario) -> None:
    """hpo status and hpo export of an SQLite store on a full disk, which no sweep holds open,
    said the store 'cannot be written', retried for store_retry (300 s) and exited 1: opening
    it needs room for SQLite's shared-memory file, which no waiting makes."""
    scenario, store = _swept_store(disk, tmp_path, write_scenario)
    # A process that ends without closing the store leaves its -wal and -shm files (then reading
    # needs no room: see the next test); the last connection to close removes them.
    with closing(sqlite3.connect(disk.mount / "study.db")) as database:
        database.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert sorted(path.name for path in disk.mount.iterdir()) == ["study.db", "study.db.hpo-lock"]
    disk.fill()
    for command in ("status", "export"):
        began = time.monotonic()
        read = run_hpo(command, scenario, "--storage", store)
        assert time.monotonic() - began < 30 and read.returncode == 1, read.stderr
        assert re.fullmatch(rf"error: the store {re.escape(store)} cannot be used here: .* \(0 bytes free on "
                            rf"{disk.mount}\); free space there\n", read.stderr), read.stderr


def test_a_store_on_a_full_disk_whose_shared_memory_file_is_left_is_read(disk: Disk, tmp_path: Path,
                                                                         write_scenario: WriteScenario) -> None:
    """A store whose -wal and -shm files a process left when it ended (as one killed, or one
    whose connection was never closed, does) needs no room to be read: hpo status answers."""
    scenario, store = _swept_store(disk, tmp_path, write_scenario)
    leave = "import os, sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('SELECT 1 FROM trials').fetchall(); os._exit(0)"
    subprocess.run([sys.executable, "-c", leave, str(disk.mount / "study.db")], check=True)
    assert {"study.db-wal", "study.db-shm"} <= {path.name for path in disk.mount.iterdir()}
    disk.fill()
    read = run_hpo("status", scenario, "--storage", store)
    assert read.returncode == 0 and "1/1 trials done: 1 complete." in read.stdout, read.stdout + read.stderr


def test_an_empty_workdir_marker_left_by_a_full_disk_marks_no_study(tmp_path: Path,
                                                                      write_scenario: WriteScenario) -> None:
    """Markers were once written in place: a full disk left an empty one, and the workdir was
    refused for good ('holds the trial folders of study ;')."""
    scenario = _scenario(tmp_path, write_scenario, 1, PLAIN)
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / ".hpo-study").write_text("")
    done = run_hpo("run", scenario, "--workdir", workdir)
    assert done.returncode == 0, done.stderr
    assert (workdir / ".hpo-study").read_text().startswith("demo\n")



def test_a_trial_whose_templates_fail_is_recorded_failed_though_its_folder_cannot_say_why(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Trial 1's templates do not render for its values (its own fault: FAIL); the disk, full
    since trial 0, keeps the why out of its folder, and the store records it all the same."""
    template = _filling(disk, before=REPORT_LOGGED, after="{% if trial_number == 1 %}{{ missing }}{% endif %}")
    scenario = _scenario(tmp_path, write_scenario, 2, template)
    workdir, store = disk.mount / "w", f"sqlite:///{tmp_path / 'study.db'}"
    done = run_hpo("run", scenario, "--workdir", workdir, "--storage", store)
    assert (done.returncode, done.stderr) == (0, ""), done.stdout + done.stderr
    assert done.stdout.count("hpo: cannot write") == 1, done.stdout
    rows = _rows(scenario, "--workdir", workdir, "--storage", store)
    assert rows[0] == ("0", "COMPLETE", "") and rows[1][:2] == ("1", "FAIL") and "'missing' is undefined" in rows[1][2]


def test_the_outage_ends_when_a_trial_that_waited_for_room_is_written_not_when_another_is() -> None:
    """On a nearly full disk a small trial's files go through beside a larger one's refused:
    that ended the outage, and the next refusal began another (lines flapped, the deadline
    started over)."""
    said: list[str] = []
    folders = _FullFolders(Path("/w"), 60, said.append)
    stopping = threading.Event()
    stopping.set()  # no pause
    folders.wait(1, FolderFull("cannot write /w/trial-0001/train.py: No space left on device"), 0.2, stopping)
    folders.written(2)
    assert len(said) == 1 and said[0].startswith("cannot write /w/trial-0001/train.py")
    folders.written(1)
    assert len(said) == 2 and said[1].startswith("the trial folders in /w can be written again after ")
    folders.failed(FolderFull("cannot write /w/trial-0003/trial.log: No space left on device"))
    folders.written(4)  # no trial waits: a trial written ends it
    assert len(said) == 4


def test_an_outage_of_the_dask_workers_folders_ends_naming_them_not_this_machines_workdir() -> None:
    """Every Dask worker's own disk full (:class:`hpo.dask_executor.DaskExecutor`): the line
    that ends the wait names the workers' folders, not the sweep's workdir, which was never full."""
    said: list[str] = []
    folders = _FullFolders(Path("/w"), 60, said.append)
    folders.failed(FolderFull("Dask worker tcp://h:1: cannot write /s/train.py: No space left on device",
                              where="the Dask workers' trial folders"))
    folders.written(1)
    assert len(said) == 2 and said[1].startswith("the Dask workers' trial folders can be written again after "), said


def test_worker_output_kept_for_a_full_disk_is_bounded_and_says_what_it_dropped(
        disk: Disk, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that stays full through a long sweep: each worker's output waits in memory only up
    to :data:`hpo.worker_logs.UNWRITTEN_BYTES` (the newest lines), and the line that says the
    logs are written again says how much did not wait."""
    from hpo import worker_logs

    kept = 64 * 1024
    monkeypatch.setattr(worker_logs, "UNWRITTEN_BYTES", kept)
    logs = worker_logs.WorkerLogs(disk.mount)
    disk.fill()
    lines = 2 * kept // 13
    said = [logs.write(0, f"line {i:07d}\n".encode()) for i in range(lines)]
    assert said[0] is not None and said[0].startswith(f"hpo: cannot write {disk.mount}/worker-0.log") \
        and not any(said[1:])
    disk.free()
    again = logs.write(0, b"last\n")
    assert again == (f"hpo: the worker logs in {disk.mount} can be written again ({lines * 13 - kept} bytes of "
                     "their output, the oldest, could not wait: they are not in them)")
    text = logs.path(0).read_bytes()
    assert len(text) == kept + len(b"last\n") and text.endswith(f"line {lines - 1:07d}\nlast\n".encode())


def test_a_sweep_whose_output_file_fills_runs_on_and_status_to_it_says_so_in_one_line(
        disk: Disk, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """``hpo run ... > run.log`` on a disk that fills: the sweep stopped at its first line with
    'error: OSError: [Errno 28] No space left on device', having run nothing. Now its lines are
    dropped, said once on stderr, and every trial is run and recorded; ``hpo status`` and ``hpo
    best`` into such a file say so in one line (exit 1), with no traceback."""
    scenario = _scenario(tmp_path, write_scenario, 3, PLAIN)
    where = ["--workdir", tmp_path / "w", "--storage", f"sqlite:///{tmp_path / 'study.db'}"]
    disk.fill()
    with (disk.mount / "run.log").open("w") as out:
        done = subprocess.run([sys.executable, "-m", "hpo", "run", scenario, *map(str, where)], env=cli_env(),
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("hpo: stdout refuses what this sweep prints (No space left on device): its lines are "
                           "dropped meanwhile; the sweep runs on and records every trial\n")
    assert [state for _, state, _ in _rows(scenario, *where)] == ["COMPLETE"] * 3
    for command in ("status", "best"):
        with (disk.mount / f"{command}.txt").open("w") as out:
            said = subprocess.run([sys.executable, "-m", "hpo", command, scenario, *map(str, where)], env=cli_env(),
                                  stdout=out, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
        assert (said.returncode, said.stderr) == (1, "error: cannot write to stdout: No space left on device\n")


def test_output_dropped_for_a_full_disk_is_told_where_it_is_written_again(disk: Disk) -> None:
    """Once the file takes lines again, it says how many were dropped there (the disk's last
    page takes part of the first refused write)."""
    from hpo.output import DroppedWhenRefused

    told = io.StringIO()
    with (disk.mount / "run.log").open("w") as file:
        out = DroppedWhenRefused(file, "stdout", told)
        out.write("first\n")
        disk.fill()
        for number in range(3):
            out.write(f"trial {number} ended\n" * 2000)  # more than a buffer: the disk refuses it
        disk.free()
        out.write("last\n")
    assert told.getvalue().startswith("hpo: stdout refuses what this sweep prints (No space left on device)")
    first, *kept, note, last = (disk.mount / "run.log").read_text().splitlines()
    dropped = re.fullmatch(r"hpo: (\d+) lines were dropped here while the disk was full", note)
    assert (first, last) == ("first", "last") and dropped, note
    assert all("trial 0 ended".startswith(line) for line in kept)  # the last may be cut short: counted dropped
    assert sum(line == "trial 0 ended" for line in kept) + int(dropped[1]) == 6000
