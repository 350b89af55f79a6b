"""Metric lines (every format, progress bars, patterns, the writer round trip), error lines of failed trials,
objective checks."""
from __future__ import annotations

import io
import math
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env

from hpo.errors import InputError
from hpo.executor import judge
from hpo.results import (
    ERROR_LINE_CHARS,
    RESERVED_ATTRS,
    MetricLine,
    MetricParser,
    Metrics,
    StepError,
    last_error_line,
    never_reported,
    out_of_gpu_memory,
    parse_smac_line,
    parse_text,
    report,
)
from hpo.scenario import Objective, load_scenario

WriteScenario = Callable[..., Path]
NAN = float("nan")
INF = float("inf")


# line -> (final values, intermediate step or None, smac status) reported by that one line
FORMAT_CASES = [
    pytest.param('{"val_error": 0.12, "test_error": 0.13}', {"val_error": 0.12, "test_error": 0.13}, None, None,
                 id="json"),
    pytest.param('  {"val_error": 1}  ', {"val_error": 1.0}, None, None, id="json-int-padded"),
    pytest.param('{"step": 3, "val_error": 0.5}', {"val_error": 0.5}, 3, None, id="json-step"),
    pytest.param("val_error=0.12", {"val_error": 0.12}, None, None, id="pair"),
    pytest.param("val_error = 1e-3", {"val_error": 1e-3}, None, None, id="pair-spaces-exponent"),
    pytest.param("val_error=0.12,", {"val_error": 0.12}, None, None, id="pair-trailing-comma"),
    pytest.param("val_error=0.12 test_error=0.13", {"val_error": 0.12, "test_error": 0.13}, None, None,
                 id="pairs"),
    pytest.param("val_error=0.12, test_error=0.13; top5.acc=0.9", {"val_error": 0.12, "test_error": 0.13,
                                                                  "top5.acc": 0.9}, None, None, id="pairs-separated"),
    pytest.param("step=2 val_error=0.4", {"val_error": 0.4}, 2, None, id="pairs-step"),
    pytest.param("val_error\t0.12", {"val_error": 0.12}, None, None, id="tab"),
    pytest.param("val_error=0.12\ttest_error=0.13", {"val_error": 0.12, "test_error": 0.13}, None, None,
                 id="pairs-tab-separated"),
    pytest.param("Lift coefficient \t 1.25e-1", {"Lift coefficient": 0.125}, None, None, id="tab-spaced-name"),
    pytest.param("Result of this algorithm run: SAT, 1.3, 0, 0.12, 1", {"runtime": 1.3, "val_error": 0.12},
                 None, "SAT", id="smac-sat"),
    pytest.param("Result of this algorithm run: sat, 2, 0, 0.5, 1, extra info", {"runtime": 2.0, "val_error": 0.5},
                 None, "SAT", id="smac-lowercase-extra"),
    pytest.param("Result for SMAC: SUCCESS, 0.5, 0, 0.25, 0", {"runtime": 0.5, "val_error": 0.25}, None, "SUCCESS",
                 id="smac-success"),
    pytest.param("Result of this algorithm run: UNSAT, 1.0, 0, 1.0, 1", {"runtime": 1.0, "val_error": 1.0}, None,
                 "UNSAT", id="smac-unsat"),
    pytest.param("Result of this algorithm run: CRASHED, 0, 0, 0, 1", {"runtime": 0.0, "val_error": 0.0}, None,
                 "CRASHED", id="smac-crashed"),
    pytest.param("Result of this algorithm run: TIMEOUT, 600, 0, 1e9, 1", {"runtime": 600.0, "val_error": 1e9},
                 None, "TIMEOUT", id="smac-timeout"),
    pytest.param("Result of this algorithm run: TIMEOUT", {}, None, "TIMEOUT", id="smac-status-only"),
    pytest.param("\x1b[1mval_error=0.125\x1b[0m", {"val_error": 0.125}, None, None, id="ansi-bold-pair"),
    pytest.param('\x1b[32m{"val_error": 0.125}\x1b[0m', {"val_error": 0.125}, None, None, id="ansi-green-json"),
    pytest.param('\x1b[2m{"step": 2, "val_error": 0.5}\x1b[0m', {"val_error": 0.5}, 2, None, id="ansi-json-step"),
    pytest.param("\x1b[36mval_error\x1b[0m=\x1b[1;33m0.125\x1b[0m \x1b[38;5;208mtest_error=0.25\x1b[m",
                 {"val_error": 0.125, "test_error": 0.25}, None, None, id="ansi-each-part"),
    pytest.param("\x1b[2K\x1b[1Gval_error\t0.125", {"val_error": 0.125}, None, None, id="ansi-line-cleared-tab"),
]

ORDINARY_LINES = [
    "Epoch 1 lr=0.1 loss 3",
    "lr=0.1 is too high",
    "Training: val_error 0.3",
    "loss: 0.25",
    "",
    "   ",
    "[1, 2, 3]",
    '"val_error"',
    "{not json}",
    "{}",
    "https://example.org/?a=1&b=2",
    "Result of this algorithm run: MAYBE, 1, 0, 0.1, 1",
    "warning: x=1 looks odd",
    "=3",
    "Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305532",
    "1\t0.5",
    "epoch\tloss\tacc",
    "\t0.5",
    "epochs:  67%|██████▋   | 2/3 [00:00<00:00, 19.14it/s] lr=0.1 is too high",
    "progress: 67% val_error=0.3",
    "Epoch 2 | 67% | val_error=0.3",
    "67%|██████▋   | val_error=0.3",
]


@pytest.mark.parametrize(("line", "values", "step", "status"), FORMAT_CASES)
def test_each_format_is_parsed(line: str, values: dict[str, float], step: int | None, status: str | None) -> None:
    parser = MetricParser("val_error")
    reported = parser.feed(line + "\n")
    assert reported is not None
    assert dict(reported.values) == pytest.approx(values)
    assert reported.step == step
    assert reported.smac_status == status
    metrics = parser.metrics()
    assert dict(metrics.final) == pytest.approx(values)
    assert metrics.intermediate == (() if step is None else ((step, pytest.approx(values)),))
    assert metrics.smac_status == status


@pytest.mark.parametrize("line", ORDINARY_LINES)
def test_ordinary_log_lines_are_ignored(line: str) -> None:
    parser = MetricParser("val_error")
    assert parser.feed(line) is None
    metrics = parser.metrics()
    assert (metrics.final, metrics.intermediate, metrics.invalid, metrics.smac_status) == ({}, (), {}, None)


def test_smac_quality_goes_to_the_named_metric() -> None:
    line = parse_smac_line("Result of this algorithm run: SAT, 1, 0, 0.3, 1", "loss")
    assert line is not None and dict(line.values) == {"runtime": 1.0, "loss": 0.3}
    assert parse_smac_line("no prefix: SAT, 1, 0, 0.3, 1", "loss") is None


def test_smac_extra_is_kept() -> None:
    metrics = parse_text("Result of this algorithm run: CRASHED, 0, 0, 0, 1, out of memory, at epoch 3\n", "e")
    assert metrics.smac_status == "CRASHED"
    assert metrics.smac_extra == "out of memory, at epoch 3"


def test_steps_are_intermediate_and_the_last_final_value_wins() -> None:
    text = """\
starting
{"step": 0, "val_error": 0.9}
Epoch 1 lr=0.1 loss 3
step=1 val_error=0.5 train_loss=0.4
val_error=0.7
{"val_error": 0.3, "test_error": 0.35}
test_error=0.33
done
"""
    metrics = parse_text(text, "val_error")
    assert metrics.intermediate == ((0, {"val_error": 0.9}), (1, {"val_error": 0.5, "train_loss": 0.4}))
    assert metrics.final == {"val_error": 0.3, "test_error": 0.33, "train_loss": 0.4}
    assert metrics.invalid == {}


