"""Trials on a real Slurm cluster: a single-node Slurm (Debian's ``slurm-wlm``) that the test
starts and removes, with hpo starting its Dask workers as batch jobs through dask-jobqueue.

Needs root and the Slurm daemons (``.ci/run`` installs ``slurm-wlm``); skipped otherwise.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import cli_env

TEMPLATE = textwrap.dedent("""\
    import os, time
    print("slurm job", os.environ.get("SLURM_JOB_ID"))
    time.sleep({{ pause }})
    print("val_error={{ x }}")
    """)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Slurm:
    """A private single-node Slurm: slurmctld and slurmd in the foreground, state in a folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        host = socket.gethostname().split(".")[0]
        for name in ("state", "spool", "log"):
            (folder / name).mkdir(parents=True)
        self.conf = folder / "slurm.conf"
        self.conf.write_text(textwrap.dedent(f"""\
            ClusterName=hpotest
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            AuthType=auth/none
            CredType=cred/none
            ProctrackType=proctrack/pgid
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            JobAcctGatherType=jobacct_gather/none
            StateSaveLocation={folder}/state
            SlurmdSpoolDir={folder}/spool
            SlurmctldPidFile={folder}/slurmctld.pid
            SlurmdPidFile={folder}/slurmd.pid
            SlurmctldLogFile={folder}/log/slurmctld.log
            SlurmdLogFile={folder}/log/slurmd.log
            SlurmUser=root
            SlurmdUser=root
            ReturnToService=2
            MpiDefault=none
            NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000 State=UNKNOWN
            PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
            """))
        self.env = {**cli_env(), "SLURM_CONF": str(self.conf)}
        self.daemons = [subprocess.Popen([daemon, "-D", "-f", str(self.conf), *extra], env=self.env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for daemon, extra in (("slurmctld", ["-i"]), ("slurmd", ["-N", host]))]

    def command(self, *argv: str) -> str:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30, check=True).stdout

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.command("sinfo", "-h", "-o", "%t").strip() == "idle":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"Slurm never became idle: {(self.folder / 'log' / 'slurmctld.log').read_text()[-2000:]}")

    def jobs(self) -> list[str]:
        """Job ids Slurm still has (pending, running or completing)."""
        return self.command("squeue", "-h", "-o", "%i").split()

    def stop(self) -> None:
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, check=False)
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Slurm]:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch")):
        pytest.skip("needs root and Slurm (Debian's slurm-wlm)")
    cluster = Slurm(tmp_path / "slurm")
    try:
        cluster.wait_idle()
        yield cluster
    finally:
        cluster.stop()


def _scenario(folder: Path, trials: int, pause: float) -> Path:
    (folder / "trial.py.j2").write_text(TEMPLATE)
    path = folder / "slurm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "slurm", "template": "trial.py.j2", "command": "python trial.py",
        "parameters": {"x": {"type": "float", "low": 0, "high": 1}, "pause": {"type": "constant", "value": pause}},
        "search": {"method": "monte_carlo", "trials": trials, "seed": 3},
        "resources": {"timeout": 120, "cluster": {"kind": "slurm", "jobs": 2, "cores": 1, "memory": "1GB",
                                                  "walltime": "00:10:00", "queue": "debug"}},
    }, sort_keys=False))
    return path


def _rows(slurm: Slurm, path: Path) -> list[dict[str, str]]:
    export = subprocess.run([sys.executable, "-m", "hpo", "export", str(path)], env=slurm.env, capture_output=True,
                            text=True, timeout=60, check=True)
    return list(csv.DictReader(io.StringIO(export.stdout)))


def _job_running_a_trial(workdir: Path, deadline: float) -> str | None:
    """The id of a Slurm job whose trial has started (its log names the job), or None by ``deadline``."""
    while time.monotonic() < deadline:
        for log in workdir.glob("trial-*/trial.log"):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("slurm job") and line.split()[-1].isdigit():
                    return line.split()[-1]
        time.sleep(0.2)
    return None


def _wait_no_jobs(slurm: Slurm, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    return slurm.jobs()


def test_trials_run_as_slurm_jobs_that_end_with_the_sweep(slurm: Slurm, tmp_path: Path) -> None:
    path = _scenario(tmp_path, trials=4, pause=0.5)
    run = subprocess.run([sys.executable, "-m", "hpo", "run", str(path)], env=slurm.env, capture_output=True,
                         text=True, timeout=240, check=False, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4/4 trials done: 4 complete." in run.stdout
    assert "Traceback" not in run.stdout + run.stderr  # distributed's errors as it cancelled the waits of its Events
    assert list((tmp_path / "runs" / "slurm" / "jobs").glob("*.out"))  # the jobs' output, in the sweep's folder
    assert not list(tmp_path.glob("slurm-*.out"))  # not where hpo was started
    rows = _rows(slurm, path)
    assert [row["state"] for row in rows] == ["COMPLETE"] * 4
    for row in rows:
        log = (Path(row["folder"]) / "trial.log").read_text()
        job = next(line.split()[-1] for line in log.splitlines() if line.startswith("slurm job"))
        assert job.isdigit(), log  # the trial ran inside a Slurm job
    assert _wait_no_jobs(slurm) == []  # the jobs were cancelled when the sweep ended


def test_a_job_cancelled_mid_trial_loses_nothing(slurm: Slurm, tmp_path: Path) -> None:
    """A job that ends under a running trial (its walltime, a node failure): the trial is LOST
    and its configuration runs again in another job; the budget is still exactly met."""
    path = _scenario(tmp_path, trials=3, pause=4)
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path)], env=slurm.env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job = _job_running_a_trial(tmp_path / "runs" / "slurm", deadline=time.monotonic() + 120)
        assert job is not None, "no Slurm job ever ran a trial"
        slurm.command("scancel", job)  # the trial sleeps 4 s: it is still running in that job
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out
    rows = _rows(slurm, path)
    states = [row["state"] for row in rows]
    assert states.count("COMPLETE") == 3 and "LOST" in states, (states, out)
    assert sorted(row["x"] for row in rows if row["state"] == "COMPLETE") == sorted({row["x"] for row in rows})
    assert _wait_no_jobs(slurm) == []
