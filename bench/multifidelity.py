"""Multi-fidelity: smac with Hyperband against TPE with Hyperband and against smac without pruning.

A small CNN learns scikit-learn's 8x8 digits (1,200 to train, 597 to validate) for up to
``--epochs`` epochs; epochs are the budget. Each method gets the same total number of epochs
(``--budget``, default 20 full trainings' worth); with Hyperband (Optuna's ``HyperbandPruner``,
as ``search.pruner: hyperband`` builds it) most trials stop after a few epochs and the sweep runs
more of them. Training is deterministic (one seed for every trial), so a configuration's learning
curve is a function of the configuration. Hyperband puts a trial in a bracket by a checksum of the
study's name and the trial's number, so each seed's study has one name for every method: its runs
repeat, and the methods with Hyperband get the same brackets. Prints, per method, the median over
seeds of the regret at equal total epochs: the best validation error of a trial that ran every
epoch, minus the best any run found; and the number of trials run.

    python -m bench.multifidelity [--seeds 5] [--epochs 9] [--budget 180] [--jobs 2]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from functools import lru_cache
from typing import Any

import numpy as np
import optuna

from hpo import space
from hpo.samplers import build_sampler
from hpo.scenario import Param

PARAMS = {
    "lr": Param(type="float", low=1e-4, high=0.1, log=True),
    "channels": Param(type="int", low=2, high=16, log=True),
    "hidden": Param(type="int", low=8, high=128, log=True),
    "dropout": Param(type="float", low=0.0, high=0.7),
    "batch_size": Param(type="int", low=32, high=256, log=True),
    "weight_decay": Param(type="float", low=1e-7, high=1e-2, log=True),
}
METHODS = ("smac+hyperband", "tpe+hyperband", "smac")


@lru_cache(maxsize=1)
def _digits() -> tuple[Any, Any, Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y[order])
    return x[:1200], y[:1200], x[1200:], y[1200:]


def train(trial: optuna.Trial, epochs: int) -> float:
    """Train the CNN of the trial's parameters, reporting the validation error after each epoch."""
    import torch
    from torch import nn

    v = space.suggest(trial, PARAMS)
    torch.manual_seed(0)
    x, y, vx, vy = _digits()
    c = v["channels"]
    model = nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * 16, v["hidden"]), nn.ReLU(), nn.Dropout(v["dropout"]),
        nn.Linear(v["hidden"], 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=v["lr"], weight_decay=v["weight_decay"])
    generator = torch.Generator().manual_seed(0)
    error = 1.0
    for epoch in range(1, epochs + 1):
        model.train()
        for batch in torch.randperm(len(y), generator=generator).split(v["batch_size"]):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            error = float((model(vx).argmax(1) != vy).float().mean())
        trial.report(error, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return error


def run_one(task: tuple[str, int, int, int]) -> tuple[str, int, float, int]:
    """(method, seed, best full-budget validation error, trials run) of one sweep of ``budget`` epochs."""
    method, seed, epochs, budget = task
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs) if "+" in method \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(study_name=f"multifidelity-{seed}", pruner=pruner,
                                sampler=build_sampler(method.split("+")[0], PARAMS, seed=seed))
    spent = 0
    while spent < budget:
        trial = study.ask()
        try:
            study.tell(trial, train(trial, epochs))
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        spent += len(study.trials[-1].intermediate_values)
    full = [t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    return method, seed, min(full) if full else 1.0, len(study.trials)


def main() -> None:
    """Run every (method, seed) on ``--jobs`` processes and print the regrets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--budget", type=int, default=180, help="total epochs per sweep")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    tasks = [(m, s, args.epochs, args.budget) for s in range(args.seeds) for m in METHODS]
    began = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        results = pool.map(run_one, tasks)
    best = min(r[2] for r in results)
    print(f"digits CNN, up to {args.epochs} epochs a trial, {args.budget} epochs a sweep, {args.seeds} seeds, "
          f"{time.perf_counter() - began:.0f} s (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'method':<16} {'median regret':>14} {'regrets by seed':<40} {'trials':>7}")
    for method in METHODS:
        mine = [r for r in results if r[0] == method]
        regrets = [r[2] - best for r in mine]
        print(f"{method:<16} {statistics.median(regrets):>14.4f} {' '.join(f'{g:.4f}' for g in regrets):<40} "
              f"{statistics.median(r[3] for r in mine):>7.0f}")


if __name__ == "__main__":
    main()
