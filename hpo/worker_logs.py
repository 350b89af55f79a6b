"""The output of the optimizer workers that ``hpo run --workers K`` starts, and of a sweep.

Each worker writes to a pipe that hpo run reads (:func:`relay`): every line goes to the
worker's log, ``<workdir>/worker-N.log`` (:class:`WorkerLogs`), and its notices, the lines
that begin ``hpo: `` or ``error: `` (what it waits for, what went wrong), reach the user's
screen too, marked with the worker's name (``hpo: worker-1: no Dask worker ...``).

A log whose disk is full is no fault of the sweep, and stops no worker: its lines wait in
memory (the newest :data:`UNWRITTEN_BYTES` of each worker's) and are written once there is room, said in one line when the first is refused and in
one more when all are written again; any still unwritten when hpo run ends are said in one
line. hpo run reads its workers' output until they end (:func:`relaying`), so that their last
lines are kept even where it stops for an error of its own; a worker whose hpo run is gone
(killed) goes on stopping as the signal it gets then asks, appending its last lines to its log
itself (:class:`PipeToRun`).

The sweep's own output, redirected to a file or a pipe, is no more fatal on a full disk or when
the pipe's reader has gone: what is refused is dropped (and counted, in a file), the sweep runs on
(:class:`DroppedWhenRefused`).
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from hpo.render import full_disk
from hpo.storage import disk_full

NOTICE_PREFIXES = ("hpo: ", "error: ")
WORKERS_STOP_S = 60.0  # how long hpo run, stopping for an error of its own, waits for its workers to stop
UNWRITTEN_BYTES = 1 << 20  # the most of a worker's output kept in memory while its log's disk is full
DRAIN_S = 5.0  # how long the output of a worker that ended is read on (a process it started may hold it open)


class WorkerLogs:
    """The logs of the workers of one ``hpo run``, in ``folder``, appended to line by line.

    Safe to call from one thread per worker."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._lock = threading.Lock()
        self._unwritten: dict[int, bytes] = {}
        self._dropped = 0
        self._full = False

    def path(self, index: int) -> Path:
        """The log of worker ``index``: ``<folder>/worker-<index>.log``."""
        return self._folder / f"worker-{index}.log"

    def write(self, index: int, data: bytes) -> str | None:
        """Append ``data`` to worker ``index``'s log, after its lines that waited for room; what
        to say of the disk, if anything: that it is full (said once) or that the logs can be
        written again. Raises OSError for any other failure to write."""
        path = self.path(index)
        with self._lock:
            data = self._unwritten.pop(index, b"") + data
            try:
                with path.open("ab", buffering=0) as log:
                    while data:
                        data = data[log.write(data):]  # a write may take part of it
            except OSError as exc:
                full = full_disk(path, exc)
                if full is not None and len(data) > UNWRITTEN_BYTES:  # the oldest lines go first
                    self._dropped += len(data) - UNWRITTEN_BYTES
                    data = data[-UNWRITTEN_BYTES:]
                self._unwritten[index] = data
                if full is None:
                    raise
                told, self._full = self._full, True
                return None if told else f"hpo: {full}; the workers' output waits for room (the sweep goes on)"
            if not self._full or self._unwritten:
                return None
            self._full = False
            dropped, self._dropped = self._dropped, 0
            lost = f" ({dropped} bytes of their output, the oldest, could not wait: they are not in them)" \
                if dropped else ""
            return f"hpo: the worker logs in {self._folder} can be written again{lost}"

    def close(self) -> str | None:
        """Write what waited for room, where there is some now; what to say of the disk, if
        anything: as :meth:`write` says, or that lines are still unwritten."""
        said = None
        for index in list(self._unwritten):
            said = self.write(index, b"")
        if not self._unwritten:
            return said
        names = ", ".join(self.path(index).name for index in sorted(self._unwritten))
        return f"hpo: the last lines of {names} could not be written: the disk is still full"


def notice(index: int, line: str) -> str | None:
    """``line`` of worker ``index`` as hpo run shows it where it is a notice (``hpo: X`` as
    ``hpo: worker-1: X``), else None."""
    for prefix in NOTICE_PREFIXES:
        if line.startswith(prefix):
            return f"{prefix}worker-{index}: {line[len(prefix):].rstrip()}"
    return None


