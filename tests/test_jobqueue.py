"""The job script that ``hpo validate`` prints for batch-job clusters: built without a scheduler, writing nothing."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import pytest
from conftest import run_hpo_process

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
    done = run_hpo_process("validate", path, timeout=120, extra_env={
        "TMPDIR": str(temporary), "PATH": f"{on_path(tmp_path / 'bin', 'sbatch')}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --gres=gpu:2" in done.stdout and SCHEDULER_PLACEHOLDER in done.stdout
    assert list(temporary.iterdir()) == []
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p != temporary and "bin" not in p.parts) \
        == before


def on_path(folder: Path, name: str) -> Path:
    """``folder`` with an executable ``name`` in it (it is never run: validate looks it up only)."""
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\nexit 1\n")
    (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize(("kind", "extra", "command"), [("slurm", {}, "sbatch"), ("lsf", {}, "bsub"),
                                                        ("htcondor", {"disk": "1GB"}, "condor_submit")])
@pytest.mark.parametrize("hpo_command", ["validate", "run"])
def test_batch_jobs_that_cannot_be_submitted_from_here_are_bad_input(
        tmp_path: Path, write_scenario: WriteScenario, kind: str, extra: dict[str, Any], command: str,
        hpo_command: str) -> None:
    """Without sbatch, validate said ok without a word, and run made the study, queued 16 trials
    and wrote their folders, then exited 1 advising to run the same command again (which failed
    the same way)."""
    cluster: dict[str, Any] = {"kind": kind, "jobs": 2, "cores": 1, "memory": "1GB", **extra}
    path = write_scenario(tmp_path / "s", resources={"cluster": cluster})
    python_only = Path(sys.executable).parent
    done = run_hpo_process(hpo_command, path, timeout=120, extra_env={"PATH": str(python_only)})
    said = (f"resources.cluster.kind: {kind} jobs are submitted with {command}, which is not on PATH here; run hpo "
            f"where {command} works (a login node of the cluster)")
    if hpo_command == "validate":  # the job script is printed, as anywhere, with the note
        assert done.returncode == 0 and done.stdout.endswith(f"\nnote: {said}\n"), done.stdout + done.stderr
    else:
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: scenario.yaml: {said}\n")
    assert not (tmp_path / "s" / "runs").exists()
