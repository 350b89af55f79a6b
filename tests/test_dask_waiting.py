"""A sweep on a Dask cluster says what it waits for: trials that no connected worker can run
(none is connected, or none offers the resources a trial takes), once, after they waited
``NO_WORKER_S``; real ``dask scheduler`` and ``dask worker`` processes."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import WriteScenario, cli_env, run_hpo, run_hpo_process
from distributed import Client
from test_dask import Control, LocalDask, Running, held, own_cluster, trial_spec, wait_for

from hpo import dask_executor
from hpo.dask_executor import DaskExecutor
from hpo.errors import InputError
from hpo.outcome import Outcome
from hpo.render import LOG_FILE
from hpo.scenario import Resources

__all__ = ["own_cluster"]  # the fixture, shared with tests/test_dask.py


@pytest.fixture(autouse=True)
def quick_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dask_executor, "NO_WORKER_S", 0.5)


def test_trials_no_worker_can_run_are_named_once(own_cluster: LocalDask, tmp_path: Path) -> None:
    """Each trial takes a GPU; the two workers offer none."""
    said: list[str] = []
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(),
                            offered=("GPU",), scheduler_lost_s=10, say=said.append)
    try:
        run = Running(executor, trial_spec(tmp_path, "print('val_error=0.5')\n", "unfit"), Control())
        wait_for(lambda: said, "the sweep waited without a word", 10)
        time.sleep(2.5)
        run.control.stopping = True
        run.thread.join(20)
    finally:
        executor.close()
    assert said == [(f"hpo: no Dask worker of the scheduler at {own_cluster.address} can run a trial: each takes GPU=1 "
                    "of a worker's Dask resources, and the 2 workers connected offer at most GPU=0; 1 trial waits for "
                    f"a worker that can (dask worker {own_cluster.address} --resources GPU=1 on a machine that has "
                    "them)")]
    assert run.error is None and (run.result.outcome, run.result.duration_s) == (Outcome.INTERRUPTED, 0.0)


def test_a_scheduler_without_workers_is_named_and_a_worker_that_joins_runs_the_trial(tmp_path: Path) -> None:
    dask = LocalDask(tmp_path / "dask")
    said: list[str] = []
    executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10, say=said.append)
    try:
        run = Running(executor, trial_spec(tmp_path, "print('val_error=0.5')\n", "no-worker"), Control())
        wait_for(lambda: said, "the sweep waited without a word", 10)
        dask.worker("late", 1)
        run.thread.join(30)
    finally:
        executor.close()
        dask.close()
    assert said == [f"hpo: no Dask worker is connected to the scheduler at {dask.address}: 1 trial waits for one"]
    assert run.error is None and (run.result.outcome, run.result.value) == (Outcome.COMPLETE, 0.5)


def test_the_hint_names_the_resources_a_trial_takes_and_an_unfit_worker_that_joins_is_said(tmp_path: Path) -> None:
    """The workers that offered CPU=2 are gone: the hint said 'dask worker ADDR', and a worker
    started so (offering no CPU) could never run the trial while the notice still said that no
    worker was connected."""
    dask = LocalDask(tmp_path / "dask")
    said: list[str] = []
    executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), Resources(), offered=("CPU",),
                            scheduler_lost_s=10, say=said.append, no_worker_hint=f"start one: dask worker {dask.address}")
    try:
        run = Running(executor, trial_spec(tmp_path, "print('val_error=0.5')\n", "unfit-later"), Control())
        wait_for(lambda: said, "the sweep waited without a word", 10)
        dask.worker("plain", 1)
        wait_for(lambda: len(said) > 1, "the unfit worker was not said", 10)
        run.control.stopping = True
        run.thread.join(20)
    finally:
        executor.close()
        dask.close()
    assert said == [(f"hpo: no Dask worker is connected to the scheduler at {dask.address}: 1 trial waits for one "
                    f"(start one: dask worker {dask.address} --resources CPU=1)"),
                    (f"hpo: no Dask worker of the scheduler at {dask.address} can run a trial: each takes CPU=1 of a "
                    "worker's Dask resources, and the 1 worker connected offers at most CPU=0; 1 trial waits for a "
                    f"worker that can (dask worker {dask.address} --resources CPU=1 on a machine that has them)")]


def test_hpo_run_says_when_no_worker_offers_what_a_trial_takes(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The user's path: gpus_per_trial 4 on a cluster whose worker offers GPU=2."""
    dask = LocalDask(tmp_path / "dask")
    try:
        dask.worker("gpu", 1, gpus="0,1", resources="GPU=2")
        path = write_scenario(tmp_path, resources={"gpus_per_trial": 4})
        run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", dask.address],
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        assert run.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(run.stdout or ()), daemon=True)
        reader.start()
        try:
            wait_for(lambda: len(lines) >= 2, "hpo run waited without a word", 20)
            run.send_signal(signal.SIGINT)
            run.wait(30)
            reader.join(10)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    finally:
        dask.close()
    assert lines[1].startswith(f"hpo: no Dask worker of the scheduler at {dask.address} can run a trial: each takes "
                               "GPU=4 of a worker's Dask resources, and the 1 worker connected offers at most GPU=2;")
    assert run.returncode == 130, lines


