"""Metric lines: the writer that trial scripts call and the parser that reads them back.

A trial reports metrics by printing lines to stdout. Three formats are understood:

* a JSON object line: ``{"val_error": 0.12, "test_error": 0.13}``
* ``key=value`` lines (Rescale's post-processing format): ``val_error=0.12`` or several
  pairs on one line, ``val_error=0.12 test_error=0.13``; the line must hold nothing else
* SMAC's wrapper line: ``Result of this algorithm run: SAT, 1.3, 0, 0.12, 1`` (status,
  runtime, runlength, quality, seed[, extra]); the quality becomes the objective metric

A line whose metrics include ``step`` is an intermediate report (one per epoch, say) that a
pruner may act on; any other line reports final values, and the last value of a key wins.

This module must stay cheap to import: trial scripts import :func:`report` from it.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TextIO

STEP_KEY = "step"
SMAC_PREFIXES = ("Result of this algorithm run:", "Result for SMAC:")
SMAC_OK_STATUSES = frozenset({"SAT", "SUCCESS"})
SMAC_STATUSES = frozenset({"SAT", "SUCCESS", "UNSAT", "TIMEOUT", "CRASHED", "ABORT", "MEMOUT"})
_PAIR = re.compile(r"^\s*([A-Za-z_][\w.\-/]*)\s*=\s*(\S+?)\s*,?\s*$")
_PAIRS = re.compile(r"([A-Za-z_][\w.\-/]*)\s*=\s*(\S+)")


def report(step: int | None = None, file: TextIO | None = None, **metrics: float) -> None:
    """Print one metric line that :class:`MetricParser` reads back.

    Call with ``step`` for a per-epoch (intermediate) report and without it for the final
    values. Only the process of global rank 0 prints, so DDP scripts may call it on every
    rank. Values must be numbers; the line is flushed at once so the sweep sees it live.
    """
    if os.environ.get("RANK", "0") != "0":
        return
    payload: dict[str, float | int] = {}
    if step is not None:
        payload[STEP_KEY] = int(step)
    payload.update({name: float(value) for name, value in metrics.items()})
    print(json.dumps(payload), file=file or sys.stdout, flush=True)


@dataclass(frozen=True)
class MetricLine:
    """What one output line reported: its values, its step if intermediate, SMAC status."""

    values: Mapping[str, float]
    step: int | None = None
    smac_status: str | None = None


@dataclass(frozen=True)
class Metrics:
    """Everything a trial's output reported, as the parser saw it so far."""

    final: Mapping[str, float] = field(default_factory=dict)
    intermediate: tuple[tuple[int, Mapping[str, float]], ...] = ()
    invalid: Mapping[str, str] = field(default_factory=dict)
    smac_status: str | None = None
    smac_extra: str = ""


def _number(text: str) -> float | None:
    try:
        return float(text.strip().rstrip(",;"))
    except ValueError:
        return None


def _parse_json(line: str) -> tuple[dict[str, float], dict[str, str]] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    values: dict[str, float] = {}
    invalid: dict[str, str] = {}
    for key, raw in obj.items():
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            invalid[str(key)] = json.dumps(raw)
        else:
            values[str(key)] = float(raw)
    return values, invalid


def _parse_pairs(line: str) -> tuple[dict[str, float], dict[str, str]] | None:
    pairs = _PAIRS.findall(line)
    if not pairs or _PAIRS.sub("", line).strip(" \t,;") != "":
        return None
    values: dict[str, float] = {}
    invalid: dict[str, str] = {}
    for key, raw in pairs:
        number = _number(raw)
        if number is None:
            invalid[key] = raw
        else:
            values[key] = number
    return values, invalid


