"""The output of the optimizer workers that ``hpo run --workers K`` starts.

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
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from hpo.render import full_disk

NOTICE_PREFIXES = ("hpo: ", "error: ")
ORPHANED = signal.SIGHUP
"""What a worker that hpo run started gets when hpo run dies (the parent-death signal): not the
SIGTERM that hpo run passes on while it lives, so that the worker knows to write its last lines
to its log itself (:meth:`PipeToRun.orphaned`)."""
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
        self._held: list[io.BufferedWriter] = []

    def claim(self, count: int) -> list[int]:
        """The numbers of this run's ``count`` workers: the first whose logs no other live hpo
        run holds (an flock on the log, held until :meth:`close` or this process's end), so that
        two runs of ``--workers`` in one workdir at once do not write into each other's logs
        (or give their workers the same seeds). A log that cannot be opened is taken as free."""
        numbers: list[int] = []
        number = 0
        while len(numbers) < count:
            try:
                log = self.path(number).open("ab", buffering=0)
            except OSError:
                numbers.append(number)
            else:
                try:
                    fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    log.close()
                else:
                    self._held.append(log)
                    numbers.append(number)
            number += 1
        return numbers

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
        for log in self._held:
            log.close()
        self._held.clear()
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
            lost = "; a trial it was running is judged lost once its heartbeat stops, and runs again" if code < 0 else ""
            with contextlib.suppress(OSError, SystemExit):
                say(f"hpo: worker-{index} {ended(code)} (its log: {logs.path(index)}){lost}")

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

    def add(self, proc: subprocess.Popen[bytes], number: int) -> None:
        """Relay ``proc``, worker ``number`` (:func:`relay`), from now on."""
        self.procs.append(proc)
        if proc.stdout:
            self.threads.append(relay(number, proc, self._logs, lambda line: self.say(line)))


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
    stops on the signal it gets then, recording its trials) or once hpo run is dying
    (:meth:`orphaned`) the lines are appended to ``log`` itself, where one is given, and a write
    that fails there too is dropped: it must not cut the worker's stop short. A line written
    just before hpo run dies may go into the pipe while it is still open, and be lost."""

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

    def orphaned(self) -> None:
        """hpo run is dying (:data:`ORPHANED`): write to the log from now on. Its pipe stays
        open until the last of its threads has died, and a line put into it meanwhile is
        never read."""
        self._stream = None