def test_a_metric_reported_only_per_step_takes_its_last_step_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    for epoch, error in enumerate([0.5, 0.25, 0.375], start=1):  # the README's hpo.train loop
        report(step=epoch, file=out, val_error=error)
    metrics = parse_text(out.getvalue(), "val_error")
    assert metrics.final == {"val_error": 0.375}
    assert [step for step, _ in metrics.intermediate] == [1, 2, 3]


# lines -> (final, invalid). A metric's last final report decides; a metric reported only with a step
# takes its last step's value (or text).
LAST_STEP_CASES = [
    pytest.param(['{"step": 1, "val_error": 0.5, "lr": 0.1}', '{"step": 2, "val_error": 0.4}', "test_error=0.3"],
                 {"val_error": 0.4, "lr": 0.1, "test_error": 0.3}, {}, id="step-each-metric-its-last-step"),
    pytest.param(["val_error=0.2", '{"step": 3, "val_error": 0.4}'], {"val_error": 0.2}, {},
                 id="step-a-final-report-wins-over-a-later-step"),
    pytest.param(['{"step": 1, "val_error": 0.5}', "val_error=abc"], {}, {"val_error": "abc"},
                 id="step-a-final-non-number-wins"),
    pytest.param(['{"step": 1, "val_error": 0.5}', '{"step": 2, "val_error": null}'], {}, {"val_error": "null"},
                 id="step-a-last-step-non-number"),
    pytest.param(['{"step": 1, "val_error": null}', '{"step": 2, "val_error": 0.5}'], {"val_error": 0.5}, {},
                 id="step-a-number-after-a-non-number"),
]
# lines -> (final, invalid). A value that is not a number is invalid, kept as printed; a metric's last report wins.
NON_NUMBER_CASES = [
    pytest.param(["val_error=abc"], {}, {"val_error": "abc"}, id="text-pair"),
    pytest.param(['{"val_error": "0.1"}'], {}, {"val_error": '"0.1"'}, id="text-json-string"),
    pytest.param(['{"val_error": null, "ok": true}'], {}, {"val_error": "null", "ok": "true"}, id="text-json-null-bool"),
    pytest.param(["val_error=abc", "val_error=0.2"], {"val_error": 0.2}, {}, id="text-then-a-number"),
    pytest.param(["val_error=0.2", "val_error=abc"], {}, {"val_error": "abc"}, id="text-after-a-number"),
    pytest.param(["val_error=0.2", '{"val_error": [1]}'], {}, {"val_error": "[1]"}, id="text-json-list-after-a-number"),
    pytest.param(["val_error=0_25"], {}, {"val_error": "0_25"}, id="text-digit-separator"),
    pytest.param(["val_error\t1_000.5"], {}, {"val_error": "1_000.5"}, id="text-tab-digit-separator"),
    pytest.param(["val_error=0.25 test_error=2_5"], {"val_error": 0.25}, {"test_error": "2_5"},
                 id="text-digit-separator-beside-a-number"),
]


@pytest.mark.parametrize(("lines", "final", "invalid"), LAST_STEP_CASES + NON_NUMBER_CASES)
def test_the_last_report_of_a_metric_decides_its_final_value_or_text(lines: list[str], final: dict[str, float],
                                                                     invalid: dict[str, str]) -> None:
    metrics = parse_text("\n".join(lines), "val_error")
    assert metrics.final == final
    assert metrics.invalid == invalid


@pytest.mark.parametrize(
    ("text", "outcome", "value", "held_out", "reason"),
    [
        pytest.param('{"step": 1, "val_error": 0.5, "test_error": 0.6}\n{"step": 2, "val_error": 0.25, "test_error": 0.5}',
                     "COMPLETE", 0.25, {"test_error": 0.5}, "", id="complete"),
        pytest.param('{"step": 1, "val_error": 0.5}\n{"step": 2, "val_error": NaN}', "FAIL", None, {},
                     "val_error is nan", id="non-finite-last-step"),
        pytest.param('{"step": 1, "val_error": 0.5, "test_error": Infinity}', "COMPLETE", 0.5, {},
                     "held-out test_error was inf: not recorded", id="non-finite-held-out-noted"),
    ],
)
def test_the_judge_reads_the_last_step_values_as_final(text: str, outcome: str, value: float | None,
                                                       held_out: dict[str, float], reason: str) -> None:
    objective = Objective(metric="val_error", held_out=("test_error",))
    result = judge(parse_text(text, "val_error"), objective, 0, None, text.splitlines(), 1.0, None)
    said = ("", reason) if outcome == "COMPLETE" else (reason, "")  # a completed trial's reason is empty: its note says
    assert (result.outcome.value, result.value, dict(result.held_out), (result.reason, result.note)) == (
        outcome, value, held_out, said)


# tqdm 4.70 on stderr merged with the script's prints on stdout: a bar's carriage return and text precede the print
TQDM_OUTPUT = """\
\repochs:   0%|          | 0/3 [00:00<?, ?it/s]val_error=1.000
val_error=0.500
\repochs:  67%|██████▋   | 2/3 [00:00<00:00, 19.14it/s]val_error=0.333
\repochs: 100%|██████████| 3/3 [00:00<00:00, 19.37it/s]
"""


def test_a_metric_after_a_progress_bar_is_read() -> None:
    assert parse_text(TQDM_OUTPUT, "val_error").final == {"val_error": 0.333}


# line -> (values, step)
PROGRESS_CASES = [
    pytest.param('\r  0%|          | 0/2 [00:00<?, ?it/s]{"step": 2, "val_error": 0.5}', {"val_error": 0.5}, 2,
                 id="json-step"),
    pytest.param("\r  0%|          | 0/2 [00:00<?, ?it/s, loss=0.1]val_error=0.25", {"val_error": 0.25}, None,
                 id="postfix"),
    pytest.param("\r100%|##########| 2/2 [00:00<00:00, 19.94it/s]\r                         \r\r  0%|          | "
                 "0.00/2.00k [00:00<?, ?B/s]val_error=0.2", {"val_error": 0.2}, None, id="ascii-cleared-unit-scale"),
    pytest.param("\r 50%|█████     | 1/2 [00:00<00:00,  9.90it/s]   val_error\t0.125", {"val_error": 0.125}, None,
                 id="padded-tab-pair"),
    pytest.param("100%|██████████| 3/3 val_error=0.2 test_error=0.3", {"val_error": 0.2, "test_error": 0.3}, None,
                 id="bar-without-times"),
    pytest.param("loading 3 files\rval_error=0.3", {"val_error": 0.3}, None, id="after-a-carriage-return"),
    pytest.param("\r100%|██████████| 3/3 [00:01<00:00]Result of this algorithm run: SAT, 1.5, 0, 0.12, 1",
                 {"runtime": 1.5, "val_error": 0.12}, None, id="smac"),
]


@pytest.mark.parametrize(("line", "values", "step"), PROGRESS_CASES)
def test_progress_output_before_a_metric_is_skipped(line: str, values: dict[str, float], step: int | None) -> None:
    reported = MetricParser("val_error").feed(line + "\n")
    assert reported is not None
    assert (dict(reported.values), reported.step) == (values, step)


