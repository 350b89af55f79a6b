"""Many workers, one store: does anything get lost or locked?

Runs ``hpo run --workers 4`` on a study of 4 x 200 trials that each take 0.05 s, all on one
store (the default SQLite file, or ``--storage URL``), then prints the trials lost (asked
for but not finished, or never run), the "database is locked" errors in any output or
reason, duplicate design points, and the throughput in trials per second.

    python bench/stress.py [--workers 4] [--per-worker 200] [--storage URL]
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from hpo.scenario import load_scenario
from hpo.storage import storage_url
from hpo.store import StudyStore


def main() -> None:
    """Run the stress test and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--per-worker", type=int, default=200)
    parser.add_argument("--storage", help="storage URL (default: SQLite in a temporary folder)")
    args = parser.parse_args()
    total = args.workers * args.per_worker
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "trial.py.j2").write_text("import time\ntime.sleep(0.05)\nprint('val_error={{ x }}')\n")
        (folder / "stress.yaml").write_text(textwrap.dedent(f"""\
            name: stress
            template: trial.py.j2
            command: python trial.py
            parameters:
              x: {{type: float, low: 0, high: 1}}
            search: {{method: monte_carlo, trials: {total}, seed: 7}}
            resources: {{parallel: {args.workers}, gpus_per_trial: 1, timeout: 60}}
            """))
        argv = [sys.executable, "-m", "hpo", "run", str(folder / "stress.yaml"), "--workers", str(args.workers)]
        if args.storage:
            argv += ["--storage", args.storage]
        began = time.monotonic()
        run = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, HPO_GPUS=""), check=False)
        wall = time.monotonic() - began
        scenario = load_scenario(folder / "stress.yaml")
        url = storage_url(scenario, args.storage)
        rows = StudyStore(scenario, url, create=False).rows()
    output = run.stdout + run.stderr
    states = collections.Counter(row.state for row in rows)
    locked = output.count("database is locked") + sum("locked" in row.reason for row in rows)
    points = collections.Counter(row.params.get("x") for row in rows)
    duplicates = sum(n - 1 for n in points.values() if n > 1)
    lost = total - states.get("COMPLETE", 0)
    print(f"{args.workers} workers x {args.per_worker} trials of 0.05 s on {url.split(':')[0]}: exit code {run.returncode}")
    print(f"trials recorded: {len(rows)} {dict(states)}")
    print(f"lost trials: {lost}")
    print(f"lock errors: {locked}")
    print(f"duplicate points: {duplicates}")
    print(f"throughput: {states.get('COMPLETE', 0) / wall:.1f} trials/s ({wall:.1f} s wall)")
    if run.returncode != 0:
        print(output[-2000:])


if __name__ == "__main__":
    main()