def test_a_batch_job_that_cannot_be_submitted_stops_the_sweep_in_one_line(tmp_path: Path,
                                                                          write_scenario: WriteScenario) -> None:
    """sbatch refuses the job (a wrong partition): hpo says so and stops, the trials waiting
    go back to WAITING; no traceback, no wait for a job that never comes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    path = write_scenario(tmp_path, resources={"cluster": {"kind": "slurm", "jobs": 1, "cores": 1, "memory": "1GB",
                                                           "queue": "gpu"}})
    done = run_hpo_process("run", path, timeout=60, extra_env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 1, done.stderr
    assert "hpo: a batch job could not be submitted: sbatch: error: invalid partition specified: gpu\n" in done.stdout
    assert done.stderr.startswith("error: resources.cluster: no batch job could be submitted to run the trials "
                                  "(sbatch: error: invalid partition specified: gpu); ")
    assert "Traceback" not in done.stdout + done.stderr and "UserWarning" not in done.stderr
    rows = run_hpo("export", path)
    assert [line.split(",")[1] for line in rows.stdout.splitlines()[1:]] == ["WAITING"] * 2, rows.stdout


def test_a_failed_submission_beside_a_job_still_pending_does_not_stop_the_sweep(tmp_path: Path,
                                                                                write_scenario: WriteScenario) -> None:
    """jobs: 2; the first job is submitted (it stays pending, as jobs do in a busy queue), the
    second is refused for a passing reason: the sweep says so and waits for the pending job,
    where it stopped at once for want of a job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "submitted"
    (bin_dir / "sbatch").write_text(
        f"#!/bin/sh\nif mkdir {count} 2>/dev/null; then echo 'Submitted batch job 41'; exit 0; fi\n"
        "echo 'sbatch: error: Batch job submission failed: Socket timed out' >&2\nexit 1\n")
    (bin_dir / "scancel").write_text("#!/bin/sh\nexit 0\n")
    for name in ("sbatch", "scancel"):
        (bin_dir / name).chmod(0o755)
    path = write_scenario(tmp_path, resources={"parallel": 2,
                                               "cluster": {"kind": "slurm", "jobs": 2, "cores": 1, "memory": "1GB"}})
    env = {**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(12)  # past the 5 s after which trials waiting with no job coming stopped the sweep
        assert run.poll() is None, run.communicate()
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, out + err
    assert out.count("hpo: a batch job could not be submitted: sbatch: error: Batch job submission failed: "
                     "Socket timed out\n") >= 1, out
    assert "no batch job could be submitted" not in err, err


def test_a_scheduler_that_goes_away_while_the_sweep_waits_for_its_first_worker_is_said_in_one_line(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """It ended with 'error: OSError: Timed out trying to connect to tcp://... after 30 s'."""
    dask = LocalDask(tmp_path / "dask")
    try:
        path = write_scenario(tmp_path)
        env = {**cli_env(), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"}
        run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", dask.address],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert run.stdout is not None
        assert "waiting for a Dask worker to join the scheduler at" in run.stdout.readline()
        dask.client.close()
        dask.scheduler.kill()
        out, err = run.communicate(timeout=60)
    finally:
        dask.close()
    assert run.returncode == 1, out + err
    assert err.startswith(f"error: the Dask scheduler at {dask.address} is gone: it went away while the sweep waited "
                          "for its first worker ("), err
    assert err.count("\n") == 1 and "run the same command to resume" in err, err


def test_the_resources_a_hint_names_are_one_shell_word() -> None:
    """'--resources GPU=1, CPU=2' pasted into a shell gave dask worker a stray argument."""
    assert dask_executor._amounts({"GPU": 1, "CPU": 2.0}) == "GPU=1,CPU=2"


@contextlib.contextmanager
def joined_later(tmp_path: Path, resources: Resources, plan: Callable[[DaskExecutor], None],
                 said: list[str]) -> Iterator[DaskExecutor]:
    """An executor on a cluster of one one-thread worker, planned by ``plan``; then a worker of
    two threads joins (once the block is entered), and the block sees the executor."""
    dask = LocalDask(tmp_path / "dask")
    dask.worker("first", 1)
    executor = DaskExecutor(Client(dask.address, timeout=10, set_as_default=False), resources, offered=(),
                            scheduler_lost_s=10, say=said.append)
    try:
        wait_for(lambda: executor.capacity() == 1, "the first worker did not connect", 10)
        plan(executor)
        dask.worker("later", 2)
        wait_for(lambda: executor.capacity() == 3, "the later worker did not connect", 10)
        yield executor
    finally:
        executor.close()
        dask.close()


def test_workers_that_join_after_the_plan_grow_the_slots(tmp_path: Path) -> None:
    """With resources.parallel: auto, the slots are planned from the workers connected when the
    sweep starts; a worker that joined later sat idle for the whole sweep."""
    said: list[str] = []

    def plan(executor: DaskExecutor) -> None:
        assert len(executor.plan()) == 1 and executor.slots_now() is None

    with joined_later(tmp_path, Resources(), plan, said) as executor:
        wait_for(lambda: said, "the worker that joined was not said", 10)
        assert executor.slots_now() == 3
    assert said == [("hpo: the Dask workers connected now take 3 trials at once: this sweep runs 3 slots "
                    "(resources.parallel: auto)")]


def test_slots_handed_out_to_workers_do_not_grow_and_the_joiner_is_said(tmp_path: Path) -> None:
    """hpo run --workers K --cluster gives each worker a fixed share of the slots planned: the
    sweep said it grew, and it did not."""
    said: list[str] = []
    with joined_later(tmp_path, Resources(), lambda executor: executor.plan(at_least=2, grows=False),
                      said) as executor:
        wait_for(lambda: said, "the worker that joined was not said", 10)
        assert executor.slots_now() is None
        address = executor.address
    assert said == [(f"hpo: the Dask workers connected now take 3 trials at once; this sweep's workers run the 2 slots "
                     f"planned when it started; `hpo worker SCENARIO --cluster {address}` (with this sweep's "
                     "--storage and --workdir) joins it with slots of its own")]


def test_a_set_parallel_does_not_grow(tmp_path: Path) -> None:
    """... and hpo run --workers 2 --cluster beyond the parallel: 1 given is refused, as it is
    on this machine (it ran 2 trials at once)."""
    said: list[str] = []

    def plan(executor: DaskExecutor) -> None:
        with pytest.raises(InputError, match=r"^--workers 2: resources.parallel is 1, and each worker runs"):
            executor.plan(at_least=2, grows=False)
        executor.plan()

    with joined_later(tmp_path, Resources(parallel=1), plan, said) as executor:
        time.sleep(2 * dask_executor.WATCH_S)
        assert executor.slots_now() is None and not said


def test_a_sweep_runs_trials_on_workers_that_join_while_it_runs(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """``hpo run --cluster`` started with one worker of one thread; a worker of two threads
    joins: three trials run at once (of four: the first slot holds the trial it claimed ahead)."""
    dask = LocalDask(tmp_path / "dask")
    dask.worker("first", 1)
    hold = tmp_path / "hold"
    hold.touch()
    path = write_scenario(tmp_path, template_text=held(hold), search={"trials": 4, "seed": 3},
                          resources={"timeout": 60, "parallel": "auto"})
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", dask.address],
                           env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [path.parent / "runs" / "demo" / f"trial-{number:04d}" / LOG_FILE for number in range(4)]
    try:
        wait_for(lambda: "held" in (logs[0].read_text() if logs[0].exists() else ""), "the first trial did not start")
        dask.worker("later", 2)
        wait_for(lambda: sum("held" in (log.read_text() if log.exists() else "") for log in logs) == 3,
                 "three trials did not run at once")
        hold.unlink()
        out, _ = run.communicate(timeout=60)
    finally:
        hold.unlink(missing_ok=True)
        if run.poll() is None:
            run.kill()
            run.wait()
        dask.close()
    assert run.returncode == 0, out
    assert ("hpo: the Dask workers connected now take 3 trials at once: this sweep runs 3 slots "
            "(resources.parallel: auto)") in out
    assert "4/4 trials done: 4 complete." in out
