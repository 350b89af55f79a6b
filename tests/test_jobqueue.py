"""The job script that ``hpo validate`` prints for batch-job clusters: built without a scheduler, writing nothing."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import pytest
from conftest import cli_env

from hpo.jobqueue import SCHEDULER_PLACEHOLDER, job_script
from hpo.scenario import Cluster

WriteScenario = Callable[..., Path]

SPECS = {
    "slurm": ({"gpus": 2, "walltime": "02:00:00", "queue": "gpu", "account": "p7"},
              ("#SBATCH -p gpu", "#SBATCH -A p7", "#SBATCH --gres=gpu:2")),
    "pbs": ({"gpus": 1, "walltime": "01:00:00", "queue": "workq"}, ("#PBS -q workq", "#PBS -l walltime=01:00:00")),
    "sge": ({"gpus": 1, "account": "p"}, ("#$ -l gpu=1", "#$ -P p")),
    "lsf": ({"gpus": 2}, ('#BSUB -gpu "num=2"',)),
    "htcondor": ({"gpus": 1, "disk": "10GB"}, ("request_gpus = 1",)),
}


@pytest.mark.parametrize("kind", list(SPECS))
def test_the_job_script_is_built_without_a_scheduler(kind: str, tmp_path: Path) -> None:
    """No scheduler starts, so Dask's scratch space (``dask-scratch-space/*.lock``) is not made."""
    extra, lines = SPECS[kind]
    spec = Cluster(kind=kind, cores=4, memory="8GB", setup=("module load cuda",), **extra)  # type: ignore[arg-type]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    with dask.config.set({"temporary-directory": str(scratch)}):
        script = job_script(spec)
    assert list(scratch.iterdir()) == []
    for line in (*lines, "module load cuda"):
        assert line in script, line
    assert f"{sys.executable} -m distributed.cli.dask_worker {SCHEDULER_PLACEHOLDER}" in script
    assert "--resources CPU=4,GPU=" in script


def test_validate_of_a_cluster_scenario_writes_nothing(tmp_path: Path, write_scenario: WriteScenario) -> None:
    cluster: dict[str, Any] = {"kind": "slurm", "jobs": 4, "cores": 8, "memory": "30GB", "gpus": 2}
    path = write_scenario(tmp_path / "s", resources={"cluster": cluster})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    done = subprocess.run([sys.executable, "-m", "hpo", "validate", str(path)], env={**cli_env(), "TMPDIR": str(temporary)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --gres=gpu:2" in done.stdout and SCHEDULER_PLACEHOLDER in done.stdout
    assert list(temporary.iterdir()) == []
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p != temporary) == before
