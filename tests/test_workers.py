"""The parallel shared-model optimizer, end to end through the CLI, and method switching."""
from __future__ import annotations

import csv
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import cli_env, run_hpo

from hpo.launch import usable_cores

BRANIN = textwrap.dedent("""\
    import math
    x, y = {{ x }}, {{ y }}
    value = (y - 5.1 / (4 * math.pi ** 2) * x ** 2 + 5 / math.pi * x - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x) + 10
    print(f"val_error={value} test_error={value + {{ shift }}}")
    """)


def hpo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the ``hpo`` CLI to the end (no GPUs: trials are CPU processes)."""
    return run_hpo(*args, timeout=timeout)


def branin(tmp_path: Path, method: str, trials: int, parallel: int = 3) -> Path:
    """A Branin scenario (a categorical constant shift keeps the held-out metric apart)."""
    (tmp_path / "branin.py.j2").write_text(BRANIN)
    path = tmp_path / "branin.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: branin
        template: branin.py.j2
        command: python branin.py
        parameters:
          x: {{type: float, low: -5, high: 10}}
          y: {{type: float, low: 0, high: 15}}
          shift: {{type: constant, value: 1.0}}
        search: {{method: {method}, trials: {trials}, seed: 11}}
        objective: {{metric: val_error, held_out: [test_error]}}
        resources: {{parallel: {parallel}, gpus_per_trial: 1}}
        """))
    return path


def rows(path: Path) -> list[dict[str, str]]:
    """The exported results."""
    result = hpo("export", str(path))
    assert result.returncode == 0, result.stderr
    return list(csv.DictReader(io.StringIO(result.stdout)))


@pytest.mark.parametrize("method", ["smac", "tpe"])
def test_three_workers_share_one_study(tmp_path: Path, method: str) -> None:
    path = branin(tmp_path, method, trials=24)
    run = hpo("run", str(path), "--workers", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "24/24 trials done: 24 complete." in run.stdout
    results = rows(path)
    assert len(results) == 24 and all(r["state"] == "COMPLETE" for r in results)
    assert len({(r["x"], r["y"]) for r in results}) == 24
    workers = sorted((tmp_path / "runs" / "branin").glob("worker-*.log"))
    assert len(workers) == 3 and all("trial" in log.read_text() for log in workers)


def test_monte_carlo_study_continues_with_smac(tmp_path: Path) -> None:
    path = branin(tmp_path, "monte_carlo", trials=10, parallel=2)
    assert hpo("run", str(path)).returncode == 0
    first = rows(path)
    path.write_text(path.read_text().replace("method: monte_carlo, trials: 10", "method: smac, trials: 30"))
    run = hpo("run", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "10 of 30 trials done before this run" in run.stdout
    results = rows(path)
    assert results[:10] == first and len(results) == 30
    best_random = min(float(r["val_error"]) for r in first)
    best_smac = min(float(r["val_error"]) for r in results[10:])
    assert best_smac < best_random


WHERE = textwrap.dedent("""\
    import os, time
    from hpo.results import report
    began = time.time()
    time.sleep({{ pause }})
    report(val_error={{ x }}, gpu=float(os.environ["CUDA_VISIBLE_DEVICES"] or -1),
           threads=float(os.environ["OMP_NUM_THREADS"]), began=began, ended=time.time())
    """)


def where(tmp_path: Path, resources: str, trials: int, pause: float) -> Path:
    """A scenario whose trials report their GPU, their threads and when they ran."""
    (tmp_path / "where.py.j2").write_text(WHERE)
    path = tmp_path / "where.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: where
        template: where.py.j2
        command: python where.py
        parameters:
          x: {{type: float, low: 0, high: 1}}
          pause: {{type: constant, value: {pause}}}
        search: {{method: monte_carlo, trials: {trials}, seed: 2}}
        objective: {{metric: val_error, held_out: [gpu, threads, began, ended]}}
        resources: {resources}
        """))
    return path


def run_with_gpus(gpus: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    env["HPO_GPUS"] = gpus
    return subprocess.run([sys.executable, "-m", "hpo", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_workers_divide_the_machines_gpus_and_threads(tmp_path: Path) -> None:
    path = where(tmp_path, "{parallel: 2, gpus_per_trial: 1}", trials=6, pause=0.2)
    result = run_with_gpus("0,1", "run", str(path), "--workers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(path)
    assert len(found) == 6 and {r["gpu"] for r in found} == {"0.0", "1.0"}
    threads = max(1, usable_cores() // 2)
    assert {float(r["threads"]) for r in found} == {threads}
    logs = [log.read_text() for log in sorted((tmp_path / "runs" / "where").glob("worker-*.log"))]
    assert ["1 process on GPU 0" in logs[0], "1 process on GPU 1" in logs[1]] == [True, True]


def test_fractional_gpus_pack_overlapping_trials_onto_one_gpu(tmp_path: Path) -> None:
    path = where(tmp_path, "{parallel: auto, gpus_per_trial: 0.25}", trials=8, pause=1.0)
    result = run_with_gpus("0", "run", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 slots: 1 process on 1/4 of GPU 0" in result.stdout
    found = rows(path)
    assert len(found) == 8 and {r["gpu"] for r in found} == {"0.0"}
    spans = [(float(r["began"]), float(r["ended"])) for r in found]
    most = max(sum(began <= moment < ended for began, ended in spans) for moment, _ in spans)
    assert most >= 3, spans
