"""Bad input through the real CLI: exit code 2 and one ``error:`` line naming the field and problem.

Also: a trial that misbehaves (no metric, non-zero exit, NaN) is a recorded failure with a
reason, not a crash of the sweep.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import runs_in_process

from hpo.errors import in_scenario
from hpo.scenario import Scenario, allowed_keys

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]

CSV_SEARCH = {"method": "csv", "csv": "design.csv", "trials": None}
GOOD_CSV_HEADER = "x,opt\n"


@dataclass(frozen=True)
class Case:
    """One bad input: how to break the base scenario, the command, and what stderr must say."""

    expect: tuple[str, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    raw: str | None = None
    args: tuple[str, ...] = ("validate", "{scenario}")


CASES = {
    # scenario
    "unknown-top-level-key": Case(("scenario.yaml", "nmae", "unknown key", "did you mean name"), {"nmae": "x"}),
    "unknown-param-key-typo": Case(("parameters.x.hihg", "unknown key", "did you mean high"),
                                   {"parameters": {"x": {"hihg": 2}}}),
    "low-above-high": Case(("parameters.x.low", "2 is above high 1"), {"parameters": {"x": {"low": 2.0}}}),
    "log-with-low-zero": Case(("parameters.x.low", "log-scaled parameter needs low > 0"),
                              {"parameters": {"x": {"log": True}}}),
    "bad-type": Case(("parameters.x.type", "'int', 'float', 'categorical', 'constant' or 'bool'"),
                     {"parameters": {"x": {"type": "double"}}}),
    "missing-command": Case(("command", "required key is missing"), drop=("command",)),
    "missing-trials": Case(("search.trials", "needs the total number of trials"), drop=("search.trials",)),
    "categorical-without-choices": Case(("parameters.c.choices", "needs a non-empty list"),
                                        {"parameters": {"c": {"type": "categorical"}}}),
    "csv-method-without-csv": Case(("search.csv", "method csv needs the path"), {"search": {"method": "csv"}}),
    "condition-on-unknown-parent": Case(("parameters.y.condition", "zz must be a parameter defined before y"),
                                        {"parameters": {"y": {"type": "float", "low": 0, "high": 1,
                                                              "condition": {"zz": "a"}}}}),
    "condition-text-on-bool-choices": Case(
        ("parameters.y.condition", "'on' is not a choice of mode ([true, false])", "write true or false unquoted"),
        {"parameters": {"mode": {"type": "categorical", "choices": [True, False]},
                        "y": {"type": "float", "low": 0, "high": 1, "condition": {"mode": "on"}}}}),
    "bad-yaml": Case(("scenario.yaml line 2", "not valid YAML"), raw="name: demo\ncommand: python: train.py\n"),
    "yaml-not-a-mapping": Case(("scenario.yaml", "a YAML mapping", "got list"), raw="- name\n- demo\n"),
    "missing-scenario-file": Case(("nope.yaml", "scenario file not found"), args=("validate", "{dir}/nope.yaml")),
    "normal-with-model-method": Case(("parameters.x.distribution", "normal is only for the designs", "smac"),
                                     {"search": {"method": "smac"},
                                      "parameters": {"x": {"distribution": "normal", "mean": 0.5, "std": 0.1}}}),
    "held-out-is-the-metric": Case(("objective.held_out", "val_error is the objective metric"),
                                   {"objective": {"held_out": ["val_error"]}}),
    "step-wider-than-range": Case(("parameters.x.step", "0.5 is wider than the range [0, 0.3]"),
                                  {"parameters": {"x": {"high": 0.3, "step": 0.5}}}),
    "step-does-not-divide-range": Case(("parameters.x.step", "0.3 does not divide the range [0, 1]",
                                        "high 0.9 or 1.2 would"), {"parameters": {"x": {"step": 0.3}}}),
    "parallel-zero": Case(("resources.parallel", "a whole number of trials at once (1 or more) or auto, got 0"), {"resources": {"parallel": 0}}),
    "gpu-fraction-not-1-over-k": Case(("resources.gpus_per_trial",
                                       "0.3 is neither a whole number of GPUs nor a fraction 1/k"),
                                      {"resources": {"gpus_per_trial": 0.3}}),
    "gpu-fraction-under-torchrun": Case(("resources.gpus_per_trial", "torchrun: true would put several NCCL ranks"),
                                        {"resources": {"gpus_per_trial": 0.25, "torchrun": True}}),
    "misspelt-script": Case(("command", "trian.py is neither a file of the trial folder", "did you mean train.py"),
                            {"command": "python trian.py"}),
    "missing-program": Case(("command", "program no-such-trainer not found"), {"command": "no-such-trainer --x 1"}),
    "storage-scheme": Case(("--storage", "cannot open foo://bar", "sqlite:///PATH"),
                           args=("status", "{scenario}", "--storage", "foo://bar")),
    "space-change-needs-no-store": Case(("--storage", "cannot open nosql://x"),
                                        args=("run", "{scenario}", "--storage", "nosql://x")),
    "storage-port-nothing-listens": Case(("--storage", "cannot open postgresql://u:***@127.0.0.1:1/db",
                                          "Connection refused", "is a server running there?"),
                                         args=("run", "{scenario}", "--storage", "postgresql://u:pw@127.0.0.1:1/db")),
    "storage-is-a-folder": Case(("--storage", "is a folder; name a file in it, e.g.", "study.db"),
                                args=("run", "{scenario}", "--storage", "sqlite:///{dir}")),
    "storage-folder-behind-a-file": Case(("--storage", "cannot create the folder", "scenario.yaml is a file"),
                                         args=("run", "{scenario}", "--storage", "journal:{scenario}/runs/study.log")),
    "validate-storage-folder-behind-a-file": Case(("--storage", "cannot create the folder", "scenario.yaml is a file"),
                                                  args=("validate", "{scenario}", "--storage",
                                                        "sqlite:///{scenario}/study.db")),
    "storage-not-a-database": Case(("--storage", "cannot open /", "notes.db: file is not a database"),
                                   files={"notes.db": "my notes\n" * 200},
                                   args=("status", "{scenario}", "--storage", "sqlite:///{dir}/notes.db")),
    "cluster-nothing-listens": Case(("--cluster", "cannot reach the Dask scheduler at tcp://127.0.0.1:1",
                                     "connection refused (is the scheduler running there?)"),
                                    args=("run", "{scenario}", "--cluster", "tcp://127.0.0.1:1")),
    "cluster-in-scenario-nothing-listens": Case(("resources.cluster", "cannot reach the Dask scheduler"),
                                                {"resources": {"cluster": "tcp://127.0.0.1:1"}},
                                                args=("run", "{scenario}")),
    "cluster-address-without-port": Case(("resources.cluster", "expected a Dask scheduler address", "'tcp://head'"),
                                         {"resources": {"cluster": "tcp://head"}}),
    "cluster-flag-not-an-address": Case(("--cluster", "expected a Dask scheduler address", "'foo'"),
                                        args=("run", "{scenario}", "--cluster", "foo")),
    "cluster-address-and-kind": Case(("resources.cluster", "address and kind exclude each other"),
                                     {"resources": {"cluster": {"address": "tcp://head:8786", "kind": "slurm",
                                                                "cores": 4, "memory": "16GB"}}}),
    "cluster-walltime-not-a-time": Case(("resources.cluster.walltime", "expected a slurm time limit", "'abc'"),
                                        {"resources": {"cluster": {"kind": "slurm", "cores": 4, "memory": "16GB",
                                                                   "walltime": "abc"}}}),
    "choices-yaml-1-2-reads-apart": Case(("parameters.opt.choices", "true is listed twice, as YAML reads the values"),
                                         raw="name: demo\ncommand: python train.py\nsearch: {trials: 2}\n"
                                             "parameters:\n  x: {type: float, low: 0, high: 1}\n"
                                             "  opt: {type: categorical, choices: [yes, on, true, True]}\n"),
    "alias-refers-to-itself": Case(("scenario.yaml line 2", "the alias *e refers to itself"),
                                   raw="name: demo\nenv: &e {A: *e}\n"),
    "parameter-name-with-a-space": Case(("parameters.x y", "holds whitespace"),
                                        {"flags": True, "parameters": {"x y": {"type": "int", "low": 1, "high": 3}}}),
    "env-value-true": Case(("env.WANDB_SILENT", "true is not text", "quote it"), {"env": {"WANDB_SILENT": True}}),
    "run-env-sets-rank": Case(("env.RANK", "torchrun sets it for each trial process"), {"env": {"RANK": "1"}},
                              args=("run", "{scenario}")),
    "grid-on-continuous": Case(("parameters.x", "method grid needs a step"), {"search": {"method": "grid"}}),
    "too-many-gpus-per-trial": Case(("resources.gpus_per_trial", "2 GPUs per trial, but resources.gpus names 1 GPU"),
                                    {"resources": {"gpus": [0], "gpus_per_trial": 2}}),
    # design CSV
    "csv-missing-file": Case(("search.csv", "design.csv not found"), {"search": CSV_SEARCH}),
    "csv-unknown-column": Case(("design.csv", "column lr is not a parameter"), {"search": CSV_SEARCH},
                               files={"design.csv": "x,opt,lr\n0.5,a,0.1\n"}),
    "csv-missing-column": Case(("design.csv", "no column for parameter opt"), {"search": CSV_SEARCH},
                               files={"design.csv": "x\n0.5\n"}),
    "csv-row-too-short": Case(("design.csv line 3", "1 value for 2 columns"), {"search": CSV_SEARCH},
                              files={"design.csv": GOOD_CSV_HEADER + "0.5,a\n0.7\n"}),
    "csv-value-out-of-range": Case(("design.csv line 2, column x", "1.5 is outside [0, 1]"), {"search": CSV_SEARCH},
                                   files={"design.csv": GOOD_CSV_HEADER + "1.5,a\n"}),
    "csv-not-a-number": Case(("design.csv line 2, column x", "'big' is not a number"), {"search": CSV_SEARCH},
                             files={"design.csv": GOOD_CSV_HEADER + "big,a\n"}),
    "csv-bad-categorical": Case(("design.csv line 3, column opt", "'c' is not one of a, b"), {"search": CSV_SEARCH},
                                files={"design.csv": GOOD_CSV_HEADER + "0.1,a\n0.2,c\n"}),
    "csv-empty": Case(("design.csv", "the design CSV is empty"), {"search": CSV_SEARCH}, files={"design.csv": ""}),
    "csv-more-trials-than-rows": Case(("search.trials", "5 trials exceed the 2 points of the csv design"),
                                      {"search": {**CSV_SEARCH, "trials": 5}},
                                      files={"design.csv": GOOD_CSV_HEADER + "0.1,a\n0.2,b\n"}),
    # templates
    "template-missing": Case(("template", "nope.py.j2 not found"), {"template": "nope.py.j2"}),
    "template-undefined-variable": Case(("train.py.j2 line 2", "'lr' is undefined"),
                                        template="from hpo.results import report\nreport(val_error={{ lr }})\n"),
    "template-syntax-error": Case(("train.py.j2 line 3", "unexpected"),
                                  template="a = 1\nb = 2\nc = {{ x + }}\n"),
    "template-dollar-undefined": Case(("train.py.j2 line 3", "${lr} is undefined"), {"syntax": "dollar"},
                                      template="a = ${x}\nb = 2\nc = ${lr}\n"),
    "template-runtime-error": Case(("train.py.j2 line 1", "ZeroDivisionError"), template="{{ x / 0 }}\n"),
    "template-run-by-its-sub-folder-path": Case(("command: template sub/train.py is written into the trial folder as "
                                                 "train.py; write train.py, or use the folder sub/ as the template"),
                                                {"template": "sub/train.py", "command": "python sub/train.py"},
                                                files={"sub/train.py": "print(1)\n"}),
    # data
    "data-dir-missing": Case(("data_dir: /", "/no-such-data not found"), {"data_dir": "no-such-data"}),
    "data-dir-is-a-file": Case(("data_dir: /", "/notes.txt is a file, not a folder"), {"data_dir": "notes.txt"},
                               files={"notes.txt": "not data\n"}),
    "run-data-dir-missing": Case(("data_dir: /", "/no-such-data not found"), {"data_dir": "no-such-data"},
                                 args=("run", "{scenario}")),
    # command line
    "unknown-command": Case(("invalid choice", "frobnicate"), args=("frobnicate", "{scenario}")),
    "workers-zero": Case(("--workers", "must be at least 1, got 0"), args=("run", "{scenario}", "--workers", "0")),
    "workers-not-a-number": Case(("--workers", "'x'"), args=("run", "{scenario}", "--workers", "x")),
    "worker-seed-negative": Case(("--seed", "must be at least 0, got -1"),
                                 args=("worker", "{scenario}", "--seed", "-1")),
    "rerun-seed-too-large": Case(("--seed", "must be at most 4294967295"),
                                 args=("rerun", "{scenario}", "0", "--seed", "4294967296")),
    "dashboard-port-out-of-range": Case(("--port", "must be at most 65535, got 99999"),
                                        args=("dashboard", "{scenario}", "--port", "99999")),
    "max-step-without-hyperband": Case(("search.max_step", "only pruner hyperband reads max_step"),
                                       {"search": {"pruner": "successive_halving", "max_step": 9}}),
    "run-seed-negative": Case(("search.seed", "greater than or equal to 0"), {"search": {"seed": -1}},
                              args=("run", "{scenario}")),
    "run-env-name-with-equals": Case(("env", "'A=B' is not an environment variable name"), {"env": {"A=B": "1"}},
                                     args=("run", "{scenario}")),
    "run-low-nan": Case(("parameters.x.low", ".nan is not a finite number"),
                        {"parameters": {"x": {"low": float("nan")}}}, args=("run", "{scenario}")),
    "unknown-option": Case(("unrecognized arguments", "--fast"), args=("validate", "{scenario}", "--fast")),
    "workdir-is-a-file": Case(("--workdir", "scenario.yaml is a file, not a folder"),
                              args=("run", "{scenario}", "--workdir", "{scenario}")),
    "export-to-a-folder": Case(("-o", "is a folder; name a file in it, e.g.", "trials.csv"),
                               args=("export", "{scenario}", "-o", "{dir}")),
    "best-copy-to-a-file": Case(("--copy-to", "scenario.yaml is a file, not a folder"),
                                args=("best", "{scenario}", "--copy-to", "{scenario}")),
    "plot-behind-a-file": Case(("-o", "cannot create the folder", "scenario.yaml is a file"),
                               args=("plot", "{scenario}", "-o", "{scenario}/plots")),
    "plot-to-a-folder-that-cannot-be-made": Case(("-o", "cannot create the folder /proc/hpo-plots"),
                                                  args=("plot", "{scenario}", "-o", "/proc/hpo-plots")),
    "stop-without-a-trial-number": Case(("stop", "trial"), args=("stop", "{scenario}")),
    # the same inputs through `hpo run`: rejected before any trial runs
    "run-csv-value-out-of-range": Case(("design.csv line 2, column x", "outside [0, 1]"), {"search": CSV_SEARCH},
                                       files={"design.csv": GOOD_CSV_HEADER + "7,a\n"}, args=("run", "{scenario}")),
    "post-process-script-missing": Case(("objective.post_process", "prase.py is neither a file of the trial folder"),
                                        {"objective": {"post_process": "python prase.py"}}),
    "command-bare-name-of-a-trial-file": Case(("command", "train.py is not on PATH; write ./train.py"),
                                              {"command": "train.py"}),
    "run-workdir-that-cannot-be-made": Case(("--workdir", "cannot create the folder /proc/hpo-workdir"),
                                            args=("run", "{scenario}", "--workdir", "/proc/hpo-workdir")),
    "run-template-undefined-variable": Case(("train.py.j2 line 1", "'lr' is undefined"), template="{{ lr }}\n",
                                            args=("run", "{scenario}")),
}


def assert_input_error(result: subprocess.CompletedProcess[str], *expect: str) -> None:
    """Exit code 2; stderr exactly one ``error: `` line holding every ``expect``; no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr.endswith("\n"), result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for text in expect:
        assert text in lines[0], (text, lines[0])
    fields = "|".join(allowed_keys(Scenario))
    assert not re.match(rf"error: ({fields})[.:]", lines[0]), f"a scenario's field without its file: {lines[0]}"


