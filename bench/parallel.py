"""The parallel shared-model optimizer: K workers vs one, at the same total number of trials.

Each trial evaluates Hartmann-6 (minimum -3.32237) and sleeps to stand in for training.
The study runs with ``hpo run --workers 1`` and ``--workers K`` (one slot each) for several
seeds, through the real CLI and an SQLite store. Prints the median regret of each, their
ratio (goal: K workers within 1.2x of one), how many runs ended in a local optimum (regret
above 0.1: Hartmann-6's best local minimum is 0.12 above its global one), duplicate configurations
(goal: 0), and the throughput in trials per hour. Runs that reach the global basin end near
0.001 and the others at 0.1 or more, so with few seeds the median can fall between the two
groups; the count of trapped runs says which, the median of the others how well they refine,
and the ratio's spread over the seeds resampled how much one run of 10 seeds can tell. K
workers' runs do not repeat (each worker's sampler seed takes in its process id, and timing
orders the trials): three 10-seed runs of one commit gave ratios of 15, 26 and 30. Both modes
also print a yardstick for the goal:
one worker's own median regret K-1 trials earlier over its median at the last trial, the ratio K
workers would reach if each of their proposals were as good as one worker's made without the
K-1 results still running. Where regret falls fast with trials, it can exceed 1.2 by itself.

With ``--in-process`` the same comparison runs without processes or timing: one sampler in an
in-memory study, each proposal made while exactly K-1 trials run (K workers whose trials all
take as long). It runs a seed in about 5 s, so rules for running trials can be compared on 100
seeds; it also prints how often 10 seeds drawn from those give a ratio within 1.2x, which says how
much one 10-seed run of the real bench can tell. The K-worker studies go on to twice the trials
(a proposal depends only on the trials before it, so their first N trials are the N-trial
study), and the bench prints after how many trials K workers reach the median regret one worker
has at N: what parallel proposals cost in trials. It ends in a local optimum far more often than
the real CLI does: with 3 workers (2 trials running at each proposal, as at most proposals of a
real 4-worker study), 16 of seeds 1 to 30, against 8 of 40 real 4-worker runs. So it ranks rules
by how well the runs that escape refine, not by how many escape.

    python -m bench.parallel [--workers 4] [--trials 50] [--seeds 10] [--sleep 0.3] [--method smac]
    python -m bench.parallel --seeds 11:21    # seeds 11 to 20, to add to an earlier run's
    python -m bench.parallel --in-process --seeds 100

Each study's figures go to stderr as it ends, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from bench.functions import FUNCTIONS
from bench.optimizers import seed_range
from hpo.samplers import build_sampler
from hpo.scenario import load_scenario
from hpo.storage import storage_url
from hpo.store import StudyStore

HARTMANN6_MIN = -3.32237
TRAPPED = 0.1
TEMPLATE = textwrap.dedent("""\
    import math, time
    A = [[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]]
    P = [[0.1312, 0.1696, 0.5569, 0.0124, 0.8283, 0.5886], [0.2329, 0.4135, 0.8307, 0.3736, 0.1004, 0.9991],
         [0.2348, 0.1451, 0.3522, 0.2883, 0.3047, 0.6650], [0.4047, 0.8828, 0.8732, 0.5743, 0.1091, 0.0381]]
    ALPHA = [1.0, 1.2, 3.0, 3.2]
    x = [{{ x0 }}, {{ x1 }}, {{ x2 }}, {{ x3 }}, {{ x4 }}, {{ x5 }}]
    value = -sum(a * math.exp(-sum(A[i][j] * (x[j] - P[i][j]) ** 2 for j in range(6))) for i, a in enumerate(ALPHA))
    time.sleep({{ sleep }})
    print(f"val_error={value}")
    """)


def run_study(folder: Path, workers: int, trials: int, seed: int, sleep: float, method: str) -> tuple[np.ndarray, int, float]:
    """Run one study; return (the best regret after each trial, by trial number; duplicate
    configurations; trials per hour)."""
    params = "\n".join(f"  x{i}: {{type: float, low: 0.0, high: 1.0}}" for i in range(6))
    scenario_path = folder / f"h6-{workers}-{seed}.yaml"
    scenario_path.write_text(
        f"name: h6-{workers}-{seed}\ntemplate: trial.py.j2\ncommand: python trial.py\nparameters:\n{params}\n"
        f"  sleep: {{type: constant, value: {sleep}}}\n"
        f"search: {{method: {method}, trials: {trials}, seed: {seed}}}\n"
        f"resources: {{parallel: {workers}, gpus_per_trial: 1}}\n")
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "hpo", "run", str(scenario_path), "--workers", str(workers)],
                         capture_output=True, text=True, env=dict(os.environ, HPO_GPUS=""), check=False)
    wall = time.monotonic() - began
    if run.returncode != 0:
        raise SystemExit(f"hpo run failed:\n{run.stdout}\n{run.stderr}")
    scenario = load_scenario(scenario_path)
    rows = StudyStore(scenario, storage_url(scenario), create=False).rows()
    values = [math.inf if row.value is None else row.value for row in sorted(rows, key=lambda row: row.number)]
    configs = [tuple(round(row.params[f"x{i}"], 12) for i in range(6)) for row in rows]
    assert len(rows) == trials, f"{len(rows)} trials instead of {trials}"
    return np.minimum.accumulate(values) - HARTMANN6_MIN, duplicates(configs), 3600 * len(rows) / wall


def duplicates(configs: list[tuple[Any, ...]]) -> int:
    """How many of ``configs`` repeat an earlier one."""
    return len(configs) - len(set(configs))


def delay_yardstick(one_worker: np.ndarray, workers: int, trials: int) -> str:
    """The line that says what ``workers - 1`` missing results cost one worker: its median regret
    ``workers - 1`` trials before ``trials`` over its median at ``trials`` (``one_worker``: the best
    regret after each trial, a row a seed). K workers whose every proposal were as good as one
    worker's made without the K-1 running results would have about this ratio."""
    earlier = trials - (workers - 1)
    ratio = np.median(one_worker[:, earlier - 1]) / np.median(one_worker[:, trials - 1])
    return (f"yardstick: one worker's median regret at {earlier} trials is {ratio:.2f}x its median at {trials}, "
            f"the ratio {workers} workers would have if each proposal were as good as one worker's "
            f"without the {workers - 1} running results")