def parse_smac_line(line: str, quality_name: str) -> MetricLine | None:
    """Parse SMAC's ``Result of this algorithm run: STATUS, runtime, runlength, quality, seed``."""
    text = line.strip()
    for prefix in SMAC_PREFIXES:
        if text.startswith(prefix):
            fields = [part.strip() for part in text[len(prefix):].split(",", 5)]
            status = fields[0].upper()
            if status not in SMAC_STATUSES:
                return None
            values: dict[str, float] = {}
            if len(fields) > 1 and (runtime := _number(fields[1])) is not None:
                values["runtime"] = runtime
            if len(fields) > 3 and (quality := _number(fields[3])) is not None:
                values[quality_name] = quality
            return MetricLine(values=values, smac_status=status)
    return None


class MetricParser:
    """Reads a trial's output line by line and accumulates the metrics it reports.

    ``quality_name`` is the metric that a SMAC result line's quality field is stored as.
    """

    def __init__(self, quality_name: str, patterns: Mapping[str, str] | None = None,
                 step_pattern: str | None = None) -> None:
        self._quality_name = quality_name
        self._patterns = {name: re.compile(p) for name, p in (patterns or {}).items()}
        self._step_pattern = re.compile(step_pattern) if step_pattern else None
        self._step: int | None = None
        self._final: dict[str, float] = {}
        self._intermediate: list[tuple[int, Mapping[str, float]]] = []
        self._invalid: dict[str, str] = {}
        self._smac_status: str | None = None
        self._smac_extra = ""

    def feed(self, line: str) -> MetricLine | None:
        """Parse one line; return what it reported, or None for an ordinary log line."""
        text = line.strip()
        if not text:
            return None
        matched = self._match_patterns(text)
        if matched is not None:
            return matched
        smac = parse_smac_line(text, self._quality_name)
        if smac is not None:
            self._smac_status = smac.smac_status
            self._final.update(smac.values)
            fields = text.split(",", 5)
            self._smac_extra = fields[5].strip() if len(fields) > 5 else ""
            return smac
        parsed = _parse_json(text) if text.startswith("{") else _parse_pairs(text)
        if parsed is None:
            return None
        values, invalid = parsed
        if not values and not invalid:
            return None
        step_value = values.pop(STEP_KEY, None)
        if step_value is not None:
            step = int(step_value)
            self._intermediate.append((step, dict(values)))
            return MetricLine(values=values, step=step)
        self._final.update(values)
        for key in values:
            self._invalid.pop(key, None)
        for key in invalid:
            self._final.pop(key, None)
        self._invalid.update(invalid)
        return MetricLine(values=values)

    def _match_patterns(self, text: str) -> MetricLine | None:
        if self._step_pattern is not None and (step := self._step_pattern.search(text)):
            self._step = int(float(step.group(1)))
        values = {}
        for name, pattern in self._patterns.items():
            match = pattern.search(text)
            if match and (number := _number(match.group(1))) is not None:
                values[name] = number
        if not values:
            return None
        self._final.update(values)
        if self._step is not None and self._quality_name in values:
            self._intermediate.append((self._step, dict(values)))
            return MetricLine(values=values, step=self._step)
        return MetricLine(values=values)

    def metrics(self) -> Metrics:
        """A snapshot of everything reported so far."""
        return Metrics(
            final=dict(self._final),
            intermediate=tuple(self._intermediate),
            invalid=dict(self._invalid),
            smac_status=self._smac_status,
            smac_extra=self._smac_extra,
        )


def parse_text(text: str, quality_name: str) -> Metrics:
    """Parse a whole output at once (a finished trial's log, say)."""
    parser = MetricParser(quality_name)
    for line in text.splitlines():
        parser.feed(line)
    return parser.metrics()


_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")
_ERROR = re.compile(r"^(\w[\w.]*(Error|Exception|Interrupt)\b.*|.*: error: .*|terminate called.*|Killed)$")


def out_of_gpu_memory(lines: Sequence[str]) -> str | None:
    """The line of CUDA's out-of-memory error in a trial's output, or None."""
    found = [line.strip() for line in lines if _OOM.search(line)]
    return found[-1][:200] if found else None


def last_error_line(lines: Sequence[str]) -> str:
    """The last line of a trial's output that reads like an error ('' if none)."""
    for line in reversed(lines):
        text = line.strip()
        if _ERROR.match(text):
            return text[:200]
    return ""