@dataclass(frozen=True)
class Outcome:
    """A case as it ran: its folder, the arguments and the finished process."""

    folder: Path
    args: list[str]
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, write_scenario: WriteScenario,
             run_cli: RunCli) -> dict[str, Outcome]:
    """Every case written to its own folder, then run through the CLI: the commands that need a
    process of their own several at once, the rest in this process's main thread meanwhile (a
    sweep runs in process only from there)."""
    prepared = {}
    for name, case in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        extra = {} if case.template is None else {"template_text": case.template}
        path = write_scenario(folder, drop=case.drop, files=case.files, raw=case.raw, **extra, **case.overrides)
        prepared[name] = (folder, [arg.format(scenario=path, dir=folder) for arg in case.args])

    def run(name: str) -> tuple[str, Outcome]:
        folder, args = prepared[name]
        return name, Outcome(folder, args, run_cli(*args, cwd=folder))

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        processes = [pool.submit(run, name) for name, (_, args) in prepared.items() if not runs_in_process(args)]
        outcomes = dict(run(name) for name, (_, args) in prepared.items() if runs_in_process(args))
        return outcomes | dict(process.result() for process in processes)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_line(outcomes: dict[str, Outcome], name: str) -> None:
    outcome = outcomes[name]
    assert_input_error(outcome.result, *CASES[name].expect)
    if outcome.args[:1] == ["run"]:
        assert not list(outcome.folder.glob("runs/*/trial-*")), "a trial ran despite the bad input"


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25


