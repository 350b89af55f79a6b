"""What the sweep tells its observer of a trial's start: only a process that really runs is
announced as started; one that could not start is announced by its end alone, which says why."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hpo.engine import Sweep, SweepConfig, TrialEnd, TrialStart
from hpo.errors import ExecutorUnavailable
from hpo.executor import TrialControl, TrialSpec
from hpo.launch import Slot
from hpo.outcome import Outcome, TrialResult
from hpo.scenario import load_scenario

WriteScenario = Callable[..., Path]


class Events:
    """An observer that keeps the order of what it is told."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.ends: list[TrialEnd] = []

    def started(self, start: TrialStart) -> None:
        self.said.append(f"start {start.number}")

    def finished(self, end: TrialEnd) -> None:
        self.said.append(f"end {end.number}")
        self.ends.append(end)


def sweep_of(tmp_path: Path, write_scenario: WriteScenario, script: str, executor: object = None) -> Sweep:
    """A sweep of two trials, one slot, whose command is ``./run.sh`` holding ``script``."""
    path = write_scenario(tmp_path, template=["run.sh"], command="./run.sh", files={"run.sh": script},
                          template_text=None)
    (tmp_path / "run.sh").chmod(0o755)
    sweep = Sweep(SweepConfig(load_scenario(path), f"sqlite:///{tmp_path}/study.db", tmp_path / "w",
                              (Slot(0, (), 1, 1),), seed=1), executor)
    sweep.prepare()
    return sweep


def test_a_trial_whose_program_cannot_start_is_not_announced_as_started(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """The script's interpreter does not exist: exec fails (ENOENT) on every trial."""
    sweep = sweep_of(tmp_path, write_scenario, "#!/no/such/interpreter\n")
    events = Events()
    sweep.run(events)
    assert events.said == ["end 0", "end 1"]
    assert [(end.result.outcome, end.result.reason) for end in events.ends] == \
        [(Outcome.FAIL, "cannot start ./run.sh: No such file or directory")] * 2


def test_a_trial_that_runs_is_announced_before_its_end_however_short(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    sweep = sweep_of(tmp_path, write_scenario, "#!/bin/sh\nexit 3\n")
    events = Events()
    sweep.run(events)
    assert events.said == ["start 0", "end 0", "start 1", "end 1"]
    assert {end.result.reason for end in events.ends} == {"exit code 3"}


class RefusedByTheMachine:
    """As :func:`hpo.executor.run_trial` when a machine limit refuses the process: ``started``
    is called, then the start is refused (:func:`hpo.launch.run_process` raises)."""

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        control.started(spec.slot)
        raise ExecutorUnavailable("cannot start a trial's process: Too many open files (a limit of this machine "
                                  "or of hpo's shell, not the trial's fault)")

    def close(self) -> None:
        """Nothing to release."""

    def slots_now(self) -> None:
        """The slots planned."""


def test_a_start_refused_by_a_machine_limit_is_not_announced_as_started(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    sweep = sweep_of(tmp_path, write_scenario, "#!/bin/sh\n", RefusedByTheMachine())
    events = Events()
    with pytest.raises(ExecutorUnavailable, match="Too many open files"):
        sweep.run(events)
    assert events.said == ["end 0"]
    assert events.ends[0].result.outcome is Outcome.INTERRUPTED
