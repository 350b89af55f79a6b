"""The user's path, end to end, on the shipped scenarios: real torchrun DDP jobs on digits.

Each test copies a shipped scenario, shrinks it (fewer trials, fewer epochs), runs ``hpo run``
as a user would, and reads what the user reads: the CSV, the status table, the charts.
"""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_hpo, write_scenario_file

from hpo.cli import main

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "scenarios"


def hpo(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """Run the ``hpo`` CLI to the end (no GPUs: trials are CPU processes)."""
    return run_hpo(*args, timeout=timeout)


def shrunk(name: str, tmp_path: Path, *, search: dict[str, Any] | None = None,
           resources: dict[str, Any] | None = None, constants: dict[str, Any] | None = None) -> Path:
    """A copy of ``scenarios/<name>.yaml`` in ``tmp_path`` with its paths made absolute."""
    raw = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    raw["template"] = str((SCENARIOS / raw["template"]).resolve())
    if "csv" in raw["search"]:
        raw["search"]["csv"] = str((SCENARIOS / raw["search"]["csv"]).resolve())
    raw["search"].update(search or {})
    raw["resources"].update(resources or {})
    for key, value in (constants or {}).items():
        raw["parameters"][key] = {"type": "constant", "value": value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV."""
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_monte_carlo_ddp_sweep_then_status_export_plot_best(tmp_path: Path) -> None:
    scenario = shrunk("digits-monte-carlo", tmp_path, search={"trials": 2}, constants={"epochs": 2})
    run = hpo("run", str(scenario))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2/2 trials done: 2 complete." in run.stdout

    out = tmp_path / "results.csv"
    assert hpo("export", str(scenario), "-o", str(out)).returncode == 0
    rows = read_csv(out)
    assert list(rows[0]) == ["number", "state", "nb_filters", "conv_size", "dropout", "lr", "optimizer",
                             "batch_size", "epochs", "val_error", "test_error", "duration_s", "folder", "reason",
                             "repeat_of", "note"]
    assert [r["number"] for r in rows] == ["0", "1"]
    for row in rows:
        assert row["state"] == "COMPLETE" and row["reason"] == ""
        assert 0.0 <= float(row["val_error"]) <= 1.0 and 0.0 <= float(row["test_error"]) <= 1.0
        folder = Path(row["folder"])
        assert (folder / "digits_cnn.py").is_file() and (folder / "model.pt").is_file()
        command = (folder / "command.txt").read_text()
        assert f"torch.distributed.run --standalone --nproc-per-node 2 --no-python {sys.executable} digits_cnn.py" in command
        log = (folder / "trial.log").read_text()
        assert '"step": 2' in log and '"test_error"' in log

    status = hpo("status", str(scenario))
    assert status.returncode == 0 and "COMPLETE" in status.stdout and "best #" in status.stdout

    plots = tmp_path / "plots"
    plot = hpo("plot", str(scenario), "-o", str(plots))
    assert plot.returncode == 0, plot.stderr
    assert (plots / "history.png").stat().st_size > 10_000
    assert (plots / "states.png").stat().st_size > 5_000

    best_dir = tmp_path / "best"
    best = hpo("best", str(scenario), "--copy-to", str(best_dir))
    assert best.returncode == 0 and "test_error=" in best.stdout
    assert (best_dir / "model.pt").is_file() and (best_dir / "trial.log").is_file()
    unmade = hpo("best", str(scenario), "--copy-to", "/proc/hpo-best")  # a folder no one can create
    assert unmade.returncode == 2 and unmade.stdout == ""
    assert unmade.stderr.strip() == "error: --copy-to: cannot create the folder /proc/hpo-best: No such file or directory"

    again = hpo("run", str(scenario))
    assert again.returncode == 0 and "2 of 2 trials done before this run" in again.stdout
    assert len(read_csv(out)) == 2


@pytest.mark.slow
def test_csv_design_runs_its_rows_in_order(tmp_path: Path) -> None:
    scenario = shrunk("digits-csv", tmp_path, search={"trials": 2}, constants={"epochs": 1})
    assert hpo("run", str(scenario)).returncode == 0
    result = hpo("export", str(scenario))
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert [(r["nb_filters"], r["lr"], r["optimizer"]) for r in rows] == [("16", "0.01", "adam"), ("32", "0.003", "adam")]
    assert all(r["state"] == "COMPLETE" for r in rows)


@pytest.mark.slow
def test_flags_reach_an_argparse_script(tmp_path: Path) -> None:
    scenario = shrunk("digits-flags", tmp_path, search={"trials": 2}, constants={"epochs": 1})
    assert hpo("run", str(scenario)).returncode == 0
    rows = list(csv.DictReader(hpo("export", str(scenario)).stdout.splitlines()))
    assert len(rows) == 2 and all(r["state"] == "COMPLETE" for r in rows)
    command = (Path(rows[0]["folder"]) / "command.txt").read_text()
    assert f"--lr {rows[0]['lr']}" in command and "--optimizer" in command


STORAGE_HINT = "--storage: empty; give a URL such as sqlite:///path/study.db"
WORKDIR_HINT = "--workdir: empty; give a folder, or leave --workdir out for runs/<name> beside the scenario"


@pytest.mark.parametrize(("args", "said"), [
    (("run", "--storage", ""), STORAGE_HINT),
    (("worker", "--storage", ""), STORAGE_HINT),
    (("run", "--workdir", ""), WORKDIR_HINT),
    (("status", "--workdir", ""), WORKDIR_HINT),
    (("export", "-o", ""), "-o: empty; give a path, or leave -o out"),
    (("plot", "--output", ""), "-o: empty; give a path, or leave -o out"),
    (("best", "--copy-to", ""), "--copy-to: empty; give a folder to copy the best trial's folder to"),
    (("dashboard", "--host", ""), ("--host: empty; give an address to listen on, e.g. 127.0.0.1, or leave --host out "
                                  "for it")),
    (("worker", "--gpus", ""), "--gpus: empty; give GPU ids, e.g. 0,1, or leave --gpus out for this machine's"),
], ids=["run-storage", "worker-storage", "run-workdir", "status-workdir", "export-o", "plot-o", "best-copy-to",
        "dashboard-host", "worker-gpus"])
def test_an_empty_path_or_url_is_refused_not_taken_for_no_option(args: tuple[str, ...], said: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage "$DB"`` with DB unset ran the sweep into the default store; ``--host "$HOST"``
    served the dashboard on every interface, ``--gpus "$GPUS"`` ran a GPU worker on the CPU."""
    scenario = write_scenario_file(tmp_path)
    assert main([args[0], str(scenario), *args[1:]]) == 2
    assert capsys.readouterr() == ("", f"error: {said}\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scenario.yaml", "train.py.j2"]


def test_a_workdir_or_store_path_from_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``--workdir=~/wd`` (no shell expands ~ after =) made a folder named ~ in the current one."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    scenario = write_scenario_file(tmp_path / "s", search={"trials": 1})
    for storage, workdir in (("sqlite:///~/x.db", "~/wd"), ("journal:~/x.journal", "~/wd2")):
        assert main(["run", str(scenario), f"--workdir={workdir}", f"--storage={storage}"]) == 0
    capsys.readouterr()
    assert {"wd", "wd2", "x.db", "x.journal"} <= {p.name for p in home.iterdir()}
    assert not (tmp_path / "~").exists()


def test_shipped_scenarios_validate() -> None:
    for path in sorted(SCENARIOS.glob("*.yaml")):
        if path.read_text().find("data_dir") >= 0:
            continue
        result = hpo("validate", str(path), timeout=60)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
        assert result.stdout.startswith("ok: ")
