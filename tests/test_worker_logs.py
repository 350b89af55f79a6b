"""In process: a worker that hpo run started writes its last lines to its log itself once hpo
run dies (:class:`hpo.worker_logs.PipeToRun`, the parent-death signal of :mod:`hpo.cli`)."""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from hpo.cli import _Signals
from hpo.worker_logs import ORPHANED, PipeToRun


def test_a_worker_whose_hpo_run_dies_says_its_stop_once_in_its_log_and_nothing_into_the_pipe(tmp_path: Path) -> None:
    """hpo run's pipe stays open until the last of its threads has died, and each thread's death
    signals the worker again: the first signal turns the output to the log before anything is
    said, the stop is made and said once, and the pipe, still open, receives nothing."""
    read, write = os.pipe()
    log = tmp_path / "worker-0.log"
    with os.fdopen(write, "w") as pipe:
        out = PipeToRun(pipe, log)
        stops: list[int] = []
        signals = _Signals(stops.append, notices=False, orphaned=out.orphaned)
        before = signal.getsignal(ORPHANED)  # SIG_IGN under nohup
        with contextlib.redirect_stderr(out), signals.installed():
            for _ in range(3):
                os.kill(os.getpid(), ORPHANED)
            code = signals.exit_code()
        assert signal.getsignal(ORPHANED) == before
    assert stops == [ORPHANED] and code == 128 + ORPHANED
    lines = log.read_text().splitlines()
    assert lines[0] == "hpo run is gone: ending running trials (they run again on resume)..."
    assert lines[1].startswith("interrupted: running trials were recorded INTERRUPTED") and len(lines) == 2
    with os.fdopen(read, "rb") as pipe_end:
        assert pipe_end.read() == b""  # its writer closed, and nothing in it


def test_without_orphaned_the_signal_is_left_alone_and_sigterm_is_said_by_name(tmp_path: Path) -> None:
    """``hpo run`` and ``hpo worker`` started by hand handle SIGINT and SIGTERM only."""
    log = tmp_path / "said.log"
    stops: list[int] = []
    signals = _Signals(stops.append, notices=True)
    before = signal.getsignal(ORPHANED)
    with log.open("w") as said, contextlib.redirect_stderr(said), signals.installed():
        assert signal.getsignal(ORPHANED) == before
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    assert stops == [signal.SIGTERM]
    assert log.read_text().splitlines() == ["hpo: SIGTERM: ending running trials (they run again on resume)...",
                                            "hpo: already stopping; running trials are being ended and recorded"]
