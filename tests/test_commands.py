"""The commands around a sweep, through the real CLI: what they do with a study that lacks
something (a completed trial, a folder, the study itself), a closed pipe, a shared workdir."""
from __future__ import annotations

import csv
import fcntl
import io
import math
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

from conftest import TEMPLATE_TEXT, cli_env, run_hpo, run_hpo_process

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]


def test_status_into_a_closed_pipe_exits_0(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path, search={"method": "monte_carlo", "trials": 30, "seed": 1})
    assert run_hpo("run", scenario).returncode == 0
    status = subprocess.Popen([sys.executable, "-m", "hpo", "status", str(scenario), "--all"], env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert status.stdout is not None and status.stdout.readline()
    status.stdout.close()
    assert status.wait(timeout=60) == 0
    assert status.stderr is not None and status.stderr.read() == b""


def test_status_shows_a_csv_study_whose_design_file_is_gone(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """hpo status refused a finished study once its design CSV was moved or half edited (it
    counts the design's rows), where export and best answered."""
    scenario = write_scenario(tmp_path, search={"method": "csv", "csv": "design.csv", "trials": None},
                              files={"design.csv": "x,opt\n0.1,a\n0.2,b\n"})
    assert run_hpo("run", scenario).returncode == 0
    (tmp_path / "design.csv").rename(tmp_path / "design.bak")
    status = run_hpo("status", scenario)
    assert (status.returncode, status.stderr) == (0, ""), status.stderr
    assert (f"note: the design's size is unknown (scenario.yaml: search.csv: design file {tmp_path / 'design.csv'} "
            "not found): the count below is of the trials the study holds\n2/2 trials done: 2 complete.") in status.stdout
    (tmp_path / "design.csv").write_text("x,opt\n0.1,a\nabc,b\n")
    status = run_hpo("status", scenario)
    assert status.returncode == 0 and "note: the design's size is unknown (design.csv line 3, column x:" in status.stdout


def test_a_sweep_whose_output_pipe_closes_runs_on_and_records_every_trial(tmp_path: Path,
                                                                         write_scenario: WriteScenario) -> None:
    """``hpo run ... | head -1``: the sweep ended at its next line with exit 0, leaving a trial
    RUNNING with no worker and the rest not run. Now it says once that its reader has gone,
    and runs to the end."""
    scenario = write_scenario(tmp_path, search={"method": "monte_carlo", "trials": 6, "seed": 1})
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(scenario)], env=cli_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout is not None and run.stdout.readline().startswith("sweep demo: ")
    run.stdout.close()
    assert run.wait(timeout=120) == 0
    assert run.stderr is not None and run.stderr.read() == (
        "hpo: the reader of stdout has gone: what this sweep prints is dropped from now on; it runs on and records "
        "every trial (hpo status shows them)\n")
    rows = list(csv.DictReader(io.StringIO(run_hpo("export", scenario).stdout)))
    assert [row["state"] for row in rows] == ["COMPLETE"] * 6


def test_two_studies_may_not_share_a_workdir(tmp_path: Path, write_scenario: WriteScenario) -> None:
    first = write_scenario(tmp_path / "a")
    second = write_scenario(tmp_path / "b", name="other")
    workdir = tmp_path / "shared"
    assert run_hpo("run", first, "--workdir", workdir).returncode == 0
    refused = run_hpo("run", second, "--workdir", workdir)
    assert refused.returncode == 2
    assert refused.stderr == f"error: --workdir: {workdir} holds the trial folders of study demo; " \
                             "give study other a folder of its own\n"
    assert run_hpo("run", first, "--workdir", workdir).returncode == 0


def test_a_study_of_the_same_name_in_another_store_may_not_take_a_workdir(tmp_path: Path,
                                                                        write_scenario: WriteScenario) -> None:
    """The marker named the study alone: a study of the same name in another store (``hpo run
    --storage``, a worker pointed at the wrong store) wrote its trial folders over the first's,
    script, params.json and model included, and exited 0."""
    scenario = write_scenario(tmp_path, search={"trials": 1})
    assert run_hpo("run", scenario).returncode == 0
    workdir = tmp_path / "runs" / "demo"
    params = (workdir / "trial-0000" / "params.json").read_text()
    for command in (("run",), ("run", "--workers", "2"), ("worker",), ("validate",)):
        other = f"sqlite:///{tmp_path / (command[0] + str(len(command)))}.db"
        refused = run_hpo(*command[:1], scenario, *command[1:], "--storage", other)
        assert refused.returncode == 2, (command, refused.stdout, refused.stderr)
        assert re.fullmatch(rf"error: scenario.yaml: workdir: {workdir} holds the trial folders of another study named demo \(created "
                            rf"\S+ [0-9a-f]{{8}}\), not the one in {re.escape(other)}; give this one a folder of its "
                            rf"own \(--workdir\), or remove {workdir} if those trials are not wanted\n", refused.stderr), \
            refused.stderr
        assert not Path(other.removeprefix("sqlite:///")).exists() or command[0] == "validate"  # no study made there
    assert (workdir / "trial-0000" / "params.json").read_text() == params
    assert run_hpo("rerun", scenario, "0").returncode == 0  # the study of the workdir goes on
    for path in [*workdir.glob("trial-*"), *workdir.glob("study.db*")]:  # started over: its marker is left alone
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert run_hpo("run", scenario).returncode == 0
    assert run_hpo("run", scenario, "--storage", f"sqlite:///{tmp_path / 'run1.db'}").returncode == 2
    elsewhere = run_hpo("run", scenario, "--storage", f"sqlite:///{tmp_path / 'run1.db'}", "--workdir", tmp_path / "w2")
    assert elsewhere.returncode == 0, elsewhere.stderr


def test_best_names_what_is_missing(tmp_path: Path, write_scenario: WriteScenario) -> None:
    failing = write_scenario(tmp_path / "failing", template_text="raise SystemExit(3)\n")
    assert run_hpo("run", failing).returncode == 1
    none = run_hpo("best", failing)
    assert (none.returncode, none.stderr) == (1, ("error: study demo: no trial completed: all 2 ended otherwise "
                                                  "(2 FAIL); hpo status gives their reasons\n"))
    scenario = write_scenario(tmp_path / "gone")
    assert run_hpo("run", scenario).returncode == 0
    for folder in (tmp_path / "gone" / "runs" / "demo").glob("trial-*"):
        shutil.rmtree(folder)
    copy = tmp_path / "copy"
    gone = run_hpo("best", scenario, "--copy-to", copy)
    assert gone.returncode == 2 and "--copy-to: trial" in gone.stderr and "is gone" in gone.stderr
    assert not copy.exists()


def test_a_sweep_in_which_no_trial_completed_exits_1_with_every_trial_recorded(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Every trial failing (a script that always crashes, data where the script finds none)
    left the study without a result, yet ``hpo run`` exited 0, so ``hpo run && hpo export``
    went on as if it had one. It exits 1, names the states, and records every trial; one
    completed trial is a result (exit 0)."""
    failing = write_scenario(tmp_path / "failing", search={"trials": 3}, resources={"parallel": 2},
                             template_text="raise SystemExit('CUDA out of memory')\n")
    said = ("error: study demo: no trial completed: all 3 ended otherwise (3 FAIL); hpo status gives their "
            "reasons\n")
    for command in (("run",), ("run",), ("worker",), ("run", "--workers", "2")):  # ended, then again with nothing to run
        run = run_hpo(command[0], failing, *command[1:])
        assert (run.returncode, run.stderr) == (1, said), (command, run.stdout, run.stderr)
        assert "3/3 trials done: 3 failed." in run.stdout, run.stdout
    status = run_hpo("status", failing)
    assert status.returncode == 0 and status.stdout.count("CUDA out of memory") == 3, status.stdout
    some = write_scenario(tmp_path / "some", search={"trials": 3}, resources={"parallel": 2},
                          template_text="{% if trial_number > 0 %}raise SystemExit(3){% endif %}\n" + TEMPLATE_TEXT)
    for command in (("run",), ("run", "--workers", "2")):
        run = run_hpo(command[0], some, *command[1:])
        assert (run.returncode, run.stderr) == (0, ""), (command, run.stdout, run.stderr)
        assert "3/3 trials done: 1 complete, 2 failed." in run.stdout, run.stdout


def test_a_rerun_never_creates_a_study(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path)
    rerun = run_hpo("rerun", scenario, "0")
    assert rerun.returncode == 2 and "no study named demo" in rerun.stderr
    assert not (tmp_path / "runs").exists()


def test_gpu_lists_are_checked(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path)
    worker = run_hpo("worker", scenario, "--gpus", "0,x")
    assert (worker.returncode, worker.stderr) == (
        2, "error: --gpus: '0,x' is not a comma-separated list of GPU ids (whole numbers, e.g. 0,1)\n")
    validate = run_hpo_process("validate", scenario, timeout=60, extra_env={"HPO_GPUS": "1,1"})
    assert (validate.returncode, validate.stderr) == (2, "error: HPO_GPUS: GPU ids must be unique, got 1,1\n")


def test_status_and_export_show_the_constants_a_trial_ran_with(tmp_path: Path,
                                                               write_scenario: WriteScenario) -> None:
    constant = {"parameters": {"epochs": {"type": "constant", "value": 3}}}
    scenario = write_scenario(tmp_path, **constant)
    assert run_hpo("run", scenario).returncode == 0
    write_scenario(tmp_path, parameters={"epochs": {"type": "constant", "value": 5}})
    exported = run_hpo("export", scenario)
    assert exported.returncode == 0
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert [row["epochs"] for row in rows] == ["3", "3"]
    assert "epochs=3" in run_hpo("status", scenario).stdout


def test_gpus_a_worker_is_given_must_be_on_the_machine(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path)
    worker = run_hpo_process("worker", scenario, "--gpus", "1,5", timeout=60, extra_env={"HPO_GPUS": "0,1"})
    assert (worker.returncode, worker.stderr) == (
        2, "error: --gpus: GPU 5 is not on this machine (it has GPUs 0,1; HPO_GPUS overrides what nvidia-smi shows)\n")


def test_validate_refuses_a_workdir_of_another_study_as_run_does(tmp_path: Path,
                                                                 write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path)
    workdir = tmp_path / "shared"
    workdir.mkdir()
    (workdir / ".hpo-study").write_text("quad\n")
    refusal = f"error: --workdir: {workdir} holds the trial folders of study quad; give study demo a folder of its own\n"
    for command in ("validate", "run"):
        refused = run_hpo(command, scenario, "--workdir", workdir)
        assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", refusal), command
    assert [p.name for p in workdir.iterdir()] == [".hpo-study"]
    fresh = tmp_path / "fresh"
    assert run_hpo("validate", scenario, "--workdir", fresh).returncode == 0
    assert not fresh.exists()


def test_bare_hpo_names_the_commands_in_one_line() -> None:
    bare = run_hpo()
    assert (bare.returncode, bare.stdout) == (2, "")
    assert bare.stderr == ("error: a command is needed: run, worker, status, tail, stop, export, plot, best, "
                           "validate, rerun, dashboard; see hpo --help\n")
    helped = run_hpo("--help")
    assert (helped.returncode, helped.stderr) == (0, "")
    assert helped.stdout.startswith("usage: hpo") and "HPO_GPUS" in helped.stdout


def test_argument_errors_are_one_line(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = str(write_scenario(tmp_path))
    for args, said in [
        (("run",), "error: hpo run: the following arguments are required: scenario\n"),
        (("tail", scenario), "error: hpo tail: the following arguments are required: trial\n"),
        (("nonsense",), ("error: hpo: argument COMMAND: invalid choice: 'nonsense' (choose from 'run', 'worker', "
                         "'status', 'tail', 'stop', 'export', 'plot', 'best', 'validate', 'rerun', 'dashboard')\n")),
        (("status", scenario, "--last", "0"), "error: hpo status: argument --last: must be at least 1, got 0\n"),
        (("status", scenario, "--all", "--last", "2"),
         "error: hpo status: argument --last: not allowed with argument --all\n"),
        (("run", scenario, "extra"), "error: hpo: unrecognized arguments: extra\n"),
    ]:
        result = run_hpo(*args)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", said), args


def test_validate_and_the_sweep_say_which_steps_the_pruner_plans_for(
        tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    """Hyperband without search.max_step plans brackets for 81 steps, which a 10-epoch script
    never reaches: the plan says so, where it was not said at all."""
    path = write_scenario(tmp_path, search={"method": "tpe", "trials": 1, "pruner": "hyperband"})
    said = "pruner hyperband over steps 1..81 (search.max_step not set: set it to the last step a trial reports)"
    validated = run_cli("validate", path)
    assert validated.returncode == 0 and f"method tpe, {said}, 1 trial," in validated.stdout
    ran = run_cli("run", path)
    assert ran.returncode == 0 and f"; {said}\n" in ran.stdout + ran.stderr


def test_a_rerun_says_whether_it_reproduced_and_warns_of_a_seed_the_trial_may_not_see(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A rerun checks reproducibility: it says how its objective compares with the original's.
    --seed on a scenario whose templates never read trial_seed ran silently as without it (a
    script may still read it from params.json: a note, not a refusal)."""
    scenario = write_scenario(tmp_path, search={"trials": 1})
    assert run_hpo("run", scenario).returncode == 0
    rerun = run_hpo("rerun", scenario, "0")
    assert rerun.returncode == 0 and "; the same val_error as trial 0; folder " in rerun.stdout
    seeded = run_hpo("rerun", scenario, "0", "--seed", "5")
    assert seeded.returncode == 0 and seeded.stdout.startswith(
        "note: --seed reaches the trial only through params.json: no template reads trial_seed and the scenario sets "
        "no seed_flag (seed_flag: --seed passes it to a script that takes --seed)\n"), seeded.stdout + seeded.stderr
    assert "; the same val_error as trial 0; folder " in seeded.stdout
    drifting = write_scenario(tmp_path / "drifting", search={"trials": 1}, template_text=(
        "from hpo.results import report\nreport(val_error=0.25 + {{ trial_seed }} / 100)\n"))
    assert run_hpo("run", drifting).returncode == 0
    changed = run_hpo("rerun", drifting, "0", "--seed", "26")
    assert changed.returncode == 0, changed.stderr
    assert "val_error=0.51; trial 0 had val_error=0.26, this run +0.25 (+96%); folder " in changed.stdout


def test_an_empty_cluster_address_is_refused_not_taken_for_this_machine(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = write_scenario(tmp_path)
    run = run_hpo("run", scenario, "--cluster", "")
    assert (run.returncode, run.stderr) == (2, ("error: --cluster: expected a Dask scheduler address such as "
                                               "tcp://10.0.0.5:8786 ([tcp|tls|ucx|ws|wss://]HOST:PORT), got ''\n"))
    assert "COMPLETE" not in run.stdout


def test_validate_prints_the_job_script_that_hpo_run_submits_with_its_output_files(tmp_path: Path) -> None:
    """hpo run sends each job's output into <workdir>/jobs; the printed script left that out."""
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "digits-slurm.yaml"
    validated = run_hpo("validate", scenario, "--workdir", tmp_path / "w")
    assert validated.returncode == 0, validated.stderr
    assert f"#SBATCH -o {tmp_path}/w/jobs/dask-worker-%J.out\n" in validated.stdout
    assert not (tmp_path / "w" / "jobs").exists()


def test_status_says_a_failed_rerun_is_a_rerun_and_why_it_failed(tmp_path: Path,
                                                                  write_scenario: WriteScenario) -> None:
    """The reason column named either the failure or the trial rerun: a failed rerun looked
    like a new trial that happened to fail."""
    scenario = write_scenario(tmp_path, search={"trials": 1}, template_text="raise SystemExit({{ 3 }})\n")
    assert run_hpo("run", scenario).returncode == 1  # no trial completed
    assert "(rerun of 0) FAIL" in run_hpo("rerun", scenario, "0").stdout
    status = run_hpo("status", scenario)
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if line.startswith("│ 1 "))
    assert "rerun of #0: exit code 3" in row, status.stdout


def test_status_on_a_narrow_terminal_keeps_the_state_whole(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A long parameter value squeezed every column on an 80-column terminal: the state was
    folded into COMPLET / E, and numbers into 0.000 / 3683. Trial, state, numbers and headers
    keep their width; the long value folds instead."""
    long_choice = "a_very_long_parameter_value_" * 4
    scenario = write_scenario(tmp_path, search={"trials": 2},
                              parameters={"opt": {"type": "categorical", "choices": [long_choice]},
                                          "optimizer_name_here": {"type": "categorical", "choices": ["sgd"]}},
                              template_text="import sys\nfrom hpo.results import report\nif {{ trial_number }} == 0:\n"
                                            "    sys.exit('the data shard is missing from the cache folder')\n"
                                            "report(val_error={{ x }})\n")
    assert run_hpo("run", scenario).returncode == 0
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**cli_env(), "TERM": "dumb"}
    env.pop("COLUMNS", None)
    status = subprocess.Popen([sys.executable, "-m", "hpo", "status", str(scenario)], env=env, stdout=terminal,
                              stderr=subprocess.PIPE)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert status.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())
    assert re.search(r"│ 1 \* +│ COMPLETE │", text), text
    assert all(name in text for name in ("val_error", "seconds", "optimizer_name_here")), text  # headers whole
    values = [line.split("│")[3].strip() for line in text.splitlines() if re.match(r"│ \d", line)]
    assert all(re.fullmatch(r"0\.\d+", value) for value in values) and len(values) == 2, text  # nor numbers


def test_status_names_each_kind_of_repeat_as_its_csv_column_does() -> None:
    """A configuration queued again (lost, interrupted), retried after a failure and rerun by
    hand read apart in status as in the CSV (``requeue_of``, ``retry_of``, ``rerun_of``); a
    failed one keeps its reason after what it repeats."""
    from hpo.cli import _reason
    from hpo.outcome import Outcome
    from hpo.rows import TrialRow

    def row(reason: str = "", **repeat: int) -> TrialRow:
        return TrialRow(7, Outcome.FAIL if reason else Outcome.COMPLETE, {}, None, {}, 1.0, "", reason, **repeat)

    assert _reason(row(requeue_of=4)) == "requeue of #4"
    assert _reason(row(retry_of=4)) == "retry of #4"
    assert _reason(row(retry_of=4, requeue_of=4)) == "retry of #4"  # a retry's copy records both
    assert _reason(row("exit code 3", rerun_of=4)) == "rerun of #4: exit code 3"
    assert _reason(row("exit code 3")) == "exit code 3"


def test_status_shows_as_many_digits_as_tell_the_values_apart(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Errors 1.99971, 1.99974 and 1.9995 read '2' three times to 4 significant digits, and the
    best's line said 'val_error=2'; each column now has the digits that tell its values apart."""
    from hpo.progress import distinct_digits

    assert distinct_digits([1.99971, 1.99974, 1.9995, None, math.inf]) == 6
    assert distinct_digits([0.5, 0.25]) == 4 and distinct_digits([]) == 4
    path = write_scenario(tmp_path, drop=["parameters.opt"], parameters={"x": {"type": "float", "low": 1, "high": 3}},
                          search={"method": "csv", "csv": "points.csv", "trials": 3},
                          template_text="from hpo.results import report\nreport(val_error={{ x }}, test_error=0.5)\n")
    (tmp_path / "points.csv").write_text("x\n1.99971\n1.99974\n1.9995\n")
    assert run_hpo("run", path).returncode == 0
    out = run_hpo("status", path).stdout
    assert re.search(r"│ 2 \*\s+│ COMPLETE │ 1\.9995\s+│ 1\.9995\s+│", out), out
    assert "1.99971" in out and "1.99974" in out and "best #2 val_error=1.9995 test_error=0.5" in out, out


def test_tail_of_a_trial_that_printed_nothing_says_so(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A trial that failed printing nothing: ``hpo tail`` printed nothing either, as if it had
    not looked."""
    path = write_scenario(tmp_path, search={"trials": 1}, template_text="x = {{ x }}\n")
    assert run_hpo("run", path).returncode == 1  # no trial completed
    tail = run_hpo("tail", path, "0")
    log = tmp_path / "runs" / "demo" / "trial-0000" / "trial.log"
    assert (tail.returncode, tail.stdout) == (0, ""), tail.stderr
    assert tail.stderr == f"hpo: trial 0's log {log} is empty: it printed nothing\n"


def test_tail_of_a_trial_that_runs_on_another_machine_says_where(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """From a machine without the trial folders, hpo tail waited 30 s, then said that the trial
    had not started (is a sweep running?) about a trial that hpo status showed running."""
    from hpo import designs
    from hpo.scenario import load_scenario
    from hpo.scheduler import Claim, Scheduler
    from hpo.store import SYS_RUN, SYS_STARTED, StudyStore

    path = write_scenario(tmp_path, search={"trials": 2})
    scenario = load_scenario(path)
    store = StudyStore(scenario, f"sqlite:///{tmp_path / 'runs' / 'demo' / 'study.db'}")
    scheduler = Scheduler(store, designs.design_points(scenario), 2, tmp_path / "elsewhere", 1)
    with store.lock():
        claim = scheduler.claim(set())
    assert isinstance(claim, Claim)
    store.set_system(claim.number, SYS_RUN, {"worker": "gpu7:12", "host": "gpu7"})
    store.set_system(claim.number, SYS_STARTED, {"slot": 0, "folder": str(claim.folder)})
    tail = run_hpo("tail", path, str(claim.number))
    assert (tail.returncode, tail.stdout) == (2, "")
    assert tail.stderr.endswith(f"error: trial {claim.number}: it runs on gpu7, and its log {claim.folder / 'trial.log'} "
                                "is not on this machine; run hpo tail there, or give the workdir a filesystem both "
                                "share\n"), tail.stderr


def test_tail_no_follow_of_a_trial_not_started_answers_at_once(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """hpo tail N --no-follow ('print what it holds now') of a claimed trial that has not
    started waited 30 s to follow it, then called that bad input (exit 2)."""
    from hpo import designs
    from hpo.scenario import load_scenario
    from hpo.scheduler import Claim, Scheduler
    from hpo.store import StudyStore

    path = write_scenario(tmp_path, search={"trials": 2})
    scenario = load_scenario(path)
    store = StudyStore(scenario, f"sqlite:///{tmp_path / 'runs' / 'demo' / 'study.db'}")
    scheduler = Scheduler(store, designs.design_points(scenario), 2, tmp_path / "runs" / "demo", 1)
    with store.lock():
        claim = scheduler.claim(set())
    assert isinstance(claim, Claim)
    began = time.monotonic()
    tail = run_hpo("tail", path, str(claim.number), "--no-follow")
    assert time.monotonic() - began < 20
    assert (tail.returncode, tail.stdout) == (0, ""), tail.stderr
    assert re.fullmatch(rf"hpo: trial {claim.number} is [A-Z]+: it has no log yet\n", tail.stderr), tail.stderr


def test_help_says_each_command_in_whole_sentences_without_developer_terms() -> None:
    """`hpo --help` cut the first line of each command's docstring mid-sentence ('... optimizer
    processes. Output'), and `hpo stop --help` showed ':func:`_worker_gone`'."""
    from hpo.cli import COMMANDS

    for command in COMMANDS:
        # no hyphen broken at a line end
        helped = run_hpo_process(command.name, "--help", timeout=60, extra_env={"COLUMNS": "100"})
        assert helped.returncode == 0, helped.stderr
        text = " ".join(helped.stdout.split())
        assert " ".join(command.summary.split()) in text and command.summary.endswith("."), command.name
        assert not re.search(r":(func|mod|class|data|meth):|``|InputError|_worker_gone", helped.stdout), helped.stdout
    listed = " ".join(run_hpo_process("--help", timeout=60, extra_env={"COLUMNS": "100"}).stdout.split())
    assert all(" ".join(command.summary.split()) in listed for command in COMMANDS), listed


def test_validate_checks_the_cluster_hpo_run_would_be_given(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """hpo validate refused --cluster, so an address meant for hpo run could not be checked."""
    scenario = write_scenario(tmp_path)
    done = run_hpo("validate", scenario, "--cluster", "tcp://10.0.0.5:8786")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith("trials on a Dask cluster")
    assert done.stdout.splitlines()[-1] == "cluster: the Dask scheduler at tcp://10.0.0.5:8786 (not contacted)"
    bad = run_hpo("validate", scenario, "--cluster", "nonsense")
    assert (bad.returncode, bad.stderr) == (2, ("error: --cluster: expected a Dask scheduler address such as "
                                               "tcp://10.0.0.5:8786 ([tcp|tls|ucx|ws|wss://]HOST:PORT), got 'nonsense'\n"))


def test_a_rerun_of_a_trial_from_before_a_space_change_is_refused(tmp_path: Path,
                                                                    write_scenario: WriteScenario) -> None:
    """After --allow-space-change added z, hpo rerun of an older trial drew a z of its own and
    said the trial did not reproduce (+4614%)."""
    scenario = write_scenario(tmp_path, drop=["parameters.opt"], search={"trials": 1})
    assert run_hpo("run", scenario).returncode == 0
    text = scenario.read_text()
    scenario.write_text(text.replace("parameters:\n", "parameters:\n  z:\n    type: float\n    low: 0\n    high: 1\n")
                        .replace("trials: 1", "trials: 2"))
    assert run_hpo("run", scenario, "--allow-space-change").returncode == 0
    refused = run_hpo("rerun", scenario, "0", "--allow-space-change")
    assert (refused.returncode, refused.stderr) == (2, (
        "error: trial 0: it has no z, which the scenario added since; hpo rerun runs a configuration of the "
        "scenario's search space as it is: rerun a trial run since the change\n"))
    assert run_hpo("rerun", scenario, "1", "--allow-space-change").returncode == 0


def test_status_shows_brackets_in_a_reason_as_they_are(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """rich read a reason's [/data/x] as markup: hpo status failed with a MarkupError."""
    scenario = write_scenario(tmp_path, search={"trials": 1},
                              template_text="raise SystemExit('[rank1]: cannot open [/data/x]')\n")
    assert run_hpo("run", scenario).returncode == 1  # no trial completed
    status = run_hpo("status", scenario)
    assert status.returncode == 0 and "cannot open [/data/x]" in status.stdout, status.stdout + status.stderr