def run_in_process(workers: int, trials: int, seed: int, method: str) -> tuple[np.ndarray, list[tuple[Any, ...]]]:
    """Run one study in memory, each proposal made while ``workers - 1`` trials run; return
    the best regret after each trial, and the trials' configurations."""
    function = FUNCTIONS["hartmann6"]
    study = optuna.create_study(sampler=build_sampler(method, function.params, seed=seed),
                                study_name=f"h6-{workers}-{seed}")
    running: list[tuple[optuna.Trial, dict[str, Any]]] = []
    for _ in range(trials):
        trial = study.ask()
        running.append((trial, function.suggest(trial)))
        if len(running) == workers:  # the oldest trial ends: a slot is free for the next proposal
            oldest, values = running.pop(0)
            study.tell(oldest, function.objective(values))
    for trial, values in running:
        study.tell(trial, function.objective(values))
    regrets = np.minimum.accumulate([t.value for t in study.trials]) - HARTMANN6_MIN
    return regrets, [tuple(t.params.values()) for t in study.trials]


def resampled_ratios(one: np.ndarray, many: np.ndarray, size: int, draws: int = 2000) -> np.ndarray:
    """The ratio of ``many``'s median regret to ``one``'s over ``draws`` draws of ``size`` seeds
    (with replacement, the same seeds for both: entry i of each is seed i)."""
    picked = np.random.default_rng(0).choice(len(one), size=(draws, size))
    return np.median(many[picked], axis=1) / np.median(one[picked], axis=1)


def regret_cells(final: np.ndarray) -> str:
    """The table cells of the runs' final regrets: their median, how many are trapped in a
    local optimum, and the median of the others."""
    untrapped = final[final <= TRAPPED]
    return (f"{np.median(final):>14.4f} {len(final) - len(untrapped):>8} "
            f"{np.median(untrapped) if len(untrapped) else math.nan:>17.4f}")


