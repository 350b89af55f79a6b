"""Metric lines: every format the parser reads, the writer round trip, and trial verdicts."""
from __future__ import annotations

import io
import math
from typing import Any

import pytest

from hpo.results import MetricParser, Metrics, parse_smac_line, parse_text, report

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
    if step is None:
        assert dict(metrics.final) == pytest.approx(values)
        assert metrics.intermediate == ()
    else:
        assert metrics.final == {}
        assert metrics.intermediate == ((step, pytest.approx(values)),)
    assert metrics.smac_status == status


@pytest.mark.parametrize("line", ORDINARY_LINES)
def test_ordinary_log_lines_are_ignored(line: str) -> None:
    parser = MetricParser("val_error")
    assert parser.feed(line) is None
    assert parser.metrics() == Metrics()


def test_smac_quality_goes_to_the_named_metric() -> None:
    line = parse_smac_line("Result of this algorithm run: SAT, 1, 0, 0.3, 1", "loss")
    assert line is not None and dict(line.values) == {"runtime": 1.0, "loss": 0.3}
    assert parse_smac_line("no prefix: SAT, 1, 0, 0.3, 1", "loss") is None


def test_smac_extra_is_kept() -> None:
    metrics = parse_text("Result of this algorithm run: CRASHED, 0, 0, 0, 1, out of memory, at epoch 3\n", "e")
    assert metrics.smac_status == "CRASHED"
    assert metrics.smac_extra == "out of memory, at epoch 3"


def test_steps_are_intermediate_and_the_last_final_value_wins() -> None:
    text = "\n".join([
        "starting",
        '{"step": 0, "val_error": 0.9}',
        "Epoch 1 lr=0.1 loss 3",
        "step=1 val_error=0.5 train_loss=0.4",
        "val_error=0.7",
        '{"val_error": 0.3, "test_error": 0.35}',
        "test_error=0.33",
        "done",
    ])
    metrics = parse_text(text, "val_error")
    assert metrics.intermediate == ((0, {"val_error": 0.9}), (1, {"val_error": 0.5, "train_loss": 0.4}))
    assert metrics.final == {"val_error": 0.3, "test_error": 0.33}
    assert metrics.invalid == {}


@pytest.mark.parametrize(
    ("lines", "final", "invalid"),
    [
        (["val_error=abc"], {}, {"val_error": "abc"}),
        (['{"val_error": "0.1"}'], {}, {"val_error": '"0.1"'}),
        (['{"val_error": null, "ok": true}'], {}, {"val_error": "null", "ok": "true"}),
        (["val_error=abc", "val_error=0.2"], {"val_error": 0.2}, {}),
        (["val_error=0.2", "val_error=abc"], {}, {"val_error": "abc"}),
        (["val_error=0.2", '{"val_error": [1]}'], {}, {"val_error": "[1]"}),
    ],
)
def test_non_numbers_are_invalid_and_the_last_report_wins(lines: list[str], final: dict[str, float],
                                                          invalid: dict[str, str]) -> None:
    metrics = parse_text("\n".join(lines), "val_error")
    assert metrics.final == final
    assert metrics.invalid == invalid


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
        ({"step": 4, "val_error": 0.3, "train_loss": 1.25}, {}, ((4, {"val_error": 0.3, "train_loss": 1.25}),)),
        ({"step": 0, "val_error": 0.1}, {}, ((0, {"val_error": 0.1}),)),
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


def test_report_prints_to_stdout(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    report(val_error=0.5)
    assert parse_text(capsys.readouterr().out, "val_error").final == {"val_error": 0.5}


@pytest.mark.parametrize("rank", ["1", "7"])
def test_report_is_silent_off_rank_zero(rank: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    report(file=out, val_error=0.5)
    report(step=1, val_error=0.5)
    assert out.getvalue() == ""
    assert capsys.readouterr().out == ""


def _metrics(text: str) -> Metrics:
    """Parse ``text`` with ``val_error`` as the SMAC quality name."""
    return parse_text(text, "val_error")


def test_parser_snapshot_is_independent() -> None:
    parser = MetricParser("val_error")
    parser.feed("val_error=1")
    snapshot = parser.metrics()
    parser.feed("val_error=2")
    assert snapshot.final == {"val_error": 1.0}
    assert parser.metrics().final == {"val_error": 2.0}
