"""Nothing is ever lost: SIGINT, SIGTERM and kill -9 at chosen moments, then resume.

Each case runs a real ``hpo run`` of a 6-point Monte Carlo design whose trials take a
fraction of a second; ``HPO_FAULTS`` makes hpo signal itself at a named point (a trial
claimed, started, half recorded, or recorded), so the moment is exact, not a sleep. After a
resume, the study must hold every design point exactly once as a trial that ran to its own
end, and nothing RUNNING or WAITING.
"""
from __future__ import annotations

import csv
import io
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import run_hpo, run_hpo_process

from hpo import designs
from hpo.errors import InputError
from hpo.scenario import load_scenario
from hpo.store import StudyStore

POINTS = 6
TRIAL = """\
import time
from hpo.results import report
time.sleep({{ pause }})
report(step=1, val_error={{ x }} * 2)
report(val_error={{ x }}, test_error={{ x }} / 2)
"""


def write(tmp_path: Path, parallel: int, pause: float = 0.1) -> Path:
    (tmp_path / "trial.py.j2").write_text(TRIAL)
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: sweep
        template: trial.py.j2
        command: python trial.py
        parameters:
          x: {{type: float, low: 0.0, high: 1.0}}
          pause: {{type: constant, value: {pause}}}
        search: {{method: monte_carlo, trials: {POINTS}, seed: 11}}
        objective: {{metric: val_error, held_out: [test_error]}}
        resources: {{parallel: {parallel}, heartbeat: 1}}
        """))
    return path


def hpo(*args: str, faults: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``hpo ARGS`` to the end; with ``faults`` (``HPO_FAULTS``: a signal at a named moment
    of the sweep), always in a process of its own."""
    if not faults:
        return run_hpo(*args, timeout=timeout)
    return run_hpo_process(*args, timeout=timeout, extra_env={"HPO_FAULTS": faults})


def rows(path: Path) -> list[dict[str, str]]:
    """The study's rows as the CSV has them (read in-process: polled often)."""
    try:
        store = StudyStore(load_scenario(path), f"sqlite:///{path.parent}/runs/sweep/study.db", create=False)
    except InputError:  # not created yet
        return []
    return [{"number": str(r.number), "state": r.state, "x": str(r.params.get("x", ""))} for r in store.rows()]


def assert_every_point_once(path: Path) -> list[dict[str, str]]:
    """The design's points, each exactly once as a trial that ran to its own end; nothing pending."""
    found = rows(path)
    exported = list(csv.DictReader(io.StringIO(hpo("export", str(path)).stdout)))
    assert [(r["number"], r["state"]) for r in exported] == [(r["number"], r["state"]) for r in found]
    points = sorted(repr(p["x"]) for p in designs.design_points(load_scenario(path)) or [])
    own = [r for r in found if r["state"] in ("COMPLETE", "FAIL", "PRUNED", "STOPPED", "TIMEOUT")]
    assert sorted(repr(float(r["x"])) for r in own) == points, found
    assert all(r["state"] == "COMPLETE" for r in own), own
    assert not [r for r in found if r["state"] in ("RUNNING", "WAITING")], found
    return found


CODES = {"INT": 130, "TERM": 143, "KILL": -9}


@pytest.mark.parametrize(("sig", "point", "parallel"), [
    ("INT", "claim@1", 1), ("INT", "started@1", 1), ("INT", "record@1", 1), ("INT", "settled@2", 1),
    ("INT", "started@2", 2), ("INT", "record@3", 2),
    ("TERM", "started@1", 1), ("TERM", "settled@2", 2),
    ("KILL", "claim@1", 1), ("KILL", "started@1", 1), ("KILL", "record@1", 1), ("KILL", "record@3", 2),
])
def test_a_signal_at_any_moment_then_resume_runs_every_point_once(tmp_path: Path, sig: str, point: str,
                                                                   parallel: int) -> None:
    """SIGINT and SIGTERM take the same graceful path (only the exit code differs), so SIGTERM
    is tried at fewer points."""
    path = write(tmp_path, parallel)
    first = hpo("run", str(path), faults=f"{point}={sig}")
    assert first.returncode == CODES[sig], first.stdout + first.stderr
    assert "Traceback" not in first.stderr
    if sig != "KILL":
        stopped = rows(path)
        assert not [r for r in stopped if r["state"] == "RUNNING"], stopped
        assert "run the same command to resume" in first.stderr
    again = hpo("run", str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    found = assert_every_point_once(path)
    assert f"{POINTS}/{POINTS} trials done: {POINTS} complete" in again.stdout
    if point.startswith("record") and sig == "KILL":  # the result was in the folder: recorded, not re-run
        number = point.split("@")[1]
        assert next(r for r in found if r["number"] == number)["state"] == "COMPLETE"


def test_hpo_stop_of_a_queued_copy_records_it_stopped_and_the_resume_never_runs_it(tmp_path: Path) -> None:
    """Ctrl-C queues the running trial's copy; ``hpo stop`` of that copy records it STOPPED
    at once (no worker runs it), and the resume runs every other point, that one never."""
    path = write(tmp_path, 1)
    assert hpo("run", str(path), faults="started@1=INT").returncode == 130
    found = rows(path)  # the next point, if it was claimed ahead, went back to the queue too
    interrupted = next(r for r in found if r["state"] == "INTERRUPTED")
    copy = next(r for r in found if r["state"] == "WAITING" and r["x"] == interrupted["x"])
    stop = hpo("stop", str(path), copy["number"])
    assert (stop.returncode, stop.stdout, stop.stderr) == (
        0, f"trial {copy['number']} was queued: recorded STOPPED, it will not run\n", "")
    stopped = next(r for r in csv.DictReader(io.StringIO(hpo("export", str(path)).stdout))
                   if r["number"] == copy["number"])
    assert (stopped["state"], stopped["reason"]) == ("STOPPED", "stopped by the user before it ran")
    assert (stopped["repeat_of"], stopped["x"]) == (interrupted["number"], copy["x"])
    assert not Path(stopped["folder"]).exists()
    again = hpo("stop", str(path), copy["number"])
    assert (again.returncode, again.stderr.strip()) == (2, f"error: trial {copy['number']}: it is STOPPED, not running or queued")
    resumed = hpo("run", str(path))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    found = rows(path)
    ran = [r for r in found if r["state"] == "COMPLETE"]
    assert len(ran) == POINTS - 1 and copy["x"] not in {r["x"] for r in ran}, found
    assert f"{POINTS}/{POINTS} trials done: {POINTS - 1} complete, 1 stopped" in resumed.stdout
