"""A Dask worker's own full disk, with real ``dask scheduler`` and ``dask worker`` processes
and a real full disk (a tiny tmpfs, :class:`conftest.Disk`; mounting it needs root): one line
that names the worker, the file and the room left on the worker's disk (measured there, not
on the sweep's machine), and only that worker's trials are affected: they run on the other
workers, and the sweep's own slots never wait for room."""
from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Disk, WriteScenario
from distributed import Client
from test_dask import Control, LocalDask, run_sweep, sweep_scenario, trial_spec, where

from hpo.dask_executor import FULL_FIRST_S, DaskExecutor
from hpo.outcome import Outcome
from hpo.render import FolderFull
from hpo.scenario import Resources, load_scenario

TRIAL_FILES = 3  # train.py, params.json, command.txt: a page of the tmpfs each


@pytest.fixture
def full_and_roomy(tmp_path: Path, disk: Disk) -> Iterator[tuple[LocalDask, str, str]]:
    """A scheduler, a worker whose scratch space is on ``disk`` and one whose is not; their addresses."""
    dask = LocalDask(tmp_path / "dask")
    try:
        full = dask.worker("full", 1, scratch=disk.mount)
        roomy = dask.worker("roomy", 1)
        yield dask, full, roomy
    finally:
        dask.close()


def leave_room_for_files(disk: Disk) -> None:
    """Give back just the room of a trial's files: its log is refused (an error that names no file)."""
    filler = disk.mount / "filler"
    os.truncate(filler, filler.stat().st_size - TRIAL_FILES * os.sysconf("SC_PAGE_SIZE"))


@pytest.mark.parametrize(("refused", "file"), [("files", "train.py"), ("log", "trial.log")])
def test_a_workers_full_disk_is_said_as_its_own_and_the_other_worker_runs_the_trials(
        full_and_roomy: tuple[LocalDask, str, str], disk: Disk, write_scenario: WriteScenario, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], refused: str, file: str) -> None:
    """The trial that the full worker refused runs on the other worker at once, and trials are
    kept off the full worker: the sweep runs to its end, with one line naming that worker and
    the room on its own disk (not the sweep's free space, nor the sweep's folder), and none of
    its slots waits for room."""
    dask, full, roomy = full_and_roomy
    disk.fill()
    if refused == "log":
        leave_room_for_files(disk)
    path = sweep_scenario(write_scenario, tmp_path, trials=4, sleep=0.3, parallel=2, store_retry=10)
    said: list[str] = []
    executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), load_scenario(path).resources,
                            offered=(), shared=False, scheduler_lost_s=10, say=said.append)
    began = time.monotonic()
    sweep = run_sweep(path, executor)
    rows = sweep.store.rows()
    assert [row.outcome for row in rows] == [Outcome.COMPLETE] * 4, (rows, said)
    assert {where(Path(row.folder))["worker"] for row in rows} == {roomy}
    line = (rf"hpo: Dask worker {full} \(full, host [^)]+\): cannot write {disk.mount}/\S+/hpo-trials/trial-\d{{4}}-"
            rf"[0-9a-f]+/{file}: No space left on device \(0 bytes free on {disk.mount}\); free space there: "
            r"meanwhile no trial goes to that worker")
    assert [re.fullmatch(line, said_line) is not None for said_line in said] == [True], said
    assert "cannot write" not in capsys.readouterr().out  # the sweep waited for no room of its own
    assert time.monotonic() - began < 30


def test_a_trial_that_every_workers_full_disk_refuses_waits_for_room_as_on_this_machine(
        tmp_path: Path, disk: Disk) -> None:
    """Where no other worker can run it, the trial's full disk is the sweep's to wait out
    (:class:`hpo.render.FolderFull`, as for its own folders); once the worker has room it is
    tried again there, and said so once."""
    dask = LocalDask(tmp_path / "dask")
    said: list[str] = []
    try:
        full = dask.worker("full", 1, scratch=disk.mount)
        disk.fill()
        executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), Resources(), offered=(),
                                shared=False, scheduler_lost_s=10, say=said.append)
        try:
            spec = trial_spec(tmp_path, "print('val_error=0.5')\n", "all-full")
            with pytest.raises(FolderFull) as refused:
                executor.run(spec, Control())
            assert refused.value.result is None and refused.value.where == "the Dask workers' trial folders"
            assert re.fullmatch(rf"Dask worker {full} \(full, host [^)]+\): cannot write {disk.mount}/\S+/train.py: "
                                rf"No space left on device \(0 bytes free on {disk.mount}\); no other Dask worker can "
                                r"run the trial", str(refused.value)), str(refused.value)
            disk.free()
            time.sleep(FULL_FIRST_S)
            result = executor.run(spec, Control())
        finally:
            executor.close()
    finally:
        dask.close()
    assert (result.outcome, result.value) == (Outcome.COMPLETE, 0.5)
    assert len(said) == 2 and said[0].startswith(f"hpo: {str(refused.value).split('; no other')[0]}; free space"), said
    assert re.fullmatch(rf"hpo: Dask worker {full} \(full, host [^)]+\) can write its trial folders again after \d+ s",
                        said[1]), said


