"""Trials on a Dask cluster: a real ``dask scheduler`` and ``dask worker`` processes on this
machine (one offering two fake GPUs), sweeps across them, pruning, stop requests, timeouts,
a worker killed mid-trial, the scheduler going away, addresses where no scheduler answers;
dask-jobqueue job scripts and scaling."""
from __future__ import annotations

import asyncio
import http.server
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

import optuna
import psutil
import pytest
from conftest import WriteScenario, cli_env, run_hpo, run_hpo_process
from distributed import Client, Event, Variable

from hpo import dask_executor
from hpo.dask_executor import (
    DaskExecutor,
    Demand,
    GpuPool,
    SchedulerGone,
    TaskOptions,
    host_threads,
    nothing_listens,
    open_cluster,
    scheduler_identity,
    trial_threads,
    worker_gpus,
)
from hpo.engine import Sweep, SweepConfig, TrialEnd, TrialStart
from hpo.errors import InputError
from hpo.executor import ENDED_AS_LOST, LocalExecutor, TrialControl, TrialSpec, saved_result
from hpo.jobqueue import TrialAdaptive, job_options, job_script, trials_per_job
from hpo.launch import TOKEN_ENV, Slot
from hpo.outcome import Outcome
from hpo.recovery import run_info
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

    def worker(self, name: str, nthreads: int, gpus: str = "", resources: str | None = None,
               scratch: Path | None = None) -> str:
        """Start a worker (``gpus``: its HPO_GPUS; ``scratch``: its local directory) and wait
        until it joined; its address."""
        known = set(self.pids())
        argv = [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--name", name, "--nthreads",
                str(nthreads), "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
                "--local-directory", str(scratch or self.folder / "scratch")]
        self._spawn(argv + (["--resources", resources] if resources else []), f"{name}.log",
                    {**cli_env(), "HPO_GPUS": gpus})
        self.client.wait_for_workers(len(known) + 1, timeout=START_S)
        return next(address for address in self.pids() if address not in known)

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


@pytest.fixture(params=["silent", "ssh", "http"])
def impostor(request: pytest.FixtureRequest) -> Iterator[str]:
    """The address of a TCP listener that is no Dask scheduler: it accepts and says nothing,
    greets as an SSH server, or is an HTTP server."""
    if request.param == "http":
        class Quiet(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                """No line per request on the test's output."""

        web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        thread = threading.Thread(target=web.serve_forever, daemon=True)
        thread.start()
        yield f"tcp://127.0.0.1:{web.server_address[1]}"
        web.shutdown()
        web.server_close()
        return
    greeting = b"SSH-2.0-OpenSSH_8.9p1\r\n" if request.param == "ssh" else b""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at teardown
                return
            accepted.append(conn)
            conn.sendall(greeting)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)
    for conn in accepted:
        conn.close()


def test_an_address_where_no_scheduler_answers_is_bad_input_within_the_connect_timeout(impostor: str) -> None:
    caught: list[BaseException] = []

    def connect() -> None:
        try:
            open_cluster(Cluster(address=impostor), Resources(), timeout=2, field="--cluster").close()
        except BaseException as exc:
            caught.append(exc)

    began = time.monotonic()
    opener = threading.Thread(target=connect, daemon=True)
    opener.start()
    opener.join(20)
    assert not opener.is_alive(), "connecting to a listener that is no Dask scheduler hangs"
    assert len(caught) == 1 and isinstance(caught[0], InputError), caught
    assert str(caught[0]).startswith(f"--cluster: no Dask scheduler answers at {impostor} ("), caught[0]
    assert time.monotonic() - began < 2 + 3


