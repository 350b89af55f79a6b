"""hpo in the ecosystem: a script it cannot edit, its studies opened by Optuna's own tools, reruns.

The unmodified script is an argparse program with dashed flags and a boolean switch that
prints exactly as pytorch/examples' ``mnist/main.py`` does (``Train Epoch: ...``,
``Test set: Average loss: ...``), written by the test: no torchvision, no download.
"""
from __future__ import annotations

import csv
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import optuna
from conftest import cli_env, run_hpo

MNIST_LIKE = textwrap.dedent("""\
    import argparse, math, time
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--save-model", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for epoch in range(1, args.epochs + 1):
        time.sleep(0.1)
        for batch in range(0, 60000, 20000):
            print(f"Train Epoch: {epoch} [{batch}/60000 ({100. * batch / 60000:.0f}%)]\\tLoss: {2.3 / epoch:.6f}")
        loss = abs(math.log10(args.lr)) * 0.05 + 1.0 / (epoch * math.sqrt(args.batch_size))
        correct = int(10000 * (1 - loss / 2))
        print(f"\\nTest set: Average loss: {loss:.4f}, Accuracy: {correct}/10000 ({100. * correct / 10000:.0f}%)\\n")
    if args.save_model:
        open("mnist_cnn.pt", "w").write(str(args.seed))
    """)

SCENARIO = textwrap.dedent("""\
    name: mnist-unmodified
    template: main.py
    command: python main.py
    seed_flag: --seed
    parameters:
      batch_size: {type: int, low: 16, high: 256, log: true, flag: --batch-size}
      lr: {type: float, low: 1.0e-3, high: 10.0, log: true, flag: --lr}
      epochs: {type: constant, value: 6, flag: --epochs}
      save_model: {type: bool, flag: --save-model}
    search: {method: smac, trials: 10, seed: 2, pruner: median}
    objective:
      metric: test_loss
      held_out: [correct]
      patterns:
        test_loss: 'Average loss: ([0-9.]+)'
        correct: 'Accuracy: ([0-9]+)/'
      step_pattern: 'Train Epoch: (\\d+)'
    resources: {parallel: 2, timeout: 60}
    """)


def sweep(tmp_path: Path) -> Path:
    (tmp_path / "main.py").write_text(MNIST_LIKE)
    path = tmp_path / "mnist.yaml"
    path.write_text(SCENARIO)
    result = run_hpo("run", path)
    assert result.returncode == 0, result.stdout + result.stderr
    return path


def export(path: Path) -> list[dict[str, str]]:
    result = run_hpo("export", path)
    assert result.returncode == 0, result.stderr
    return list(csv.DictReader(io.StringIO(result.stdout)))


def test_an_unmodified_argparse_script_is_tuned_with_pruning(tmp_path: Path) -> None:
    path = sweep(tmp_path)
    rows = export(path)
    assert len(rows) == 10 and {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    assert complete and all(0 < float(r["test_loss"]) < 1 and int(float(r["correct"])) > 5000 for r in complete)
    pruned = [r for r in rows if r["state"] == "PRUNED"]
    assert pruned and all(r["reason"].startswith("pruned at step ") for r in pruned)
    for row in rows:
        command = (Path(row["folder"]) / "command.txt").read_text()
        assert f"--batch-size {row['batch_size']} " in command and "--epochs 6" in command
        assert ("--save-model" in command) == (row["save_model"] == "True")
        assert (Path(row["folder"]) / "mnist_cnn.pt").exists() == (row["save_model"] == "True" and
                                                                   row["state"] == "COMPLETE")
    study = optuna.load_study(study_name="mnist-unmodified", storage=f"sqlite:///{tmp_path}/runs/mnist-unmodified/study.db")
    assert any(len(t.intermediate_values) >= 2 for t in study.trials)


def test_a_study_is_first_class_for_optuna_and_its_dashboard(tmp_path: Path) -> None:
    path = sweep(tmp_path)
    url = f"sqlite:///{tmp_path}/runs/mnist-unmodified/study.db"
    study = optuna.load_study(study_name="mnist-unmodified", storage=url)
    assert study.metric_names == ["test_loss"]
    assert study.user_attrs["held_out"] == ["correct"] and "step_pattern" in study.user_attrs["scenario"]
    frame = study.trials_dataframe()
    for column in ("user_attrs_outcome", "user_attrs_reason", "user_attrs_duration_s", "user_attrs_folder",
                   "user_attrs_correct"):
        assert column in frame.columns
    assert "params_epochs" not in frame.columns  # constants are not searched
    server = subprocess.Popen([sys.executable, "-m", "hpo", "dashboard", str(path), "--port", "0"],
                              env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = _served_port(server)  # the port it got: a port found free beforehand may be taken by then
        studies = _get_json(f"http://127.0.0.1:{port}/api/studies", server)
        entry = next(s for s in studies["study_summaries"] if s["study_name"] == "mnist-unmodified")
        detail = _get_json(f"http://127.0.0.1:{port}/api/studies/{entry['study_id']}", server)
        assert detail["objective_names"] == ["test_loss"]
        sortable = {a["key"]: a["sortable"] for a in detail["union_user_attrs"]}
        assert sortable["duration_s"] and sortable["correct"] and {"outcome", "reason", "folder"} <= set(sortable)
        busy = run_hpo("dashboard", path, "--port", port)
        assert busy.returncode == 2 and busy.stderr.startswith(f"error: --port: cannot serve on 127.0.0.1:{port}")
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 128 + signal.SIGINT


def test_rerun_repeats_a_configuration_without_using_budget(tmp_path: Path) -> None:
    path = sweep(tmp_path)
    rows = export(path)
    original = next(r for r in rows if r["state"] == "COMPLETE")
    result = run_hpo("rerun", path, original["number"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"(rerun of {original['number']}) COMPLETE" in result.stdout
    again = export(path)
    rerun = again[-1]
    assert len(again) == 11 and rerun["repeat_of"] == original["number"]
    assert [rerun[k] for k in ("batch_size", "lr", "save_model", "test_loss")] == [
        original[k] for k in ("batch_size", "lr", "save_model", "test_loss")]
    old = (Path(original["folder"]) / "command.txt").read_text()
    assert (Path(rerun["folder"]) / "command.txt").read_text() == old
    seeded = run_hpo("rerun", path, original["number"], "--seed", "99")
    assert seeded.returncode == 0 and "--seed 99" in (Path(export(path)[-1]["folder"]) / "command.txt").read_text()
    status = run_hpo("status", path)
    assert "10/10 trials done" in status.stdout
    assert json.loads((Path(rerun["folder"]) / "params.json").read_text())["trial_seed"] == json.loads(
        (Path(original["folder"]) / "params.json").read_text())["trial_seed"]


def _served_port(server: subprocess.Popen[str]) -> int:
    """The port that ``hpo dashboard --port 0`` says it serves on (its output read in a thread,
    for at most a minute)."""
    lines: queue.Queue[str] = queue.Queue()
    assert server.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            assert server.poll() is None, seen
            continue
        served = re.search(r"http://127\.0\.0\.1:(\d+)/dashboard/", seen[-1])
        if served is not None:
            return int(served[1])
    raise AssertionError(f"the dashboard never said where it serves: {seen}")


def _get_json(url: str, server: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            assert server.poll() is None, server.communicate()[0]
            assert time.monotonic() < deadline, "the dashboard never answered"
            time.sleep(0.3)


assert os.sep == "/"
