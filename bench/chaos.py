"""Chaos: workers killed at random under a shared sweep. Is any evaluation lost or doubled?

Runs a Monte Carlo design of ``--trials`` short trials with ``--workers`` ``hpo worker``
processes on one store (SQLite in a temporary folder, or ``--storage URL``), first
undisturbed, then while a random worker is killed with SIGKILL every ``--every`` seconds
(give or take half) and a fresh one started in its place. Prints, for each run: design
points never evaluated (lost; goal 0), points evaluated more than once (doubled; goal 0),
the LOST trials that were re-run, and the wall time, with the disturbed/undisturbed ratio.

    python -m bench.chaos [--workers 4] [--trials 100] [--sleep 0.3] [--every 3] [--storage URL]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead import sleepy_scenario
from hpo import designs
from hpo.outcome import Outcome
from hpo.scenario import load_scenario
from hpo.store import StudyStore


def start_worker(path: Path, url: str, seed: int, log: Path) -> subprocess.Popen[bytes]:
    """One ``hpo worker`` process on one slot, its output appended to ``log``."""
    env = dict(os.environ, HPO_GPUS="", OMP_NUM_THREADS="1")
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "hpo", "worker", str(path), "--storage", url, "--seed",
                                 str(seed), "--parallel", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)


def run(path: Path, url: str, workers: int, every: float | None, rng: random.Random) -> tuple[float, int]:
    """Run the sweep to its end with ``workers`` workers; kill one every ``every`` s. Returns
    the wall time and the number of kills."""
    log = path.parent / "workers.log"
    procs = [start_worker(path, url, seed, log) for seed in range(workers)]
    seed, kills = workers, 0
    began = time.monotonic()
    next_kill = began + every * rng.uniform(0.5, 1.5) if every else float("inf")
    while any(proc.poll() is None for proc in procs):
        time.sleep(0.05)
        if time.monotonic() >= next_kill:
            alive = [i for i, proc in enumerate(procs) if proc.poll() is None]
            if alive:
                victim = rng.choice(alive)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                procs[victim] = start_worker(path, url, seed, log)
                seed, kills = seed + 1, kills + 1
            next_kill = time.monotonic() + every * rng.uniform(0.5, 1.5)  # type: ignore[operator]
    return time.monotonic() - began, kills


def audit(path: Path, url: str) -> tuple[int, int, int, int]:
    """Design points never evaluated, points evaluated twice or more, LOST rows, rows left running."""
    scenario = load_scenario(path)
    rows = StudyStore(scenario, url, create=False).rows()
    points = [point["x"] for point in designs.design_points(scenario) or []]
    seen = collections.Counter(row.params.get("x") for row in rows if row.outcome.own)
    lost = sum(1 for x in points if seen[x] == 0)
    doubled = sum(1 for x in points if seen[x] > 1)
    return (lost, doubled, sum(row.outcome is Outcome.LOST for row in rows),
            sum(not row.outcome.ended for row in rows))


def main() -> None:
    """Run the undisturbed and the disturbed sweep and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.3, help="seconds each trial sleeps")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between kills (on average)")
    parser.add_argument("--storage", help="a server URL (default: SQLite in a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    walls = {}
    for label, every in (("undisturbed", None), ("disturbed", args.every)):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            name = f"chaos-{label}-{os.getpid()}"
            path = sleepy_scenario(folder, name, args.trials, args.sleep, "{parallel: 1, heartbeat: 1, timeout: 60}",
                                   seed=3).path
            url = args.storage or f"sqlite:///{folder / 'study.db'}"
            wall, kills = run(path, url, args.workers, every, rng)
            lost, doubled, relost, left = audit(path, url)
        walls[label] = wall
        print(f"{label:>11}: {args.workers} workers, {args.trials} trials of {args.sleep:g} s on {url.split(':')[0]}: "
              f"{kills} workers killed, lost {lost}, doubled {doubled} (goal 0, 0), {relost} LOST trials re-run, "
              f"{left} left running, wall {wall:.1f} s", flush=True)
    print(f"wall time disturbed/undisturbed: {walls['disturbed'] / walls['undisturbed']:.2f}x")


if __name__ == "__main__":
    main()
