"""Metric lines and error lines: the writer that trial scripts call and the parsers that read output back.

A trial reports metrics by printing lines to stdout. Four formats are understood:

* a JSON object line: ``{"val_error": 0.12, "test_error": 0.13}``
* ``key=value`` lines: ``val_error=0.12`` or several pairs on one line,
  ``val_error=0.12 test_error=0.13``; the line must hold nothing else
* ``name<TAB>value`` lines (Rescale's post-processing format): ``val_error\\t0.12``
* SMAC's wrapper line: ``Result of this algorithm run: SAT, 1.3, 0, 0.12, 1`` (status,
  runtime, runlength, quality, seed[, extra]); the quality becomes the objective metric

Progress output that precedes a metric on its line is skipped: a line is read from its last
carriage return on, past a leading tqdm-style bar (``epochs:  67%|██▋ | 2/3 [00:01<00:00]x=1``).
ANSI escape codes (colours) are removed from every line before it is read. A value is a number
as Python's ``float`` reads it, but for digit separators: ``0_25`` is not a number.

A line whose metrics include ``step`` is an intermediate report (one per epoch, say) that a
pruner may act on; any other line reports final values, and the last value of a key wins. A
metric reported only in intermediate reports takes its last intermediate value as final value.
A step is a whole number from 0 to :data:`LARGEST_STEP` (``2.0`` is step 2); a line with any other
step (``1.5``, ``-1``, ``NaN``, ``"2"``) is ignored and :meth:`MetricParser.feed` raises
:class:`StepError` saying so (the trial's log gets the message), never rounded onto a step
that another report may already hold.

Scripts that cannot be edited are read with ``patterns``, a regular expression with one
group per metric (``'Average loss: ([0-9.]+)'``), searched in every line, progress output
included; the last match wins. A line that a progress bar rewrote with carriage returns is
read update by update, so its last update wins there too. A ``step_pattern``
(``'Train Epoch: (\\d+)'``) sets the current step: each objective value after it, a match of
the objective's pattern or a line in a built-in format without ``step``, is also an
intermediate value at that step. A step match that is not a step as above is refused the
same way and leaves no current step until the next step match.

Where the objective metric has no pattern, the first line that gives it a value in a form not
read (``{'val_error': 0.25}``, ``INFO val_error=0.25``) is kept: :func:`never_reported` quotes it.

:func:`last_error_line` and :func:`out_of_gpu_memory` read a failed trial's last output
lines for the line that says why it failed.

This module must stay cheap to import: trial scripts import :func:`report` from it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

STEP_KEY = "step"
SMAC_PREFIXES = ("Result of this algorithm run:", "Result for SMAC:")
SMAC_OK_STATUSES = frozenset({"SAT", "SUCCESS"})
SMAC_STATUSES = frozenset({"SAT", "SUCCESS", "UNSAT", "TIMEOUT", "CRASHED", "ABORT", "MEMOUT"})
RESERVED_ATTRS = frozenset({"outcome", "reason", "duration_s", "folder", "worker", "slot", "gpus", "rerun_of",
                            "retry_of", "requeue_of", "retries", "design_index", "lost_count",
                            "disk_full_count", "note"})
"""User attributes that hpo writes on every trial; no held-out metric may take one of these names."""
LARGEST_STEP = 2**31 - 1
"""The largest step a report may carry (Optuna's SQL storages keep a step in a 32-bit integer)."""
ERROR_LINE_CHARS = 200
UNREAD_LINE_CHARS = 80
"""How much of a line that named the objective in a form not read :func:`never_reported` quotes."""
_NAME_CHAR = r"[\w.\-/]"
# A name begins where no name character precedes it, and a tab pair's name ends in a name
# character: either way one split of the line is tried, so both take linear time.
_PAIRS = re.compile(rf"(?<!{_NAME_CHAR})([A-Za-z_]{_NAME_CHAR}*)\s*=\s*(\S+)")
_TAB_PAIR = re.compile(rf"^([A-Za-z_](?:[\w.\-/ ]*{_NAME_CHAR})?)[ ]*\t[\t ]*(\S+)$")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # an ANSI control sequence: a colour, a cursor move
_PROGRESS_BAR = re.compile(  # tqdm's "desc:  67%|██▋ | 2/3 [00:01<00:00, 1.9it/s]"
    r"^[^|]*\d%\|[^|]*\|\s*\d[\w.]*/\d[\w.]*(?:\s*\[[^\]]*\])?")


def report(step: int | None = None, file: TextIO | None = None, **metrics: float) -> None:
    """Print one metric line that :class:`MetricParser` reads back.

    Call with ``step`` for a per-epoch (intermediate) report and without it for the final
    values. Only the process of global rank 0 prints, so DDP scripts may call it on every
    rank. Values must be numbers. The line is written in one call (a pipe takes up to 4 KiB
    in one piece, so other processes' output sharing it cannot land inside the line) and
    flushed at once so the sweep sees it live. In a job of several processes it is written
    after a newline: another rank's ``print`` writes its text and its newline apart, and its
    text, not yet ended, would lead the line (which is then read as no report). A step that
    is not a whole number from 0 to :data:`LARGEST_STEP`, a value that is not a number, or no
    metric at all raise ValueError (TypeError for a value of a type that is no number) at
    once, naming what is wrong.

    Args:
        step: the step (epoch) of an intermediate report, a whole number from 0 to
            :data:`LARGEST_STEP`; None for final values.
        file: where to print (default: stdout).
        metrics: the metric values by name.
    """
    if not metrics:
        raise ValueError("report(): give at least one metric, e.g. report(val_error=0.1)")
    payload: dict[str, float | int] = {}
    if step is not None:
        try:  # a number of any kind (an int, numpy's, a one-element tensor), never text or true/false
            number = float(step) if not isinstance(step, (str, bytes, bool)) else math.nan
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not (number.is_integer() and 0 <= number <= LARGEST_STEP):
            raise ValueError(f"report(): step is {step!r}, not a whole number from 0 to {LARGEST_STEP}")
        payload[STEP_KEY] = int(number)
    for name, value in metrics.items():
        try:
            payload[name] = float(value)
        except (TypeError, ValueError) as exc:  # the class float() raised, with the metric's name
            raise type(exc)(f"report(): {name} is {value!r}, not a number") from None
    if not _rank_zero():
        return
    out = file or sys.stdout
    out.write(("\n" if _world_size() > 1 else "") + json.dumps(payload) + "\n")
    out.flush()


def _process_group() -> Any:
    """``torch.distributed`` where the script imported it and initialized its process group,
    else None (this module never imports torch)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed
    return None


def _world_size() -> int:
    """How many processes the job has: torch.distributed's world size once its process group
    is initialized, else ``$WORLD_SIZE`` (1 without)."""
    group = _process_group()
    if group is not None:
        return int(group.get_world_size())
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def _rank_zero() -> bool:
    """Whether this process is of global rank 0: torch.distributed's rank once its process
    group is initialized (``mp.spawn`` sets no ``RANK``: every rank printed), else ``$RANK``."""
    group = _process_group()
    if group is not None:
        return bool(group.get_rank() == 0)
    return (os.environ.get("RANK") or "0") == "0"


@dataclass(frozen=True)
class MetricLine:
    """What one output line reported: its values, its step if intermediate, SMAC status."""

    values: Mapping[str, float]
    step: int | None = None
    smac_status: str | None = None


@dataclass(frozen=True)
class Metrics:
    """Everything a trial's output reported, as the parser saw it so far.

    ``final`` holds the last final value of each metric, or its last intermediate value if it
    had no final report; ``intermediate`` the per-step reports in order; ``invalid`` the
    metrics whose last such report was not a number (as printed); ``unread`` the first line
    that gave the objective metric a value in a form not read, by metric (see the module docstring).
    """

    final: Mapping[str, float] = field(default_factory=dict)
    intermediate: tuple[tuple[int, Mapping[str, float]], ...] = ()
    invalid: Mapping[str, str] = field(default_factory=dict)
    smac_status: str | None = None
    smac_extra: str = ""
    unread: Mapping[str, str] = field(default_factory=dict)


_Parsed = tuple[dict[str, float], dict[str, str]]


class StepError(ValueError):
    """An output line's step is not a whole number from 0 to :data:`LARGEST_STEP`; the line was ignored."""


def _shown(value: float) -> str:
    """``value`` as a note prints it: a whole number as an integer (``2147483648``), any other
    (or a whole number of 17 digits or more) in its shortest exact form (``1.5``, ``1e+20``)."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)


def _whole_step(value: float | None, shown: str, where: str) -> int:
    """``value`` as a step; :class:`StepError` naming ``shown`` (the step as printed) and
    ``where`` it came from when it is not a whole number from 0 to :data:`LARGEST_STEP`."""
    if value is not None and value.is_integer() and 0 <= value <= LARGEST_STEP:
        return int(value)
    raise StepError(f"{where} {shown} is not a whole number from 0 to {LARGEST_STEP}; the line is ignored")


def _number(text: str) -> float | None:
    """``text`` (a trailing ``,`` or ``;`` aside) as a number, or None; ``0_25`` is no number."""
    text = text.strip().rstrip(",;")
    if "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _split(pairs: Iterable[tuple[str, str]]) -> _Parsed:
    values: dict[str, float] = {}
    invalid: dict[str, str] = {}
    for key, raw in pairs:
        number = _number(raw)
        if number is None:
            invalid[key] = raw
        else:
            values[key] = number
    return values, invalid


def _record(numbers: dict[str, float], texts: dict[str, str], values: Mapping[str, float],
            invalid: Mapping[str, str]) -> None:
    """Add a report's values and non-numbers to ``numbers`` and ``texts``: a key's last report wins."""
    numbers.update(values)
    for key in values:
        texts.pop(key, None)
    for key in invalid:
        numbers.pop(key, None)
    texts.update(invalid)


def _parse_json(line: str) -> _Parsed | None:
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


def _parse_pairs(line: str) -> _Parsed | None:
    if "=" not in line:
        return None
    pairs = _PAIRS.findall(line)
    if not pairs or _PAIRS.sub("", line).strip(" \t,;") != "":
        return None
    return _split(pairs)


def _parse_tab_pair(line: str) -> _Parsed | None:
    match = _TAB_PAIR.match(line)
    return _split([(match.group(1), match.group(2))]) if match else None


def _after_progress(text: str) -> str:
    """``text`` from its last carriage return on, past a leading tqdm-style progress bar, stripped."""
    text = text.rpartition("\r")[2]
    bar = _PROGRESS_BAR.match(text) if "%|" in text else None
    return text[bar.end() if bar else 0:].strip()


def _parse_formats(line: str) -> _Parsed | None:
    """The metrics of a JSON, ``key=value`` or ``name<TAB>value`` line, or None."""
    if line.startswith("{"):
        return _parse_json(line)
    return (_parse_tab_pair(line) if "\t" in line else None) or _parse_pairs(line)


def parse_smac_line(line: str, quality_name: str) -> MetricLine | None:
    """Parse SMAC's ``Result of this algorithm run: STATUS, runtime, runlength, quality, seed``.

    Args:
        line: one output line.
        quality_name: the metric that the quality field is stored as.
    """
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

    Args:
        quality_name: the objective metric: a SMAC result line's quality is stored under it,
            and its values after a step match are intermediate values.
        patterns: regular expressions with one group, by metric name (``objective.patterns``).
        step_pattern: a regular expression whose one group is the current step (a whole number).
    """

    def __init__(self, quality_name: str, patterns: Mapping[str, str] | None = None,
                 step_pattern: str | None = None) -> None:
        self._quality_name = quality_name
        self._patterns = {name: re.compile(pattern) for name, pattern in (patterns or {}).items()}
        # the objective named with a number ("val_error: 0.25", "'val_error': tensor(0.25)"), unless a pattern reads it
        self._quality_named = None if quality_name in self._patterns else re.compile(
            rf"(?<!{_NAME_CHAR}){re.escape(quality_name)}['\"]?\s*(?:[:=]\s*|\s+)(?:[-+]?\.?\d|[\w.]+\()")
        self._unread: dict[str, str] = {}
        self._step_pattern = re.compile(step_pattern) if step_pattern else None
        self._step: int | None = None
        self._final: dict[str, float] = {}
        self._intermediate: list[tuple[int, Mapping[str, float]]] = []
        self._taken = 0  # how many of them take_intermediate handed out
        self._invalid: dict[str, str] = {}
        self._last_step: dict[str, float] = {}
        self._last_step_invalid: dict[str, str] = {}
        self._smac_status: str | None = None
        self._smac_extra = ""

    def feed(self, line: str) -> MetricLine | None:
        """Parse one line, each of its updates in turn where a progress bar rewrote it with
        carriage returns; return what its last report said, or None for an ordinary log line.

        The returned line has a ``step`` when it is an intermediate report: a line with a
        ``step`` key, or an objective value (a pattern match or a built-in format's) after a
        step pattern match (also a final value). A line that torchrun's ``--tee`` prefixed with
        its rank (``[default0]:``) is read without the prefix on rank 0 and is a log line on
        the others, whose reports copy rank 0's.

        Raises:
            StepError: the line's step (its ``step`` key or the step pattern's match) is not a
                whole number from 0 to :data:`LARGEST_STEP`; that update is ignored (the line's
                others are read), and a refused step match leaves no current step.
        """
        text = (_ANSI.sub("", line) if "\x1b" in line else line).strip()
        prefix = _RANK_PREFIX.match(text)  # torchrun --tee: [default0]:{"val_error": 0.1}
        if prefix is not None:
            if int(prefix.group(1)) != 0:  # another rank's copy of what rank 0 reports
                return None
            text = text[prefix.end():]
        reported, refused = None, None
        for update in text.split("\r"):  # a progress bar's updates, each read in its turn
            try:
                reported = self._feed_update(update.strip()) or reported
            except StepError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused
        return reported

    def _feed_update(self, text: str) -> MetricLine | None:
        """:meth:`feed` for one update of a line (the text between carriage returns)."""
        if not text:
            return None
        self._match_step(text)
        shown = _after_progress(text)
        smac = parse_smac_line(shown, self._quality_name)
        if smac is not None:
            self._smac_status = smac.smac_status
            _record(self._final, self._invalid, smac.values, {})
            fields = shown.split(",", 5)
            self._smac_extra = fields[5].strip() if len(fields) > 5 else ""
            return smac
        values, invalid = _parse_formats(shown) or ({}, {})
        matched, unmatched = self._match_patterns(text)
        values.update(matched)
        invalid.update(unmatched)
        if self._quality_name not in values and self._quality_name not in invalid:
            self._note_unread(shown)
        if not values and not invalid:
            return None
        if STEP_KEY in values or STEP_KEY in invalid:
            reported = values.pop(STEP_KEY, None)
            step = _whole_step(reported, invalid.pop(STEP_KEY) if reported is None else _shown(reported), STEP_KEY)
            self._intermediate.append((step, dict(values)))
            _record(self._last_step, self._last_step_invalid, values, invalid)
            return MetricLine(values=values, step=step)
        _record(self._final, self._invalid, values, invalid)
        if self._step is not None and self._quality_name in values:
            self._intermediate.append((self._step, dict(values)))
            return MetricLine(values=values, step=self._step)
        return MetricLine(values=values)

    def _match_step(self, text: str) -> None:
        """Set the current step from a step pattern match in ``text``; :class:`StepError` (and
        no current step) where the match is not a step."""
        match = self._step_pattern.search(text) if self._step_pattern else None
        if match is None or match.group(1) is None:
            return
        try:
            self._step = _whole_step(_number(match.group(1)), match.group(1), "step_pattern matched step")
        except StepError:
            self._step = None
            raise

    def _note_unread(self, shown: str) -> None:
        """Keep ``shown`` if it is the first line to give the objective a value in a form not read."""
        if (self._quality_named is not None and not self._unread and self._quality_name in shown
                and self._quality_named.search(shown)):
            self._unread[self._quality_name] = _short(shown, UNREAD_LINE_CHARS)

    def _match_patterns(self, text: str) -> _Parsed:
        found = []
        for name, pattern in self._patterns.items():
            match = pattern.search(text)
            if match and match.group(1) is not None:
                found.append((name, match.group(1)))
        return _split(found)

    def take_intermediate(self) -> list[tuple[int, Mapping[str, float]]]:
        """The intermediate reports (step, values) recorded since the last call, in order."""
        taken, self._taken = self._intermediate[self._taken:], len(self._intermediate)
        return taken

    def metrics(self) -> Metrics:
        """A snapshot of everything reported so far (see :class:`Metrics`)."""
        final = {key: value for key, value in self._last_step.items() if key not in self._invalid}
        final.update(self._final)
        invalid = {key: text for key, text in self._last_step_invalid.items() if key not in self._final}
        invalid.update(self._invalid)
        return Metrics(
            final=final,
            intermediate=tuple(self._intermediate),
            invalid=invalid,
            smac_status=self._smac_status,
            smac_extra=self._smac_extra,
            unread=dict(self._unread),
        )


def never_reported(metric: str, metrics: Metrics) -> str:
    """Why a trial that exited 0 has no ``metric``: ``{metric} was never reported``, and where a
    line gave it a value in a form not read, that line (cut short) and the forms that are read."""
    reason = f"{metric} was never reported"
    if metric not in metrics.unread:
        return reason
    read = json.dumps({metric: 0.25})
    if _PAIRS.fullmatch(f"{metric}=0.25"):
        read = f"{metric}=0.25 or {read},"
    return (f'{reason}; a line names it in a form hpo does not read: "{metrics.unread[metric]}" '
            f"(hpo reads {read} alone on a line)")


def parse_text(text: str, quality_name: str, patterns: Mapping[str, str] | None = None,
               step_pattern: str | None = None) -> Metrics:
    """Parse a whole output at once: a finished trial's log or a post-processing command's output
    (a line with a refused step is skipped, see :meth:`MetricParser.feed`).

    Args:
        text: the output.
        quality_name, patterns, step_pattern: as for :class:`MetricParser`.
    """
    parser = MetricParser(quality_name, patterns, step_pattern)
    for line in text.splitlines():
        with contextlib.suppress(StepError):
            parser.feed(line)
    return parser.metrics()


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")
_FRAME = re.compile(r'^\s+File "[^"]*", line \d+')
_TRACEBACK = "Traceback (most recent call last):"
_LAUNCHER_NOISE = re.compile(r"torch[/.]distributed[/.]elastic")
_SUMMARY_BORDER = re.compile(r"^(?:={20,}|-{20,})$")
_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|HIP out of memory|OutOfMemoryError|"
                  r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|Cuda failure 'out of memory'")
_ERROR_LINE = re.compile(
    r"^[\w.\-/]+: error: "  # argparse: "main.py: error: unrecognized arguments: ..."
    r"|^terminate called "  # a C++ exception that nothing caught
    r"|^(?:[\w.]+\.)?(?:[A-Z]\w*)?(?:Error|Exception|Interrupt)(?::|$)"  # an exception line without its traceback
    r"|can't open file|No such file or directory|command not found|: not found$")
_SIGNAL_LINE = re.compile(  # what a shell prints for a process that a signal ended
    r"^(?:.*:\s+)?(?:\d+\s+)?"
    r"(?:Killed|Segmentation fault|Bus error|Aborted|Floating point exception|Illegal instruction)\b")
_LOG_ERROR = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|^\W*(?:[Ee]rror|[Ff]atal)\b")
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*: ?(.*)$")


@dataclass(frozen=True)
class _ErrorLine:
    """A line that says why a trial failed: its text, the rank that printed it, how telling it is.

    Tier 1: an exception, a usage error, a C++ abort's message; 2: a shell's report of a
    signal (``Killed``); 3: a logged ``ERROR``.
    """

    text: str
    rank: int | None
    tier: int


@dataclass(frozen=True)
class _RootCause:
    """torchrun's "Root Cause (first observed failure)": the rank, its exit code and its error if shown."""

    rank: int | None
    exitcode: str
    error: str


def _clean(line: str) -> tuple[int | None, str]:
    text = _ANSI.sub("", line.rstrip("\r\n"))
    prefix = _RANK_PREFIX.match(text)
    return (int(prefix.group(1)), text[prefix.end():]) if prefix else (None, text)


def _is_summary_start(lines: Sequence[tuple[int | None, str]], index: int) -> bool:
    """Whether torchrun's failure summary begins at ``index`` (a tail may begin inside it)."""
    text = lines[index][1]
    if "ChildFailedError" in text or text.startswith(("Failures:", "Root Cause (first observed failure)")):
        return True
    following = lines[index + 1][1] if index + 1 < len(lines) else ""
    return bool(_SUMMARY_BORDER.match(text)) and following.endswith(" FAILED")


def _exception_lines(lines: Iterable[tuple[int | None, str]]) -> list[_ErrorLine]:
    """Every error line of ``lines``: the exception line that ends each traceback, and lines that read as errors.

    Tracebacks are followed per rank (a ``[rank1]:`` prefix), so interleaved ranks do not mix;
    a tail that begins inside a traceback is read from its first ``File`` frame.
    """
    in_traceback: dict[int | None, bool] = {}
    found: list[_ErrorLine] = []
    for rank, text in lines:
        if not text.strip() or _LAUNCHER_NOISE.search(text) or _SUMMARY_BORDER.match(text):
            continue
        if text.startswith(_TRACEBACK) or _FRAME.match(text):
            in_traceback[rank] = True
        elif in_traceback.get(rank):
            if not text[0].isspace():
                in_traceback[rank] = False
                found.append(_ErrorLine(text.strip(), rank, 1))
        elif text.lstrip().startswith("what():") and found and found[-1].text.startswith("terminate called"):
            what = text.lstrip()[len("what():"):].strip()
            found[-1] = _ErrorLine(f"{found[-1].text}: {what}", found[-1].rank, 1)
        elif _ERROR_LINE.search(text) or _OOM.search(text):
            found.append(_ErrorLine(text.strip(), rank, 1))
        elif _SIGNAL_LINE.search(text):
            found.append(_ErrorLine(text.strip(), rank, 2))
        elif _LOG_ERROR.search(text):
            found.append(_ErrorLine(text.strip(), rank, 3))
    return found


def _root_cause(summary: Sequence[tuple[int | None, str]]) -> _RootCause | None:
    """Read torchrun's failure summary (the lines from its ``ChildFailedError`` on), or None."""
    texts = [text for _, text in summary]
    starts = [i for i, text in enumerate(texts) if text.startswith("Root Cause")]
    if not starts:
        return None
    fields: dict[str, str] = {}
    trace: list[str] = []
    for text in texts[starts[-1] + 1:]:
        if _SUMMARY_BORDER.match(text):
            break
        field_match = _ROOT_FIELD.match(text) if "traceback" not in fields else None
        if field_match:
            fields[field_match.group(1)] = field_match.group(2).strip()
        elif "traceback" in fields:
            trace.append(text.removeprefix("  "))
    rank_text = fields.get("rank", "").split(" ")[0]
    message = fields.get("traceback", "")
    if message.startswith(_TRACEBACK):
        raised = _exception_lines((None, text) for text in [message, *trace])
        message = raised[-1].text if raised else ""
    elif message.startswith("To enable traceback"):
        message = ""
    return _RootCause(int(rank_text) if rank_text.isdigit() else None,
                      fields.get("exitcode", "?").split(" ")[0], message)


def _read_tail(lines: Sequence[str]) -> tuple[list[tuple[int | None, str]], list[_ErrorLine], _RootCause | None]:
    """A tail's cleaned lines before torchrun's failure summary, their error lines, and the summary's root cause."""
    cleaned = [_clean(line) for line in lines]
    split = next((i for i in range(len(cleaned)) if _is_summary_start(cleaned, i)), len(cleaned))
    return cleaned[:split], _exception_lines(cleaned[:split]), _root_cause(cleaned[split:])


def _last_plain_line(lines: Sequence[tuple[int | None, str]]) -> str:
    """The last line that stands on its own, unless it reports metrics; '' if none.

    Blank lines, bare progress bars, a launcher's log lines and indented lines (which continue
    the line above, as a warning's source line) are passed over; the text after a progress bar
    counts. A metric line as the last word means the output does not say why the trial failed.
    """
    for _, text in reversed(lines):
        shown = text.rpartition("\r")[2]
        if shown[:1].isspace() and not (_PROGRESS_BAR.match(shown) if "%|" in shown else None):
            continue
        shown = _after_progress(shown)
        if shown and not _LAUNCHER_NOISE.search(shown) and not _SUMMARY_BORDER.match(shown):
            return "" if shown.startswith(SMAC_PREFIXES) or _parse_formats(shown) is not None else shown
    return ""


def _short(text: str, limit: int = ERROR_LINE_CHARS) -> str:
    """``text`` on one line, its runs of white space made one space, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def last_error_line(lines: Sequence[str], *, or_last_line: bool = False) -> str:
    """The line of a trial's output that best says why it failed, cut to ~200 characters; '' if none.

    That is the exception line that ends a Python traceback (frames skipped), argparse's
    ``prog: error: ...`` or ``terminate called ...`` with its ``what()``; failing those, a
    shell's report of a signal (``Killed``); failing those, a logged ``ERROR``. Under torchrun
    it is the error of the rank that torchrun names as the root cause (the others' errors are
    usually consequences), else the root cause in torchrun's summary; torchrun's own
    traceback and log lines are skipped. The last such line wins. With ``or_last_line`` (for
    a non-zero exit), failing all those, the output's last line unless it reports metrics
    (``dataset shard missing`` printed before ``sys.exit(3)``), past progress bars and
    indented continuation lines.

    Args:
        lines: the last lines of the output (any tail; a traceback cut at its top still reads).
        or_last_line: fall back to the last line when no line reads as an error.
    """
    output, found, root = _read_tail(lines)
    tiers = [[line.text for line in found if line.tier == tier] for tier in (2, 3)]
    if root is None:
        groups = [[line.text for line in found if line.tier == 1], *tiers]
    else:
        groups = [[line.text for line in found if line.tier == 1 and line.rank == root.rank],
                  [root.error] if root.error else [],
                  [line.text for line in found if line.tier == 1 and line.rank is None], *tiers,
                  [f"rank {root.rank} exited with code {root.exitcode}"]]
    chosen = next((group[-1] for group in groups if group), "")
    if not chosen and or_last_line:
        chosen = _last_plain_line(output)
    return _short(chosen)


def out_of_gpu_memory(lines: Sequence[str]) -> str | None:
    """The line of CUDA's out-of-memory error in a trial's output (cut to ~200 characters), or None.

    Recognises ``torch.OutOfMemoryError: CUDA out of memory``, ``RuntimeError: CUDA out of
    memory``, ``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED`` (and cuDNN's, ROCm's
    and NCCL's), wherever they stand but in a traceback's source lines. Under torchrun the
    root-cause rank's line is preferred.

    Args:
        lines: the last lines of the output.
    """
    _, found, root = _read_tail(lines)
    errors = [line for line in found if _OOM.search(line.text)]
    own = [line.text for line in errors if root is not None and line.rank == root.rank]
    if own:
        return _short(own[-1])
    if root is not None and _OOM.search(root.error):
        return _short(root.error)
    return _short(errors[-1].text) if errors else None
