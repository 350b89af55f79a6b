"""End-to-end control of real sweeps: kill -9 and resume, stop, pruning, timeouts, tail, retries.

Every test runs the real ``hpo`` CLI in subprocesses on fast templates (no torch import).
"""
from __future__ import annotations

import contextlib
import csv
import io
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import cli_env, run_hpo

from hpo.launch import TOKEN_ENV

SLEEPY = textwrap.dedent("""\
    import sys, time
    from hpo.results import report
    x = {{ x }}
    for step in range({{ steps }}):
        time.sleep({{ pause }})
        report(step=step, val_error=x + (1 - step / {{ steps }}) * x * 10)
    report(val_error=x, test_error=x / 2)
    """)


def hpo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``hpo ARGS`` to the end."""
    return run_hpo(*args, timeout=timeout)


def hpo_background(*args: str) -> subprocess.Popen[str]:
    """Start ``hpo ARGS`` and return at once."""
    return subprocess.Popen([sys.executable, "-m", "hpo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env())


def scenario(tmp_path: Path, *, trials: int = 6, parallel: int = 2, steps: int = 3, pause: float = 0.1,
             extra: str = "", template: str = SLEEPY) -> Path:
    """Write the sleepy template and a scenario using it; return the scenario path."""
    (tmp_path / "trial.py.j2").write_text(template)
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: sweep
        template: trial.py.j2
        command: python trial.py
        parameters:
          x: {{type: float, low: 0.0, high: 1.0}}
          steps: {{type: constant, value: {steps}}}
          pause: {{type: constant, value: {pause}}}
        objective: {{metric: val_error, held_out: [test_error]}}
        resources: {{parallel: {parallel}, gpus_per_trial: 1, heartbeat: 1}}
        """) + extra + ("" if "search:" in extra else f"search: {{method: monte_carlo, trials: {trials}}}\n"))
    return path


def export(path: Path) -> list[dict[str, str]]:
    """The results CSV of the scenario, as rows."""
    result = hpo("export", str(path))
    assert result.returncode == 0, result.stderr
    return list(csv.DictReader(io.StringIO(result.stdout)))


def trial_processes(folder: Path) -> list[psutil.Process]:
    """Live trial processes of the sweep whose scenario lives in ``folder``."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if TOKEN_ENV in env and env.get("HPO_TRIAL_DIR", "").startswith(str(folder)):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for(predicate: object, timeout: float = 60) -> None:
    """Poll ``predicate()`` until true."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def running_trials(path: Path) -> list[str]:
    """Numbers of the trials the store shows as RUNNING (read in-process and read-only: polled
    often, and never racing the run to create the store's tables)."""
    database = path.parent / "runs" / "sweep" / "study.db"
    if not database.exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)) as conn:
            rows = conn.execute("SELECT number FROM trials WHERE state = 'RUNNING'").fetchall()
    except sqlite3.OperationalError:  # the run is still creating the store
        return []
    return [str(number) for (number,) in rows]


