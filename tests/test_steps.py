"""Steps of real trial processes: a step pattern over the built-in formats feeds the pruner,
and a step that is not a whole number is refused with a note in ``trial.log``."""
from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

from hpo.executor import LocalExecutor, TrialControl, TrialSpec
from hpo.launch import Slot
from hpo.outcome import Outcome, TrialResult
from hpo.render import TrialFile
from hpo.scenario import Objective


class Control(TrialControl):
    """Records the intermediate values the executor reports; asks to prune from ``prune_at`` on."""

    def __init__(self, prune_at: int | None = None) -> None:
        self.values: list[tuple[int, float]] = []
        self.prune_at = prune_at

    def started(self, slot: Slot) -> None:
        """Nothing to record."""

    def intermediate(self, step: int, value: float) -> bool:
        self.values.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def record(self, step: int, value: float) -> None:
        self.values.append((step, value))

    def end_request(self) -> str | None:
        return None


def _run(tmp_path: Path, code: str, objective: Objective, control: Control) -> TrialResult:
    spec = TrialSpec(number=3, params={}, folder=tmp_path / "trial-0003",
                     files=(TrialFile("train.py", textwrap.dedent(code).encode()),), argv=(sys.executable, "train.py"),
                     env={}, slot=Slot(0, (), 1, 1), token=f"steps:{os.getpid()}:{time.monotonic_ns()}", timeout=60,
                     objective=objective)
    return LocalExecutor().run(spec, control)


def test_a_step_pattern_makes_key_value_lines_intermediate_values_that_prune(tmp_path: Path) -> None:
    code = """\
        import time
        for epoch in range(1, 50):
            print(f"Epoch {epoch}", flush=True)
            print(f"val_error={1 / epoch}", flush=True)
            time.sleep(0.05)
        """
    control = Control(prune_at=3)
    result = _run(tmp_path, code, Objective(step_pattern=r"Epoch (\d+)"), control)
    assert control.values[:3] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert (result.outcome, result.reason) == (Outcome.PRUNED, "pruned at step 3")


def test_a_step_that_is_not_a_whole_number_is_noted_in_the_log_not_truncated(tmp_path: Path) -> None:
    code = """\
        import json
        for line in ({"step": 1, "val_error": 0.9}, {"step": 1.5, "val_error": 0.5}, {"step": 1.9, "val_error": 0.4},
                     {"step": -1, "val_error": 0.3}, {"val_error": 0.2}):
            print(json.dumps(line), flush=True)
        """
    control = Control()
    result = _run(tmp_path, code, Objective(), control)
    assert control.values == [(1, 0.9)]
    assert (result.outcome, result.value, result.step) == (Outcome.COMPLETE, 0.2, 1)
    notes = [line for line in (tmp_path / "trial-0003" / "trial.log").read_text().splitlines()
             if line.startswith("hpo: ")]
    assert notes == [f"hpo: could not handle an output line: step {step} is not a whole number from 0 to "
                     f"2147483647; the line is ignored" for step in ("1.5", "1.9", "-1")]
