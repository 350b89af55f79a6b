"""Side-by-side benchmark of search methods: hpo's smac, tpe and gp, SMAC3's HPO facade, random search.

Run from the repository root::

    python -m bench.optimizers                          # every function, 10 seeds, 100 trials
    python -m bench.optimizers --quick                  # 3 seeds, 50 trials, a smoke test
    python -m bench.optimizers --functions branin,mixed --seeds 5
    python -m bench.optimizers --methods SMAC3,tpe,gp,random --save bench/baselines.jsonl  # once (slow)
    python -m bench.optimizers --methods smac --load bench/baselines.jsonl             # then smac beside them

hpo's methods are built exactly as a scenario's ``search.method`` builds them
(:func:`hpo.samplers.build_sampler`) and suggest through :func:`hpo.space.suggest`, as the engine
does; SMAC3 runs its HPO facade (random forest) on the same ConfigSpace space. Prints the median
regret (best value found minus the known optimum; for a real tuning task, minus the best value
any run found) at 50 and 100 trials, the ratio of smac to the best of the anchors (tpe, gp,
SMAC3), and smac against that anchor seed by seed (seeds won, tied and lost, and Wilcoxon's
signed-rank p-value): the goal is a ratio <= 1 everywhere. ``--save`` keeps each run's best
value at each budget and its wall time, which is all the table needs.
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

import optuna

from bench.functions import FUNCTIONS, TestFunction
from hpo.optimizer import SmacSampler
from hpo.samplers import build_sampler

METHODS = ("smac", "tpe", "gp", "SMAC3", "random")
VARIANTS = ("smac-forest", "smac-gp")
ANCHORS = ("tpe", "gp", "SMAC3")


@dataclass(frozen=True)
class Run:
    """One optimizer run: the best value found after each budget, and the run's wall time."""

    method: str
    function: str
    seed: int
    best: dict[int, float]
    seconds: float


def _sampler(fn: TestFunction, method: str, seed: int) -> optuna.samplers.BaseSampler:
    """hpo's sampler of ``method``; a variant ``smac-MODEL`` forces the model of smac's portfolio."""
    if method in VARIANTS:
        return SmacSampler(fn.params, seed=seed, model=method.split("-")[1])
    return build_sampler(method, fn.params, seed=seed)


def _optuna_values(fn: TestFunction, method: str, n_trials: int, seed: int) -> list[float]:
    study = optuna.create_study(sampler=_sampler(fn, method, seed))
    study.optimize(fn, n_trials=n_trials)
    return [t.value if t.value is not None else float("inf") for t in study.trials]


