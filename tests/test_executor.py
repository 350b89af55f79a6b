"""Running one trial and judging how it ended: the judge's table, and real processes on the local executor."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hpo.executor import SCRIPT_RESULT_FILE, LocalExecutor, TrialControl, TrialSpec, judge, run_trial, saved_result
from hpo.launch import Slot
from hpo.outcome import Outcome
from hpo.render import TrialFile
from hpo.results import parse_text
from hpo.scenario import Objective

OBJECTIVE = Objective(metric="val_error", held_out=("test_error",))


@pytest.mark.parametrize(
    ("text", "exit_code", "ended_by", "outcome", "value", "held_out", "reason"),
    [
        pytest.param("val_error=0.2 test_error=0.3", 0, None, "COMPLETE", 0.2, {"test_error": 0.3}, "", id="complete"),
        pytest.param("val_error=0.2", 0, None, "COMPLETE", 0.2, {}, "", id="complete-no-held-out"),
        pytest.param("val_error=0.2 test_error=0.3\nValueError: bad shape", 1, None, "FAIL", None,
                     {"test_error": 0.3}, "exit code 1: ValueError: bad shape", id="exit-code-with-error-line"),
        pytest.param("usage: main.py [-h]\nmain.py: error: unrecognized arguments: --batch_size 64", 2, None, "FAIL",
                     None, {}, "exit code 2: main.py: error: unrecognized arguments: --batch_size 64", id="argparse"),
        pytest.param("epoch 1\ndataset shard missing", 3, None, "FAIL", None, {}, "exit code 3: dataset shard missing",
                     id="exit-code-quotes-a-plain-last-line"),
        pytest.param("val_error=0.2", -9, None, "FAIL", None, {}, "killed by SIGKILL (out of host memory?)",
                     id="sigkill"),
        pytest.param("x\nSegfault", -11, None, "FAIL", None, {}, "killed by SIGSEGV", id="sigsegv"),
        pytest.param("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, None, "FAIL", None,
                     {}, "out of GPU memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                     id="oom"),
        pytest.param("exitcode  : -9 (pid: 123)", 1, None, "FAIL", None, {}, "killed by SIGKILL (out of host memory?)",
                     id="torchrun-rank-sigkill"),
        pytest.param("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\nretrying with batch 32\n"
                     "val_error=0.1", 0, None, "COMPLETE", 0.1, {}, "", id="oom-caught-and-recovered"),
        pytest.param("hello world\nloss 3", 0, None, "FAIL", None, {}, "val_error was never reported", id="missing"),
        pytest.param("test_error=0.3", 0, None, "FAIL", None, {"test_error": 0.3}, "val_error was never reported",
                     id="missing-held-out-kept"),
        pytest.param("val_error=nan test_error=0.1", 0, None, "FAIL", None, {"test_error": 0.1}, "val_error is nan",
                     id="nan"),
        pytest.param("val_error=inf", 0, None, "FAIL", None, {}, "val_error is inf", id="inf"),
        pytest.param("val_error=abc", 0, None, "FAIL", None, {}, "val_error is not a number: abc", id="non-number"),
        pytest.param("val_error=0.2 test_error=nan", 0, None, "COMPLETE", 0.2, {}, "", id="held-out-nan-no-reason"),
        pytest.param("Result of this algorithm run: UNSAT, 1, 0, 0.5, 1", 0, None, "FAIL", None, {},
                     "trial reported UNSAT", id="unsat"),
        pytest.param("Result of this algorithm run: SAT, 1, 0, 0.5, 1", 0, None, "COMPLETE", 0.5, {}, "", id="sat"),
        pytest.param("val_error=0.2 test_error=0.3", 0, "timeout", "TIMEOUT", None, {},
                     "killed after 30 s (resources.timeout)", id="timeout-keeps-no-held-out"),
        pytest.param('{"step": 2, "val_error": 0.4}', -15, "pruned", "PRUNED", None, {}, "pruned at step 2",
                     id="pruned"),
        pytest.param('{"step": 1, "val_error": 0.4, "test_error": 0.3}\n{"step": 500, "train_loss": 0.1}', -15,
                     "pruned", "PRUNED", None, {}, "pruned at step 1", id="pruned-names-an-objective-step"),
        pytest.param("test_error=0.3", -15, "stopped", "STOPPED", None, {}, "stopped by the user", id="stopped"),
        pytest.param("val_error=0.1", -15, "interrupted", "INTERRUPTED", None, {},
                     "interrupted: the sweep was stopped; it runs again on resume", id="interrupted"),
        pytest.param("", 127, "cannot start trian: No such file", "FAIL", None, {}, "cannot start trian: No such file",
                     id="cannot-start"),
    ],
)
def test_judge(text: str, exit_code: int, ended_by: str | None, outcome: str, value: float | None,
               held_out: dict[str, float], reason: str) -> None:
    result = judge(parse_text(text, "val_error"), OBJECTIVE, exit_code, ended_by, text.splitlines(), 1.0, 30)
    assert (result.outcome.value, result.value, dict(result.held_out), result.reason) == (
        outcome, value, held_out, reason)


class Control(TrialControl):
    """Records what the executor tells the sweep; asks to prune at ``prune_at``; each pruner
    question takes ``ask_s``."""

    def __init__(self, prune_at: int | None = None, end: str | None = None, ask_s: float = 0.0) -> None:
        self.gpus: Sequence[int] | None = None
        self.values: list[tuple[int, float]] = []
        self.judged: list[int] = []
        self.decided: int | None = None
        self.prune_at = prune_at
        self.end = end
        self.ask_s = ask_s

    def started(self, slot: Slot) -> None:
        self.gpus = slot.gpus

    def intermediate(self, step: int, value: float) -> bool:
        time.sleep(self.ask_s)
        self.values.append((step, value))
        self.judged.append(step)
        if self.decided is None and self.prune_at is not None and step >= self.prune_at:
            self.decided = step
        return self.decided is not None

    def record(self, step: int, value: float) -> None:
        self.values.append((step, value))

    def end_request(self) -> str | None:
        return self.end


def spec(tmp_path: Path, code: str, objective: Objective = OBJECTIVE, timeout: float | None = 30,
         extra: tuple[TrialFile, ...] = ()) -> TrialSpec:
    files = (TrialFile("train.py", textwrap.dedent(code).encode()), *extra)
    return TrialSpec(number=7, params={"x": 1}, folder=tmp_path / "trial-0007", files=files,
                     argv=(sys.executable, "train.py"), env={"HPO_TRIAL_NUMBER": "7"}, slot=Slot(0, (3,), 1, 2),
                     token=f"test:{os.getpid()}:{time.monotonic_ns()}", timeout=timeout, objective=objective)


def test_a_trial_runs_in_its_folder_and_leaves_its_result_there(tmp_path: Path) -> None:
    control = Control()
    result = LocalExecutor().run(spec(tmp_path, """\
        import os
        print({"step": 1, "val_error": 0.5}.__repr__().replace("'", '"'))
        print(f"val_error=0.25 test_error={len(os.environ['CUDA_VISIBLE_DEVICES'])}")
        assert os.environ["HPO_TRIAL_DIR"] == os.getcwd() and os.environ["OMP_NUM_THREADS"] == "2"
        """), control)
    assert (result.outcome, result.value, dict(result.held_out)) == (Outcome.COMPLETE, 0.25, {"test_error": 1.0})
    assert control.gpus == (3,) and control.values == [(1, 0.5)]
    folder = tmp_path / "trial-0007"
    assert saved_result(folder, 7) == result and saved_result(folder, 8) is None
    assert "val_error=0.25" in (folder / "trial.log").read_text()


def test_a_result_json_the_script_writes_itself_is_kept_beside_hpo_s(tmp_path: Path) -> None:
    """A script that saved its own results as result.json lost them: hpo's record replaced the file."""
    result = LocalExecutor().run(spec(tmp_path, """\
        import json
        json.dump({"accuracy": 0.9, "epochs": 3}, open("result.json", "w"))
        print("val_error=0.1")
        """), Control())
    folder = tmp_path / "trial-0007"
    assert saved_result(folder, 7) == result and result.value == 0.1
    assert json.loads((folder / SCRIPT_RESULT_FILE).read_text()) == {"accuracy": 0.9, "epochs": 3}


