"""Launching trials: task slots, their GPUs, the argument list, and the process itself.

Each of ``resources.parallel`` slots owns ``gpus_per_trial`` GPUs (exported as
``CUDA_VISIBLE_DEVICES``); without GPUs a slot runs ``gpus_per_trial`` CPU processes. A
trial's command is an argument list, never a shell string; under torchrun it becomes
``python -m torch.distributed.run --standalone --nproc-per-node N script ...``. The process
runs in its own session; on timeout, stop or interrupt the whole tree is killed, and every
process carries ``HPO_TRIAL_TOKEN`` so that orphans of a killed sweep can be found.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

from hpo.errors import InputError
from hpo.scenario import Resources

TOKEN_ENV = "HPO_TRIAL_TOKEN"
GPU_ENV = "HPO_GPUS"
PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")
KILL_GRACE_S = 5.0
POLL_S = 0.05


@dataclass(frozen=True)
class Slot:
    """A task slot: its GPUs (empty on CPU), processes per trial, threads per process."""

    index: int
    gpus: tuple[int, ...]
    processes: int
    threads: int


def detect_gpus() -> tuple[int, ...]:
    """GPU ids of this machine: ``HPO_GPUS`` if set (e.g. ``0,1`` or empty), else nvidia-smi."""
    forced = os.environ.get(GPU_ENV)
    if forced is not None:
        return tuple(int(part) for part in forced.replace(" ", "").split(",") if part)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(int(line) for line in out.split() if line.strip().isdigit())


def plan_slots(resources: Resources, gpus: Sequence[int], cpu_count: int | None = None) -> tuple[Slot, ...]:
    """Split the GPUs (``resources.gpus`` or those detected) between the task slots."""
    ids = tuple(resources.gpus) if resources.gpus is not None else tuple(gpus)
    per_trial = resources.gpus_per_trial
    if ids:
        if len(ids) < per_trial:
            raise InputError(f"resources.gpus_per_trial: {per_trial} GPUs per trial, but this machine has "
                             f"{len(ids)} GPU{'s' if len(ids) != 1 else ''}")
        count = min(resources.parallel, len(ids) // per_trial)
        return tuple(Slot(i, ids[i * per_trial:(i + 1) * per_trial], per_trial, 1) for i in range(count))
    cpus = cpu_count or os.cpu_count() or 1
    threads = max(1, cpus // (resources.parallel * per_trial))
    return tuple(Slot(i, (), per_trial, threads) for i in range(resources.parallel))


def build_argv(command: Sequence[str], params: Mapping[str, Any], flags: bool,
               processes: int, torchrun: bool) -> list[str]:
    """The trial's argument list: ``python`` is this interpreter; flags append ``--name value``."""
    argv = list(command)
    if Path(argv[0]).name in PYTHON_NAMES:
        argv[0] = sys.executable
    if flags:
        for name, value in params.items():
            argv += [f"--{name}", str(value)]
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes), "--no-python", *argv]
    return argv


def trial_env(slot: Slot, token: str, extra: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial's processes on ``slot``."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env.update({TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(slot.threads),
                "HPO_SLOT": str(slot.index)})
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot.gpus)) if slot.gpus else ""
    return env


@dataclass(frozen=True)
class ProcessResult:
    """How a trial's process ended: exit code, what ended it early (if anything), seconds."""

    exit_code: int
    ended_by: str | None
    duration_s: float
    pid: int


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launching thread's process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a finished trial's process group (stray background work)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_all(procs: Sequence[psutil.Process], kill: bool) -> None:
    for proc in procs:
        try:
            proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            pass


def kill_tree(pid: int, grace_s: float = KILL_GRACE_S, child: subprocess.Popen[bytes] | None = None) -> None:
    """Terminate ``pid``, its process group and every descendant; SIGKILL after ``grace_s``.

    Pass ``child`` when ``pid`` is our own child, so that its Popen object reaps it (and
    keeps its exit code) rather than psutil.
    """
    try:
        root = psutil.Process(pid)
        others = root.children(recursive=True) + ([] if child is not None else [root])
    except psutil.NoSuchProcess:
        others = []
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    _signal_all(others, kill=False)
    if child is not None:
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    _, alive = psutil.wait_procs(others, timeout=grace_s)
    _signal_all(alive, kill=True)
    psutil.wait_procs(alive, timeout=grace_s)
    _kill_group(pid)


def kill_by_token(token: str) -> int:
    """Kill every process of this user whose environment carries ``token``; return how many."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TOKEN_ENV) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for proc in found:
        kill_tree(proc.pid, grace_s=2.0)
    return len(found)


def run_process(argv: Sequence[str], cwd: Path, env: Mapping[str, str], log_path: Path,
                timeout: float | None, on_line: Callable[[str], None],
                should_end: Callable[[], str | None]) -> ProcessResult:
    """Run ``argv`` in ``cwd``; stream its output to ``log_path`` and ``on_line``.

    ``should_end`` is polled while it runs: a non-None answer (e.g. ``"stopped"``) ends the
    process tree and becomes ``ended_by``, as does ``"timeout"``. The tree is always killed
    before this returns, so no trial process outlives it.
    """
    start = time.monotonic()
    with log_path.open("ab", buffering=0) as log:
        try:
            proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            log.write(f"hpo: cannot start {argv[0]}: {exc.strerror}\n".encode())
            return ProcessResult(127, f"cannot start {argv[0]}: {exc.strerror}", 0.0, -1)
        reader = threading.Thread(target=_pump, args=(proc, log, on_line), daemon=True)
        reader.start()
        ended_by: str | None = None
        try:
            while ended_by is None:
                reader.join(timeout=POLL_S)
                if proc.poll() is not None:
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    ended_by = "timeout"
                else:
                    ended_by = should_end()
        except BaseException:
            ended_by = "interrupted"
            raise
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid, child=proc)
            else:
                _kill_group(proc.pid)
            reader.join(timeout=KILL_GRACE_S)
    return ProcessResult(proc.returncode, ended_by, time.monotonic() - start, proc.pid)


def _pump(proc: subprocess.Popen[bytes], log: Any, on_line: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        log.write(raw)
        try:
            on_line(raw.decode("utf-8", errors="replace"))
        except Exception as exc:  # a bad callback must not stop the log
            log.write(f"hpo: could not handle an output line: {exc}\n".encode())