def _smac_values(fn: TestFunction, n_trials: int, seed: int) -> list[float]:
    from smac import HyperparameterOptimizationFacade, Scenario
    from smac.runhistory.dataclasses import TrialValue

    values: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        scenario = Scenario(
            fn.config_space(seed=seed), deterministic=True, n_trials=n_trials, seed=seed,
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


def run_one(task: tuple[str, str, int, tuple[int, ...]]) -> Run:
    """Run ``method`` on the named function with ``seed`` for the largest of ``budgets`` trials."""
    method, name, seed, budgets = task
    _quiet()
    fn = FUNCTIONS[name]
    start = time.perf_counter()
    if method == "SMAC3":
        values = _smac_values(fn, max(budgets), seed)
    else:
        values = _optuna_values(fn, method, max(budgets), seed)
    return Run(method, name, seed, {b: min(values[:b]) for b in budgets}, time.perf_counter() - start)


def _quiet() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("smac").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def regrets(runs: list[Run], budget: int) -> dict[tuple[str, str], dict[int, float]]:
    """Regret of each run after ``budget`` trials by seed, grouped by (function, method); a real
    task's reference is the best value any run found at any budget."""
    reference: dict[str, float] = {}
    for run in runs:
        optimum = FUNCTIONS[run.function].optimum
        found = min(run.best.values())
        reference[run.function] = min(reference.get(run.function, found), found) if optimum is None else optimum
    grouped: dict[tuple[str, str], dict[int, float]] = {}
    for run in runs:
        if budget in run.best:
            regret = max(run.best[budget] - reference[run.function], 0.0)
            grouped.setdefault((run.function, run.method), {})[run.seed] = regret
    return grouped


def paired(mine: dict[int, float], other: dict[int, float]) -> str:
    """Seed by seed on the seeds both have: ``W-T-L p``, the seeds where ``mine`` has the lower,
    the equal and the higher regret, and the two-sided p-value of Wilcoxon's signed-rank test
    of their differences (1 where all are equal), so a median ratio away from 1 can be told
    from the spread of 10 seeds."""
    from scipy.stats import wilcoxon

    seeds = sorted(set(mine) & set(other))
    differences = [mine[s] - other[s] for s in seeds]
    wins, losses = sum(d < 0 for d in differences), sum(d > 0 for d in differences)
    p = float(wilcoxon(differences).pvalue) if wins + losses else 1.0
    return f"{wins}-{len(seeds) - wins - losses}-{losses} {p:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    if b == 0:
        return "1.00" if a == 0 else "inf"
    return f"{a / b:.2f}"


def report(runs: list[Run], budgets: list[int], functions: list[str]) -> str:
    """The table of median regrets, smac's ratio to the best anchor and smac against it seed by
    seed (:func:`paired`), then mean run times."""
    methods = [m for m in METHODS + VARIANTS if any(r.method == m for r in runs)]
    lines = [f"{'function':<13} {'trials':>6} " + " ".join(f"{m:>10}" for m in methods)
             + f" {'smac/best':>9} {'best':>6} {'W-T-L p':>12}"]
    by_budget = {budget: regrets(runs, budget) for budget in budgets}
    for name in functions:
        for budget in budgets:
            grouped = by_budget[budget]
            med = {m: statistics.median(grouped[(name, m)].values()) for m in methods if (name, m) in grouped}
            cells = " ".join(f"{med[m]:>10.4g}" if m in med else f"{'-':>10}" for m in methods)
            anchors = {m: med[m] for m in ANCHORS if m in med}
            best = min(anchors, key=anchors.__getitem__) if anchors else None
            ratio = _ratio(med.get("smac"), anchors[best]) if best else "-"
            versus = paired(grouped[(name, "smac")], grouped[(name, best)]) if best and "smac" in med else "-"
            lines.append(f"{name:<13} {budget:>6} {cells} {ratio:>9} {best or '-':>6} {versus:>12}")
    lines.append("\nmean wall time per run (s): " + ", ".join(
        f"{m} {statistics.mean(r.seconds for r in runs if r.method == m):.1f}" for m in methods))
    return "\n".join(lines)


def save(run: Run, path: str) -> None:
    """Append ``run`` to ``path`` (one JSON object a line)."""
    with open(path, "a") as out:
        out.write(json.dumps(dataclasses.asdict(run)) + "\n")


def load(path: str) -> list[Run]:
    """The runs saved at ``path`` (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as saved:
        rows = [json.loads(line) for line in saved if line.strip()]
    return [Run(**{**r, "best": {int(b): v for b, v in r["best"].items()}}) for r in rows]


def seed_range(text: str, first: int = 0) -> range:
    """``N`` (N seeds from ``first``) or ``A:B`` (seeds A to B-1)."""
    start, _, stop = text.rpartition(":")
    return range(int(start), int(stop)) if start else range(first, first + int(stop))


def main(argv: list[str] | None = None) -> int:
    """Parse options, run every (method, function, seed) on ``--jobs`` processes, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=seed_range, default=range(10), help="N seeds (0 to N-1, default 10) or A:B")
    parser.add_argument("--functions", default=",".join(FUNCTIONS), help="comma-separated names or tags")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS + VARIANTS))
    parser.add_argument("--quick", action="store_true", help="3 seeds and 50 trials")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--save", metavar="FILE", help="append each run to FILE (JSON lines) as it ends; runs "
                        "already there are not run again")
    parser.add_argument("--load", metavar="FILE", help="report these saved runs beside this run's")
    args = parser.parse_args(argv)
    functions = [n for f in args.functions.split(",") if f
                 for n in ([f] if f in FUNCTIONS else [n for n, fn in FUNCTIONS.items() if f in fn.tags])]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS + VARIANTS]
    if unknown or not functions:
        parser.error(f"unknown method {unknown[0]}" if unknown else "no function matches --functions")
    seeds = range(3) if args.quick else args.seeds
    budgets = [50] if args.quick else [50, 100]
    done = [r for r in load(args.save) if r.function in functions and r.method in methods and r.seed in seeds
            and all(b in r.best for b in budgets)] if args.save else []
    finished = {(r.method, r.function, r.seed) for r in done}
    tasks = [(m, f, s, tuple(budgets)) for s in seeds for f in functions for m in methods if (m, f, s) not in finished]
    tasks.sort(key=lambda t: (t[2], FUNCTIONS[t[1]].optimum is None))
    start = time.perf_counter()
    runs = list(done)
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for run in pool.imap_unordered(run_one, tasks):
            runs.append(run)
            if args.save:
                save(run, args.save)
    print(f"{len(tasks)} runs, {max(budgets)} trials each, seeds {seeds.start}-{seeds.stop - 1}, "
          f"in {time.perf_counter() - start:.0f} s\n")
    if args.load:
        runs += [r for r in load(args.load) if r.method not in methods and r.function in functions and r.seed in seeds]
    print(report(runs, budgets, functions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