def in_process(workers: int, trials: int, seeds: range, method: str) -> None:
    """Print the in-process comparison (see the module docstring)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    results = {count: [run_in_process(count, trials * (1 if count == 1 else 2), seed, method) for seed in seeds]
               for count in (1, workers)}
    print(f"Hartmann-6 in process, method {method}, {trials} trials, seeds {seeds.start}-{seeds.stop - 1}, "
          f"each proposal made while workers - 1 trials run")
    print(f"{'workers':>8} {'median regret':>14} {'trapped':>8} {'median untrapped':>17} {'duplicates':>11}")
    curves = {count: np.array([r[0] for r in runs]) for count, runs in results.items()}
    for count, runs in results.items():
        repeated = sum(duplicates(r[1][:trials]) for r in runs)
        print(f"{count:>8} {regret_cells(curves[count][:, trials - 1])} {repeated:>11}")
    one, many = (curves[count][:, trials - 1] for count in results)
    ratios = resampled_ratios(one, many, min(10, len(one)))
    print(f"regret ratio {workers} workers / 1 worker: {np.median(many) / np.median(one):.2f} "
          f"(goal <= 1.2); over 2000 draws of 10 of these seeds, the ratio is within 1.2 in "
          f"{np.mean(ratios <= 1.2):.0%} (median ratio {np.median(ratios):.2f})")
    print(delay_yardstick(curves[1], workers, trials))
    medians = np.median(curves[workers], axis=0)
    for n in sorted({trials // 2, trials * 3 // 4, trials}):
        target = np.median(curves[1][:, n - 1])
        reached = np.flatnonzero(medians <= target)
        when = f"after {reached[0] + 1} trials ({(reached[0] + 1) / n:.2f}x)" if len(reached) else \
            f"not within {len(medians)} trials"
        print(f"one worker's median regret at {n} trials, {target:.4f}: {workers} workers reach it {when}")


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=50)
    from_one = functools.partial(seed_range, first=1)
    parser.add_argument("--seeds", type=from_one, default=from_one("10"), help="N (seeds 1 to N) or A:B")
    parser.add_argument("--sleep", type=float, default=0.3)
    parser.add_argument("--method", default="smac")
    parser.add_argument("--in-process", action="store_true", help="emulate the workers in one process (no timing)")
    args = parser.parse_args()
    if args.in_process:
        in_process(args.workers, args.trials, args.seeds, args.method)
        return
    results: dict[int, list[tuple[float, int, float]]] = {1: [], args.workers: []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "trial.py.j2").write_text(TEMPLATE)
        for seed in args.seeds:
            for workers, runs in results.items():
                runs.append(run_study(folder, workers, args.trials, seed, args.sleep, args.method))
                regrets, dupes, per_hour = runs[-1]
                print(f"seed {seed}, {workers} worker{'s' if workers > 1 else ''}: regret {regrets[-1]:.3g}, "
                      f"{dupes} duplicates, {per_hour:.0f} trials/hour", file=sys.stderr, flush=True)
    print(f"Hartmann-6, method {args.method}, {args.trials} trials, seeds {args.seeds.start}-{args.seeds.stop - 1}, "
          f"{args.sleep:g} s per trial")
    print(f"{'workers':>8} {'median regret':>14} {'trapped':>8} {'median untrapped':>17} {'duplicates':>11} "
          f"{'trials/hour':>12}")
    finals = {workers: np.array([r[0][-1] for r in runs]) for workers, runs in results.items()}
    for workers, runs in results.items():
        print(f"{workers:>8} {regret_cells(finals[workers])} "
              f"{sum(r[1] for r in runs):>11} {statistics.median(r[2] for r in runs):>12.0f}")
    for workers, runs in results.items():
        print(f"regret by seed, {workers} worker{'s' if workers > 1 else ''}: " + " ".join(f"{r[0][-1]:.3g}" for r in runs))
    one, many = (float(np.median(finals[w])) for w in results)
    speed = statistics.median(r[2] for r in results[args.workers]) / statistics.median(r[2] for r in results[1])
    print(f"regret ratio {args.workers} workers / 1 worker: {many / one:.2f} (goal <= 1.2)   throughput x{speed:.2f}")
    ratios = resampled_ratios(finals[1], finals[args.workers], len(args.seeds))
    low, high = np.quantile(ratios, [0.05, 0.95])
    print(f"the seeds resampled 2000 times: the ratio from {low:.2f} to {high:.2f} (5th to 95th percentile), "
          f"within 1.2 in {np.mean(ratios <= 1.2):.0%}; how many runs are trapped moves it most")
    print(delay_yardstick(np.array([r[0] for r in results[1]]), args.workers, args.trials))
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
