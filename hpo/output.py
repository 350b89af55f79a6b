"""What the commands print, where what receives it refuses it.

A sweep (``hpo run``, ``hpo worker``) whose stdout or stderr goes to a file or a pipe runs on
when the file's disk fills or the pipe's reader goes away: what is refused is dropped, said
once on the other stream, and counted in the file once it takes lines again
(:class:`DroppedWhenRefused`). The other commands print a result a user waits for: a stdout
that refuses it ends them with one line, ``error: cannot write to stdout: ...``
(:class:`StdoutRefused`, raised by :func:`refusals_raised`); a closed pipe (``| head``) ends
them with exit 0, as elsewhere.
"""
from __future__ import annotations

import contextlib
import io
import os
import stat
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from hpo.storage import disk_full


class DroppedWhenRefused(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` of a sweep whose output goes to a file or a pipe
    (``hpo run ... > run.log``, ``hpo run ... | head``): what the file's disk refuses (full, a
    quota) is dropped, and so is everything once the pipe's reader has gone, so that the sweep
    runs on, and records every trial, without the lines it would have shown. The first refusal
    is said on :attr:`other`, the sweep's other stream; once a file takes lines again, it is told
    how many were dropped there. Each write goes out at once, unbuffered, so that nothing
    refused waits in a buffer to be written out of turn later. Safe to call from several threads."""

    def __init__(self, stream: TextIO, name: str, other: TextIO) -> None:
        with contextlib.suppress(OSError):
            stream.flush()
        self._fd = stream.fileno()
        self._tty = stream.isatty()
        self._encoding = stream.encoding
        self._name = name
        self.other = other
        self._lock = threading.Lock()
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
        with self._lock:
            said = self._write(text)
        if said:
            with contextlib.suppress(OSError):
                self.other.write(said + "\n")
                self.other.flush()
        return len(text)

    def _write(self, text: str) -> str | None:
        """Write ``text``, or drop it; the line to say on the other stream, if any."""
        if self._closed:
            return None
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
            return (f"hpo: the reader of {self._name} has gone: what this sweep prints is dropped from now on; "
                    "it runs on and records every trial (hpo status shows them)")
        except OSError as exc:
            if not disk_full(exc):
                raise
            first = not self._dropped
            if written >= len(note):  # the note is in the file: what it counted is told
                self._dropped = 0
            self._line_begun = not data[:written].endswith(b"\n") if written else self._line_begun
            unwritten = own[max(0, written - len(note)):]
            self._dropped += max(int(bool(unwritten)), unwritten.count(b"\n"))  # a line cut short counts
            return (f"hpo: {self._name} refuses what this sweep prints ({exc.strerror or exc}): its lines are "
                    "dropped meanwhile; the sweep runs on and records every trial") if first else None
        self._dropped, self._line_begun = 0, False
        return None


@contextlib.contextmanager
def output_dropped_when_refused() -> Iterator[None]:
    """Within, stdout and stderr, where they go to a file or a pipe (not a terminal), are
    :class:`DroppedWhenRefused`, each telling the other (through it) what the first refused."""
    out, err = sys.stdout, sys.stderr
    new_out = DroppedWhenRefused(out, "stdout", err) if _file_or_pipe(out) else out
    new_err = DroppedWhenRefused(err, "stderr", out) if _file_or_pipe(err) else err
    for stream, other in ((new_out, new_err), (new_err, new_out)):
        if isinstance(stream, DroppedWhenRefused):
            stream.other = other
    sys.stdout, sys.stderr = new_out, new_err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


class StdoutRefused(OSError):
    """What a command printed, stdout refused (its disk is full, ``> /dev/full``)."""


class _Refusing(io.TextIOBase):
    """``stdout`` whose refusals for a full disk are :class:`StdoutRefused` (a broken pipe
    stays a BrokenPipeError)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    @property
    def buffer(self) -> _RefusingBuffer:
        return _RefusingBuffer(self._stream.buffer)  # type: ignore[attr-defined]

    def write(self, text: str) -> int:
        with _raised():
            return self._stream.write(text)

    def flush(self) -> None:
        with _raised():
            self._stream.flush()


class _RefusingBuffer:
    """The bytes under :class:`_Refusing` (``hpo tail`` writes a log's bytes as they are)."""

    def __init__(self, buffer: io.BufferedIOBase) -> None:
        self._buffer = buffer

    def write(self, data: bytes) -> int:
        with _raised():
            return self._buffer.write(data)

    def flush(self) -> None:
        with _raised():
            self._buffer.flush()


@contextlib.contextmanager
def _raised() -> Iterator[None]:
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        if disk_full(exc):
            raise StdoutRefused(exc.errno, exc.strerror) from None
        raise


@contextlib.contextmanager
def refusals_raised() -> Iterator[None]:
    """Within, what stdout refuses for a full disk raises :class:`StdoutRefused`, flushed at
    the end so that nothing refused waits for the interpreter's own flush at exit."""
    out = sys.stdout
    sys.stdout = _Refusing(out)
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = out


def _file_or_pipe(stream: TextIO) -> bool:
    try:
        mode = os.fstat(stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
    return stat.S_ISREG(mode.st_mode) or stat.S_ISFIFO(mode.st_mode) or \
        (stat.S_ISCHR(mode.st_mode) and mode.st_rdev == os.makedev(1, 7))  # /dev/full stands for a full disk