def test_a_trial_whose_end_is_asked_before_it_starts_is_not_started(tmp_path: Path) -> None:
    control = Control(end="stopped")
    result = LocalExecutor().run(spec(tmp_path, "open('ran', 'w').close()"), control)
    assert (result.outcome, result.duration_s, result.reason) == (Outcome.STOPPED, 0.0, "stopped by the user")
    folder = tmp_path / "trial-0007"
    assert control.gpus is None and not (folder / "ran").exists() and saved_result(folder, 7) == result


def test_pruning_and_stop_requests_end_the_process(tmp_path: Path) -> None:
    code = """\
        import time
        from hpo.results import report
        for step in range(100):
            report(step=step, val_error=1.0 / (step + 1))
            time.sleep(0.05)
        """
    pruned = LocalExecutor().run(spec(tmp_path / "a", code), Control(prune_at=2))
    assert pruned.outcome is Outcome.PRUNED and pruned.reason.startswith("pruned at step")
    stopped = LocalExecutor().run(spec(tmp_path / "b", code), Control(end="stopped"))
    assert stopped.outcome is Outcome.STOPPED and stopped.duration_s < 10


def test_a_crash_reason_carries_the_last_error_line(tmp_path: Path) -> None:
    result = LocalExecutor().run(spec(tmp_path, "print('starting')\nraise ZeroDivisionError('division by zero')\n"),
                                 Control())
    assert result.outcome is Outcome.FAIL
    assert result.reason == "exit code 1: ZeroDivisionError: division by zero"


