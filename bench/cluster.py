"""Trials per hour on a local Dask cluster, 1 worker against 2, and the Dask executor's overhead.

Trials are a script that sleeps 1 s and prints its metric. A Dask scheduler and one-thread
workers run on this machine (``dask scheduler``, ``dask worker``). Prints:

* trials per hour with 1 worker and with 2 workers (one trial at a time each), and the
  speed-up (goal >= 1.9x);
* the per-trial overhead the Dask executor adds over the local one, both on one slot: the
  median of (executor.run wall time - the trial process's own time), Dask minus local
  (goal <= 50 ms), and the difference of the whole sweeps' wall time per trial.

    python -m bench.cluster [--trials 24] [--sleep 1.0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from distributed import Client

from bench.overhead import sleepy_scenario
from hpo.dask_executor import DaskExecutor
from hpo.engine import Sweep, SweepConfig
from hpo.executor import Executor, LocalExecutor, TrialControl, TrialSpec
from hpo.launch import plan_slots
from hpo.outcome import Outcome, TrialResult
from hpo.scenario import Scenario

REPO = Path(__file__).resolve().parents[1]


class Timed:
    """An executor wrapper that keeps, per trial, run's wall time minus the process's own time."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.extra: list[float] = []

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        began = time.perf_counter()
        result = self.inner.run(spec, control)
        self.extra.append(time.perf_counter() - began - result.duration_s)
        return result

    def close(self) -> None:
        self.inner.close()


@contextmanager
def local_dask(folder: Path, workers: int) -> Iterator[str]:
    """A Dask scheduler and ``workers`` one-thread workers on this machine; yields its address."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(file)], env=env, stderr=subprocess.DEVNULL)]
    try:
        while not file.exists() or not file.read_text().strip():
            if procs[0].poll() is not None:
                raise SystemExit(f"the Dask scheduler exited with code {procs[0].returncode}")
            time.sleep(0.05)
        address = json.loads(file.read_text())["address"]
        for index in range(workers):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny",
                                           "--no-dashboard", "--host", "127.0.0.1", "--name", f"w{index}",
                                           "--local-directory", str(folder / "scratch")],
                                          env=env, stderr=subprocess.DEVNULL))
        with Client(address, set_as_default=False) as client:
            client.wait_for_workers(workers, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):  # the workers first: one whose scheduler is gone may never exit
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scenario_in(folder: Path, trials: int, sleep: float) -> Scenario:
    """The bench's sweep of trials that sleep ``sleep`` seconds, in ``folder``."""
    return sleepy_scenario(folder, "cluster", trials, sleep, "{parallel: auto}")


def sweep(folder: Path, scenario: Scenario, executor: Executor, slots: tuple) -> float:
    """Run the whole sweep; its wall time in seconds."""
    sweep = Sweep(SweepConfig(scenario, f"sqlite:///{folder / 'study.db'}", folder / "work", slots, 1), executor)
    sweep.prepare()
    began = time.monotonic()
    sweep.run()
    wall = time.monotonic() - began
    outcomes = {row.outcome for row in sweep.store.rows()}
    assert outcomes == {Outcome.COMPLETE}, outcomes
    return wall


def on_dask(folder: Path, scenario: Scenario, workers: int) -> tuple[float, list[float]]:
    with local_dask(folder / "dask", workers) as address:
        executor = Timed(DaskExecutor(Client(address, set_as_default=False), scenario.resources))
        slots = executor.inner.plan()
        assert len(slots) == workers, slots
        return sweep(folder, scenario, executor, slots), executor.extra


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--sleep", type=float, default=1.0)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f} at the start; {args.trials} trials of "
          f"{args.sleep:g} s each; Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local = Timed(LocalExecutor())
        scenario = scenario_in(root / "local", args.trials, args.sleep)
        local_wall = sweep(root / "local", scenario, local, plan_slots(scenario.resources, (), at_least=1)[:1])
        one_wall, one_extra = on_dask(root / "one", scenario_in(root / "one", args.trials, args.sleep), 1)
        two_wall, _ = on_dask(root / "two", scenario_in(root / "two", args.trials, args.sleep), 2)
    per_hour = {workers: args.trials / wall * 3600 for workers, wall in ((1, one_wall), (2, two_wall))}
    print(f"1 Dask worker:  {one_wall:6.2f} s, {per_hour[1]:7.0f} trials/hour")
    print(f"2 Dask workers: {two_wall:6.2f} s, {per_hour[2]:7.0f} trials/hour")
    print(f"speed-up with 2 workers: {per_hour[2] / per_hour[1]:.2f}x (goal >= 1.9x)")
    print(f"local executor, 1 slot: {local_wall:6.2f} s, {args.trials / local_wall * 3600:7.0f} trials/hour")
    local_ms, dask_ms = 1000 * statistics.median(local.extra), 1000 * statistics.median(one_extra)
    print(f"executor.run beyond the trial process, median: local {local_ms:.1f} ms, Dask {dask_ms:.1f} ms; "
          f"the Dask executor adds {dask_ms - local_ms:.1f} ms per trial (goal <= 50 ms)")
    print(f"whole sweep, 1 slot: Dask {1000 * (one_wall - local_wall) / args.trials:+.1f} ms per trial against local")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
