"""The job script of a batch-job cluster names where its output goes, as ``hpo run`` sends it."""
from __future__ import annotations

from pathlib import Path

import pytest

from hpo.jobqueue import job_script
from hpo.scenario import Cluster


@pytest.mark.parametrize("kind", ["slurm", "pbs"])
def test_the_job_script_sends_the_jobs_output_where_hpo_run_does(kind: str, tmp_path: Path) -> None:
    """Into ``<workdir>/jobs``, which printing the script does not create."""
    logs = tmp_path / "work" / "jobs"
    script = job_script(Cluster(kind=kind, cores=2, memory="4GB"), logs)
    assert f"-e {logs}" in script and f"-o {logs}" in script, script
    assert not logs.exists() and "hpo-job-logs-" not in script
