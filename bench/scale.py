"""Fast at scale: whole-command wall time of ``hpo status``, ``export`` and ``best`` on a long study.

Builds a study of ``--trials`` finished trials (5 parameters, a held-out metric, 8
intermediate values each, hpo's flat attributes) in an SQLite file, once (``--db PATH``
keeps it for later runs: building 10,000 trials takes minutes), then times each command as a
user runs it: the first call (which reads every trial and writes the row cache), the median
of ``--runs`` more on the finished study (answered from the cache alone), and of ``--runs``
more while the store is being written (its file touched before each call, as a running
sweep's writes do: the command opens the store and reads what is new). Goals at 10,000
trials: status <= 1 s, export and best <= 2 s.

    python -m bench.scale [--trials 10000] [--runs 5] [--db /tmp/scale.db]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import create_trial

SCENARIO = textwrap.dedent("""\
    name: scale
    template: t.py.j2
    command: python t.py
    parameters:
      a: {type: float, low: 0, high: 1}
      b: {type: float, low: 0.001, high: 1, log: true}
      c: {type: int, low: 1, high: 5}
      d: {type: categorical, choices: [x, y]}
      e: {type: int, low: 8, high: 64, log: true}
    search: {method: tpe, trials: %d}
    objective: {metric: val_error, held_out: [test_error]}
    """)
DISTRIBUTIONS = {"a": FloatDistribution(0, 1), "b": FloatDistribution(1e-3, 1, log=True), "c": IntDistribution(1, 5),
                 "d": CategoricalDistribution(["x", "y"]), "e": IntDistribution(8, 64, log=True)}


def build(url: str, trials: int) -> None:
    """A study named ``scale`` of ``trials`` finished trials, as hpo records them."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="scale", storage=url, load_if_exists=True)
    missing = trials - len(study.get_trials(deepcopy=False))
    rng = random.Random(0)
    batch = []
    for number in range(trials - missing, trials):
        params = {"a": rng.random(), "b": 10 ** rng.uniform(-3, 0), "c": rng.randint(1, 5),
                  "d": rng.choice(["x", "y"]), "e": rng.randint(8, 64)}
        value = rng.random()
        batch.append(create_trial(params=params, distributions=DISTRIBUTIONS, value=value,
                                  intermediate_values={step: value + 1 / (step + 1) for step in range(8)},
                                  user_attrs={"outcome": "COMPLETE", "reason": "", "duration_s": 1.5,
                                              "folder": f"/runs/scale/trial-{number:05d}", "test_error": value}))
    if batch:
        study.add_trials(batch)


def timed(argv: list[str], touch: Path | None = None) -> float:
    """Whole-command wall time of ``argv``; ``touch``: mark that file written just now first,
    as a running sweep keeps doing (the command must then read the store)."""
    if touch is not None:
        touch.touch()
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=dict(os.environ, HPO_GPUS=""))
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return elapsed


def main() -> None:
    """Build (or reuse) the study, time the commands, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--db", help="SQLite file to build once and reuse (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        db = Path(args.db) if args.db else folder / "scale.db"
        url = f"sqlite:///{db.resolve()}"
        began = time.perf_counter()
        build(url, args.trials)
        print(f"study of {args.trials} trials ready in {time.perf_counter() - began:.0f} s ({db})", flush=True)
        (folder / "t.py.j2").write_text("print('val_error={{ a }}')\n")
        scenario = folder / "scale.yaml"
        scenario.write_text(SCENARIO % args.trials)
        commands = {"status": ["status"], "export": ["export", "-o", str(folder / "out.csv")], "best": ["best"]}
        for name, words in commands.items():
            argv = [sys.executable, "-m", "hpo", *words, str(scenario), "--storage", url]
            goal = 1.0 if name == "status" else 2.0
            for cache in db.parent.glob(f"{db.name}.*.hpo-rows.json"):
                cache.unlink()
            os.utime(db, (time.time() - 60, time.time() - 60))  # the sweep ended a minute ago
            first = timed(argv)
            quiet = [timed(argv) for _ in range(args.runs)]
            written = [timed(argv, touch=db) for _ in range(args.runs)]
            for label, times in (("finished study", quiet), ("store being written", written)):
                print(f"hpo {name:<6} at {args.trials} trials, {label}: median {statistics.median(times):.2f} s "
                      f"(min {min(times):.2f}, max {max(times):.2f}; goal <= {goal:g} s)", flush=True)
            print(f"hpo {name:<6} at {args.trials} trials, first call (reads every trial, writes the cache): "
                  f"{first:.2f} s", flush=True)


if __name__ == "__main__":
    main()
