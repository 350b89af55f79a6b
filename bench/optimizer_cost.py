"""What the smac optimizer costs per trial on a long history, through the whole engine and alone.

A user's study of ``--history`` finished trials (default 1,000) on a 6-parameter mixed space
(log-scaled floats and ints, a categorical, a linear float) is continued by ``--more`` trials
(default 20) with ``hpo run``, once with ``search.method: smac`` and once with ``monte_carlo``,
from copies of the same SQLite store; each trial runs a tiny script that prints its metric. The
difference of the two per-trial wall times is what the optimizer costs through the engine
(store included). The pair is run ``--repeats`` times, which method goes first alternating, and
the cost is the median of the pairs' differences (pairing keeps it honest while the machine's
speed drifts); the smallest and largest show the spread. The history is written with Optuna's
API (``study.add_trials``) to save a thousand process starts.

Then the sampler alone: on a copy of the store opened in-process, the mean time of smac's
proposal (the first ``suggest`` of a trial, where it is made) and of ask + suggest + tell, beside
Optuna's random sampler.

    python -m bench.optimizer_cost [--history 1000] [--more 20] [--repeats 7]

Where the difference goes (2 cores, 1,000 trials): a design claims its next trial while the
current one runs and records the finished one in the background, so its slot waits only for a
process start. A proposal needs the last result, so smac's slot records it (about 19 ms), then
claims (about 60 ms: the study read, Optuna's ask, the proposal itself of about 20 ms, six
parameter writes) before the next process starts; its first proposal also waits for the forest
helper's import of scikit-learn (1.6 to 2.2 s here, 1.1 s of it scipy.stats), up to half a
second more than a design's start. Claiming a search method's next trial ahead, its values
proposed once the last result is recorded, took 15 ms off that path but not off the wall time
on 2 cores (20-trial runs, 15 pairs: ratio 1.00), where the trial, the helper and the claim
share the processors; it was not kept.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import optuna
import yaml

from hpo import space
from hpo.samplers import build_sampler
from hpo.scenario import Param

PARAMETERS: dict[str, dict[str, Any]] = {
    "lr": {"type": "float", "low": 1e-5, "high": 1.0, "log": True},
    "batch_size": {"type": "int", "low": 16, "high": 512, "log": True},
    "layers": {"type": "int", "low": 1, "high": 8},
    "dropout": {"type": "float", "low": 0.0, "high": 0.8},
    "optimizer": {"type": "categorical", "choices": ["sgd", "adam", "rmsprop"]},
    "weight_decay": {"type": "float", "low": 1e-7, "high": 0.1, "log": True},
}
TEMPLATE = textwrap.dedent("""\
    import math
    lr, batch, layers, dropout, opt, wd = {{ lr }}, {{ batch_size }}, {{ layers }}, {{ dropout }}, "{{ optimizer }}", {{ weight_decay }}
    error = (math.log10(lr) + 3) ** 2 / 4 + (math.log2(batch) - 6) ** 2 / 8 + (layers - 3) ** 2 / 4
    error += 4 * (dropout - 0.1 * layers) ** 2 + {"sgd": 0.2, "adam": 0.0, "rmsprop": 0.1}[opt]
    error += (math.log10(wd) + 4) ** 2 / 25
    print(f"val_error={error}")
    """)


def objective(v: dict[str, Any]) -> float:
    """The template's metric, computed in-process (for the history)."""
    error = (math.log10(v["lr"]) + 3) ** 2 / 4 + (math.log2(v["batch_size"]) - 6) ** 2 / 8 + (v["layers"] - 3) ** 2 / 4
    error += 4 * (v["dropout"] - 0.1 * v["layers"]) ** 2 + {"sgd": 0.2, "adam": 0.0, "rmsprop": 0.1}[v["optimizer"]]
    return error + (math.log10(v["weight_decay"]) + 4) ** 2 / 25


def params() -> dict[str, Param]:
    """The parameters as hpo reads them from a scenario."""
    return {name: Param(**spec) for name, spec in PARAMETERS.items()}


def write_history(store: Path, name: str, n: int, seed: int = 0) -> None:
    """A study of ``n`` finished trials (random configurations, their metric) in SQLite file ``store``."""
    study = optuna.create_study(storage=f"sqlite:///{store}", study_name=name)
    sampler_study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    distributions = space.distributions(params())
    trials = []
    for _ in range(n):
        trial = sampler_study.ask()
        values = space.suggest(trial, params())
        trials.append(optuna.trial.create_trial(params=values, distributions=distributions, value=objective(values)))
    study.add_trials(trials)