def test_hpo_run_on_an_address_where_no_scheduler_answers_says_so_in_one_line(
        write_scenario: WriteScenario, tmp_path: Path, impostor: str) -> None:
    done = run_hpo_process("run", write_scenario(tmp_path), "--cluster", impostor, timeout=60,
                           extra_env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: --cluster: no Dask scheduler answers at {impostor} (")
    assert done.stderr.count("\n") == 1, done.stderr


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


class Starts:
    """An observer that keeps where each trial started, in words."""

    def __init__(self) -> None:
        self.where: dict[int, str] = {}

    def started(self, start: TrialStart) -> None:
        self.where[start.number] = start.where

    def finished(self, end: TrialEnd) -> None:
        """Nothing to keep."""


def run_sweep(path: Path, executor: DaskExecutor, observer: Starts | None = None) -> Sweep:
    scenario = load_scenario(path)
    workdir = path.parent / "work"
    sweep = Sweep(SweepConfig(scenario, f"sqlite:///{path.parent / 'study.db'}", workdir, executor.plan(), 1),
                  executor)
    sweep.prepare()
    sweep.run(observer)
    return sweep


def where(folder: Path) -> dict[str, str]:
    """What a trial's log says: the worker that ran it and the trial's own printed fields."""
    text = (folder / LOG_FILE).read_text()
    header = next(line for line in text.splitlines() if line.startswith("hpo: runs on Dask worker"))
    fields = next(line for line in text.splitlines() if line.startswith("ppid")).split()
    return {"worker": header.split()[5], **dict(zip(fields[::2], fields[1::2]))}


def test_a_trials_variable_and_events_leave_the_scheduler_when_it_ends(cluster: LocalDask) -> None:
    """A long sweep leaves nothing behind on the scheduler: each trial's Variable and Events are
    dropped as it ends, a cancelled trial's Variable (its worker may still read it) once
    ``LOST_GRACE_S`` has passed or the sweep ends."""
    def held() -> tuple[set[str], set[str]]:
        def names(dask_scheduler: Any) -> tuple[set[str], set[str]]:
            return set(dask_scheduler.extensions["variables"].variables), set(dask_scheduler.extensions["events"]._events)

        variables, events = cluster.client.run_on_scheduler(names)
        return {name for name in variables if "leftover" in name}, {name for name in events if "leftover" in name}

    with Client(cluster.address, timeout=10, set_as_default=False) as client:
        leftovers = dask_executor._Leftovers(client)
        for token in ("leftover-a", "leftover-b"):
            Variable(dask_executor._end_variable(token), client=client).set("")
            Event(dask_executor._asked_event(token), client=client).set()
            Event(dask_executor._start_event(f"{token}-task"), client=client).set()
        assert held() == ({"hpo-end-leftover-a", "hpo-end-leftover-b"}, {
            "hpo-asked-leftover-a", "leftover-a-task-started", "hpo-asked-leftover-b", "leftover-b-task-started"})
        leftovers.forget("leftover-a", ["leftover-a-task"])
        leftovers.forget("leftover-b", ["leftover-b-task"], later=True)
        wait_for(lambda: held() == ({"hpo-end-leftover-b"}, set()), "what the trials left stayed on the scheduler", 5)
        leftovers.drop_all()  # a Variable's delete is sent, not answered
        wait_for(lambda: held() == (set(), set()), "what the trials left stayed on the scheduler", 5)


def test_trials_run_inside_the_gpu_worker_on_its_own_gpus(cluster: LocalDask, write_scenario: WriteScenario,
                                                          tmp_path: Path) -> None:
    path = sweep_scenario(write_scenario, tmp_path, trials=4, sleep=1.0, gpus_per_trial=1, parallel="auto")
    executor = open_cluster(Cluster(address=cluster.address), load_scenario(path).resources, timeout=10)
    assert executor.options.restricted == ("GPU",) and len(executor.plan()) == 2
    starts = Starts()
    sweep = run_sweep(path, executor, starts)
    rows = sweep.store.rows()
    assert [row.outcome for row in rows] == [Outcome.COMPLETE] * 4
    assert sorted(starts.where.values()) == sorted(f"1 process on GPU {row.gpus}" for row in rows), \
        "the sweep says the GPU the worker gave each trial (it said '1 CPU process of 1 thread')"
    pids = cluster.pids()
    seen = [where(Path(row.folder)) for row in rows]
    gpu_worker = next(address for address, info in scheduler_identity(cluster.client)["workers"].items()
                      if info["name"] == "gpu")
    assert {s["worker"] for s in seen} == {gpu_worker}
    assert {int(s["ppid"]) for s in seen} == {pids[gpu_worker]}
    assert {s["gpus"] for s in seen} == {"'0'", "'1'"}
    host_share = len(os.sched_getaffinity(0)) * 2 // 3  # the GPU worker's 2 of its host's 3 worker threads
    assert {s["threads"] for s in seen} == {str(max(1, host_share // 2))}
    spans = [(float(s["start"]), float(Path(row.folder, LOG_FILE).read_text().split("end ")[1].split()[0]), s["gpus"])
             for s, row in zip(seen, rows)]
    for a in spans:
        for b in spans:
            if a is not b and a[0] < b[1] and b[0] < a[1]:
                assert a[2] != b[2], "two trials ran on one GPU at once"


def test_the_scenario_env_sets_a_dask_trials_threads_and_its_log_says_so(own_cluster: LocalDask,
                                                                        write_scenario: WriteScenario,
                                                                        tmp_path: Path) -> None:
    path = sweep_scenario(write_scenario, tmp_path, trials=1, sleep=0.0)
    path.write_text(path.read_text() + "env:\n  OMP_NUM_THREADS: 3\n")
    sweep = run_sweep(path, open_cluster(Cluster(address=own_cluster.address), load_scenario(path).resources,
                                         timeout=10))
    [row] = sweep.store.rows()
    assert row.outcome == Outcome.COMPLETE
    assert where(Path(row.folder))["threads"] == "3"
    assert "CPU process of 3 threads" in Path(row.folder, LOG_FILE).read_text()


def test_the_workers_of_one_host_share_its_threads(cluster: LocalDask) -> None:
    """The module's two workers listen on one host: 1 + 2 threads; an address elsewhere has its own."""
    client = cluster.client
    workers = scheduler_identity(client)["workers"]
    assert len(workers) == 2
    for address, info in workers.items():
        worker = SimpleNamespace(address=address, state=SimpleNamespace(nthreads=info["nthreads"]))
        assert host_threads(client, worker) == 3  # type: ignore[arg-type]
    elsewhere = SimpleNamespace(address="tcp://10.255.0.1:4000", state=SimpleNamespace(nthreads=4))
    assert host_threads(client, elsewhere) == 4  # type: ignore[arg-type]


def test_the_workers_are_read_from_the_scheduler_not_the_clients_cache(cluster: LocalDask,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's periodic refresh leaves a cached identity that lists no worker, and may leave
    it between ``scheduler_info``'s fetch and its return: hpo never reads that cache."""
    client = cluster.client
    monkeypatch.setattr(client, "scheduler_info", lambda *args, **kwargs: {"id": "cached", "workers": {}})
    workers = scheduler_identity(client)["workers"]
    assert len(workers) == 2
    address, info = next(iter(workers.items()))
    worker = SimpleNamespace(address=address, state=SimpleNamespace(nthreads=info["nthreads"]))
    assert host_threads(client, worker) == 3  # type: ignore[arg-type]


@pytest.mark.parametrize(("nthreads", "offered", "host", "processes", "expected"), [
    (4, {}, 4, 1, 4),  # the host's only worker: 16 cores, 4 trials at once
    (4, {}, 16, 1, 1),  # one of four such workers (a LocalCluster): a quarter of the cores
    (2, {}, 3, 2, 2),  # 2 of 3 host threads: 8 of 12 cores, 2 trials at once of 2 processes
    (4, {"CPU": 8.0}, 16, 1, 2),  # a worker that offers cores takes those, whoever shares its host
    (1, {}, 64, 1, 1),  # never below one thread
])
def test_a_dask_trial_takes_its_workers_share_of_the_host(monkeypatch: pytest.MonkeyPatch, nthreads: int,
                                                          offered: dict[str, float], host: int, processes: int,
                                                          expected: int) -> None:
    monkeypatch.setattr(dask_executor, "usable_cores", lambda: 16 if processes == 1 else 12)
    worker = SimpleNamespace(state=SimpleNamespace(nthreads=nthreads, total_resources=offered))
    options = TaskOptions("t", Demand(0, 1, processes), ("CPU",) if offered else (), True, 30.0)
    assert trial_threads(worker, options, host) == expected  # type: ignore[arg-type]


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
    ({"CUDA_VISIBLE_DEVICES": "0,0"}, ()),  # not distinct ids: what nvidia-smi shows (none here)
    ({"CUDA_VISIBLE_DEVICES": "GPU-5e1c0b2a"}, ()),  # a UUID: likewise
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


class Control(TrialControl):
    """The sweep's side, scripted: prune at ``prune_at``, ask ``end`` once started, or
    ``interrupted`` at once when ``stopping`` (the sweep stops). Keeps the values the pruner
    judged and, apart, those it need not judge."""

    def __init__(self, prune_at: int | None = None, end: str | None = None) -> None:
        self.gpus: tuple[int, ...] | None = None
        self.values: list[tuple[int, float]] = []
        self.recorded: list[tuple[int, float]] = []
        self.prune_at = prune_at
        self.end = end
        self.stopping = False

    def started(self, slot: Slot) -> None:
        self.gpus = slot.gpus

    def intermediate(self, step: int, value: float) -> bool:
        self.values.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def record(self, step: int, value: float) -> None:
        self.recorded.append((step, value))

    def end_request(self) -> str | None:
        if self.stopping:
            return "interrupted"
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


def test_pruning_end_requests_and_timeouts_end_remote_trials(scratch_executor: DaskExecutor, tmp_path: Path) -> None:
    start = time.monotonic()
    pruned = Control(prune_at=3)
    result = scratch_executor.run(trial_spec(tmp_path / "a", STEPS, "pruned"), pruned)
    assert (result.outcome, result.reason, result.step) == (Outcome.PRUNED, "pruned at step 3", 3)
    assert pruned.values == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)] and pruned.recorded == []
    assert saved_result(tmp_path / "a" / "trial-0005", 5) == result
    asked_to_stop = Control(end="stopped")
    stopped = scratch_executor.run(trial_spec(tmp_path / "b", STEPS, "stopped"), asked_to_stop)
    assert (stopped.outcome, stopped.reason) == (Outcome.STOPPED, "stopped by the user")
    assert asked_to_stop.values == asked_to_stop.recorded == []  # as on this machine: a trial being stopped reports none
    judged_lost = scratch_executor.run(trial_spec(tmp_path / "d", STEPS, "lost"), Control(end="lost"))  # elsewhere
    assert (judged_lost.outcome, judged_lost.reason) == (Outcome.INTERRUPTED, ENDED_AS_LOST)
    timed_out = scratch_executor.run(trial_spec(tmp_path / "c", STEPS, "timeout", timeout=1.0), Control())
    assert timed_out.outcome is Outcome.TIMEOUT
    assert time.monotonic() - start < 25


def test_a_remote_flood_of_step_values_reaches_the_sweep_whole(scratch_executor: DaskExecutor,
                                                                tmp_path: Path) -> None:
    """Every value reaches the sweep once: judged while the trial runs, recorded after."""
    control = Control()
    flood = "from hpo.results import report\nfor step in range(500):\n    report(step=step, val_error=step)\n" \
            "report(val_error=0.25)\n"
    result = scratch_executor.run(trial_spec(tmp_path, flood, "flood"), control)
    assert (result.outcome, result.value) == (Outcome.COMPLETE, 0.25)
    assert sorted(control.values + control.recorded) == [(step, float(step)) for step in range(500)]


def test_a_trial_pruned_in_its_own_folder_names_the_judged_step_there(cluster: LocalDask, tmp_path: Path) -> None:
    """Its worker wrote the step it ran to when the request came; the judged one stands."""
    executor = DaskExecutor(Client(cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            shared=True, scheduler_lost_s=10)
    try:
        control = Control(prune_at=2)
        result = executor.run(trial_spec(tmp_path, STEPS, "pruned-shared"), control)
    finally:
        executor.close()
    assert (result.outcome, result.reason, result.step) == (Outcome.PRUNED, "pruned at step 2", 2)
    assert control.values == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert saved_result(tmp_path / "trial-0005", 5) == result


STEP_LINES = """\
import time
x = {{ x }}
for step in range(30):
    print(f"step={step} val_error={x + 1.0 / (step + 1):.6f}", flush=True)
    time.sleep(0.05 if x < 0.6 else 0.2)  # those pruned still run when the request reaches their worker
"""


def study_trials(storage: str) -> list[tuple[int, str, str, dict[int, float]]]:
    """Each trial of the study ``demo``: number, state, reason, intermediate values."""
    study = optuna.load_study(study_name="demo", storage=storage)
    return [(t.number, t.state.name, t.user_attrs.get("reason", ""), dict(t.intermediate_values))
            for t in study.get_trials(deepcopy=False)]


def test_a_pruned_sweep_records_on_dask_what_it_records_on_this_machine(cluster: LocalDask,
                                                                        write_scenario: WriteScenario,
                                                                        tmp_path: Path) -> None:
    """Pruned at the step the pruner judged, with no later value in the study, on both paths."""
    path = write_scenario(tmp_path, drop=("search.trials", "parameters.opt"), template_text=STEP_LINES,
                          files={"design.csv": "x\n0.5\n0.9\n0.1\n0.7\n"},
                          search={"method": "csv", "csv": "design.csv", "pruner": "successive_halving"})
    scenario = load_scenario(path)
    recorded = {}
    for name, executor in (("local", LocalExecutor()),
                           ("dask", open_cluster(Cluster(address=cluster.address), scenario.resources, timeout=10))):
        storage = f"sqlite:///{tmp_path / name}.db"
        sweep = Sweep(SweepConfig(scenario, storage, tmp_path / name, (Slot(0, (), 1, 1),), 1), executor)
        sweep.prepare()
        sweep.run()
        recorded[name] = study_trials(storage)
    assert [(state, reason) for _, state, reason, _ in recorded["local"]] == [
        ("COMPLETE", ""), ("PRUNED", "pruned at step 1"), ("COMPLETE", ""), ("PRUNED", "pruned at step 1")]
    assert recorded["dask"] == recorded["local"]


def tokens_alive(token: str) -> list[int]:
    """The processes of this machine that carry the trial token ``token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TOKEN_ENV) == token:
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
    token = next(str(run_info(trial)["token"]) for trial in sweep.store.trials() if trial.number == 1)
    assert tokens_alive(token) == []  # its token: another test's "demo" study may run a trial 1 meanwhile


def held_sweep(tmp_path: Path, write_scenario: WriteScenario, address: str, trials: int,
               parallel: int) -> tuple[Path, Path, subprocess.Popen[str]]:
    """``hpo run --cluster address`` started on a study of HELD trials (each waits while the
    returned ``hold`` file exists); returns the file, the scenario and the running process."""
    hold = tmp_path / "hold"
    hold.touch()
    path = write_scenario(tmp_path, template_text=HELD, search={"trials": trials, "seed": 3},
                          parameters={"x": {"type": "float", "low": 0.0, "high": 1.0},
                                      "hold": {"type": "constant", "value": str(hold)}},
                          resources={"timeout": 60, "parallel": parallel})
    env = {**cli_env(), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"}
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", address],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return hold, path, run


def test_the_scheduler_going_away_stops_the_sweep_and_a_resume_finishes_it(
        own_cluster: LocalDask, write_scenario: WriteScenario, tmp_path: Path) -> None:
    hold, path, run = held_sweep(tmp_path, write_scenario, own_cluster.address, trials=3, parallel=2)
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
    tokens = [str(run_info(trial)["token"]) for trial in study_store(path).trials() if run_info(trial)]
    assert tokens and not [token for token in tokens if tokens_alive(token)], "trials run on without their sweep"
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


def held(hold: Path) -> str:
    """A trial's code that runs while ``hold`` exists, then reports val_error=0.5."""
    return (f"import os, time\nprint('held', flush=True)\nwhile os.path.exists({str(hold)!r}):\n"
            "    time.sleep(0.05)\nprint('val_error=0.5')\n")


def wait_for(condition: Any, what: str, seconds: float = START_S) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Running:
    """``executor.run(spec, control)`` in a thread: its result, or what it raised."""

    def __init__(self, executor: DaskExecutor, spec: TrialSpec, control: Control) -> None:
        self.spec = spec
        self.control = control
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(executor,), daemon=True)
        self.thread.start()

    def _run(self, executor: DaskExecutor) -> None:
        try:
            self.result = executor.run(self.spec, self.control)
        except BaseException as exc:
            self.error = exc

    def log(self) -> str:
        log = self.spec.folder / LOG_FILE
        return log.read_text() if log.exists() else ""


def test_the_scheduler_dying_ends_trials_on_their_workers_and_the_sweep_keeps_what_they_wrote(
        own_cluster: LocalDask, tmp_path: Path) -> None:
    """Trial a completes while the scheduler hangs, then the scheduler is killed while trial b
    runs and trial c waits in Dask's queue: b's worker kills it at once (it does not run on
    unseen), and the sweep's side says how each ended: a COMPLETE (its result.json), b
    INTERRUPTED after the time it ran, c INTERRUPTED after 0 s without having started."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=3, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10)
    holds = {name: tmp_path / f"hold-{name}" for name in "abc"}
    for hold in holds.values():
        hold.touch()
    runs = {name: Running(executor, trial_spec(tmp_path / name, held(hold), f"gone-{name}"), Control())
            for name, hold in holds.items()}
    try:
        # started as the sweep knows it: the start reached its side through the scheduler, not only
        # the trial's log (under load the scheduler can stop while that message is on its way)
        wait_for(lambda: sum("held" in run.log() and run.control.gpus is not None for run in runs.values()) == 2,
                 "two trials did not start")
        queued = next(name for name, run in runs.items() if run.control.gpus is None)
        done, killed = (name for name in "abc" if name != queued)
        own_cluster.scheduler.send_signal(signal.SIGSTOP)
        holds[done].unlink()
        wait_for(lambda: saved_result(runs[done].spec.folder, 5) is not None, "the trial did not complete", 10)
        own_cluster.scheduler.kill()
        began = time.monotonic()
        wait_for(lambda: not tokens_alive(runs[killed].spec.token), "the trial runs on without its scheduler", 10)
        assert time.monotonic() - began < 5
        for run in runs.values():
            run.thread.join(30)
        assert all(isinstance(run.error, SchedulerGone) for run in runs.values()), [r.error for r in runs.values()]
        results = {name: run.error.result for name, run in runs.items()}  # type: ignore[union-attr]
        assert (results[done].outcome, results[done].value) == (Outcome.COMPLETE, 0.5)
        assert results[killed].outcome is Outcome.INTERRUPTED and 0 < results[killed].duration_s < 30
        written = saved_result(runs[killed].spec.folder, 5)
        assert written is not None and written.duration_s == results[killed].duration_s
        assert f"the Dask scheduler at {own_cluster.address} is gone" in results[killed].reason
        assert (results[queued].outcome, results[queued].duration_s) == (Outcome.INTERRUPTED, 0.0)
        assert "before it started" in results[queued].reason and runs[queued].control.gpus is None
    finally:
        for hold in holds.values():
            hold.unlink(missing_ok=True)
        executor.close()


@pytest.mark.parametrize("first", ["queued", "running"])
def test_a_trial_queued_in_dask_when_the_sweep_stops_never_starts(own_cluster: LocalDask, tmp_path: Path,
                                                                  first: str) -> None:
    """Two trials hold both workers, a third waits in Dask's queue; the sweep stops, and the
    first to see it is the queued trial's side (its task is cancelled at once) or a running
    trial's (whose end frees a worker: the queued trial must not start there either)."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10)
    hold = tmp_path / "hold"
    hold.touch()
    runs = [Running(executor, trial_spec(tmp_path / str(i), held(hold), f"queued-{i}"), Control()) for i in range(3)]
    try:
        wait_for(lambda: sum("held" in run.log() for run in runs) == 2, "two trials did not start")
        queued = next(run for run in runs if "held" not in run.log())
        seeing = queued if first == "queued" else next(run for run in runs if run is not queued)
        seeing.control.stopping = True
        seeing.thread.join(10)
        assert not seeing.thread.is_alive(), "the trial that saw the sweep stop did not end"
        assert seeing.error is None and seeing.result.outcome is Outcome.INTERRUPTED
        time.sleep(1.0)
        hold.unlink()
        for run in runs:
            run.thread.join(30)
        assert queued.error is None and (queued.result.outcome, queued.result.duration_s) == (Outcome.INTERRUPTED, 0)
        assert queued.control.gpus is None and "runs on Dask worker" not in queued.log()
    finally:
        hold.unlink(missing_ok=True)
        executor.close()


def test_a_trial_its_worker_ends_on_its_own_is_lost(own_cluster: LocalDask, tmp_path: Path) -> None:
    """A scheduler that does not answer the worker for ``scheduler_lost_s`` (a network
    partition) makes the worker end its trial; when the scheduler answers again and the
    task's result comes back, the trial is LOST (its worker gave up on it), not INTERRUPTED
    as if the sweep had stopped."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=1.5)
    hold = tmp_path / "hold"
    hold.touch()
    run = Running(executor, trial_spec(tmp_path, held(hold), "partition"), Control())
    try:
        wait_for(lambda: "held" in run.log(), "the trial did not start")
        own_cluster.scheduler.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: not tokens_alive(run.spec.token), "the worker did not end the trial", 15)
        finally:
            own_cluster.scheduler.send_signal(signal.SIGCONT)
        run.thread.join(30)
        assert run.error is None and run.result.outcome is Outcome.LOST, (run.result, run.error)
        assert "closed or lost the scheduler" in run.result.reason
        assert saved_result(run.spec.folder, 5) == run.result
    finally:
        hold.unlink(missing_ok=True)
        executor.close()


def submitted(work: Path) -> list[Path]:
    """The folders of the trials a sweep in ``work`` has handed to Dask and not yet seen end."""
    return [marker.parent for marker in work.glob("trial-*/.hpo-token")]


def started(folder: Path) -> bool:
    """Whether the HELD trial in ``folder`` has started."""
    return "held" in ((folder / LOG_FILE).read_text() if (folder / LOG_FILE).exists() else "")


@pytest.mark.parametrize("how", ["ctrl-c", "scheduler killed"])
def test_trials_still_queued_in_dask_go_back_to_waiting(own_cluster: LocalDask, write_scenario: WriteScenario,
                                                        tmp_path: Path, how: str) -> None:
    """Three slots on two one-thread workers (six trials: each slot has one and one claimed
    ahead), so a trial waits in Dask's queue. When the sweep stops (Ctrl-C) or its scheduler
    is killed, the running trials are INTERRUPTED; the queued one never starts and goes back
    to WAITING, as trials claimed ahead do. The same command finishes the sweep."""
    hold, path, run = held_sweep(tmp_path, write_scenario, own_cluster.address, trials=6, parallel=3)
    work = path.parent / "runs" / "demo"
    try:
        wait_for(lambda: len(submitted(work)) == 3 and sum(map(started, submitted(work))) == 2,
                 "two trials did not start beside a third in Dask's queue")
        queued = next(folder for folder in submitted(work) if not started(folder))
        time.sleep(0.5)
        if how == "ctrl-c":
            run.send_signal(signal.SIGINT)
        else:
            own_cluster.scheduler.kill()
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == (130 if how == "ctrl-c" else 1), err
    rows = {row.number: row for row in study_rows(path)}
    assert rows[int(queued.name.removeprefix("trial-"))].outcome is Outcome.WAITING, (rows, (queued / LOG_FILE).read_text(), err)
    assert "runs on Dask worker" not in (queued / LOG_FILE).read_text()
    assert sorted(row.outcome for row in rows.values() if row.requeue_of is None and row.outcome.ended) == [
        Outcome.INTERRUPTED] * 2
    hold.unlink()
    fresh = LocalDask(tmp_path / "fresh") if how != "ctrl-c" else own_cluster
    try:
        if fresh is not own_cluster:
            fresh.worker("w", 2)
        done = run_hpo("run", path, "--cluster", fresh.address, timeout=120)
    finally:
        if fresh is not own_cluster:
            fresh.close()
    assert done.returncode == 0, done.stderr
    assert sum(row.outcome is Outcome.COMPLETE for row in study_rows(path)) == 6


def study_store(path: Path) -> StudyStore:
    """The study that ``hpo run`` keeps beside ``path``."""
    scenario = load_scenario(path)
    return StudyStore(scenario, storage_url(scenario, None, scenario.default_workdir()), create=False)


def study_rows(path: Path) -> list[TrialRow]:
    """The rows of the study that ``hpo run`` keeps beside ``path``."""
    return study_store(path).rows()


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
