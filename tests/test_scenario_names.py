"""The names a scenario gives: each a column of the results CSV of its own, each key once per
mapping, each key a known one. Through the real CLI (exit code 2, the one ``error:`` line) and
the YAML loader in-process."""
from __future__ import annotations

import csv
import io
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from hpo.cli import export_rows
from hpo.errors import InputError
from hpo.scenario import RESULTS_COLUMNS, DuplicateKeyError, UniqueKeyLoader, load_scenario

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]

FIXED = "(number, state, duration_s, folder, reason, repeat_of, note)"
FLOAT = {"type": "float", "low": 0.0, "high": 1.0}


def assert_one_line(result: subprocess.CompletedProcess[str], line: str) -> None:
    """Exit code 2 and exactly ``error: <line>`` on stderr, no traceback."""
    assert (result.returncode, result.stderr) == (2, f"error: {line}\n"), (result.returncode, result.stderr)
    assert "Traceback" not in result.stdout


def test_the_fixed_columns_are_those_export_writes(scenario_path: Path) -> None:
    scenario = load_scenario(scenario_path)
    out = io.StringIO()
    export_rows(SimpleNamespace(scenario=scenario), out, rows=[])
    header = next(csv.reader(io.StringIO(out.getvalue())))
    assert header == ["number", "state", "x", "opt", "val_error", "test_error", "duration_s", "folder", "reason",
                      "repeat_of", "note"]  # as DESIGN.md and the README give it
    own = {*scenario.parameters, scenario.objective.metric, *scenario.objective.held_out}
    assert tuple(name for name in header if name not in own) == RESULTS_COLUMNS
    assert ", ".join(RESULTS_COLUMNS) == FIXED[1:-1]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"parameters": {"state": FLOAT}},
         f"parameters.state: 'state' is a column of the results CSV {FIXED}; rename the parameter"),
        *(({"parameters": {name: {"type": "constant", "value": 1}}},
           f"parameters.{name}: {name!r} is a column of the results CSV {FIXED}; rename the parameter")
          for name in ("number", "reason", "folder", "duration_s", "repeat_of", "note")),
        ({"parameters": {"val_error": FLOAT}},
         ("parameters.val_error: 'val_error' is also the objective metric, and the results CSV has one column per "
          "name; rename the parameter or the metric")),
        ({"parameters": {"test_error": FLOAT}},
         ("parameters.test_error: 'test_error' is also a held-out metric, and the results CSV has one column per "
          "name; rename the parameter or the metric")),
        ({"objective": {"held_out": ["number"]}},
         f"objective.held_out: 'number' is a column of the results CSV {FIXED}; rename the metric"),
        ({"objective": {"held_out": ["test_error", "state"]}},
         f"objective.held_out: 'state' is a column of the results CSV {FIXED}; rename the metric"),
        ({"objective": {"metric": "repeat_of"}},
         f"objective.metric: 'repeat_of' is a column of the results CSV {FIXED}; rename the metric"),
    ],
)
def test_a_name_that_repeats_a_column_of_the_results_csv_is_refused(
        tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli, overrides: dict[str, Any],
        expected: str) -> None:
    path = write_scenario(tmp_path, **overrides)
    assert_one_line(run_cli("validate", path, cwd=tmp_path), f"scenario.yaml: {expected}")