FILLS = """\
import os
if os.getcwd().startswith({mount!r}):  # its worker's scratch space, on the small disk: filled as a runaway checkpoint would
    fd = os.open("checkpoint", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\\0" * 4096)
    except OSError:
        pass
print("x" * 8192, flush=True)  # more than the page its log has begun
print("val_error=0.5", flush=True)
"""


def test_a_trial_that_fills_its_workers_disk_is_interrupted_and_names_the_worker(tmp_path: Path, disk: Disk) -> None:
    """Its log refused, the trial ends INTERRUPTED (it runs again), its reason naming the worker
    and the room on the worker's disk, told to the sweep as a full disk that ended it (so it is
    counted); trials are kept off that worker from then on."""
    dask = LocalDask(tmp_path / "dask")
    said: list[str] = []
    try:
        full = dask.worker("full", 1, scratch=disk.mount)
        executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), Resources(), offered=(),
                                shared=False, scheduler_lost_s=10, say=said.append)
        try:
            with pytest.raises(FolderFull) as filled:  # the sweep counts it: the third time, FAIL
                executor.run(trial_spec(tmp_path / "a", FILLS.format(mount=str(disk.mount)), "fills"), Control())
            result = filled.value.result
            assert filled.value.where == f"the trial folders of Dask worker {full} (full, host {socket.gethostname()})"
            with pytest.raises(FolderFull, match="no other Dask worker can run the trial"):
                executor.run(trial_spec(tmp_path / "b", "print('val_error=0.5')\n", "next"), Control())
        finally:
            executor.close()
    finally:
        dask.close()
    line = (rf"Dask worker {full} \(full, host [^)]+\): cannot write {disk.mount}/\S+/trial.log: No space left on "
            rf"device \(0 bytes free on {disk.mount}\)")
    assert result.outcome is Outcome.INTERRUPTED and re.fullmatch(rf"interrupted: {line}; it runs again",
                                                                   result.reason), result
    assert len(said) == 1 and re.fullmatch(rf"hpo: {line}; free space there: meanwhile no trial goes to that worker",
                                           said[0]), said


def test_a_dask_trial_that_fills_its_workers_disk_each_time_fails_the_third_time(
        tmp_path: Path, disk: Disk, write_scenario: WriteScenario) -> None:
    """As on this machine (:data:`hpo.scheduler.RUN_AGAIN_LIMIT`): the worker's disk that the
    trial fills each time it runs (its scratch folder is removed, so there is room again) is
    counted, and the third time the configuration is FAIL (meanwhile the sweep waits, as the
    only worker is kept off for a while after each refusal)."""
    dask = LocalDask(tmp_path / "dask")
    try:
        dask.worker("full", 1, scratch=disk.mount)
        path = write_scenario(tmp_path / "s", template_text=FILLS.format(mount=str(disk.mount)).replace(
                                  "0.5", "{{ x }}"),
                              search={"trials": 1, "seed": 3}, parameters={"x": {"type": "float", "low": 0.0,
                                                                                  "high": 1.0}},
                              resources={"timeout": 60, "store_retry": 30})
        said: list[str] = []
        executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False),
                                load_scenario(path).resources, offered=(), shared=False, scheduler_lost_s=10,
                                say=said.append)
        sweep = run_sweep(path, executor)
    finally:
        dask.close()
    rows = sweep.store.rows()
    assert [row.outcome for row in rows] == [Outcome.INTERRUPTED, Outcome.INTERRUPTED, Outcome.FAIL], rows
    assert rows[2].reason.startswith("its files filled the disk 3 times: Dask worker "), rows[2].reason
