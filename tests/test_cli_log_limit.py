"""A trial whose trial.log cannot be written (here a file-size limit, ``ulimit -f``, as a full
disk would) fails at once, its process ended: it is not left to train on unlogged to its end,
and the sweep goes on with the next trial."""
from __future__ import annotations

import csv
import io
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import cli_env, run_hpo

WriteScenario = Callable[..., Path]

LOUD_THEN_LONG = """\
import time
for _ in range(600):
    print("y" * 1000)
time.sleep(30)
print("val_error={{ x }}")
"""


def test_a_log_past_the_file_size_limit_ends_the_trial_at_once_and_the_sweep_goes_on(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, template_text=LOUD_THEN_LONG, drop=["parameters.opt"],
                          objective={"held_out": [], "patterns": {"val_error": "val_error=([0-9.]+)"}})
    began = time.monotonic()
    command = f"ulimit -f 500; exec {shlex.quote(sys.executable)} -m hpo run {shlex.quote(str(path))}"
    limited = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                             timeout=120, check=False)
    assert time.monotonic() - began < 45, "a trial ran on to its end (60 s)"
    assert limited.returncode == 1, limited.stderr  # no trial completed
    assert "2/2 trials done: 2 failed." in limited.stdout
    rows = list(csv.DictReader(io.StringIO(run_hpo("export", path, cwd=tmp_path).stdout)))
    reason = "cannot write trial.log: File too large (the output past it is lost)"
    assert [(row["state"], row["reason"]) for row in rows] == [("FAIL", reason)] * 2
    assert all(float(row["duration_s"]) < 5 for row in rows)