MISBEHAVING_TEMPLATE = """\
import math
import sys

from hpo.results import report

mode = "{{ mode }}"
print("Epoch 1 lr=0.1 loss 3", flush=True)
if mode == "ok":
    report(val_error=0.25, test_error=0.5)
elif mode == "garbage":
    print("all done, no metric here")
elif mode == "crash":
    report(val_error=0.1)
    sys.exit(3)
elif mode == "shard":
    print("dataset shard missing", file=sys.stderr)
    sys.exit(3)
elif mode == "nan":
    report(val_error=math.nan, test_error=0.4)
elif mode == "text":
    print("val_error=low")
"""

EXPECTED_OUTCOMES = {
    "ok": ("COMPLETE", ""),
    "garbage": ("FAIL", "val_error was never reported"),
    "crash": ("FAIL", "exit code 3"),
    "shard": ("FAIL", "exit code 3: dataset shard missing"),
    "nan": ("FAIL", "val_error is nan"),
    "text": ("FAIL", "val_error is not a number: low"),
}


@pytest.fixture(scope="module")
def misbehaving_sweep(tmp_path_factory: pytest.TempPathFactory, write_scenario: WriteScenario,
                      run_cli: RunCli) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A finished grid sweep over trials that succeed, print garbage, crash, report NaN or text."""
    folder = tmp_path_factory.mktemp("misbehaving")
    path = write_scenario(folder, drop=("parameters.x", "parameters.opt"), template_text=MISBEHAVING_TEMPLATE,
                          parameters={"mode": {"type": "categorical", "choices": list(EXPECTED_OUTCOMES)}},
                          search={"method": "grid", "trials": None}, resources={"parallel": 2})
    return path, run_cli("run", path, cwd=folder)


def test_misbehaving_trials_fail_with_reasons_and_the_sweep_goes_on(
        misbehaving_sweep: tuple[Path, subprocess.CompletedProcess[str]], run_cli: RunCli, tmp_path: Path) -> None:
    path, result = misbehaving_sweep
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    out = tmp_path / "results.csv"
    exported = run_cli("export", path, "-o", out)
    assert exported.returncode == 0, exported.stderr
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["number"] for row in rows] == [str(i) for i in range(len(EXPECTED_OUTCOMES))]
    assert {row["mode"]: (row["state"], row["reason"]) for row in rows} == EXPECTED_OUTCOMES
    by_mode = {row["mode"]: row for row in rows}
    assert float(by_mode["ok"]["val_error"]) == 0.25 and float(by_mode["ok"]["test_error"]) == 0.5
    assert by_mode["nan"]["val_error"] == "" and float(by_mode["nan"]["test_error"]) == 0.4
    for row in rows:
        assert Path(row["folder"], "trial.log").is_file()


def test_stop_of_a_missing_trial_after_a_run(misbehaving_sweep: tuple[Path, subprocess.CompletedProcess[str]],
                                             run_cli: RunCli) -> None:
    path, _ = misbehaving_sweep
    assert_input_error(run_cli("stop", path, "99"), "trial 99", "no such trial")


def test_stop_of_a_finished_trial_after_a_run(misbehaving_sweep: tuple[Path, subprocess.CompletedProcess[str]],
                                              run_cli: RunCli) -> None:
    path, _ = misbehaving_sweep
    assert_input_error(run_cli("stop", path, "0"), "trial 0", "not running")


def test_version(run_cli: RunCli) -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("hpo 0.")


def test_status_before_any_run(tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    assert_input_error(run_cli("status", write_scenario(tmp_path)), "no study named demo", "hpo run")


def test_a_field_is_named_with_its_scenario_file_wherever_it_was_checked() -> None:
    """A check made after the scenario was read (the command, the GPUs, a Slurm job) names the
    file as the checks made while reading do; a flag, a trial or a template keeps its own name."""
    fields = ("command", "resources", "search")
    assert in_scenario("resources.cluster.kind: no sbatch", "s.yaml", fields) == "s.yaml: resources.cluster.kind: no sbatch"
    assert in_scenario("command: train.py not found", "s.yaml", fields) == "s.yaml: command: train.py not found"
    for message in ("--workers 3: too many", "trial 4: no log", "template a.py.j2 line 2: x", "commander: x"):
        assert in_scenario(message, "s.yaml", fields) == message
