"""What the commands tell a user, in-process: the plan of a sweep (threads, slots capped by
the GPUs), the status of running trials on shares of fake GPUs, and outputs that cannot be
written (one line naming the path, exit 2, no half-written file)."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import Disk, cli_env, write_scenario_file

from hpo.cli import describe_plan, main
from hpo.launch import Slot
from hpo.rows import gpu_cell
from hpo.scenario import load_scenario
from hpo.storage import storage_url
from hpo.store import SYS_STARTED, StudyStore, scenario_text

OMP_TEMPLATE = """\
import os
from hpo.results import report

print("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
report(val_error={{ x }}, test_error=0.5)
"""

WAIT_TEMPLATE = """\
import pathlib, time
from hpo.results import report

while not pathlib.Path("{{ trial_dir }}/../release").exists():
    time.sleep(0.05)
report(val_error={{ x }}, test_error=0.5)
"""


@pytest.fixture
def study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A finished sweep of two trials on this machine's CPU; its scenario file."""
    monkeypatch.setenv("HPO_GPUS", "")
    scenario = write_scenario_file(tmp_path / "study")
    assert main(["run", str(scenario)]) == 0
    return scenario


def test_the_plan_shows_the_threads_the_scenario_env_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HPO_GPUS", "")
    scenario = write_scenario_file(tmp_path, template_text=OMP_TEMPLATE, env={"OMP_NUM_THREADS": 13},
                                   search={"trials": 1})
    assert main(["run", str(scenario)]) == 0
    out = capsys.readouterr().out
    assert "done before this run; 1 slot: 1 CPU process of 13 threads\n" in out
    assert "trial 0 started on slot 0 (1 CPU process of 13 threads)" in out
    assert "OMP_NUM_THREADS 13\n" in (tmp_path / "runs" / "demo" / "trial-0000" / "trial.log").read_text()
    assert main(["validate", str(scenario)]) == 0
    assert "1 slot: 1 CPU process of 13 threads\n" in capsys.readouterr().out


@pytest.mark.parametrize(("gpus_per_trial", "parallel", "said"), [
    (0.5, 10, ("4 slots (resources.parallel 10 capped to 4: 2 GPUs, 2 trials per GPU): "
               "1 process on 1/2 of GPU 0; 1 process on 1/2 of GPU 1")),
    (1, 3, ("2 slots (resources.parallel 3 capped to 2: 2 GPUs, 1 GPU per trial): 1 process on GPU 0; "
            "1 process on GPU 1")),
    (0.5, 4, "4 slots: 1 process on 1/2 of GPU 0; 1 process on 1/2 of GPU 1"),
    (1, "auto", "2 slots: 1 process on GPU 0; 1 process on GPU 1"),
])
def test_the_plan_says_once_when_the_gpus_cap_parallel(gpus_per_trial: float, parallel: Any, said: str,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HPO_GPUS", "0,1")
    scenario = write_scenario_file(tmp_path, resources={"parallel": parallel, "gpus_per_trial": gpus_per_trial})
    assert main(["validate", str(scenario)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"ok: demo: 2 parameters, method monte_carlo, 2 trials, {said}"


def test_a_share_of_a_gpu_one_trial_at_a_time_says_how_to_share_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """gpus_per_trial: 0.25 with parallel left at 1 ran one trial on a quarter of the GPU,
    the other three quarters idle, without a word."""
    monkeypatch.setenv("HPO_GPUS", "0")
    scenario = write_scenario_file(tmp_path, resources={"gpus_per_trial": 0.25})
    assert main(["validate", str(scenario)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "1 slot (resources.parallel 1: one trial at a time; resources.parallel: auto runs 4 on each GPU): "
        "1 process on 1/4 of GPU 0")


def test_a_worker_given_its_slots_or_a_smaller_parallel_is_not_capped() -> None:
    slots = (Slot(0, (0,), 1, 1, 2), Slot(1, (1,), 1, 1, 2))
    assert describe_plan(slots) == "2 slots: 1 process on 1/2 of GPU 0; 1 process on 1/2 of GPU 1"
    assert describe_plan(slots, parallel=(2, "resources.parallel")) == describe_plan(slots)
    assert describe_plan(slots, parallel=("auto", "--parallel")) == describe_plan(slots)
    assert describe_plan(slots, parallel=(8, "--parallel")).startswith(
        "2 slots (--parallel 8 capped to 2: 2 GPUs, 2 trials per GPU): ")


@pytest.mark.parametrize(("gpus", "share", "cell"), [("1", 2, "1 (1/2)"), ("0", 4, "0 (1/4)"), ("0,1", 1, "0,1"),
                                                     ("3", 1, "3"), ("", 2, "")])
def test_the_gpu_cell_names_the_share(gpus: str, share: int, cell: str) -> None:
    assert gpu_cell(gpus, share) == cell


def _status(scenario: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The lines of ``hpo status``; none before the sweep made its study."""
    code = main(["status", str(scenario)])
    out = capsys.readouterr().out
    return out.splitlines() if code == 0 else []


def test_status_shows_gpu_shares_and_the_seconds_of_running_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HPO_GPUS", "1")
    scenario = write_scenario_file(tmp_path, template_text=WAIT_TEMPLATE,
                                   resources={"parallel": 2, "gpus_per_trial": 0.5})
    sweep = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(scenario)], env={**cli_env(), "HPO_GPUS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            lines = [line for line in _status(scenario, capsys) if "RUNNING" in line]
            if len(lines) == 2 and all("1 (1/2)" in line for line in lines) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(lines) == 2, lines
        for line in lines:
            assert re.search(r"│ \d+\.\d \(running\) +│ 1 \(1/2\) +│", line), line
        time.sleep(1.1)
        again = [line for line in _status(scenario, capsys) if "RUNNING" in line]
        first, later = (float(re.search(r"(\d+\.\d) \(running\)", line)[1]) for line in (lines[0], again[0]))
        assert later >= first + 1.0
    finally:
        (tmp_path / "runs" / "demo").mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / "demo" / "release").touch()
        _, errors = sweep.communicate(timeout=60)
    assert sweep.returncode == 0, errors
    done = [line for line in _status(scenario, capsys) if "COMPLETE" in line]
    assert len(done) == 2 and all("1 (1/2)" in line and "(running)" not in line for line in done)


def test_export_to_a_full_disk_is_one_line_and_exit_1(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk is no fault of the input (it was exit 2, as bad input); an -o that cannot be
    written for another reason stays bad input."""
    assert main(["export", str(study), "-o", "/dev/full"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: cannot write /dev/full: No space left on device (")
    assert captured.err.count("\n") == 1
    assert main(["export", str(study), "-o", "/proc/version"]) == 2
    assert capsys.readouterr().err.startswith("error: -o: cannot write /proc/version: ")


@pytest.mark.parametrize("args", [(), ("-o", "-")], ids=["no-o", "o-dash"])
def test_export_to_a_full_stdout_ends_as_status_does_with_exit_1(args: tuple[str, ...], study: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """It exited 2, for bad input, blaming -o, which was not given."""
    full = open("/dev/full", "w")  # noqa: SIM115 (its close fails too: what is left in its buffer)
    monkeypatch.setattr(sys, "stdout", full)
    assert main(["export", str(study), *args]) == 1
    monkeypatch.undo()
    with contextlib.suppress(OSError):
        full.close()
    assert capsys.readouterr().err == "error: cannot write to stdout: No space left on device\n"


def test_an_export_that_fails_midway_leaves_the_last_file_whole(study: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = study.parent / "results.csv"
    assert main(["export", str(study), "-o", str(out)]) == 0
    before = out.read_text()
    out.chmod(0o640)

    def disk_full_midway(ctx: Any, handle: io.TextIOBase, rows: Any = None) -> int:
        handle.write("number,state,x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("hpo.cli.export_rows", disk_full_midway)
    capsys.readouterr()
    assert main(["export", str(study), "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: cannot write {out}: No space left on device (")
    assert out.read_text() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["results.csv", "runs", "scenario.yaml", "train.py.j2"]
    monkeypatch.undo()
    assert main(["export", str(study), "-o", str(out)]) == 0
    assert out.read_text() == before and out.stat().st_mode & 0o777 == 0o640


def test_a_copy_of_the_best_trial_that_fails_midway_leaves_nothing(study: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full_midway(source: Path, target: Path) -> None:
        Path(target).mkdir()
        (Path(target) / "train.py").write_text("x =")
        raise shutil.Error([(str(Path(source) / "trial.log"), str(Path(target) / "trial.log"),
                             f"[Errno 28] No space left on device: '{target}/trial.log'")])

    monkeypatch.setattr(shutil, "copytree", disk_full_midway)
    target = study.parent / "best" / "copy"
    assert main(["best", str(study), "--copy-to", str(target)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: --copy-to: cannot copy \S+/trial-000\d to {target}: No space left on device "
                        r"\(.* free on .*\)\n", err), err
    assert list(target.parent.iterdir()) == []
    monkeypatch.undo()
    assert main(["best", str(study), "--copy-to", str(target)]) == 0
    assert (target / "train.py").read_text().startswith("from hpo.results import report")
    assert sorted(p.name for p in target.parent.iterdir()) == ["copy"]


def test_a_copy_of_the_best_trial_onto_a_full_disk_names_that_disk(study: Path, disk: Disk,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The room said was that of the disk above the target's folder (71 GiB free on /), not
    of the full disk the copy went to."""
    disk.fill()
    target = disk.mount / "best"
    assert main(["best", str(study), "--copy-to", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f": No space left on device (0 bytes free on {disk.mount})\n"), err
    assert sorted(p.name for p in disk.mount.iterdir()) == ["filler"]


def test_a_copy_of_the_best_trial_is_made_though_stdout_is_closed(study: Path) -> None:
    """``hpo best S --copy-to D | true``: the first line met the closed pipe, the command ended
    with exit 0 and nothing was copied."""
    target = study.parent / "best-copy"
    best = subprocess.Popen([sys.executable, "-m", "hpo", "best", str(study), "--copy-to", str(target)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert best.stdout is not None
    best.stdout.close()
    assert best.wait(timeout=60) == 0
    assert (target / "train.py").read_text().startswith("from hpo.results import report")


def test_status_counts_a_running_trial_from_the_start_of_its_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HPO_GPUS", "")
    path = write_scenario_file(tmp_path)
    scenario = load_scenario(path)
    store = StudyStore(scenario, storage_url(scenario))
    store.describe(scenario_text(path))
    started, ahead = store.ask(), store.ask()  # both claimed now; only the first one's process starts
    time.sleep(3.0)
    store.set_system(started.number, SYS_STARTED, {"slot": 0, "gpus": "", "folder": "f", "at": time.time()})
    lines = {line.split("│")[1].strip(): line for line in _status(path, capsys) if line.startswith("│ ")}
    seconds = re.search(r"(\d+\.\d) \(running\)", lines[str(started.number)])
    assert "RUNNING" in lines[str(started.number)] and seconds is not None and float(seconds[1]) < 2.0
    assert "WAITING" in lines[str(ahead.number)] and "(running)" not in lines[str(ahead.number)]


def test_piped_status_has_no_trailing_spaces(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _status(study, capsys)
    assert lines[0] == "demo: trials 0-1 of 2"
    assert [line for line in lines if line != line.rstrip()] == []
    assert main(["status", str(study), "--last", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "demo: trial 1 of 2"


def test_one_trial_is_said_in_the_singular(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HPO_GPUS", "")
    scenario = write_scenario_file(tmp_path, drop=("parameters.opt",), search={"trials": 1})
    assert main(["validate", str(scenario)]) == 0
    assert capsys.readouterr().out.startswith("ok: demo: 1 parameter, method monte_carlo, 1 trial, 1 slot: ")
    assert main(["run", str(scenario)]) == 0
    capsys.readouterr()
    out = tmp_path / "results.csv"
    assert main(["export", str(scenario), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote 1 trial to {out}\n"


def test_a_copy_of_the_best_trial_into_its_own_folder_is_refused(study: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["best", str(study)]) == 0
    said = capsys.readouterr().out.splitlines()
    number, folder = said[0].split(":")[0].removeprefix("trial "), Path(said[-1].removeprefix("  folder: "))
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    for target in (folder / "copy", folder / "sub" / "copy"):
        assert main(["best", str(study), "--copy-to", str(target)]) == 2
        captured = capsys.readouterr()
        refusal = f"error: --copy-to: {target} is inside trial {number}'s folder {folder}; copy it to a folder outside it\n"
        assert (captured.out, captured.err) == ("", refusal)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before


@pytest.mark.parametrize(("host", "flag", "why"), [
    ("nohost.invalid", "--host", None),
    ("192.0.2.1", "--host", "Cannot assign requested address"),  # TEST-NET-1: no machine's own address
    ("127.0.0.1", "--port", "Address already in use"),
])
def test_a_dashboard_that_cannot_listen_blames_the_host_or_the_port(host: str, flag: str, why: str | None,
                                                                    study: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("optuna_dashboard")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["dashboard", str(study), "--host", host, "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {flag}: cannot serve on {host}:{port}: ")
    assert captured.err.count("\n") == 1
    if why is not None:
        assert captured.err.endswith(f": {why}\n")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_dashboard_ended_by_a_signal_exits_as_every_command_does(signum: int, code: int, study: Path) -> None:
    """It exited 0 on Ctrl-C and on SIGTERM; its server is shut down first, and says nothing more."""
    pytest.importorskip("optuna_dashboard")
    server = subprocess.Popen([sys.executable, "-m", "hpo", "dashboard", str(study), "--port", "0"], env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = re.search(r"http://\S+/dashboard/", server.stdout.readline())
        assert url is not None, server.communicate(timeout=30)
        api = url[0].removesuffix("dashboard/") + "api/studies"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(api, timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard never answered"
                time.sleep(0.2)
        server.send_signal(signum)
        out, err = server.communicate(timeout=30)
    finally:
        server.kill()
    assert (server.returncode, out, err) == (code, "", "")