def test_kill_9_then_rerun_finishes_exactly_the_budget(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=8, steps=20, pause=0.1)
    first = hpo_background("run", str(path))
    wait_for(lambda: len(trial_processes(tmp_path)) >= 2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    wait_for(lambda: not trial_processes(tmp_path), timeout=20)
    second = hpo("run", str(path))
    assert second.returncode == 0, second.stdout + second.stderr
    rows = export(path)
    assert not [r for r in rows if r["state"] in ("RUNNING", "WAITING")]
    lost = [r for r in rows if r["state"] == "LOST"]
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    assert len(complete) == 8 and len({r["x"] for r in complete}) == 8
    assert len(lost) == 2 and all(r["reason"] == "lost: its worker stopped" for r in lost)
    assert {r["x"] for r in lost} <= {r["x"] for r in complete}
    assert not trial_processes(tmp_path)
    for row in lost:  # the resumed run says whom it judged lost, and which trial runs it again
        again = next(r["number"] for r in rows if r["repeat_of"] == row["number"])
        assert re.search(rf"^trial {row['number']} \(worker \S+:{first.pid}\) judged lost: its process is gone; "
                         rf"recorded LOST after [0-9.]+ s; queued again as trial {again}$", second.stdout, re.MULTILINE)
        assert re.search(rf"^trial {again} started .*; runs trial {row['number']}'s configuration again$",
                         second.stdout, re.MULTILINE), second.stdout


def test_status_stop_and_tail_say_a_killed_sweep_s_trial_has_no_worker(tmp_path: Path) -> None:
    """After kill -9 of the sweep its trial stays RUNNING until the next run: status showed it
    "(running)", stop said it "asked the worker" (there is none) and exited 0, and tail
    followed its log for ever."""
    path = scenario(tmp_path, trials=2, parallel=1, steps=50, pause=0.1)
    first = hpo_background("run", str(path))
    wait_for(lambda: len(trial_processes(tmp_path)) == 1)
    first.send_signal(signal.SIGKILL)
    first.wait()
    wait_for(lambda: not trial_processes(tmp_path), timeout=20)
    number = running_trials(path)[0]
    status = hpo("status", str(path))
    assert status.returncode == 0 and "(running)" not in status.stdout, status.stdout
    assert ("its worker is gone (its process is gone): the next sweep or worker on this study records how it "
            "ended") in status.stdout, status.stdout
    stop = hpo("stop", str(path), number)
    assert (stop.returncode, stop.stdout) == (2, ""), stop.stdout
    assert stop.stderr == (f"error: trial {number}: its worker is gone (its process is gone), so nothing runs it "
                           "to stop; the next sweep or worker on this study records how it ended\n")
    tail = hpo("tail", str(path), number, timeout=20)
    assert tail.returncode == 0, tail.stderr
    assert tail.stderr.endswith(f"hpo: trial {number}'s worker is gone (its process is gone): its log ends here; "
                                "the next sweep or worker on this study records how it ended\n")
    assert next(r for r in export(path) if r["number"] == number)["state"] == "RUNNING"


def test_kill_9_with_retry_reruns_the_lost_configuration(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=4, steps=20, pause=0.1, extra="search: {method: monte_carlo, trials: 4, retry_failed: 1}\n")
    first = hpo_background("run", str(path))
    wait_for(lambda: len(trial_processes(tmp_path)) == 2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert hpo("run", str(path)).returncode == 0
    rows = export(path)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    lost = [r for r in rows if r["state"] == "LOST"]
    assert len(complete) == 4 and len(lost) >= 2
    assert {r["x"] for r in lost} <= {r["x"] for r in complete}


def test_stop_from_another_process(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=1, parallel=1, steps=200, pause=0.1)
    run = hpo_background("run", str(path))
    wait_for(lambda: "0" in running_trials(path) and len(trial_processes(tmp_path)) == 1)
    stop = hpo("stop", str(path), "0")
    assert stop.returncode == 0, stop.stderr
    began = time.monotonic()
    wait_for(lambda: not running_trials(path), timeout=15)
    assert time.monotonic() - began < 10
    assert run.wait(timeout=60) == 0
    rows = export(path)
    assert len(rows) == 1
    assert rows[0]["state"] == "STOPPED" and rows[0]["reason"] == "stopped by the user"
    assert not trial_processes(tmp_path)


def test_timeout_kills_the_whole_tree(tmp_path: Path) -> None:
    template = textwrap.dedent("""\
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        print("x={{ x }}", flush=True)
        time.sleep(1000)
        """)
    path = scenario(tmp_path, trials=1, parallel=1, template=template,
                    extra="")
    text = path.read_text().replace("heartbeat: 1}", "heartbeat: 1, timeout: 2}")
    path.write_text(text)
    result = hpo("run", str(path))
    assert result.returncode == 1  # its one trial timed out: no trial completed
    row = export(path)[0]
    assert row["state"] == "TIMEOUT" and row["reason"] == "killed after 2 s (resources.timeout)"
    assert not trial_processes(tmp_path)


def intermediate_values(path: Path) -> dict[int, dict[int, float]]:
    """Each trial's intermediate values as Optuna holds them."""
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{path.parent / 'runs' / 'sweep' / 'study.db'}")
    return {trial.number: trial.intermediate_values for trial in study.trials}


def test_a_trial_that_floods_its_output_with_steps_is_recorded_whole(tmp_path: Path) -> None:
    """Its steps come far faster than the pruner answers, and it exits at once: every line is
    still in trial.log, every step in Optuna, and its final values are the ones judged."""
    template = textwrap.dedent("""\
        import json
        x = {{ x }}
        for step in range(1, {{ steps }} + 1):
            print(json.dumps({"step": step, "val_error": x + 1.0 / step}))
        print(json.dumps({"val_error": x, "test_error": x / 2}))
        """)
    path = scenario(tmp_path, template=template, parallel=1, steps=2000,
                    extra="search: {method: monte_carlo, trials: 1, pruner: median, seed: 1}\n")
    assert hpo("run", str(path)).returncode == 0
    row = export(path)[0]
    assert row["state"] == "COMPLETE"
    assert (float(row["val_error"]), float(row["test_error"])) == (float(row["x"]), float(row["x"]) / 2)
    assert len((Path(row["folder"]) / "trial.log").read_text().splitlines()) == 2001
    assert sorted(intermediate_values(path)[0]) == list(range(1, 2001))


def test_a_pruned_trial_names_its_objective_step_and_keeps_no_held_out_metric(tmp_path: Path) -> None:
    """Its batch lines carry steps of their own (iterations); the reason names the epoch at
    which the pruner decided, Optuna holds nothing after it, and its test_error (of a model
    trained in part) is not recorded: a pruned trial has no final results."""
    template = textwrap.dedent("""\
        import json, time
        x = {{ x }}
        for epoch in range(1, {{ steps }} + 1):
            print(json.dumps({"step": epoch, "val_error": x + 1.0 / epoch, "test_error": x + 2.0 / epoch}), flush=True)
            for batch in range(1, 4):
                print(json.dumps({"step": (epoch * 3 + batch) * 100, "train_loss": x}), flush=True)
            time.sleep({{ pause }})
        """)
    (tmp_path / "design.csv").write_text("x\n0.1\n0.2\n0.15\n0.9\n")
    path = scenario(tmp_path, template=template, parallel=1, steps=5, pause=0.1,
                    extra="search: {method: csv, csv: design.csv, pruner: median, seed: 1}\n")
    assert hpo("run", str(path)).returncode == 0
    rows = export(path)
    assert [r["state"] for r in rows] == ["COMPLETE"] * 3 + ["PRUNED"]
    assert all(r["test_error"] for r in rows[:3])
    steps = sorted(intermediate_values(path)[3])  # [1] unless this machine was too busy to judge epoch 1 in time
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 5
    assert (rows[3]["reason"], rows[3]["test_error"], rows[3]["val_error"]) == (f"pruned at step {steps[-1]}", "", "")


def test_pruning_ends_bad_trials(tmp_path: Path) -> None:
    template = textwrap.dedent("""\
        import time
        from hpo.results import report
        x = {{ x }}
        for step in range(10):
            time.sleep(0.05)
            report(step=step, val_error=x)
        report(val_error=x)
        """)
    path = scenario(tmp_path, template=template, parallel=1,
                    extra="search: {method: monte_carlo, trials: 12, pruner: median, seed: 3}\n")
    assert hpo("run", str(path)).returncode == 0
    rows = export(path)
    pruned = [r for r in rows if r["state"] == "PRUNED"]
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    assert pruned and complete
    assert all(r["reason"].startswith("pruned at step") for r in pruned)
    assert min(float(r["x"]) for r in pruned) > min(float(r["val_error"]) for r in complete)


def test_tail_follows_a_running_trial_to_its_end(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=1, parallel=1, steps=30, pause=0.1)
    run = hpo_background("run", str(path))
    wait_for(lambda: "0" in running_trials(path) or run.poll() is not None, timeout=120)
    assert run.poll() is None, run.communicate()
    tail = hpo("tail", str(path), "0", timeout=60)
    run.wait(timeout=60)
    assert tail.returncode == 0
    lines = [line for line in tail.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 31 and '"test_error"' in lines[-1]


def test_ctrl_c_ends_trials_and_resume_retries_them(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=4, steps=30, pause=0.1)
    run = hpo_background("run", str(path))
    wait_for(lambda: len(trial_processes(tmp_path)) == 2)
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=30) == 130
    assert not trial_processes(tmp_path)
    rows = export(path)
    interrupted = [r for r in rows if r["state"] == "INTERRUPTED"]
    assert len(interrupted) >= 2 and not [r for r in rows if r["state"] == "RUNNING"]
    assert hpo("run", str(path)).returncode == 0
    rows = export(path)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    assert len(complete) == 4
    assert {r["x"] for r in interrupted} <= {r["x"] for r in complete}


@pytest.mark.parametrize("method", ["tpe", "gp", "smac"])
def test_a_resumed_seeded_sweep_draws_none_of_its_configurations_again(tmp_path: Path, method: str) -> None:
    """The seeded random start begins again in a new process: resumed, it must not spend its
    trials on the first run's configurations or near copies of them."""
    path = scenario(tmp_path, parallel=1, steps=1, pause=0.0, extra=f"search: {{method: {method}, trials: 3, seed: 5}}\n")
    assert hpo("run", str(path)).returncode == 0
    path.write_text(path.read_text().replace("trials: 3", "trials: 6"))
    assert hpo("run", str(path)).returncode == 0
    xs = [float(r["x"]) for r in export(path)]
    assert len(xs) == 6
    assert min(abs(later - earlier) for i, later in enumerate(xs) for earlier in xs[:i]) > 0.01, xs


def test_stop_of_a_finished_trial_is_bad_input(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=1, parallel=1, steps=1, pause=0.0)
    assert hpo("run", str(path)).returncode == 0
    result = hpo("stop", str(path), "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: trial 0: it is COMPLETE, not running or queued"


@pytest.mark.parametrize("method", ["monte_carlo", "tpe"])
def test_two_runs_share_one_store_without_exceeding_the_budget(tmp_path: Path, method: str) -> None:
    path = scenario(tmp_path, steps=2, pause=0.05,
                    extra=f"search: {{method: {method}, trials: 10, seed: 5}}\n")
    runs = [hpo_background("worker", str(path), "--seed", str(seed)) for seed in (1, 2)]
    for run in runs:
        assert run.wait(timeout=120) == 0, run.stdout.read() if run.stdout else ""
    rows = export(path)
    assert len(rows) == 10 and all(r["state"] == "COMPLETE" for r in rows)
    assert len({r["x"] for r in rows}) == 10


def test_resuming_in_a_changed_space_is_refused_unless_allowed(tmp_path: Path) -> None:
    path = scenario(tmp_path, trials=2, parallel=1, steps=1, pause=0.0)
    assert hpo("run", str(path)).returncode == 0
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(path.read_text().replace("x: {type", "width: {type").replace("{{ x }}", "{{ width }}")
                       .replace("trials: 2", "trials: 3"))
    (tmp_path / "trial.py.j2").write_text(SLEEPY.replace("{{ x }}", "{{ width }}"))
    refused = hpo("run", str(renamed), "--workdir", str(tmp_path / "runs" / "sweep"))
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("error: renamed.yaml: parameters.x: the study's trials have this parameter, the "
                                             "scenario no longer (renamed to width?)")
    allowed = hpo("run", str(renamed), "--workdir", str(tmp_path / "runs" / "sweep"), "--allow-space-change")
    assert allowed.returncode == 0, allowed.stderr
    exported = hpo("export", str(renamed), "--workdir", str(tmp_path / "runs" / "sweep"))
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert len(rows) == 3 and rows[0]["x"] and rows[2]["width"] and not rows[2]["x"]
