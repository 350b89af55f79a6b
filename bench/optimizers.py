"""Side-by-side benchmark: hpo's ForestSampler, SMAC3's HPO facade, Optuna TPE and random search.

Run from the repository root::

    python -m bench.optimizers                       # full run: 6 functions, 5 seeds, 100 trials
    python -m bench.optimizers --quick               # 3 seeds, 50 trials, a smoke test
    python -m bench.optimizers --functions branin,mixed --seeds 10
    python -m bench.optimizers --methods SMAC3,TPE,random --save base.json   # baselines once,
    python -m bench.optimizers --methods hpo --load base.json                # then hpo beside them

Prints the median regret (best value found minus the known optimum; for a real tuning
task, minus the best value any run found) at 50 and 100 trials, the ratios hpo/SMAC3 and
hpo/TPE, and ForestSampler's mean ask+tell time with the study on SQLite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import optuna

from bench.functions import FUNCTIONS, TestFunction
from hpo.forest import ForestSampler

METHODS = ("hpo", "SMAC3", "TPE", "random")


@dataclass(frozen=True)
class Run:
    """One optimizer run: the objective values in trial order and the wall time."""

    method: str
    function: str
    seed: int
    values: tuple[float, ...]
    seconds: float


def _optuna_values(fn: TestFunction, sampler: optuna.samplers.BaseSampler, n_trials: int) -> list[float]:
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda trial: fn.objective(fn.suggest(trial)), n_trials=n_trials)
    return [t.value for t in study.trials]


def _smac_values(fn: TestFunction, n_trials: int, seed: int) -> list[float]:
    from smac import HyperparameterOptimizationFacade, Scenario
    from smac.runhistory.dataclasses import TrialValue

    values: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        scenario = Scenario(
            fn.config_space(seed=seed),
            deterministic=True,
            n_trials=n_trials,
            seed=seed,
            output_directory=os.path.join(folder, "smac"),
        )
        smac = HyperparameterOptimizationFacade(
            scenario, target_function=lambda config, seed=0: 0.0, overwrite=True, logging_level=40
        )
        for _ in range(n_trials):
            info = smac.ask()
            values.append(fn.objective(dict(info.config)))
            smac.tell(info, TrialValue(cost=values[-1]))
    return values


def _samplers(fn: TestFunction, seed: int) -> dict[str, Callable[[], optuna.samplers.BaseSampler]]:
    return {
        "hpo": lambda: ForestSampler(fn.config_space(), seed=seed),
        "TPE": lambda: optuna.samplers.TPESampler(seed=seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }


def run_one(task: tuple[str, str, int, int]) -> Run:
    """Run ``method`` on the named function for ``n_trials`` trials with ``seed``."""
    method, name, seed, n_trials = task
    _quiet()
    fn = FUNCTIONS[name]
    start = time.perf_counter()
    if method == "SMAC3":
        values = _smac_values(fn, n_trials, seed)
    else:
        values = _optuna_values(fn, _samplers(fn, seed)[method](), n_trials)
    return Run(method, name, seed, tuple(values), time.perf_counter() - start)


def _quiet() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("smac").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def time_ask_tell(n_finished: int, n_measured: int = 20, seed: int = 0) -> tuple[float, float]:
    """Mean seconds per ask+tell on an SQLite study pre-filled with ``n_finished`` trials:
    (ForestSampler, RandomSampler) on Hartmann-6, after three warm-up trials."""
    _quiet()
    fn = FUNCTIONS["hartmann6"]
    rng = np.random.default_rng(seed)
    cs = fn.config_space(seed=seed)
    distributions = {p.name: optuna.distributions.FloatDistribution(p.low, p.high) for p in fn.params}
    prefill = []
    for config in cs.sample_configuration(n_finished):
        params = {k: float(v) for k, v in dict(config).items()}
        value = fn.objective(params) + 0.01 * rng.standard_normal()
        prefill.append(optuna.trial.create_trial(params=params, distributions=distributions, value=value))
    means = []
    with tempfile.TemporaryDirectory() as folder:
        for i, sampler in enumerate((ForestSampler(cs, seed=seed), optuna.samplers.RandomSampler(seed=seed))):
            storage = f"sqlite:///{os.path.join(folder, f'study{i}.db')}"
            study = optuna.create_study(storage=storage, sampler=sampler)
            study.add_trials(prefill)
            for measured in (False, True):
                start = time.perf_counter()
                for _ in range(n_measured if measured else 3):
                    trial = study.ask()
                    study.tell(trial, fn.objective(fn.suggest(trial)))
            means.append((time.perf_counter() - start) / n_measured)
    return means[0], means[1]


def _regrets(runs: list[Run], n_trials: int) -> dict[tuple[str, str], list[float]]:
    """Regret of each run after ``n_trials`` trials, grouped by (function, method)."""
    reference: dict[str, float] = {}
    for run in runs:
        optimum = FUNCTIONS[run.function].optimum
        found = min(run.values)
        if optimum is None:
            reference[run.function] = min(reference.get(run.function, found), found)
        else:
            reference[run.function] = optimum
    grouped: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        if len(run.values) >= n_trials:
            regret = min(run.values[:n_trials]) - reference[run.function]
            grouped.setdefault((run.function, run.method), []).append(max(regret, 0.0))
    return grouped


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    if b == 0:
        return "-" if a == 0 else "inf"
    return f"{a / b:.2f}"


def report(runs: list[Run], budgets: list[int], functions: list[str]) -> str:
    """The table of median regrets, ratios, best raw values of real tasks and run times."""
    lines = [
        f"{'function':<12} {'trials':>6} " + " ".join(f"{m:>9}" for m in METHODS) + f" {'hpo/SMAC3':>9} {'hpo/TPE':>8}"
    ]
    for name in functions:
        for budget in budgets:
            grouped = _regrets(runs, budget)
            med = {m: statistics.median(grouped[(name, m)]) for m in METHODS if (name, m) in grouped}
            cells = " ".join(f"{med[m]:>9.4f}" if m in med else f"{'-':>9}" for m in METHODS)
            ratios = f"{_ratio(med.get('hpo'), med.get('SMAC3')):>9} {_ratio(med.get('hpo'), med.get('TPE')):>8}"
            lines.append(f"{name:<12} {budget:>6} {cells} {ratios}")
    for name in functions:
        if FUNCTIONS[name].optimum is None:
            lines.append(f"\n{name}: median best value found (regret above is vs the best any run found)")
            for budget in budgets:
                best = {
                    m: statistics.median(min(r.values[:budget]) for r in runs if r.function == name and r.method == m)
                    for m in METHODS
                    if any(r.function == name and r.method == m for r in runs)
                }
                lines.append(f"  {budget:>4} trials: " + ", ".join(f"{m} {v:.4f}" for m, v in best.items()))
    lines.append("\nmean wall time per run (s): " + ", ".join(
        f"{m} {statistics.mean(r.seconds for r in runs if r.method == m):.1f}" for m in METHODS if any(r.method == m for r in runs)
    ))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse options, run every (method, function, seed) on ``--jobs`` processes, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per method and function (default 5)")
    parser.add_argument("--functions", default=",".join(FUNCTIONS), help="comma-separated names")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--quick", action="store_true", help="3 seeds and 50 trials, timing at 100 trials only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--save", metavar="FILE", help="write this run's results to FILE (JSON)")
    parser.add_argument("--load", metavar="FILE", help="report these saved runs beside this run's")
    args = parser.parse_args(argv)
    functions = [f for f in args.functions.split(",") if f]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [f for f in functions if f not in FUNCTIONS] + [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown function or method: {', '.join(unknown)}")
    seeds = 3 if args.quick else args.seeds
    n_trials = 50 if args.quick else 100
    budgets = [50] if args.quick else [50, 100]
    tasks = [(m, f, s, n_trials) for m in methods for f in functions for s in range(seeds)]
    tasks.sort(key=lambda t: (t[0] != "SMAC3", FUNCTIONS[t[1]].optimum is not None))
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        runs = list(pool.imap_unordered(run_one, tasks))
    print(f"{len(runs)} runs, {n_trials} trials each, {seeds} seeds, in {time.perf_counter() - start:.0f} s\n")
    if args.save:
        with open(args.save, "w") as out:
            json.dump([dataclasses.asdict(r) for r in runs], out)
    if args.load:
        with open(args.load) as saved:
            loaded = [Run(**{**r, "values": tuple(r["values"])}) for r in json.load(saved)]
        runs += [r for r in loaded if r.method not in methods and r.function in functions and r.seed < seeds]
    print(report(runs, budgets, functions))
    if "hpo" in methods:
        print("\nForestSampler ask+tell per trial, SQLite study (RandomSampler's in brackets):")
        for n in [100] if args.quick else [100, 1000]:
            forest, rand = time_ask_tell(n)
            print(f"  {n:>5} finished trials: {forest * 1e3:6.1f} ms  ({rand * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