def test_a_line_rewritten_by_a_progress_bar_is_read_update_by_update_as_the_whole_output_is() -> None:
    """tqdm or Lightning sends its updates to a pipe as one line parted by carriage returns: the
    value the bar ends on is recorded (the first update's was), every step matched reaches the
    pruner's record (only the first did), and a live read agrees with :func:`parse_text`."""
    bar = "".join(f"\rEpoch {i}: {i * 10:3d}%|{'#' * i:10s}| {i}/10 [00:0{i}<00:00, val_loss={1.0 - i * 0.05:.3f}]"
                  for i in range(1, 11))
    for patterns, step_pattern in (({"val_loss": r"val_loss=([0-9.]+)"}, None),
                                   ({"val_loss": r"val_loss=([0-9.]+)"}, r"Epoch (\d+):")):
        parser = MetricParser("val_loss", patterns, step_pattern)
        reported = parser.feed(bar + "\n")
        assert reported is not None and reported.values == {"val_loss": 0.5}
        metrics = parser.metrics()
        assert metrics.final == {"val_loss": 0.5} == parse_text(bar, "val_loss", patterns, step_pattern).final
        if step_pattern:
            assert reported.step == 10
            assert metrics.intermediate == tuple((i, {"val_loss": pytest.approx(1.0 - i * 0.05)}) for i in range(1, 11))
            assert metrics.intermediate == parse_text(bar, "val_loss", patterns, step_pattern).intermediate
    overwritten = MetricParser("val_error")
    assert overwritten.feed("val_error=0.3\rEpoch 1 done\n") == MetricLine(values={"val_error": 0.3})


def test_a_refused_step_in_one_update_leaves_the_others_read() -> None:
    parser = MetricParser("loss", {"loss": r"loss=([0-9.]+)"}, r"Epoch (\S+):")
    with pytest.raises(StepError):
        parser.feed("\rEpoch 1: loss=0.5\rEpoch x1.5: loss=0.4\rEpoch 3: loss=0.3\n")
    assert parser.metrics().intermediate == ((1, {"loss": 0.5}), (3, {"loss": 0.3}))


def test_patterns_still_search_the_whole_line() -> None:
    text = "Epoch 2\r 50%|█████     | 1/2 [00:00<00:00, loss=0.25]\nloss 0.5\r 50%|█████     | 1/2 [00:00<00:00]"
    metrics = parse_text(text, "loss", {"loss": r"loss[ =]([0-9.]+)"}, r"Epoch (\d+)")
    assert metrics.intermediate == ((2, {"loss": 0.25}), (2, {"loss": 0.5}))
    assert metrics.final == {"loss": 0.5}


# Lines of 200,000 characters, parsed in linear time (the old key=value and tab-pair expressions took minutes).
LONG = 200_000


