"""Slot utilization and per-trial overhead of the sweep engine.

60 trivial trials (a script that sleeps 1 s and prints a metric) on 2 slots: the ideal wall
time is 60 x 1 s / 2 = 30 s. Prints the wall time, the slot utilization (ideal / wall;
goal >= 95 %), the median idle gap of a slot between two trials (what the slot waits for:
render + spawn, and ask + tell where they are on the critical path), and the median time of
ask and of tell themselves (for designs they run while the previous trial runs).

    python bench/overhead.py [--trials 60] [--slots 2] [--sleep 1.0] [--storage URL]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

from hpo.engine import Sweep, SweepConfig, TrialEnd, TrialStart
from hpo.launch import plan_slots
from hpo.scenario import Scenario, load_scenario

TEMPLATE = textwrap.dedent("""\
    import time
    time.sleep({{ sleep }})
    print("val_error={{ x }}")
    """)


def sleepy_scenario(folder: Path, name: str, trials: int, sleep: float, resources: str, seed: int = 1) -> Scenario:
    """A Monte Carlo sweep of ``trials`` trials that each sleep ``sleep`` seconds and print a
    metric, written into ``folder`` (``resources``: the scenario's flow mapping; ``seed``: the
    design's) and loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trial.py.j2").write_text(TEMPLATE)
    (folder / "bench.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        template: trial.py.j2
        command: python trial.py
        parameters:
          x: {{type: float, low: 0, high: 1}}
          sleep: {{type: constant, value: {sleep}}}
        search: {{method: monte_carlo, trials: {trials}, seed: {seed}}}
        resources: {resources}
        """))
    return load_scenario(folder / "bench.yaml")


class TimedSweep(Sweep):
    """A Sweep that times its ask (claim) and tell (finish) steps."""

    asks: ClassVar[list[float]] = []
    tells: ClassVar[list[float]] = []
    collector: Collector

    def _execute(self, slot: Any, claim: Any) -> Any:
        try:
            return super()._execute(slot, claim)
        finally:
            self.collector.exited(slot.index)

    def _claim(self) -> Any:
        began = time.perf_counter()
        try:
            return super()._claim()
        finally:
            self.asks.append(time.perf_counter() - began)

    def _settle(self, claim: Any, result: Any) -> None:
        began = time.perf_counter()
        try:
            super()._settle(claim, result)
        finally:
            self.tells.append(time.perf_counter() - began)


class Collector:
    """Keeps every TrialEnd and, per slot, the gaps between one trial's process exit and the
    next one's start."""

    def __init__(self) -> None:
        self.ends: list[TrialEnd] = []
        self.gaps: list[float] = []
        self._exited: dict[int, float] = {}

    def started(self, start: TrialStart) -> None:
        if start.slot in self._exited:
            self.gaps.append(time.monotonic() - self._exited.pop(start.slot))

    def exited(self, slot: int) -> None:
        self._exited[slot] = time.monotonic()

    def finished(self, end: TrialEnd) -> None:
        self.ends.append(end)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=1.0)
    parser.add_argument("--storage", help="storage URL (default: SQLite in a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        scenario = sleepy_scenario(folder, "overhead", args.trials, args.sleep,
                                   f"{{parallel: {args.slots}, gpus_per_trial: 1}}")
        slots = plan_slots(scenario.resources, ())
        url = args.storage or f"sqlite:///{folder / 'work' / 'study.db'}"
        sweep = TimedSweep(SweepConfig(scenario, url, folder / "work", slots, seed=1))
        collector = Collector()
        sweep.collector = collector
        sweep.prepare()
        began = time.monotonic()
        sweep.run(collector)
        wall = time.monotonic() - began
    ideal = args.trials * args.sleep / args.slots
    overheads = sorted(gap * 1000 for gap in collector.gaps)
    process = [end.result.duration_s - args.sleep for end in collector.ends]
    states = {end.result.outcome.value for end in collector.ends}
    print(f"trials: {len(collector.ends)} ({', '.join(sorted(states))}) on {args.slots} slots, store {url.split(':')[0]}")
    print(f"wall time: {wall:.2f} s   ideal: {ideal:.2f} s")
    print(f"slot utilization: {100 * ideal / wall:.1f} %   (goal >= 95 %)")
    print(f"slot idle gap between trials (a process exited -> the next started: claim, render, spawn): "
          f"median {statistics.median(overheads):.1f} ms, p90 {overheads[int(0.9 * (len(overheads) - 1))]:.1f} ms")
    print(f"ask (lock + budget + ask + suggest): median {1000 * statistics.median(sweep.asks):.1f} ms   "
          f"tell (result + tell): median {1000 * statistics.median(sweep.tells):.1f} ms")
    print(f"process time beyond the {args.sleep:g} s sleep (interpreter start-up and exit): "
          f"median {1000 * statistics.median(process):.1f} ms")


if __name__ == "__main__":
    main()
