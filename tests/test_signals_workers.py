"""Nothing is ever lost with several workers: signals to ``hpo run --workers 2``, and a sequence of stops."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_env
from test_signals import assert_every_point_once, hpo, rows, write


def test_signals_then_kill_then_resume(tmp_path: Path) -> None:
    """The sequence of the report: SIGINT, then SIGTERM, then kill -9, then a resume."""
    path = write(tmp_path, 1)
    assert hpo("run", str(path), faults="started@0=INT").returncode == 130
    assert hpo("run", str(path), faults="settled@2=TERM").returncode == 143
    assert hpo("run", str(path), faults="started@4=KILL").returncode == -9
    assert hpo("run", str(path)).returncode == 0
    assert_every_point_once(path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_workers_stop_together_and_resume(tmp_path: Path, sig: signal.Signals) -> None:
    path = write(tmp_path, 2, pause=1.0)
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--workers", "2"], env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while sum("RUNNING" == r["state"] for r in rows(path)) < 2:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.2)
    run.send_signal(sig)
    out, err = run.communicate(timeout=60)
    assert run.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -9}[sig], out + err
    if sig == signal.SIGKILL:  # the workers get SIGTERM when hpo run dies, and stop as gracefully
        deadline = time.monotonic() + 30
        while any(r["state"] == "RUNNING" for r in rows(path)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert not [r for r in rows(path) if r["state"] == "RUNNING"]
    again = hpo("run", str(path), "--workers", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert_every_point_once(path)
    logs = sorted((tmp_path / "runs" / "sweep").glob("worker-*.log"))
    assert len(logs) == 2 and all(log.read_text().count("--- hpo worker") == 2 for log in logs)
