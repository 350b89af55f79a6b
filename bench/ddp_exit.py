"""Do data-parallel trials end cleanly? 200 trials of the main job, counted by how they ended.

Runs the quick-start job's trials (``scenarios/digits-monte-carlo.yaml``: the digits CNN,
its 16 Monte Carlo configurations in turn) one after another, each exactly as hpo runs it:
the template rendered into a fresh folder, then ``python -m torch.distributed.run
--standalone --nproc-per-node 2 --no-python PYTHON digits_cnn.py`` there, 2 gloo processes
on the CPU with one thread each. A trial fails on a non-zero exit code; a failure after
the final metrics were printed (a rank aborted at exit) is the bug this bench guards
against. Goal: 0 failures. About 25 minutes on 2 CPU cores; run it under ``nice``.

Usage: ``python -m bench.ddp_exit [--trials 200] [--template PATH] [--keep DIR]``
(``--template`` runs another version of the template, e.g. an older one from git).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2

from hpo.designs import design_points
from hpo.results import parse_text
from hpo.scenario import load_scenario

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIO = REPO_ROOT / "scenarios" / "digits-monte-carlo.yaml"
TEMPLATE = REPO_ROOT / "templates" / "digits_cnn.py.j2"
SCRIPT = "digits_cnn.py"
PROCESSES = 2
TRIAL_TIMEOUT_S = 600
ABORT_MARKERS = ("terminate called", "SIGABRT", "Signal 6")


@dataclass(frozen=True)
class Ending:
    """How one trial ended: exit code, whether its final metrics were printed, seconds."""

    number: int
    exit_code: int
    reported: bool
    aborted: bool
    seconds: float
    tail: str


def trial_env(threads: int) -> dict[str, str]:
    """The environment hpo gives a trial on a CPU slot: no GPUs, ``threads`` per process."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    return env


def run_trial(number: int, params: dict[str, object], template: str, folder: Path, seed: int,
              env: dict[str, str]) -> Ending:
    """Render trial ``number`` into ``folder`` and run it under torchrun as hpo does."""
    folder.mkdir(parents=True)
    context = {**params, "trial_number": number, "trial_dir": str(folder), "seed": seed,
               "trial_seed": seed + number}
    jinja = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    (folder / SCRIPT).write_text(jinja.from_string(template).render(context))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(PROCESSES), "--no-python", sys.executable, SCRIPT]
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=TRIAL_TIMEOUT_S, check=False)
    seconds = time.perf_counter() - began
    (folder / "trial.log").write_text(done.stdout + done.stderr)
    metrics = parse_text(done.stdout, "val_error")
    reported = {"val_error", "test_error"} <= set(metrics.final)
    output = done.stdout + done.stderr
    return Ending(number, done.returncode, reported, any(mark in output for mark in ABORT_MARKERS),
                  seconds, "\n".join(done.stderr.strip().splitlines()[-3:]))


def main() -> None:
    """Run the trials and print how they ended."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--template", type=Path, default=TEMPLATE, help="the digits template to run")
    parser.add_argument("--keep", type=Path, help="keep the trial folders here (default: deleted)")
    args = parser.parse_args()
    scenario = load_scenario(SCENARIO)
    points = design_points(scenario)
    assert points, "the main job is a design of experiments"
    template = args.template.read_text()
    threads = max(1, (os.cpu_count() or 1) // PROCESSES)
    env = trial_env(threads)
    load_before = os.getloadavg()
    print(f"{args.trials} trials of {SCENARIO.name} ({len(points)} configurations in turn) from "
          f"{args.template.name}: torchrun, {PROCESSES} gloo processes x {threads} thread(s)", flush=True)
    endings: list[Ending] = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for number in range(args.trials):
            ending = run_trial(number, points[number % len(points)], template, root / f"trial-{number:04d}",
                               scenario.search.seed, env)
            endings.append(ending)
            if ending.exit_code != 0:
                print(f"trial {number}: exit code {ending.exit_code}, final metrics "
                      f"{'printed' if ending.reported else 'missing'}; {ending.tail}", flush=True)
            if (number + 1) % 20 == 0:
                failed = sum(e.exit_code != 0 for e in endings)
                print(f"  {number + 1} trials, {failed} failed, {time.perf_counter() - began:.0f} s", flush=True)
    wall = time.perf_counter() - began
    failed = [e for e in endings if e.exit_code != 0]
    kinds = collections.Counter(
        "aborted at exit after the final metrics" if e.reported and e.aborted else
        "failed after the final metrics" if e.reported else "failed before the final metrics"
        for e in failed)
    seconds = sorted(e.seconds for e in endings)
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.1f}' for x in load_before)}; "
          f"after {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"trials: {len(endings)}, wall {wall:.0f} s, median {seconds[len(seconds) // 2]:.1f} s per trial")
    print(f"failures: {len(failed)} of {len(endings)} (goal 0)")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count}")


if __name__ == "__main__":
    main()
