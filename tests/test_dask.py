"""Trials on a Dask cluster: a real ``dask scheduler`` and ``dask worker`` processes on this
machine (one offering two fake GPUs), sweeps across them, pruning, stop requests, timeouts,
a worker killed mid-trial, the scheduler going away; dask-jobqueue job scripts and scaling."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from conftest import WriteScenario, cli_env, run_hpo
from distributed import Client

from hpo.dask_executor import DaskExecutor, Demand, GpuPool, nothing_listens, open_cluster, worker_gpus
from hpo.engine import Sweep, SweepConfig
from hpo.executor import TrialSpec, saved_result
from hpo.jobqueue import TrialAdaptive, job_options, job_script, trials_per_job
from hpo.launch import TOKEN_ENV, Slot
from hpo.outcome import Outcome
from hpo.render import LOG_FILE, TrialFile
from hpo.rows import TrialRow
from hpo.scenario import Cluster, Objective, Resources, load_scenario
from hpo.storage import storage_url
from hpo.store import StudyStore

START_S = 60
TRIAL = """\
import os, time
from hpo.results import report
print("ppid", os.getppid(), "gpus", repr(os.environ["CUDA_VISIBLE_DEVICES"]), "threads", os.environ["OMP_NUM_THREADS"],
      "start", time.time(), flush=True)
time.sleep({{ sleep }})
print("end", time.time(), flush=True)
report(val_error={{ x }}, test_error=1 - {{ x }})
"""
HELD = """\
import os, time
from hpo.results import report
print("held", flush=True)
while os.path.exists("{{ hold }}"):
    time.sleep(0.1)
report(val_error={{ x }})
"""
STEPS = """\
import time
from hpo.results import report
for step in range(200):
    report(step=step, val_error=1.0 / (step + 1))
    time.sleep(0.05)