def test_a_parameter_named_like_the_default_objective_metric_is_refused(
        tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    path = write_scenario(tmp_path, drop=("objective",), parameters={"val_error": FLOAT})
    assert_one_line(run_cli("validate", path, cwd=tmp_path),
                    "scenario.yaml: parameters.val_error: 'val_error' is also the objective metric, and the results "
                    "CSV has one column per name; rename the parameter or the metric")


SCENARIO = """\
name: demo
template: train.py.j2
command: python train.py
parameters:
  x: {type: float, low: 0.0, high: 1.0}
  opt: {type: categorical, choices: [a, b]}
search:
  method: monte_carlo
  trials: 2
"""


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (SCENARIO.replace("  opt:", "  x: {type: float, low: 0.5, high: 0.6}\n  opt:"),
         "parameters.x: defined twice (lines 5 and 6)"),
        (SCENARIO + "search:\n  method: sobol\n", "search: defined twice (lines 7 and 10)"),
        ("name: a\n" + SCENARIO, "name: defined twice (lines 1 and 2)"),
        (SCENARIO.replace("high: 1.0}", "high: 1.0, low: 0.5}"), "parameters.x.low: defined twice (line 5)"),
        (SCENARIO + "resources:\n  cluster:\n    kind: slurm\n    cores: 4\n    cores: 8\n",
         "resources.cluster.cores: defined twice (lines 13 and 14)"),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli, raw: str,
                                      expected: str) -> None:
    path = write_scenario(tmp_path, raw=raw)
    assert_one_line(run_cli("validate", path, cwd=tmp_path), f"scenario.yaml: {expected}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a:\n  b:\n    - {c: 1}\n    - {c: 1, d: 2, d: 3}\n", "a.b.1.d: defined twice (line 4)"),
        ("a: 1\nb: 2\n'a': 3\n", "a: defined twice (lines 1 and 3)"),
        ("1: x\n1.0: y\n", "1.0: defined twice (lines 1 and 2)"),
    ],
)
def test_the_loader_names_the_path_and_both_lines(text: str, expected: str) -> None:
    with pytest.raises(DuplicateKeyError) as info:
        yaml.load(text, Loader=UniqueKeyLoader)
    assert info.value.problem == expected


def test_the_loader_reads_what_the_safe_loader_reads() -> None:
    """Keys that a merge brings in may be overridden, as YAML merges allow; anchors still work."""
    text = "base: &b {low: 0, high: 1}\nx: {<<: *b, high: 2}\ny: *b\nz: [a, {k: 1}]\n"
    assert yaml.load(text, Loader=UniqueKeyLoader) == yaml.safe_load(text)
    assert yaml.load(text, Loader=UniqueKeyLoader)["x"] == {"low": 0, "high": 2}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (SCENARIO.replace("search:", "serach:"), "serach: unknown key (did you mean search?)"),
        (SCENARIO.replace("name: demo", "nmae: demo"), "nmae: unknown key (did you mean name?)"),
        (SCENARIO.replace("template:", "tempalte:"), "tempalte: unknown key (did you mean template?)"),
    ],
)
def test_a_misspelt_top_level_key_is_named_not_the_key_it_leaves_missing(
        tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli, raw: str, expected: str) -> None:
    path = write_scenario(tmp_path, raw=raw)
    assert_one_line(run_cli("validate", path, cwd=tmp_path), f"scenario.yaml: {expected}")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("", ("parameters: a parameter's name is empty (its flag would be --, its column of the results CSV "
              "blank); name it")),
        ("x y", ("parameters.x y: 'x y' holds whitespace, which would split its flag and its template variable; "
                 "rename the parameter")),
        ("lr\t", ("parameters.lr\t: 'lr\\t' holds whitespace, which would split its flag and its template "
                  "variable; rename the parameter")),
        ("a=b", "parameters.a=b: 'a=b' holds '=', which would end its flag's name (--a=b); rename the parameter"),
        ("-lr", "parameters.-lr: '-lr' starts with '-', which its flag adds itself (--name); rename the parameter"),
    ],
)
def test_a_name_that_no_flag_or_column_can_carry_is_refused(tmp_path: Path, write_scenario: WriteScenario,
                                                            name: str, expected: str) -> None:
    """Such names made the flags --, --x y and --a=b, and a blank column of the results CSV."""
    path = write_scenario(tmp_path, parameters={name: FLOAT})
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"scenario.yaml: {expected}"


def test_names_with_dashes_dots_and_underscores_pass(tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, flags=True, parameters={name: FLOAT for name in ("batch-size", "a.b", "_w", "x_1")})
    scenario = load_scenario(path)
    assert [scenario.flag_of(name) for name in ("batch-size", "a.b", "_w", "x_1")] == \
        ["--batch-size", "--a.b", "--_w", "--x_1"]