def ended(code: int) -> str:
    """How a worker process with exit status ``code`` ended, in words (``was killed by SIGKILL``)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"ended with exit code {code}"


STOPPED_CODES = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)
"""Exit statuses of a worker that ended as asked (its sweep's end, a Ctrl-C or SIGTERM passed on)."""


def relay(index: int, proc: subprocess.Popen[bytes], logs: WorkerLogs, say: Callable[[str], None]) -> threading.Thread:
    """Start a thread that writes each line of worker ``index``'s output (``proc``'s stdout) to
    its log and says its notices (:func:`notice`) and what the log's disk is like, until the
    output ends; then, where the worker ended otherwise than asked (:data:`STOPPED_CODES`: it
    was killed, or failed), says so at once. A log that cannot be written for another reason is
    said once, and left alone."""
    output = proc.stdout
    assert output is not None

    def pump() -> None:
        logged = True
        for raw in iter(output.readline, b""):
            disk = None
            if logged:
                try:
                    disk = logs.write(index, raw)
                except OSError as exc:  # the output is still read: a worker whose pipe fills up would block
                    logged = False
                    disk = f"hpo: cannot write {logs.path(index)}: {exc.strerror or exc}; worker-{index}'s output is " \
                           "not logged"
            for line in filter(None, (disk, notice(index, raw.decode(errors="replace")))):
                with contextlib.suppress(OSError, SystemExit):  # the screen is gone (rich exits on a closed pipe)
                    say(line)
        code = proc.wait()
        if code not in STOPPED_CODES:
            with contextlib.suppress(OSError, SystemExit):
                say(f"hpo: worker-{index} {ended(code)} (its log: {logs.path(index)}); the other workers run on, and "
                    "a trial it was running is judged lost once its heartbeat stops, and runs again")

    thread = threading.Thread(target=pump, name=f"hpo-worker-{index}-output", daemon=True)
    thread.start()
    return thread


class Relays:
    """The relays of the workers of one hpo run (:func:`relaying`): each worker's output is
    read from the moment it is added, so that none blocks on a full pipe while hpo run starts
    the others or first reads the store. ``say`` may be replaced (by the progress view's,
    once it shows); each line is said through the one set then."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: WorkerLogs, say: Callable[[str], None]) -> None:
        self.procs = procs
        self.say = say
        self._logs = logs
        self.threads: list[threading.Thread] = []

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        """Relay ``proc``, the next worker (:func:`relay`), from now on."""
        self.procs.append(proc)
        if proc.stdout:
            self.threads.append(relay(len(self.procs) - 1, proc, self._logs, lambda line: self.say(line)))


@contextlib.contextmanager
def relaying(procs: list[subprocess.Popen[bytes]], logs: WorkerLogs, say: Callable[[str], None]) -> Iterator[Relays]:
    """Relay the output of the worker processes added to the :class:`Relays` (and to ``procs``)
    through the block and on until they end, so that their last lines are logged and said too.
    Where the block raised (hpo run stops for an error of its own, or a worker could not
    start), they are sent SIGTERM first, as they would be once hpo run is gone, and waited for
    up to :data:`WORKERS_STOP_S`."""
    relays = Relays(procs, logs, say)
    try:
        yield relays
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        raise
    finally:
        deadline = time.monotonic() + WORKERS_STOP_S
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for thread in relays.threads:
            thread.join(DRAIN_S)
        said = logs.close()
        if said:
            relays.say(said)


class PipeToRun(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a worker that hpo run started: ``stream``, the pipe
    that hpo run reads (:func:`relay`), each write sent at once (its lines reach the log and
    the screen as they are said). Once that pipe is broken (hpo run was killed: the worker
    stops on the signal it gets then, recording its trials) the lines are appended to ``log``
    itself, where one is given, and a write that fails there too is dropped: it must not cut
    the worker's stop short. A line written as hpo run dies may go into the pipe while it is
    still open, and be lost."""

    def __init__(self, stream: TextIO, log: Path | None = None) -> None:
        self._stream: TextIO | None = stream
        self._log = log
        self._fileno = stream.fileno()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                self._stream.write(text)
                self._stream.flush()
                return len(text)
            except BrokenPipeError:
                self._stream = None
        if self._log is not None:
            with contextlib.suppress(OSError), self._log.open("a") as log:
                log.write(text)
        return len(text)

    def fileno(self) -> int:
        return self._fileno


class DroppedWhenRefused(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a sweep whose output goes to a file or a pipe
    (``hpo run ... > run.log``, ``hpo run ... | head``): what the file's disk refuses (full, a
    quota) is dropped, and so is everything once the pipe's reader has gone, so that the sweep
    runs on, and records every trial, without the lines it would have shown. The first refusal
    is said on ``other``, the sweep's other stream; once a file takes lines again, it is told
    how many were dropped there. Each write goes out at once, unbuffered, so that nothing
    refused waits in a buffer to be written out of turn later."""

    def __init__(self, stream: TextIO, name: str, other: TextIO) -> None:
        with contextlib.suppress(OSError):
            stream.flush()
        self._fd = stream.fileno()
        self._tty = stream.isatty()
        self._encoding = stream.encoding
        self._name = name
        self._other = other
        self._dropped = 0
        self._line_begun = False  # a refused write left part of a line in the file
        self._closed = False  # the pipe's reader is gone: nothing more is written

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._tty

    def fileno(self) -> int:
        return self._fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding

    def write(self, text: str) -> int:
        if self._closed:
            return len(text)
        own = text.encode(self._encoding, "replace")
        note = b""
        if self._dropped:
            note = (b"\n" if self._line_begun else b"") + \
                f"hpo: {self._dropped} lines were dropped here while the disk was full\n".encode()
        data, written = note + own, 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except BrokenPipeError:
            self._closed = True
            self._say(f"hpo: the reader of {self._name} has gone: what this sweep prints is dropped from now on; "
                      "it runs on and records every trial (hpo status shows them)")
            return len(text)
        except OSError as exc:
            if not disk_full(exc):
                raise
            if not self._dropped:
                self._say(f"hpo: {self._name} refuses what this sweep prints ({exc.strerror or exc}): its lines are "
                          "dropped meanwhile; the sweep runs on and records every trial")
            self._line_begun = not data[:written].endswith(b"\n") if written else self._line_begun
            unwritten = own[max(0, written - len(note)):]
            self._dropped += max(int(bool(unwritten)), unwritten.count(b"\n"))  # a line cut short counts
            return len(text)
        self._dropped, self._line_begun = 0, False
        return len(text)

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError):
            self._other.write(line + "\n")
            self._other.flush()


@contextlib.contextmanager
def output_dropped_when_refused() -> Iterator[None]:
    """Within, stdout and stderr, where they go to a file or a pipe (not a terminal), are
    :class:`DroppedWhenRefused`."""
    out, err = sys.stdout, sys.stderr
    if _file_or_pipe(out):
        sys.stdout = DroppedWhenRefused(out, "stdout", err)
    if _file_or_pipe(err):
        sys.stderr = DroppedWhenRefused(err, "stderr", out)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def _file_or_pipe(stream: TextIO) -> bool:
    try:
        fd = stream.fileno()
        return written_to_disk(fd) or stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


def written_to_disk(fd: int) -> bool:
    """Whether what is written to ``fd`` goes to a disk that may fill: a file, or /dev/full
    (which stands for one)."""
    try:
        mode = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISREG(mode.st_mode) or _dev_full(mode)


def full_where_written(fd: int) -> bool:
    """Whether ``fd`` is a file on a disk with no room left, or /dev/full."""
    try:
        mode = os.fstat(fd)
        return _dev_full(mode) or (stat.S_ISREG(mode.st_mode) and os.fstatvfs(fd).f_bavail == 0)
    except OSError:
        return False


def _dev_full(mode: os.stat_result) -> bool:
    return stat.S_ISCHR(mode.st_mode) and mode.st_rdev == os.makedev(1, 7)