@pytest.mark.parametrize(
    ("line", "final"),
    [
        pytest.param("a" * LONG, {}, id="a-long-word"),
        pytest.param("a" * LONG + "=1", {"a" * LONG: 1.0}, id="a-long-name"),
        pytest.param("a" + " " * LONG + "=1", {"a": 1.0}, id="spaces-before-equals"),
        pytest.param("a " * (LONG // 2) + "b", {}, id="many-words"),
        pytest.param("a" + " " * LONG + "\t1", {"a": 1.0}, id="spaces-before-a-tab"),
        pytest.param("a" + " " * LONG + "\t1 2", {}, id="spaces-before-a-tab-then-two-words"),
        pytest.param("\r 50%|" + "█" * LONG + "| 1/2 [00:00<00:00]val_error=0.5", {"val_error": 0.5}, id="a-long-bar"),
        pytest.param("9%|" * (LONG // 3), {}, id="many-bar-starts"),
    ],
)
def test_long_lines_are_parsed_quickly(line: str, final: dict[str, float]) -> None:
    start = time.perf_counter()
    metrics = parse_text(line, "val_error")
    assert time.perf_counter() - start < 2.0
    assert metrics.final == final


@pytest.mark.parametrize(
    ("text", "value"),
    [("val_error=nan", NAN), ("val_error=inf", INF), ('{"val_error": NaN}', NAN), ('{"val_error": -Infinity}', -INF)],
)
def test_non_finite_numbers_are_parsed(text: str, value: float) -> None:
    parsed = parse_text(text, "val_error").final["val_error"]
    assert (math.isnan(parsed) and math.isnan(value)) or parsed == value


@pytest.mark.parametrize(
    ("kwargs", "final", "intermediate"),
    [
        ({"val_error": 0.125}, {"val_error": 0.125}, ()),
        ({"val_error": 1, "test_error": 2.5e-7}, {"val_error": 1.0, "test_error": 2.5e-7}, ()),
        ({"step": 4, "val_error": 0.3, "train_loss": 1.25}, {"val_error": 0.3, "train_loss": 1.25},
         ((4, {"val_error": 0.3, "train_loss": 1.25}),)),
        ({"step": 0, "val_error": 0.1}, {"val_error": 0.1}, ((0, {"val_error": 0.1}),)),
        ({"val_error": INF}, {"val_error": INF}, ()),
        ({"val_error": 1 / 3}, {"val_error": 1 / 3}, ()),
    ],
)
def test_report_round_trips_through_the_parser(kwargs: dict[str, Any], final: dict[str, float],
                                               intermediate: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    report(file=out, **kwargs)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    metrics = parse_text(text, "val_error")
    assert metrics.final == final
    assert metrics.intermediate == intermediate


def test_report_round_trips_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    report(file=out, val_error=NAN)
    assert math.isnan(parse_text(out.getvalue(), "val_error").final["val_error"])


class _RawWrites(io.RawIOBase):
    """An unbuffered file that records each write it gets, as a pipe sees them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes.append(bytes(data))
        return len(data)


def test_report_writes_each_line_in_one_call_under_unbuffered_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """As stdout is under ``PYTHONUNBUFFERED=1`` (every trial's setting): a line written in two calls lets
    another rank's output, sharing the pipe, land between its text and its newline, and the metric is lost."""
    monkeypatch.delenv("RANK", raising=False)
    raw = _RawWrites()
    stdout = io.TextIOWrapper(raw, write_through=True)
    report(step=1, file=stdout, val_error=0.5)
    report(file=stdout, val_error=0.25, test_error=0.125)
    assert raw.writes == [b'{"step": 1, "val_error": 0.5}\n', b'{"val_error": 0.25, "test_error": 0.125}\n']



def test_report_prints_to_stdout(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    report(val_error=0.5)
    assert parse_text(capsys.readouterr().out, "val_error").final == {"val_error": 0.5}


def test_report_in_a_job_of_several_processes_ends_another_ranks_unended_text_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's print('loss 0.5') writes 'loss 0.5' and its newline apart: rank 0's report
    between the two led with rank 1's text and was read as no report (147 of 2,000 lost)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = io.StringIO()
    out.write("rank 1 log line loss 0.5")  # rank 1's text, its newline still to come
    report(file=out, step=7, val_error=0.25)
    out.write("\n")
    assert out.getvalue() == 'rank 1 log line loss 0.5\n{"step": 7, "val_error": 0.25}\n\n'
    assert parse_text(out.getvalue(), "val_error").intermediate == ((7, {"val_error": 0.25}),)
    monkeypatch.setenv("WORLD_SIZE", "1")
    alone = io.StringIO()
    report(file=alone, val_error=0.5)
    assert alone.getvalue() == '{"val_error": 0.5}\n'


@pytest.mark.parametrize("rank", ["1", "7"])
def test_report_is_silent_off_rank_zero(rank: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    report(file=out, val_error=0.5)
    report(step=1, val_error=0.5)
    assert out.getvalue() == ""
    assert capsys.readouterr().out == ""


def test_parser_snapshot_is_independent() -> None:
    parser = MetricParser("val_error")
    parser.feed("val_error=1")
    snapshot = parser.metrics()
    parser.feed("val_error=2")
    assert snapshot.final == {"val_error": 1.0}
    assert parser.metrics().final == {"val_error": 2.0}


MNIST_OUTPUT = """\
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305532
Train Epoch: 1 [640/60000 (1%)]\tLoss: 1.359438
Train Epoch: 1 [59520/60000 (99%)]\tLoss: 0.032419

Test set: Average loss: 0.0487, Accuracy: 9838/10000 (98%)

Train Epoch: 2 [0/60000 (0%)]\tLoss: 0.084102
Train Epoch: 2 [59520/60000 (99%)]\tLoss: 0.021907

Test set: Average loss: 0.0341, Accuracy: 9886/10000 (99%)

"""
MNIST_PATTERNS = {"test_loss": r"Average loss: ([0-9.]+)", "correct": r"Accuracy: ([0-9]+)/"}
MNIST_STEP = r"Train Epoch: (\d+)"


def test_patterns_read_pytorch_examples_mnist_with_a_step_per_epoch() -> None:
    parser = MetricParser("test_loss", MNIST_PATTERNS, MNIST_STEP)
    reported = [parser.feed(line) for line in MNIST_OUTPUT.splitlines()]
    steps = [(line.step, dict(line.values)) for line in reported if line is not None]
    assert steps == [(1, {"test_loss": 0.0487, "correct": 9838.0}), (2, {"test_loss": 0.0341, "correct": 9886.0})]
    metrics = parser.metrics()
    assert metrics.intermediate == ((1, {"test_loss": 0.0487, "correct": 9838.0}),
                                    (2, {"test_loss": 0.0341, "correct": 9886.0}))
    assert metrics.final == {"test_loss": 0.0341, "correct": 9886.0}
    assert metrics.invalid == {}


def test_without_a_step_pattern_matches_are_final_values_only() -> None:
    metrics = parse_text(MNIST_OUTPUT, "test_loss", MNIST_PATTERNS)
    assert metrics.intermediate == ()
    assert metrics.final == {"test_loss": 0.0341, "correct": 9886.0}


@pytest.mark.parametrize(
    ("text", "intermediate", "final"),
    [
        pytest.param("loss 0.9\nEpoch 1\nloss 0.5", ((1, {"loss": 0.5}),), {"loss": 0.5}, id="match-before-any-step"),
        pytest.param("Epoch 1: loss 0.5\nEpoch 2: loss 0.4", ((1, {"loss": 0.5}), (2, {"loss": 0.4})), {"loss": 0.4},
                     id="step-and-value-on-one-line"),
        pytest.param("Epoch 1\nEpoch 2\nloss 0.5", ((2, {"loss": 0.5}),), {"loss": 0.5}, id="last-step-counts"),
        pytest.param("Epoch 1\nEpoch 1.5\nloss 0.5", (), {"loss": 0.5}, id="non-integer-step-leaves-no-step"),
        pytest.param("Epoch x\nloss 0.5", (), {"loss": 0.5}, id="non-number-step"),
        pytest.param("Epoch 3\nacc 0.9", (), {"acc": 0.9}, id="held-out-match-is-not-a-step"),
    ],
)
def test_objective_matches_after_a_step_match_are_intermediate(text: str, intermediate: tuple[Any, ...],
                                                                final: dict[str, float]) -> None:
    metrics = parse_text(text, "loss", {"loss": r"loss ([-+.\w]+)", "acc": r"acc (\S+)"}, r"Epoch ([^\s:]+)")
    assert metrics.intermediate == intermediate
    assert metrics.final == final


@pytest.mark.parametrize(
    ("lines", "final", "invalid"),
    [
        (["loss: n/a"], {}, {"loss": "n/a"}),
        (["loss: n/a", "loss: 0.5"], {"loss": 0.5}, {}),
        (["loss: 0.5", "loss: n/a"], {}, {"loss": "n/a"}),
        (["loss: nan"], {"loss": NAN}, {}),
    ],
)
def test_a_pattern_match_that_is_not_a_number_is_invalid(lines: list[str], final: dict[str, float],
                                                        invalid: dict[str, str]) -> None:
    metrics = parse_text("\n".join(lines), "loss", {"loss": r"loss: (\S+)"})
    assert metrics.final.keys() == final.keys()
    assert all(math.isnan(v) if math.isnan(final[k]) else v == final[k] for k, v in metrics.final.items())
    assert metrics.invalid == invalid


def test_odd_steps_and_optional_groups_do_not_break_the_parser() -> None:
    text = '{"step": NaN, "val_error": 0.4}\nloss: \nEpoch \nloss: 0.2'
    metrics = parse_text(text, "loss", {"loss": r"loss: ([0-9.]+)?"}, r"Epoch (\d+)?")
    assert metrics.intermediate == ()
    assert metrics.final == {"loss": 0.2}


def test_patterns_add_to_the_built_in_formats() -> None:
    text = '{"step": 1, "val_error": 0.4}\nval_error=0.3 train_loss=0.2\nTop-1 acc 91.5%\n'
    metrics = parse_text(text, "val_error", {"top1": r"Top-1 acc ([0-9.]+)%"})
    assert metrics.intermediate == ((1, {"val_error": 0.4}),)
    assert metrics.final == {"val_error": 0.3, "train_loss": 0.2, "top1": 91.5}


def test_a_post_processing_output_in_rescales_tab_format() -> None:
    text = "test_loss\t0.0341\ncorrect\t9886\nstatus\tconverged\nparsed 2 values from trial.log\n"
    metrics = parse_text(text, "test_loss")
    assert metrics.final == {"test_loss": 0.0341, "correct": 9886.0}
    assert metrics.invalid == {"status": "converged"}


# Real output of torchrun (torch 2.13, 2 processes, gloo) running an argparse script in which rank 1 fails:
# an exception (without and with torch's @record), a SIGKILL, an unknown flag. Paths shortened.
TORCHRUN_AGENT = """\
Traceback (most recent call last):
  File "/opt/venv/bin/torchrun", line 6, in <module>
    sys.exit(main())
             ^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""

TORCHRUN_TRACEBACK = """\
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 28, in <module>
[rank1]:     main()
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 23, in main
[rank1]:     step(torch.ones(2), a.lr)
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 8, in step
[rank1]:     raise ValueError(f"lr {lr} is too high: the loss diverged to nan")
[rank1]: ValueError: lr 3.0 is too high: the loss diverged to nan
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 28, in <module>
[rank0]:     main()
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 24, in main
[rank0]:     dist.barrier()
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35728. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1122 17:29:11.041000 22400 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22410 closing signal SIGTERM
E1122 17:29:11.106000 22400 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 22411) of binary: /opt/venv/bin/python
""" + TORCHRUN_AGENT + """\
============================================================
main.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_17:29:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22410)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22410
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_17:29:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 22411)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

TORCHRUN_RECORD = """\
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 28, in <module>
[rank1]:     main()
[rank1]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
[rank1]:     return f(*args, **kwargs)
[rank1]:            ^^^^^^^^^^^^^^^^^^
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 23, in main
[rank1]:     step(torch.ones(2), a.lr)
[rank1]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 8, in step
[rank1]:     raise ValueError(f"lr {lr} is too high: the loss diverged to nan")
[rank1]: ValueError: lr 3.0 is too high: the loss diverged to nan
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 28, in <module>
[rank0]:     main()
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
[rank0]:     return f(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 24, in main
[rank0]:     dist.barrier()
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1688. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1122 17:29:05.345000 22380 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22386 closing signal SIGTERM
E1122 17:29:05.409000 22380 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 22387) of binary: /opt/venv/bin/python
E1122 17:29:05.413000 22380 torch/distributed/elastic/multiprocessing/errors/error_handler.py:145] no error file defined for parent, to copy child error file (/tmp/torchelastic_7nowmsmx/1bc94c39-7580-44f5-8c5e-519ae0dbb898_wcktcnhw/attempt_0/1/error.json)
""" + TORCHRUN_AGENT + """\
============================================================
main.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_17:29:04
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22386)  (SIGTERM)
  error_file: /tmp/torchelastic_7nowmsmx/1bc94c39-7580-44f5-8c5e-519ae0dbb898_wcktcnhw/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
      return f(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^
    File "/home/ada/runs/mnist/trial_0003/main.py", line 24, in main
      dist.barrier()
    File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
      return func(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^^^^
    File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
      work.wait()
  RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1688. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️

------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_17:29:04
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 22387)
  error_file: /tmp/torchelastic_7nowmsmx/1bc94c39-7580-44f5-8c5e-519ae0dbb898_wcktcnhw/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
      return f(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^
    File "/home/ada/runs/mnist/trial_0003/main.py", line 23, in main
      step(torch.ones(2), a.lr)
    File "/home/ada/runs/mnist/trial_0003/main.py", line 8, in step
      raise ValueError(f"lr {lr} is too high: the loss diverged to nan")
  ValueError: lr 3.0 is too high: the loss diverged to nan

============================================================
"""

TORCHRUN_SIGKILL = """\
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.305
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 28, in <module>
[rank0]:     main()
[rank0]:   File "/home/ada/runs/mnist/trial_0003/main.py", line 24, in main
[rank0]:     dist.barrier()
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:54934: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1122 17:29:15.989000 22419 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22423 closing signal SIGTERM
E1122 17:29:16.027000 22419 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 22424) of binary: /opt/venv/bin/python
""" + TORCHRUN_AGENT + """\
=======================================================
main.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_17:29:16
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22423)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22423
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_17:29:15
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 22424)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 22424
=======================================================
"""

TORCHRUN_ARGPARSE = """\
usage: main.py [-h] [--lr LR] [--kill]
main.py: error: unrecognized arguments: --batch_size 64
usage: main.py [-h] [--lr LR] [--kill]
main.py: error: unrecognized arguments: --batch_size 64
W1122 17:29:22.705000 22440 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22444 closing signal SIGTERM
E1122 17:29:22.737000 22440 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 1 (pid: 22445) of binary: /opt/venv/bin/python
""" + TORCHRUN_AGENT + """\
============================================================
main.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_17:29:22
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22444)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22444
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_17:29:22
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 22445)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

TRACEBACK_OOM = """\
Train Epoch: 3 [12800/50000 (26%)]\tLoss: 1.021877
Traceback (most recent call last):
  File "/home/ada/runs/cifar/trial_0007/train.py", line 112, in <module>
    main()
  File "/home/ada/runs/cifar/trial_0007/train.py", line 97, in main
    loss = criterion(model(images), labels)
                     ^^^^^^^^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/conv.py", line 554, in _conv_forward
    return F.conv2d(
           ^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.52 GiB. GPU 0 has a total capacity of 79.19 GiB \
of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.96 GiB memory in use. Of the allocated \
memory 74.01 GiB is allocated by PyTorch, and 2.47 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  \
See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""
OLD_OOM = """\
Traceback (most recent call last):
  File "train.py", line 64, in <module>
    output = model(data)
RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already \
allocated; 3.75 MiB free; 14.80 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try \
setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF
"""
CUDA_ERROR_OOM = """\
Traceback (most recent call last):
  File "/home/ada/runs/digits/trial_0002/train.py", line 40, in <module>
    model = Net().to(device)
            ^^^^^^^^^^^^^^^^
RuntimeError: CUDA error: out of memory
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

"""
CUBLAS_OOM = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/ada/runs/cifar/trial_0011/train.py", line 88, in <module>
[rank0]:     logits = head(features)
[rank0]: RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`
"""
CPP_ABORT_OOM = """\
terminate called after throwing an instance of 'c10::OutOfMemoryError'
  what():  CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 23.64 GiB of which 301.06 MiB \
is free.
Exception raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1131 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f3b0c35b617 in libc10.so)
Aborted (core dumped)
"""
CHAINED = """\
Traceback (most recent call last):
  File "train.py", line 12, in load
    return np.load(path)
FileNotFoundError: [Errno 2] No such file or directory: '/data/digits.npz'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 30, in <module>
    data = load(args.data)
RuntimeError: no data set at /data/digits.npz: run prepare.py first
"""
SYNTAX_ERROR = """\
  File "/home/ada/runs/digits/trial_0000/train.py", line 14
    lr = 0.01 *
               ^
SyntaxError: invalid syntax
"""
RETRIED_OOM_THEN_ERROR = """\
Traceback (most recent call last):
  File "train.py", line 71, in main
    history = fit_halving_batch_on_OutOfMemoryError(model, data, batch_size=args.batch_size)
  File "train.py", line 40, in fit_halving_batch_on_OutOfMemoryError
    raise ValueError(f"batch size {size} is below the {MIN_BATCH} that BatchNorm needs")
ValueError: batch size 3 is below the 8 that BatchNorm needs
"""
WARNINGS_ONLY = """\
/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: UserWarning: This DataLoader will create 8 \
worker processes in total. Our suggested max number of worker in current system is 2.
  warnings.warn(
val_error=0.31
"""
LOGGED_ERROR = """\
2025-03-02 10:31:07,123 INFO train: epoch 1 done
2025-03-02 10:31:09,456 ERROR train: the validation set is empty (0 of 1797 samples)
"""
MNIST_USAGE_ERROR = """\
usage: main.py [-h] [--batch-size N] [--test-batch-size N] [--epochs N] [--lr LR] [--gamma M] [--no-accel]
               [--dry-run] [--seed S] [--log-interval N] [--save-model]
main.py: error: unrecognized arguments: --batch_size 64
"""
TORCH_OOM_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.52 GiB. GPU 0 has a total capacity "
                  "of 79.19 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.96 GiB mem…")
OLD_OOM_LINE = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 "
                "GiB already allocated; 3.75 MiB free; 14.80 GiB reserved in total by PyTorch) If reserved memory …")
CPP_OOM_LINE = ("terminate called after throwing an instance of 'c10::OutOfMemoryError': CUDA out of memory. Tried to "
                "allocate 512.00 MiB. GPU 0 has a total capacity of 23.64 GiB of which 301.06 MiB is free.")
LR_ERROR = "ValueError: lr 3.0 is too high: the loss diverged to nan"

# output -> (last_error_line, out_of_gpu_memory)
ERROR_CASES = [
    pytest.param(TORCHRUN_TRACEBACK, LR_ERROR, None, id="torchrun-root-cause-rank-not-the-last-traceback"),
    pytest.param(TORCHRUN_RECORD, LR_ERROR, None, id="torchrun-record"),
    pytest.param(TORCHRUN_SIGKILL, "Signal 9 (SIGKILL) received by PID 22424", None, id="torchrun-sigkill"),
    pytest.param(TORCHRUN_ARGPARSE, "main.py: error: unrecognized arguments: --batch_size 64", None,
                 id="torchrun-argparse"),
    pytest.param(MNIST_USAGE_ERROR, "main.py: error: unrecognized arguments: --batch_size 64", None, id="argparse"),
    pytest.param(TRACEBACK_OOM, TORCH_OOM_LINE, TORCH_OOM_LINE, id="torch-oom"),
    pytest.param(OLD_OOM, OLD_OOM_LINE, OLD_OOM_LINE, id="runtime-error-oom"),
    pytest.param(CUDA_ERROR_OOM, "RuntimeError: CUDA error: out of memory", "RuntimeError: CUDA error: out of memory",
                 id="cuda-error-oom"),
    pytest.param(CUBLAS_OOM, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                 "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                 id="cublas-oom"),
    pytest.param(CPP_ABORT_OOM, CPP_OOM_LINE, CPP_OOM_LINE, id="terminate-called-what"),
    pytest.param(CHAINED, "RuntimeError: no data set at /data/digits.npz: run prepare.py first", None,
                 id="chained-exceptions-the-last"),
    pytest.param(SYNTAX_ERROR, "SyntaxError: invalid syntax", None, id="syntax-error-without-header"),
    pytest.param(RETRIED_OOM_THEN_ERROR, "ValueError: batch size 3 is below the 8 that BatchNorm needs", None,
                 id="oom-in-source-lines-is-not-oom"),
    pytest.param(WARNINGS_ONLY, "", None, id="warnings-are-not-errors"),
    pytest.param(LOGGED_ERROR, "2025-03-02 10:31:09,456 ERROR train: the validation set is empty (0 of 1797 samples)",
                 None, id="logged-error"),
    pytest.param(LOGGED_ERROR + CHAINED, "RuntimeError: no data set at /data/digits.npz: run prepare.py first", None,
                 id="exception-beats-logged-error"),
    pytest.param("epoch 1\nKilled\n", "Killed", None, id="shell-killed"),
    pytest.param("bash: line 1:  4242 Segmentation fault      (core dumped) python train.py\n",
                 "bash: line 1: 4242 Segmentation fault (core dumped) python train.py", None, id="shell-segfault"),
    pytest.param("python: can't open file '/home/ada/runs/x/trial_0000/tran.py': [Errno 2] No such file or directory\n",
                 "python: can't open file '/home/ada/runs/x/trial_0000/tran.py': [Errno 2] No such file or directory",
                 None, id="cannot-open-script"),
    pytest.param("loading data\nException: no file matches data/*.npz\n", "Exception: no file matches data/*.npz", None,
                 id="exception-line-without-traceback"),
    pytest.param("", "", None, id="empty"),
    pytest.param(MNIST_OUTPUT, "", None, id="a-clean-run"),
    pytest.param("loading data\ndataset shard missing\n", "", None, id="a-plain-line-is-no-error-line"),
]


@pytest.mark.parametrize(("output", "line", "oom"), ERROR_CASES)
def test_the_error_line_of_real_outputs(output: str, line: str, oom: str | None) -> None:
    lines = output.splitlines()
    assert last_error_line(lines) == line
    assert out_of_gpu_memory(lines) == oom
    assert len(line) <= ERROR_LINE_CHARS


LONG_PLAIN_LINE = "shard " + "x" * 400

# output -> last_error_line(or_last_line=True), as for a non-zero exit
LAST_LINE_CASES = [
    pytest.param("loading data\ndataset shard missing\n", "dataset shard missing", id="a-plain-stderr-line"),
    pytest.param("dataset shard missing\n\repochs: 100%|██████████| 3/3 [00:00<00:00, 19.37it/s]\n\n",
                 "dataset shard missing", id="a-progress-bar-and-blank-lines-are-passed-over"),
    pytest.param("Epoch 1 lr=0.1 loss 3\nval_error=0.4 test_error=0.5\n", "", id="a-metric-line-last"),
    pytest.param("dataset shard missing\n" + '{"step": 1, "val_error": 0.5}\n', "", id="a-json-metric-line-last"),
    pytest.param("dataset shard missing\ntest_error\t0.5\n", "", id="a-tab-metric-line-last"),
    pytest.param("dataset shard missing\nResult of this algorithm run: SAT, 1, 0, 0.4, 1\n", "",
                 id="a-smac-line-last"),
    pytest.param("\r 50%|█████     | 1/2 [00:00<00:00]shard 3 of 8 missing\n", "shard 3 of 8 missing",
                 id="the-text-after-a-progress-bar"),
    pytest.param("[rank0]:\x1b[33mno shard for rank 0\x1b[0m\n", "no shard for rank 0", id="colours-and-rank-prefix"),
    pytest.param("train.py:9: UserWarning: no GPU, running on the CPU\n  warnings.warn(\n",
                 "train.py:9: UserWarning: no GPU, running on the CPU", id="an-indented-line-continues-the-one-above"),
    pytest.param(LONG_PLAIN_LINE, LONG_PLAIN_LINE[:ERROR_LINE_CHARS - 1] + "…", id="cut-to-length"),
    pytest.param(CHAINED + "cleaning up\n", "RuntimeError: no data set at /data/digits.npz: run prepare.py first",
                 id="an-exception-wins"),
    pytest.param(LOGGED_ERROR + "bye\n", "2025-03-02 10:31:09,456 ERROR train: the validation set is empty (0 of "
                 "1797 samples)", id="a-logged-error-wins"),
    pytest.param(TORCHRUN_SIGKILL, "Signal 9 (SIGKILL) received by PID 22424", id="torchrun-root-cause-wins"),
    pytest.param(TQDM_OUTPUT, "", id="metrics-after-progress-bars"),
    pytest.param("", "", id="empty"),
]


@pytest.mark.parametrize(("output", "line"), LAST_LINE_CASES)
def test_a_non_zero_exit_quotes_the_last_line_when_no_line_reads_as_an_error(output: str, line: str) -> None:
    tail = output.split("\n")  # as the executor's tail: lines end at newlines only, carriage returns stay
    assert last_error_line(tail, or_last_line=True) == line


@pytest.mark.parametrize(
    ("output", "answers"),
    [
        pytest.param(TORCHRUN_TRACEBACK, {"", "rank 1 exited with code 1", LR_ERROR}, id="traceback"),
        pytest.param(TORCHRUN_RECORD, {"", LR_ERROR}, id="record"),
        pytest.param(TORCHRUN_ARGPARSE, {"", "rank 1 exited with code 2",
                                         "main.py: error: unrecognized arguments: --batch_size 64"}, id="argparse"),
        pytest.param(TRACEBACK_OOM, {TORCH_OOM_LINE}, id="oom"),
    ],
)
def test_every_tail_of_an_output_gives_its_error_or_an_honest_less(output: str, answers: set[str]) -> None:
    lines = output.splitlines()
    found = {last_error_line(lines[-count:]) for count in range(1, len(lines) + 1)}
    assert found == answers


def test_a_long_log_keeps_its_error_in_the_last_lines() -> None:
    training = [f"Train Epoch: {n // 100 + 1} [{n % 100 * 600}/60000]\tLoss: 0.{n:04d}" for n in range(5000)]
    lines = training + CHAINED.splitlines() + ["val_error=0.3"] * 50
    assert last_error_line(lines[-200:]) == "RuntimeError: no data set at /data/digits.npz: run prepare.py first"


def test_patterns_and_the_step_pattern_read_coloured_output() -> None:
    coloured = MNIST_OUTPUT.replace("Train Epoch:", "\x1b[1mTrain Epoch:\x1b[0m").replace(
        "Average loss: ", "Average loss: \x1b[32m").replace(", Accuracy", "\x1b[0m, Accuracy")
    metrics = parse_text(coloured, "test_loss", MNIST_PATTERNS, MNIST_STEP)
    assert metrics == parse_text(MNIST_OUTPUT, "test_loss", MNIST_PATTERNS, MNIST_STEP)
    assert metrics.final == {"test_loss": 0.0341, "correct": 9886.0}


def test_colours_and_rank_prefixes_are_removed() -> None:
    lines = ["[default1]:\x1b[31mTraceback (most recent call last):\x1b[0m", '[default1]:  File "t.py", line 3, in <module>',
             "[default1]:    f()", "[default1]:\x1b[1mKeyError: 'lr'\x1b[0m"]
    assert last_error_line(lines) == "KeyError: 'lr'"


MNIST_OBJECTIVE = {"metric": "test_loss", "held_out": ["correct"], "patterns": MNIST_PATTERNS}


def test_the_objective_reads_patterns_a_step_pattern_and_a_post_processing_command(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, objective={**MNIST_OBJECTIVE, "step_pattern": MNIST_STEP,
                                               "post_process": "python parse.py --log 'trial log.txt'"})
    objective = load_scenario(path).objective
    assert objective.patterns == MNIST_PATTERNS
    assert objective.step_pattern == MNIST_STEP
    assert objective.post_process == ("python", "parse.py", "--log", "trial log.txt")
    assert parse_text(MNIST_OUTPUT, objective.metric, objective.patterns, objective.step_pattern).final == {
        "test_loss": 0.0341, "correct": 9886.0}


@pytest.mark.parametrize(
    ("objective", "expected"),
    [
        ({"metric": ""}, "objective.metric: the objective needs the name of a metric, not an empty one"),
        ({"metric": "  "}, "objective.metric: the objective needs the name of a metric"),
        ({"metric": "step"}, "objective.metric: step marks a metric line as an intermediate report"),
        ({"metric": "reason"}, "objective.metric: reason is a name hpo records on every trial"),
        ({"held_out": ["outcome"]}, "objective.held_out: outcome is a name hpo records on every trial"),
        ({"held_out": ["duration_s"]}, "objective.held_out: duration_s is a name hpo records on every trial"),
        ({"held_out": [""]}, "objective.held_out: a held-out metric needs a name, not an empty one"),
        ({"held_out": ["acc", "acc"]}, "objective.held_out: acc is listed twice"),
        ({**MNIST_OBJECTIVE, "patterns": {"test_loss": "Average loss: [0-9.]+"}},
         "objective.patterns.test_loss: needs exactly one group, the (...) around the number, found 0"),
        ({**MNIST_OBJECTIVE, "patterns": {"test_loss": r"(Average|Mean) loss: ([0-9.]+)"}},
         ("objective.patterns.test_loss: needs exactly one group, the (...) around the number, found 2; "
         "write other parentheses as (?:...)")),
        ({**MNIST_OBJECTIVE, "patterns": {"correct": "Accuracy: ([0-9]+/"}},
         "objective.patterns.correct: not a regular expression (missing ), unterminated subpattern at position 10)"),
        ({**MNIST_OBJECTIVE, "patterns": {"test_loss": 5}}, "objective.patterns.test_loss: Input should be a valid"),
        ({**MNIST_OBJECTIVE, "patterns": {"train_loss": "Loss: ([0-9.]+)"}},
         ("objective.patterns: 'train_loss' is neither the objective metric (test_loss) nor a held-out metric "
         "(correct)")),
        ({"step_pattern": r"Train Epoch: \d+"}, "objective.step_pattern: needs exactly one group"),
        ({"step_pattern": "Epoch (["}, "objective.step_pattern: not a regular expression"),
        ({"post_process": ""}, "objective.post_process: the command is empty"),
        ({"post_process": []}, "objective.post_process: the command is empty"),
        ({"post_process": "python 'parse.py"}, "objective.post_process: cannot split the command: No closing quotation"),
    ],
)
def test_a_bad_objective_names_its_field(tmp_path: Path, write_scenario: WriteScenario, objective: dict[str, Any],
                                         expected: str) -> None:
    path = write_scenario(tmp_path, objective=objective)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value).startswith(f"scenario.yaml: {expected}")
    assert "\n" not in str(info.value)


def test_reserved_names_are_the_attributes_hpo_records() -> None:
    assert {"outcome", "reason", "duration_s", "folder", "worker", "slot", "gpus", "rerun_of", "retry_of",
            "requeue_of", "design_index", "lost_count"} <= RESERVED_ATTRS


def test_built_in_objective_lines_after_a_step_match_are_intermediate_values() -> None:
    """A step pattern without ``patterns``: the objective's ``key=value`` and JSON lines after
    ``Epoch e`` are epoch e's values (they were final values only, and nothing was pruned)."""
    text = ("Epoch 1\nval_error=1.5\nEpoch 2\n{\"val_error\": 1.0, \"test_error\": 1.1}\nEpoch 3\ntest_error=0.9\n"
            "{\"step\": 7, \"val_error\": 0.8}\nResult of this algorithm run: SAT, 1, 0, 0.7, 1\n")
    parser = MetricParser("val_error", step_pattern=r"Epoch (\d+)")
    reported = [parser.feed(line) for line in text.splitlines()]
    assert [(line.step, dict(line.values)) for line in reported if line is not None] == [
        (1, {"val_error": 1.5}), (2, {"val_error": 1.0, "test_error": 1.1}), (None, {"test_error": 0.9}),
        (7, {"val_error": 0.8}), (None, {"runtime": 1.0, "val_error": 0.7})]
    metrics = parser.metrics()
    assert [step for step, _ in metrics.intermediate] == [1, 2, 7]
    assert metrics.final == {"val_error": 0.7, "test_error": 0.9, "runtime": 1.0}


@pytest.mark.parametrize(("line", "shown"), [
    pytest.param('{"step": 0.5, "val_error": 0.9}', "0.5", id="json-half"),
    pytest.param('{"step": 1.9, "val_error": 0.4}', "1.9", id="json-below-two"),
    pytest.param("step=1.5 val_error=0.4", "1.5", id="pairs"),
    pytest.param('{"step": -1, "val_error": 0.4}', "-1", id="negative"),
    pytest.param('{"step": 1e20, "val_error": 0.4}', "1e+20", id="beyond-storage"),
    pytest.param('{"step": 2147483648, "val_error": 0.4}', "2147483648", id="one-beyond-storage"),
    pytest.param("step=4294967296.0 val_error=0.4", "4294967296", id="whole-float-beyond-storage"),
    pytest.param('{"step": 3.0000000000000004, "val_error": 0.4}', "3.0000000000000004", id="next-to-whole"),
    pytest.param("step=1_0 val_error=0.4", "1_0", id="digit-separator"),
    pytest.param('{"step": NaN, "val_error": 0.4}', "nan", id="nan"),
    pytest.param('{"step": "2", "val_error": 0.4}', '"2"', id="text"),
    pytest.param('{"step": true, "val_error": 0.4}', "true", id="bool"),
])
def test_a_step_that_is_not_a_whole_number_is_refused_not_truncated(line: str, shown: str) -> None:
    parser = MetricParser("val_error")
    assert parser.feed('{"step": 1, "val_error": 0.5}') is not None
    with pytest.raises(StepError, match=rf"^step {re.escape(shown)} is not a whole number from 0 to 2147483647; "):
        parser.feed(line)
    assert parser.metrics() == Metrics(final={"val_error": 0.5}, intermediate=((1, {"val_error": 0.5}),))
    assert parse_text(f"{line}\nval_error=0.3", "val_error") == Metrics(final={"val_error": 0.3})


def test_a_whole_float_step_is_that_step() -> None:
    reported = MetricParser("val_error").feed('{"step": 2.0, "val_error": 0.4}')
    assert reported is not None and reported.step == 2


def test_a_step_pattern_match_that_is_not_a_whole_number_is_refused_and_leaves_no_step() -> None:
    parser = MetricParser("loss", {"loss": r"loss (\S+)"}, r"Epoch ([^\s:]+)")
    parser.feed("Epoch 1")
    parser.feed("loss 0.5")
    with pytest.raises(StepError, match=r"^step_pattern matched step 1\.5 is not a whole number"):
        parser.feed("Epoch 1.5")
    parser.feed("loss 0.4")
    with pytest.raises(StepError, match=r"matched step -2 is not"):
        parser.feed("Epoch -2: loss 0.1")
    parser.feed("Epoch 2")
    parser.feed("loss 0.3")
    metrics = parser.metrics()
    assert metrics.intermediate == ((1, {"loss": 0.5}), (2, {"loss": 0.3}))
    assert metrics.final == {"loss": 0.3}


def test_report_prints_a_whole_step_and_refuses_another_at_once() -> None:
    """report(step=1.5) and report(step=-1) printed lines that the parser refused later, as a
    note in trial.log, where a value that is not a number raised at once; report() printed {}."""
    import numpy as np
    import torch

    out = io.StringIO()
    for step in (2.0, np.int64(2), torch.tensor(2), np.array(2.0)):
        report(step=step, file=out, val_error=0.5)
    assert out.getvalue().splitlines() == ['{"step": 2, "val_error": 0.5}'] * 4
    out = io.StringIO()
    for step in (1.5, -1, 2**31, "2", float("nan"), True, [2]):
        with pytest.raises(ValueError, match=rf"^report\(\): step is {re.escape(repr(step))}, not a whole number "
                                             r"from 0 to 2147483647$"):
            report(step=step, file=out, val_error=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^report\(\): give at least one metric"):
        report(step=1, file=out)
    assert out.getvalue() == ""


def test_report_prints_where_rank_is_set_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK='' (set, empty) read as another rank than 0: nothing was reported."""
    monkeypatch.setenv("RANK", "")
    out = io.StringIO()
    report(file=out, val_error=0.5)
    assert out.getvalue() == '{"val_error": 0.5}\n'


# line -> the line as the reason quotes it: the objective named with a value in a form hpo does not read
UNREAD_CASES = [
    pytest.param("{'val_error': 0.25}", "{'val_error': 0.25}", id="python-dict-repr"),
    pytest.param("2026-01-01 12:00:00,001 INFO val_error=0.125", "2026-01-01 12:00:00,001 INFO val_error=0.125",
                 id="logging-prefix"),
    pytest.param("INFO: val_error=0.25", "INFO: val_error=0.25", id="level-prefix"),
    pytest.param("Epoch 3: val_error: 0.25", "Epoch 3: val_error: 0.25", id="colon"),
    pytest.param("Training: val_error 0.3", "Training: val_error 0.3", id="space"),
    pytest.param('{"eval": {"val_error": 0.2}}', '{"eval": {"val_error": 0.2}}', id="nested-json"),
    pytest.param("\x1b[2mINFO\x1b[0m val_error=tensor(0.25)", "INFO val_error=tensor(0.25)", id="coloured-tensor"),
    pytest.param("INFO " + "x" * 100 + " val_error=0.1", "INFO " + "x" * 74 + "…", id="cut-short"),
]


@pytest.mark.parametrize(("line", "quoted"), UNREAD_CASES)
def test_a_missing_objective_quotes_a_line_that_named_it_in_a_form_not_read(line: str, quoted: str) -> None:
    metrics = parse_text(f"starting\n{line}\nval_error\n{{'val_error': 0.5}}\ntest_error=0.3\n", "val_error")
    assert metrics.final == {"test_error": 0.3}
    assert metrics.unread == {"val_error": quoted}
    assert never_reported("val_error", metrics) == (
        f'val_error was never reported; a line names it in a form hpo does not read: "{quoted}" '
        '(hpo reads val_error=0.25 or {"val_error": 0.25}, alone on a line)')


def test_a_missing_objective_whose_name_is_no_key_is_shown_in_json() -> None:
    metrics = parse_text("INFO Lift coefficient: 0.125", "Lift coefficient")
    assert never_reported("Lift coefficient", metrics) == (
        'Lift coefficient was never reported; a line names it in a form hpo does not read: '
        '"INFO Lift coefficient: 0.125" (hpo reads {"Lift coefficient": 0.25} alone on a line)')


@pytest.mark.parametrize(
    ("text", "patterns"),
    [
        pytest.param("val_error improved\nbest_val_error=0.1 so far\nval_error_ema: 0.2\n\"val_error\"\nval_error:",
                     None, id="no-value-or-another-name"),
        pytest.param("val_error=0.3\rEpoch 1 done", None, id="before-a-carriage-return"),
        pytest.param("val_error: None\nlogging val_error: every epoch", None, id="no-number"),
        pytest.param("INFO val_error=0.125", {"val_error": r"^val_error (\S+)$"}, id="the-objective-has-a-pattern"),
        pytest.param('{"step": -1, "val_error": 0.4}\nval_error=n/a', None, id="read-but-refused-or-not-a-number"),
    ],
)
def test_a_missing_objective_is_plainly_never_reported_without_such_a_line(text: str,
                                                                          patterns: dict[str, str] | None) -> None:
    metrics = parse_text(text, "val_error", patterns)
    assert metrics.unread == {}
    assert never_reported("val_error", metrics) == "val_error was never reported"


def test_report_prints_on_rank_zero_only_under_mp_spawn(tmp_path: Path) -> None:
    """``torch.multiprocessing.spawn`` sets no ``RANK``: every rank printed, so a trial held one
    rank's curve and another's final value."""
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(f"""\
        import os
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from hpo.results import report

        def work(rank):
            dist.init_process_group("gloo", init_method="file://{tmp_path}/rendezvous", rank=rank, world_size=2)
            report(step=1, val_error=1.0 + rank)
            report(val_error=0.1 + rank)
            dist.barrier()
            dist.destroy_process_group()

        if __name__ == "__main__":
            os.environ.pop("RANK", None)
            mp.spawn(work, nprocs=2)
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**cli_env(), "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr
    parsed = parse_text(done.stdout, "val_error")
    assert parsed.final == {"val_error": 0.1} and list(parsed.intermediate) == [(1, {"val_error": 1.0})], done.stdout


def test_metric_lines_that_torchrun_tee_prefixed_are_read_from_rank_zero() -> None:
    """Under torchrun --tee every line starts [defaultN]: the trial failed 'val_error was never reported'."""
    text = ('[default1]:{"step": 1, "val_error": 9.0}\n[default0]:{"step": 1, "val_error": 0.5}\n'
            '[default0]:val_error=0.25 test_error=0.3\n[default1]:val_error=9.0\n')
    parsed = parse_text(text, "val_error")
    assert parsed.final == {"val_error": 0.25, "test_error": 0.3}
    assert list(parsed.intermediate) == [(1, {"val_error": 0.5})]


def test_report_names_a_metric_that_is_not_a_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TypeError, match=r"^report\(\): val_error is None, not a number$"):
        report(file=io.StringIO(), val_error=None)  # type: ignore[arg-type]