def fresh_copy(history: Path, store: Path) -> Path:
    """``store``, a copy of ``history`` with no write-ahead log of an earlier run beside it
    (SQLite would replay that log onto the copy)."""
    for leftover in (store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")):
        leftover.unlink(missing_ok=True)
    shutil.copy(history, store)
    return store


def continue_study(folder: Path, store: Path, name: str, method: str, total: int) -> float:
    """Seconds per trial of ``hpo run`` continuing the study in ``store`` to ``total`` trials."""
    workdir = folder / f"runs-{store.stem}"  # trial folders of one copy of the study: each is a study of its own
    shutil.rmtree(workdir, ignore_errors=True)
    scenario = {"name": name, "template": "trial.py.j2", "command": "python trial.py", "parameters": PARAMETERS,
                "search": {"method": method, "trials": total, "seed": 1}, "storage": f"sqlite:///{store}",
                "workdir": str(workdir), "resources": {"parallel": 1}}
    path = folder / f"{method}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    before = _finished(store, name)
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "hpo", "run", str(path)], capture_output=True, text=True,
                         env=dict(os.environ, HPO_GPUS=""), check=False)
    wall = time.perf_counter() - began
    if run.returncode != 0:
        raise SystemExit(f"hpo run failed:\n{run.stdout}\n{run.stderr}")
    return wall / (_finished(store, name) - before)


def _finished(store: Path, name: str) -> int:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{store}")
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished())


def sampler_alone(store: Path, name: str, method: str, n: int) -> tuple[float, float]:
    """Mean seconds of the proposal (first suggest) and of ask + suggest + tell, over ``n`` trials
    after three warm-up trials, in-process on the study in ``store``."""
    sampler = build_sampler(method, params(), seed=1)
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{store}", sampler=sampler)
    proposal, whole = [], []
    for i in range(n + 3):
        began = time.perf_counter()
        trial = study.ask()
        first = time.perf_counter()
        trial.suggest_float("lr", 1e-5, 1.0, log=True)
        proposed = time.perf_counter()
        values = space.suggest(trial, params())
        study.tell(trial, objective(values))
        if i >= 3:
            proposal.append(proposed - first)
            whole.append(time.perf_counter() - began)
    return statistics.mean(proposal), statistics.mean(whole)


def main() -> None:
    """Build the history, run the continuations and the in-process timing, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument("--more", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = "cost"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "trial.py.j2").write_text(TEMPLATE)
        history = folder / "history.db"
        write_history(history, name, args.history)
        per_trial: dict[str, list[float]] = {"smac": [], "monte_carlo": []}
        for repeat in range(args.repeats):
            for method in sorted(per_trial, reverse=repeat % 2 == 1):
                store = fresh_copy(history, folder / f"{method}.db")
                per_trial[method].append(continue_study(folder, store, name, method, args.history + args.more))
        alone = {}
        for method in ("smac", "random"):
            store = fresh_copy(history, folder / f"alone-{method}.db")
            alone[method] = sampler_alone(store, name, method, args.more)
    smac, mc = (statistics.median(per_trial[m]) for m in ("smac", "monte_carlo"))
    print(f"{args.history} finished trials, continued by {args.more}, {args.repeats} repeats (load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"hpo run, seconds per trial: smac {smac:.3f} (runs {', '.join(f'{v:.3f}' for v in per_trial['smac'])}), "
          f"monte_carlo {mc:.3f} (runs {', '.join(f'{v:.3f}' for v in per_trial['monte_carlo'])})")
    costs = [(a - b) * 1e3 for a, b in zip(per_trial["smac"], per_trial["monte_carlo"])]
    print(f"optimizer cost through the engine: {statistics.median(costs):.0f} ms per trial, the median of "
          f"{len(costs)} pairs (from {min(costs):.0f} to {max(costs):.0f} ms; goal <= 50 ms)")
    print(f"in-process, SQLite: smac proposal {alone['smac'][0] * 1e3:.1f} ms, ask+suggest+tell "
          f"{alone['smac'][1] * 1e3:.1f} ms; random ask+suggest+tell {alone['random'][1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
