"""The parallel shared-model optimizer, end to end through the CLI, and method switching."""
from __future__ import annotations

import csv
import io
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import run_hpo

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
