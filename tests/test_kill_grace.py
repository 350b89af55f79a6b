"""Ending a trial's process tree takes one grace for all of it (SIGTERM to every process at once,
SIGKILL to what is left ``KILL_GRACE_S`` later), not one for the trial's process and another
for the rest: a trial that ignored SIGTERM, with a ``setsid`` child that ignored it too, was
reported ``TIMEOUT in 11.6 s: killed after 1.5 s (resources.timeout)``. Whatever ends it
(timeout, stop, prune, Ctrl-C) takes the same path; the timeout's reason says when SIGKILL was
needed."""
from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from hpo import cli
from hpo.launch import TOKEN_ENV, kill_by_token, kill_tree, run_process

WriteScenario = Callable[..., Path]
GRACE_S = 1.5

TREE = """\
import signal, subprocess, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.{main})
code = "import signal, time; from pathlib import Path; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
       "Path('child.ready').touch(); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
Path("child.pid").write_text(str(child.pid))
while not Path("child.ready").exists():
    time.sleep(0.01)
print("ready", flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("main", ["SIG_IGN", "SIG_DFL"])
def test_a_timeout_takes_one_grace_for_the_whole_tree_and_says_so(
        tmp_path: Path, write_scenario: WriteScenario, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], main: str) -> None:
    """Through hpo run: the trial and its setsid'd child both ignore SIGTERM (SIG_IGN) or only
    the child does (SIG_DFL); either way one grace, both gone, and the reason says SIGKILL was needed."""
    monkeypatch.setattr("hpo.launch.KILL_GRACE_S", GRACE_S)
    monkeypatch.setenv("HPO_GPUS", "")
    timeout = 4.0  # room for the tree to set SIG_IGN on a loaded machine before SIGTERM comes
    path = write_scenario(tmp_path, template_text=TREE.format(main=main), drop=["parameters.opt"],
                          search={"method": "sobol", "trials": 1}, objective={"held_out": []},
                          resources={"timeout": timeout})
    workdir = tmp_path / "w"
    assert cli.main(["run", str(path), "--workdir", str(workdir)]) == 1  # no trial completed
    capsys.readouterr()
    assert cli.main(["export", str(path), "--workdir", str(workdir)]) == 0
    row = next(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (row["state"], row["reason"]) == (
        "TIMEOUT", (f"killed after {timeout:g} s (resources.timeout; it ignored SIGTERM and was killed {GRACE_S:g} s "
                   "later)"))
    assert timeout + GRACE_S <= float(row["duration_s"]) < timeout + 2 * GRACE_S
    assert _gone(int((workdir / "trial-0000" / "child.pid").read_text()))


def test_a_timeout_whose_tree_obeys_sigterm_keeps_its_reason(tmp_path: Path, write_scenario: WriteScenario,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPO_GPUS", "")
    path = write_scenario(tmp_path, template_text="import time\ntime.sleep(60)\n", drop=["parameters.opt"],
                          search={"method": "sobol", "trials": 1}, objective={"held_out": []},
                          resources={"timeout": 0.5})
    workdir = tmp_path / "w"
    assert cli.main(["run", str(path), "--workdir", str(workdir)]) == 1  # no trial completed
    assert "trial 0 TIMEOUT in 0." in capsys.readouterr().out
    assert cli.main(["export", str(path), "--workdir", str(workdir)]) == 0
    row = next(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (row["state"], row["reason"]) == ("TIMEOUT", "killed after 0.5 s (resources.timeout)")


@pytest.mark.parametrize("asked", ["stopped", "pruned", "interrupted"])
def test_stop_prune_and_ctrl_c_take_the_same_single_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          asked: str) -> None:
    monkeypatch.setattr("hpo.launch.KILL_GRACE_S", GRACE_S)
    script = tmp_path / "tree.py"
    script.write_text(TREE.format(main="SIG_IGN"))
    ready: list[float] = []

    def on_lines(lines: list[str], running: bool) -> None:
        if any(line.strip() == "ready" for line in lines):
            ready.append(time.monotonic())

    token = f"test:{os.getpid()}:{time.monotonic_ns()}"
    result = run_process([sys.executable, str(script)], tmp_path, {**os.environ, TOKEN_ENV: token},
                         tmp_path / "trial.log", 60, on_lines, lambda: asked if ready else None)
    ended = time.monotonic()
    assert (result.ended_by, result.sigkill_after_s, result.exit_code) == (asked, GRACE_S, -signal.SIGKILL)
    assert GRACE_S <= ended - ready[0] < 2 * GRACE_S
    assert _gone(int((tmp_path / "child.pid").read_text()))


def _ignoring(token: str, setsid: bool = True) -> subprocess.Popen[bytes]:
    """A process that carries ``token`` and ignores SIGTERM, once it does."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
        """)], env={**os.environ, TOKEN_ENV: token}, stdout=subprocess.PIPE, start_new_session=setsid)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_kill_by_token_gives_every_process_found_one_grace() -> None:
    """Orphans of a killed sweep: each found used to get a grace of its own, one after another."""
    token = f"test:{os.getpid()}:{time.monotonic_ns()}"
    procs = [_ignoring(token) for _ in range(3)]
    try:
        began = time.monotonic()
        assert kill_by_token(token, grace_s=1.0) == 3
        assert 1.0 <= time.monotonic() - began < 2.5  # one after another, three graces took 3 s
        assert all(_gone(proc.pid) for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_kill_tree_says_whether_sigkill_was_needed() -> None:
    token = f"test:{os.getpid()}:{time.monotonic_ns()}"
    stubborn, obedient = _ignoring(token), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                                            start_new_session=True)
    try:
        assert kill_tree(obedient.pid, grace_s=5.0, child=obedient) is None
        assert obedient.returncode == -signal.SIGTERM
        began = time.monotonic()
        assert kill_tree(stubborn.pid, grace_s=0.5, child=stubborn) == 0.5
        assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - began < 1.5
    finally:
        for proc in (stubborn, obedient):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


COUNTED = """\
import os, signal, subprocess, sys, time
from pathlib import Path
code = '''
import os, signal, sys, time
from pathlib import Path
def count(signum, frame):
    with open("terms.txt", "a") as out:
        out.write(f"{os.getpid()}\\\\n")
    time.sleep(0.3)
    sys.exit(0)
signal.signal(signal.SIGTERM, count)
Path(f"ready.{os.getpid()}").touch()
time.sleep(60)
'''
children = [subprocess.Popen([sys.executable, "-c", code], start_new_session=setsid) for setsid in (False, True)]
exec(code.replace("time.sleep(60)", "while len(list(Path().glob('ready.*'))) < 3: time.sleep(0.01)\\n"
                  "print('ready', flush=True)\\ntime.sleep(60)"))
"""


def test_each_process_of_the_tree_gets_one_sigterm(tmp_path: Path) -> None:
    """The group's SIGTERM reaches its members; the processes outside it (setsid) get their own,
    and none a second one, which a script's handler (or torchrun's) would take as a second stop."""
    script = tmp_path / "tree.py"
    script.write_text(COUNTED)
    ready: list[bool] = []
    token = f"test:{os.getpid()}:{time.monotonic_ns()}"
    result = run_process([sys.executable, str(script)], tmp_path, {**os.environ, TOKEN_ENV: token},
                         tmp_path / "trial.log", 60, lambda lines, running: ready.extend(["ready\n" in lines]),
                         lambda: "stopped" if any(ready) else None)
    terms = (tmp_path / "terms.txt").read_text().split()
    assert (result.ended_by, result.sigkill_after_s) == ("stopped", None)
    assert len(terms) == len(set(terms)) == 3, terms