def test_a_trial_killed_by_someone_else_says_sigkill(tmp_path: Path) -> None:
    result = LocalExecutor().run(spec(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"),
                                 Control())
    assert (result.outcome, result.reason) == (Outcome.FAIL, "killed by SIGKILL (out of host memory?)")


def test_cuda_out_of_memory_is_recognised(tmp_path: Path) -> None:
    result = LocalExecutor().run(spec(tmp_path, """\
        import sys
        print("Traceback (most recent call last):")
        print('  File "train.py", line 3, in <module>')
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
              "of 79.19 GiB of which 3.06 GiB is free.")
        sys.exit(1)
        """), Control())
    assert result.outcome is Outcome.FAIL
    assert result.reason.startswith("out of GPU memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")


def test_post_process_output_is_parsed(tmp_path: Path) -> None:
    objective = Objective(metric="val_error", held_out=("test_error",), post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"print(open('out.txt').read().strip())\n")
    result = LocalExecutor().run(spec(tmp_path, "open('out.txt', 'w').write('val_error=0.125 test_error=0.5')\n",
                                      objective, extra=(parse,)), Control())
    assert (result.outcome, result.value, dict(result.held_out)) == (Outcome.COMPLETE, 0.125, {"test_error": 0.5})


def test_a_failing_post_process_fails_the_trial(tmp_path: Path) -> None:
    objective = Objective(metric="val_error", post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"raise SystemExit('parse.py: no results file')\n")
    result = LocalExecutor().run(spec(tmp_path, "print('done')\n", objective, extra=(parse,)), Control())
    assert result.outcome is Outcome.FAIL and result.reason.startswith("post_process exit code 1")


def test_a_post_process_that_cannot_start_fails_the_trial_naming_it(tmp_path: Path) -> None:
    objective = Objective(metric="val_error", post_process=("no-such-post-process-xyz",))
    result = LocalExecutor().run(spec(tmp_path, "print('val_error=0.5')\n", objective), Control())
    assert result.outcome is Outcome.FAIL
    assert result.reason.startswith("cannot start no-such-post-process-xyz")


class EndDuringPostProcess(Control):
    """Asks to end the trial (``end``) once its post_process has written ``post-started``."""

    def __init__(self, end: str, folder: Path) -> None:
        super().__init__()
        self.request = end
        self.folder = folder

    def end_request(self) -> str | None:
        return self.request if (self.folder / "post-started").exists() else None


@pytest.mark.parametrize(("request_", "outcome", "reason"), [
    ("interrupted", Outcome.INTERRUPTED, "interrupted: the sweep was stopped; it runs again on resume"),
    ("stopped", Outcome.STOPPED, "stopped by the user"),
])
def test_ending_the_trial_during_its_post_process_is_judged_as_during_the_command(
        tmp_path: Path, request_: str, outcome: Outcome, reason: str) -> None:
    objective = Objective(metric="val_error", post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"import time\nopen('post-started', 'w').close()\ntime.sleep(60)\n")
    trial = spec(tmp_path, "print('val_error=0.5')\n", objective, extra=(parse,))
    result = LocalExecutor().run(trial, EndDuringPostProcess(request_, trial.folder))
    assert (result.outcome, result.reason) == (outcome, reason)
    assert result.duration_s < 10


@pytest.mark.parametrize("cause", [None, "its worker lost the scheduler"])
def test_an_interrupted_trial_with_a_lost_cause_is_written_lost_once(tmp_path: Path, cause: str | None) -> None:
    """The cause is asked once the trial is interrupted; ``result.json`` is written with the
    final verdict, never first as INTERRUPTED (a reader could see that and stop waiting)."""
    objective = Objective(metric="val_error", post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"import time\nopen('post-started', 'w').close()\ntime.sleep(60)\n")
    trial = spec(tmp_path, "print('val_error=0.5')\n", objective, extra=(parse,))
    written: list[object] = []

    def lost_cause() -> str | None:
        written.append(saved_result(trial.folder, 7))
        return cause

    result = run_trial(trial, EndDuringPostProcess("interrupted", trial.folder), trial.folder, lost_cause)
    assert written == [None]
    if cause is None:
        assert result.outcome is Outcome.INTERRUPTED
    else:
        assert (result.outcome, result.reason) == (Outcome.LOST, f"lost: {cause}")
    assert saved_result(trial.folder, 7) == result


def test_the_post_process_gets_what_is_left_of_the_trial_timeout(tmp_path: Path) -> None:
    objective = Objective(metric="val_error", post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"import time\ntime.sleep(1.5)\nprint('val_error=0.5')\n")
    trial = spec(tmp_path, "import time\ntime.sleep(0.8)\n", objective, timeout=1.5, extra=(parse,))
    result = LocalExecutor().run(trial, Control())
    assert (result.outcome, result.reason) == (Outcome.TIMEOUT, "killed after 1.5 s (resources.timeout)")
    assert 1.5 <= result.duration_s < 2.4


def test_a_post_process_exit_code_carries_its_error_line(tmp_path: Path) -> None:
    objective = Objective(metric="val_error", held_out=("test_error",), post_process=("python", "parse.py"))
    parse = TrialFile("parse.py", b"print('test_error=0.25')\nraise ValueError('no results file')\n")
    result = LocalExecutor().run(spec(tmp_path, "print('done')\n", objective, extra=(parse,)), Control())
    assert (result.outcome, result.reason) == (Outcome.FAIL, "post_process exit code 1: ValueError: no results file")
    assert dict(result.held_out) == {"test_error": 0.25}


class PausedControl(Control):
    """A worker paused (not scheduled) for ``pause`` seconds at its first poll of the trial."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def end_request(self) -> str | None:
        if self.gpus is not None:  # started: the trial's process runs
            time.sleep(self.pause)
            self.pause = 0.0
        return None


def test_a_trial_that_ended_while_its_worker_was_paused_counts_only_what_is_known(tmp_path: Path) -> None:
    """Its process ended during the pause, at a moment nobody saw: the duration runs to when it
    was last seen running, not to when the worker woke, and result.json notes the pause."""
    result = LocalExecutor().run(spec(tmp_path, "import time; time.sleep(0.3); print('val_error=0.5')"),
                                 PausedControl(2.0))
    assert result.outcome is Outcome.COMPLETE and result.duration_s < 0.5
    record = json.loads((tmp_path / "trial-0007" / "result.json").read_text())
    assert record["duration_s"] == result.duration_s and 1.5 < record["paused_s"] < 3.0
    assert saved_result(tmp_path / "trial-0007", 7) == result


def test_a_trial_that_ran_through_a_pause_of_its_worker_counts_all_of_it(tmp_path: Path) -> None:
    result = LocalExecutor().run(spec(tmp_path, "import time; time.sleep(1.5); print('val_error=0.5')"),
                                 PausedControl(1.0))
    assert result.outcome is Outcome.COMPLETE and result.duration_s >= 1.5
    assert "paused_s" not in json.loads((tmp_path / "trial-0007" / "result.json").read_text())


def test_a_held_out_metric_reported_nan_is_a_completed_trials_note_not_its_reason() -> None:
    """The results CSV's reason is empty for a completed trial (DESIGN.md): a held-out metric
    not recorded is said in the trial's note instead."""
    result = judge(parse_text("val_error=0.2 test_error=nan", "val_error"), OBJECTIVE, 0, None, [], 1.0, 30)
    assert (result.outcome, result.reason, result.note) == (
        Outcome.COMPLETE, "", "held-out test_error was nan: not recorded")
    assert judge(parse_text("val_error=0.2 test_error=0.3", "val_error"), OBJECTIVE, 0, None, [], 1.0, 30).note == ""


def test_judge_names_the_step_at_which_the_pruner_decided() -> None:
    metrics = parse_text('{"step": 1, "val_error": 0.4}\n{"step": 2, "val_error": 0.3}', "val_error")
    result = judge(metrics, OBJECTIVE, -15, "pruned", [], 1.0, 30, pruned_at=1)
    assert (result.outcome, result.reason, result.step) == (Outcome.PRUNED, "pruned at step 1", 1)


def test_nothing_reaches_the_pruner_after_it_decided(tmp_path: Path) -> None:
    """The trial goes on printing until its process is killed; the reason names the step the
    pruner judged (an objective step, not a later batch line's), and nothing after it is reported."""
    control = Control(prune_at=1)
    result = LocalExecutor().run(spec(tmp_path, """\
        import json, time
        for epoch in range(1, 201):
            print(json.dumps({"step": epoch, "val_error": 1.0 / epoch}), flush=True)
            for batch in range(1, 4):
                print(json.dumps({"step": (epoch * 3 + batch) * 100, "train_loss": 0.5}), flush=True)
            time.sleep(0.005)
        """), control)
    assert control.decided is not None and result.outcome is Outcome.PRUNED
    assert (result.reason, result.step) == (f"pruned at step {control.decided}", control.decided)
    assert control.judged[-1] == control.decided and max(step for step, _ in control.values) == control.decided


def test_a_backlog_of_reports_is_all_logged_parsed_and_recorded_before_the_judgement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial that prints steps faster than the pruner answers, then exits: every line is in
    trial.log and parsed, every value recorded; the pruner judges them in turn while the
    process runs, and none once it has ended."""
    monkeypatch.setattr("hpo.launch.KILL_GRACE_S", 0.2)
    control = Control(ask_s=0.005)
    result = LocalExecutor().run(spec(tmp_path, """\
        import json
        for step in range(1, 501):
            print(json.dumps({"step": step, "val_error": 0.5 + 1.0 / step}))
        print(json.dumps({"val_error": 0.5, "test_error": 0.25}))
        """), control)
    assert (result.outcome, result.value, dict(result.held_out)) == (Outcome.COMPLETE, 0.5, {"test_error": 0.25})
    assert len((tmp_path / "trial-0007" / "trial.log").read_text().splitlines()) == 501
    assert [step for step, _ in control.values] == list(range(1, 501))
    assert len(control.judged) < 50


def test_the_pruner_judges_every_step_in_turn_however_fast_they_come(tmp_path: Path) -> None:
    """Successive halving enters a rung with the value it is asked about: a step skipped
    because later ones waited would enter rung 0 with a late (better) value."""
    control = Control(ask_s=0.005)
    LocalExecutor().run(spec(tmp_path, """\
        import json, time
        for step in range(1, 301):
            print(json.dumps({"step": step, "val_error": 1.0 / step}))
        time.sleep(1.0)
        """), control)
    assert len(control.judged) > 50 and control.judged == list(range(1, len(control.judged) + 1))
    assert [step for step, _ in control.values] == list(range(1, 301))  # the rest recorded once it ended


def test_every_step_of_a_line_a_progress_bar_rewrote_reaches_the_pruner(tmp_path: Path) -> None:
    """Several reports in one line, parted by carriage returns: only the line's last reached
    the pruner and the study (step 3 of '{step 3}\\r{step 4}' was dropped)."""
    control = Control()
    result = LocalExecutor().run(spec(tmp_path, """\
        import sys, time
        sys.stdout.write('{"step": 1, "val_error": 0.9}\\n')
        sys.stdout.write(' 33%|###   | 1/3\\r{"step": 2, "val_error": 0.8}\\r 50%|#####\\n')
        sys.stdout.write('{"step": 3, "val_error": 0.7}\\r{"step": 4, "val_error": 0.6}\\n')
        sys.stdout.write('bar\\r{"step": 5, "val_error": 0.5}\\rval_error=0.4\\n')
        sys.stdout.flush()
        time.sleep(0.5)
        """), control)
    assert (result.outcome, result.value) == (Outcome.COMPLETE, 0.4)
    assert control.values == [(1, 0.9), (2, 0.8), (3, 0.7), (4, 0.6), (5, 0.5)] and control.judged == [1, 2, 3, 4, 5]


def test_a_trial_that_ends_by_itself_after_the_pruner_said_prune_is_pruned(tmp_path: Path) -> None:
    """The pruner said prune while the trial ran, and it exited before it could be killed: it
    was recorded COMPLETE, its intermediate values cut off at the pruned step."""
    control = Control(prune_at=1, ask_s=0.5)
    result = LocalExecutor().run(spec(tmp_path, """\
        import time
        print('{"step": 1, "val_error": 0.9}', flush=True)
        time.sleep(0.1)
        print("val_error=0.5 test_error=0.4")
        """), control)
    assert (result.outcome, result.reason, result.step, dict(result.held_out)) == (
        Outcome.PRUNED, "pruned at step 1", 1, {})


def test_the_sweeps_control_and_a_dask_workers_are_one_trial_control() -> None:
    """Both implement every method of the one interface; a subclass missing one is refused."""
    from hpo.dask_executor import _WorkerControl
    from hpo.engine import _Control

    assert issubclass(_Control, TrialControl) and issubclass(_WorkerControl, TrialControl)

    class WithoutRecord(TrialControl):
        def started(self, slot: Slot) -> None:
            """Nothing to note."""

        def intermediate(self, step: int, value: float) -> bool:
            return False

        def end_request(self) -> str | None:
            return None

    with pytest.raises(TypeError, match="record"):
        WithoutRecord()  # type: ignore[abstract]