"""


class LocalDask:
    """A Dask scheduler and workers on this machine, as real processes (killed at teardown)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []
        folder.mkdir(parents=True, exist_ok=True)
        self.address = self._scheduler()
        self.client = Client(self.address, timeout=10, set_as_default=False)

    def _spawn(self, argv: list[str], log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(self.folder / log).open("w"),
                                stdin=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc

    def _scheduler(self) -> str:
        file = self.folder / "scheduler.json"
        self.scheduler = self._spawn([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                      "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                                     "scheduler.log", cli_env())
        deadline = time.monotonic() + START_S
        while not file.exists():
            assert time.monotonic() < deadline and self.scheduler.poll() is None, "the scheduler did not start"
            time.sleep(0.05)
        while True:
            try:
                return str(json.loads(file.read_text())["address"])
            except ValueError:
                time.sleep(0.05)

    def worker(self, name: str, nthreads: int, gpus: str = "", resources: str | None = None) -> None:
        """Start a worker (``gpus``: its HPO_GPUS) and wait until it joined."""
        argv = [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--name", name, "--nthreads",
                str(nthreads), "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
                "--local-directory", str(self.folder / "scratch")]
        self._spawn(argv + (["--resources", resources] if resources else []), f"{name}.log",
                    {**cli_env(), "HPO_GPUS": gpus})
        self.client.wait_for_workers(len(self.pids()) + 1, timeout=START_S)

    def pids(self) -> dict[str, int]:
        """Worker address -> process id."""
        return {address: int(pid) for address, pid in self.client.run(os.getpid).items()}

    def close(self) -> None:
        self.client.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_scheduler_that_starts_within_the_grace_is_waited_for(tmp_path: Path) -> None:
    """A sweep started beside its scheduler finds nothing listening for a moment: that is not
    yet bad input (a wrong port is, once the grace has passed: tests/test_bad_input.py)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
            "--no-dashboard"]
    started: list[subprocess.Popen[bytes]] = []
    later = threading.Timer(1.0, lambda: started.append(subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=(tmp_path / "scheduler.log").open("w"), env=cli_env())))
    later.start()
    began = time.monotonic()
    try:
        assert not nothing_listens(f"tcp://127.0.0.1:{port}")
        assert time.monotonic() - began >= 1.0
    finally:
        later.join()
        started[0].kill()
        started[0].wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDask]:
    """A scheduler, a CPU worker with one thread and a worker with two threads and two fake GPUs."""
    dask = LocalDask(tmp_path_factory.mktemp("dask"))
    try:
        dask.worker("cpu", 1)
        dask.worker("gpu", 2, gpus="0,1", resources="GPU=2")
        yield dask
    finally:
        dask.close()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalDask]:
    """A scheduler of this test alone (the test kills its processes), with two one-thread workers."""
    dask = LocalDask(tmp_path / "dask")
    try:
        dask.worker("w1", 1)
        dask.worker("w2", 1)
        yield dask
    finally:
        dask.close()


def sweep_scenario(write_scenario: WriteScenario, folder: Path, trials: int, sleep: float, **resources: Any) -> Path:
    return write_scenario(folder, template_text=TRIAL, search={"trials": trials, "seed": 3},
                          parameters={"x": {"type": "float", "low": 0.0, "high": 1.0},
                                      "sleep": {"type": "constant", "value": sleep}},
                          resources={"timeout": 60, **resources})


def run_sweep(path: Path, executor: DaskExecutor) -> Sweep:
    scenario = load_scenario(path)
    workdir = path.parent / "work"
    sweep = Sweep(SweepConfig(scenario, f"sqlite:///{path.parent / 'study.db'}", workdir, executor.plan(), 1),
                  executor)
    sweep.prepare()
    sweep.run()
    return sweep


def where(folder: Path) -> dict[str, str]:
    """What a trial's log says: the worker that ran it and the trial's own printed fields."""
    text = (folder / LOG_FILE).read_text()
    header = next(line for line in text.splitlines() if line.startswith("hpo: runs on Dask worker"))
    fields = next(line for line in text.splitlines() if line.startswith("ppid")).split()
    return {"worker": header.split()[5], **dict(zip(fields[::2], fields[1::2]))}


def test_trials_run_inside_the_gpu_worker_on_its_own_gpus(cluster: LocalDask, write_scenario: WriteScenario,
                                                          tmp_path: Path) -> None:
    path = sweep_scenario(write_scenario, tmp_path, trials=4, sleep=1.0, gpus_per_trial=1, parallel="auto")
    executor = open_cluster(Cluster(address=cluster.address), load_scenario(path).resources, timeout=10)
    assert executor.options.restricted == ("GPU",) and len(executor.plan()) == 2
    sweep = run_sweep(path, executor)
    rows = sweep.store.rows()
    assert [row.outcome for row in rows] == [Outcome.COMPLETE] * 4
    pids = cluster.pids()
    seen = [where(Path(row.folder)) for row in rows]
    gpu_worker = next(address for address, info in cluster.client.scheduler_info()["workers"].items()
                      if info["name"] == "gpu")
    assert {s["worker"] for s in seen} == {gpu_worker}
    assert {int(s["ppid"]) for s in seen} == {pids[gpu_worker]}
    assert {s["gpus"] for s in seen} == {"'0'", "'1'"}
    assert {s["threads"] for s in seen} == {str(max(1, len(os.sched_getaffinity(0)) // 2))}
    spans = [(float(s["start"]), float(Path(row.folder, LOG_FILE).read_text().split("end ")[1].split()[0]), s["gpus"])
             for s, row in zip(seen, rows)]
    for a in spans:
        for b in spans:
            if a is not b and a[0] < b[1] and b[0] < a[1]:
                assert a[2] != b[2], "two trials ran on one GPU at once"


def test_fractions_share_a_gpu_and_gpus_per_trial_takes_whole_ones() -> None:
    pool = GpuPool((0, 1))
    assert [pool.take(1, 2) for _ in range(4)] == [(0,), (1,), (0,), (1,)]
    whole = GpuPool((0, 1, 2))
    assert whole.take(2, 1) == (0, 1)
    taken: list[tuple[int, ...]] = []
    waiter = threading.Thread(target=lambda: taken.append(whole.take(2, 1)))
    waiter.start()
    time.sleep(0.2)
    assert taken == []
    whole.give_back((0, 1))
    waiter.join(5)
    assert taken in ([(0, 1)], [(0, 2)], [(1, 2)])
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        whole.take(4, 1)


@pytest.mark.parametrize(("env", "gpus"), [
    ({"HPO_GPUS": "2,3"}, (2, 3)),
    ({"HPO_GPUS": "", "CUDA_VISIBLE_DEVICES": "0,1"}, ()),
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, (4, 5)),
    ({"CUDA_VISIBLE_DEVICES": ""}, ()),
])
def test_a_worker_finds_its_gpus(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], gpus: tuple[int, ...]) -> None:
    for name in ("HPO_GPUS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert worker_gpus() == gpus


@pytest.mark.parametrize(("resources", "demand", "asks", "at_once"), [
    ({}, Demand(1, 1, 1), {"GPU": 1.0, "CPU": 1.0}, 2),
    ({"gpus_per_trial": 2}, Demand(2, 1, 2), {"GPU": 2.0, "CPU": 2.0}, 1),
    ({"gpus_per_trial": 0.25}, Demand(1, 4, 1), {"GPU": 0.25, "CPU": 1.0}, 8),
    ({"processes_per_trial": 4}, Demand(4, 1, 4), {"GPU": 4.0, "CPU": 4.0}, 0),
])
def test_what_a_trial_takes_of_a_worker(resources: dict[str, Any], demand: Demand, asks: dict[str, float],
                                        at_once: int) -> None:
    got = Demand.of(Resources(**resources))
    assert got == demand
    assert got.restrictions(("GPU", "CPU")) == pytest.approx(asks)
    assert got.at_once(16, {"GPU": 2.0, "CPU": 8.0}, ("GPU", "CPU")) == at_once
    assert got.restrictions(()) == {} and got.at_once(3, {}, ()) == 3


class Control:
    """The sweep's side, scripted: prune at ``prune_at``, ask ``end`` once started."""

    def __init__(self, prune_at: int | None = None, end: str | None = None) -> None:
        self.gpus: tuple[int, ...] | None = None
        self.values: list[tuple[int, float]] = []
        self.prune_at = prune_at
        self.end = end

    def started(self, gpus: Any) -> None:
        self.gpus = tuple(gpus)

    def intermediate(self, step: int, value: float) -> bool:
        self.values.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def end_request(self) -> str | None:
        return self.end if self.gpus is not None else None


def trial_spec(folder: Path, code: str, name: str, timeout: float | None = 60) -> TrialSpec:
    """Trial 5 running ``code``; its token is unique, as a trial's is (processes carrying it
    are killed when the trial ends, so two test runs must not share one)."""
    token = f"{name}:{os.getpid()}:{time.monotonic_ns()}"
    return TrialSpec(number=5, params={}, folder=folder / "trial-0005", files=(TrialFile("train.py", code.encode()),),
                     argv=(sys.executable, "train.py"), env={}, slot=Slot(0, (), 1, 1), token=token, timeout=timeout,
                     objective=Objective(metric="val_error"))


@pytest.fixture
def scratch_executor(cluster: LocalDask) -> Iterator[DaskExecutor]:
    """An executor that runs trials in the workers' scratch space, on any worker."""
    executor = DaskExecutor(Client(cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            shared=False, scheduler_lost_s=10)
    yield executor
    executor.close()


def test_without_a_shared_filesystem_the_log_and_result_come_back(scratch_executor: DaskExecutor,
                                                                  tmp_path: Path) -> None:
    code = "".join(f"print('line {i}', 'x' * 2000)\n" for i in range(100)) + "print('val_error=0.5')\n"
    control = Control()
    result = scratch_executor.run(trial_spec(tmp_path, code, "scratch"), control)
    assert (result.outcome, result.value) == (Outcome.COMPLETE, 0.5) and control.gpus in ((), (0,), (1,))
    folder = tmp_path / "trial-0005"
    log = (folder / LOG_FILE).read_text()
    assert f"folder {tmp_path}" not in log and "/hpo-trials/trial-0005-" in log
    assert [line.split()[1] for line in log.splitlines() if line.startswith("line ")] == [str(i) for i in range(100)]
    assert log.rstrip().endswith("val_error=0.5")
    assert saved_result(folder, 5) == result and (folder / "train.py").exists() and not (folder / ".hpo-token").exists()


def test_pruning_stop_requests_and_timeouts_end_remote_trials(scratch_executor: DaskExecutor, tmp_path: Path) -> None:
    start = time.monotonic()
    pruned = Control(prune_at=3)
    result = scratch_executor.run(trial_spec(tmp_path / "a", STEPS, "pruned"), pruned)
    assert result.outcome is Outcome.PRUNED and pruned.values[:3] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    stopped = scratch_executor.run(trial_spec(tmp_path / "b", STEPS, "stopped"), Control(end="stopped"))
    assert (stopped.outcome, stopped.reason) == (Outcome.STOPPED, "stopped by the user")
    timed_out = scratch_executor.run(trial_spec(tmp_path / "c", STEPS, "timeout", timeout=1.0), Control())
    assert timed_out.outcome is Outcome.TIMEOUT
    assert time.monotonic() - start < 25


def tokens_alive(token_prefix: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TOKEN_ENV, "").startswith(token_prefix):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_worker_killed_mid_trial_loses_nothing(own_cluster: LocalDask, write_scenario: WriteScenario,
                                                 tmp_path: Path) -> None:
    path = sweep_scenario(write_scenario, tmp_path, trials=4, sleep=1.5, parallel=2)
    executor = open_cluster(Cluster(address=own_cluster.address), load_scenario(path).resources, timeout=10)
    pids = own_cluster.pids()
    killed: list[int] = []

    def kill_when_a_trial_runs() -> None:
        log = tmp_path / "work" / "trial-0001" / LOG_FILE
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and "ppid" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.05)
        victim = pids[where(log.parent)["worker"]]
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)

    killer = threading.Thread(target=kill_when_a_trial_runs)
    killer.start()
    sweep = run_sweep(path, executor)
    killer.join()
    rows = sweep.store.rows()
    assert len(killed) == 1
    assert next(proc for proc in own_cluster.procs if proc.pid == killed[0]).wait(10) == -signal.SIGKILL
    lost = [row for row in rows if row.outcome is Outcome.LOST]
    assert [row.number for row in lost] == [1] and "Dask worker" in lost[0].reason
    assert sum(row.outcome.own for row in rows) == 4
    assert [row.outcome for row in rows if row.outcome is not Outcome.LOST] == [Outcome.COMPLETE] * 4
    again = [row for row in rows if row.requeue_of == 1]
    assert len(again) == 1 and again[0].params == lost[0].params and again[0].outcome is Outcome.COMPLETE
    assert not any(row.outcome is Outcome.RUNNING for row in rows)
    assert tokens_alive("demo:1:") == []


def test_the_scheduler_going_away_stops_the_sweep_and_a_resume_finishes_it(
        own_cluster: LocalDask, write_scenario: WriteScenario, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    path = write_scenario(tmp_path, template_text=HELD, search={"trials": 3, "seed": 3},
                          parameters={"x": {"type": "float", "low": 0.0, "high": 1.0},
                                      "hold": {"type": "constant", "value": str(hold)}},
                          resources={"timeout": 60, "parallel": 2})
    env = {**cli_env(), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"}
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", own_cluster.address],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = path.parent / "runs" / "demo" / "trial-0000" / LOG_FILE
        deadline = time.monotonic() + START_S
        while "held" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        own_cluster.scheduler.kill()
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, err
    assert err.startswith(f"error: the Dask scheduler at {own_cluster.address} is gone; run the same command to "
                          "resume") and err.count("\n") == 1, err
    states = {row.outcome for row in study_rows(path)}
    assert Outcome.INTERRUPTED in states and Outcome.RUNNING not in states
    hold.unlink()
    fresh = LocalDask(tmp_path / "fresh")
    try:
        fresh.worker("w", 2)
        done = run_hpo("run", path, "--cluster", fresh.address, timeout=120)
    finally:
        fresh.close()
    assert done.returncode == 0, done.stderr
    rows = study_rows(path)
    assert sum(row.outcome is Outcome.COMPLETE for row in rows) == 3
    assert {row.outcome for row in rows} == {Outcome.COMPLETE, Outcome.INTERRUPTED}


def study_rows(path: Path) -> list[TrialRow]:
    """The rows of the study that ``hpo run`` keeps beside ``path``."""
    scenario = load_scenario(path)
    return StudyStore(scenario, storage_url(scenario, None, scenario.default_workdir()), create=False).rows()


SLURM = Cluster(kind="slurm", jobs=4, cores=8, memory="32GB", gpus=2, walltime="02:00:00", queue="gpu",
                account="proj7", job_extra=("--constraint=a100",), setup=("source ~/venv/bin/activate",))


def test_slurm_job_script() -> None:
    script = job_script(SLURM)
    for line in ("#SBATCH -p gpu", "#SBATCH -A proj7", "#SBATCH --cpus-per-task=8", "#SBATCH -t 02:00:00",
                 "#SBATCH --gres=gpu:2", "#SBATCH --constraint=a100", "source ~/venv/bin/activate"):
        assert line in script.splitlines(), line
    worker = script.splitlines()[-1]
    assert f"{sys.executable} -m distributed.cli.dask_worker tcp://" in worker
    assert worker.endswith("--resources CPU=8,GPU=2") and "--nthreads 8" in worker


def test_pbs_job_script() -> None:
    spec = Cluster(kind="pbs", cores=4, memory="16GB", gpus=1, walltime="01:00:00", queue="workq", account="p2",
                   setup=("module load cuda",))
    script = job_script(spec)
    for line in ("#PBS -q workq", "#PBS -A p2", "#PBS -l select=1:ncpus=4:ngpus=1:mem=15GB",
                 "#PBS -l walltime=01:00:00", "module load cuda"):
        assert line in script.splitlines(), line
    assert script.rstrip().endswith("--resources CPU=4,GPU=1")


def test_validate_prints_the_job_script(write_scenario: WriteScenario, tmp_path: Path) -> None:
    path = write_scenario(tmp_path, resources={"cluster": SLURM.model_dump(exclude_defaults=True)})
    done = run_hpo("validate", path)
    assert done.returncode == 0, done.stderr
    assert "up to 4 slurm jobs" in done.stdout and "#SBATCH --gres=gpu:2" in done.stdout


@pytest.mark.parametrize(("kind", "extra", "options"), [
    ("sge", {"account": "p", "gpus": 1}, {"project": "p", "job_extra_directives": ["-l gpu=1"]}),
    ("lsf", {"gpus": 2}, {"job_extra_directives": ['-gpu "num=2"']}),
    ("htcondor", {"disk": "10GB", "gpus": 1, "job_extra": ("+MaxRuntime = 3600",)},
     {"disk": "10GB", "job_extra_directives": {"+MaxRuntime": "3600", "request_gpus": "1"}}),
])
def test_other_batch_schedulers(kind: str, extra: dict[str, Any], options: dict[str, Any]) -> None:
    got = job_options(Cluster(kind=kind, cores=4, memory="8GB", **extra))
    assert {key: got[key] for key in options} == options


@pytest.mark.parametrize(("cluster", "resources", "per_job"), [
    ({"cores": 8, "gpus": 4}, {}, 4),
    ({"cores": 8, "gpus": 4}, {"gpus_per_trial": 0.5}, 8),
    ({"cores": 2, "gpus": 4}, {"gpus_per_trial": 0.5}, 2),
    ({"cores": 8, "gpus": 4}, {"gpus_per_trial": 2}, 2),
    ({"cores": 8}, {"processes_per_trial": 2}, 4),
    ({"cores": 1, "gpus": 1}, {"gpus_per_trial": 2}, 0),
])
def test_trials_per_job(cluster: dict[str, Any], resources: dict[str, Any], per_job: int) -> None:
    assert trials_per_job(Cluster(kind="slurm", memory="8GB", **cluster), Resources(**resources)) == per_job


@pytest.mark.parametrize(("value", "error"), [
    ("tcp://a b:1", "resources.cluster.address: expected a Dask scheduler address"),
    ({"kind": "slurm", "cores": 4}, "resources.cluster.memory: required for batch jobs (kind slurm)"),
    ({"kind": "slurm", "cores": 4, "memory": "lots"}, "resources.cluster.memory: expected an amount"),
    ({"kind": "pbs", "cores": 4, "memory": "4GB", "quue": "x"}, "resources.cluster.quue: unknown key (did you"),
    ({"address": "tcp://h:1", "cores": 4}, "resources.cluster.cores: describes batch jobs"),
    ({"kind": "htcondor", "cores": 4, "memory": "4GB"}, "resources.cluster.disk: required for HTCondor jobs"),
    ({"kind": "k8s", "cores": 4, "memory": "4GB"}, "resources.cluster.kind: Input should be 'slurm'"),
    (3, "resources.cluster: expected a Dask scheduler address or a mapping"),
])
def test_bad_cluster_settings_are_named(write_scenario: WriteScenario, tmp_path: Path, value: Any,
                                        error: str) -> None:
    from hpo.errors import InputError

    with pytest.raises(InputError, match=None) as caught:
        load_scenario(write_scenario(tmp_path, resources={"cluster": value}))
    assert error in str(caught.value)


def test_adaptive_scaling_follows_the_trials_left() -> None:
    scheduler = SimpleNamespace(tasks={})
    adaptive = TrialAdaptive(SimpleNamespace(scheduler=scheduler), per_job=2, interval=0)
    for states, jobs in ([], 0), (["queued"] * 3, 2), (["processing", "memory", "no-worker"], 1), (["memory"], 0):
        scheduler.tasks = {str(i): SimpleNamespace(state=state) for i, state in enumerate(states)}
        assert asyncio.run(adaptive.target()) == jobs
