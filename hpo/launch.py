"""Launching trials: task slots, their GPUs, the argument list, and the process itself.

Each of ``resources.parallel`` slots owns ``gpus_per_trial`` GPUs, or a share of one
(exported as ``CUDA_VISIBLE_DEVICES``); without GPUs a slot runs CPU processes. Threads (of
the cores this process may run on) are divided among all the slots of the machine, whichever
worker process owns them. A trial's command is an argument list, never a shell string;
without torchrun it is one process, under torchrun it becomes
``python -m torch.distributed.run --standalone --nproc-per-node N script ...``. The process
runs in its own session; its output is logged as it comes and handed on in order, every
line of it before the run returns; on timeout, stop, prune, interrupt or a log that cannot be
written the whole tree is killed, with one grace for all of it: SIGTERM to every process at
once, SIGKILL to those still running :data:`KILL_GRACE_S` later. Every process carries
``HPO_TRIAL_TOKEN``: those that left the tree (``setsid``) are killed with it, or once the
trial's process has ended by itself, as are orphans of a killed sweep.
"""
from __future__ import annotations

import ctypes
import difflib
import errno
import itertools
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hpo.errors import ExecutorUnavailable, InputError
from hpo.render import full_disk
from hpo.scenario import Resources, Scenario

TOKEN_ENV = "HPO_TRIAL_TOKEN"
GPU_ENV = "HPO_GPUS"
PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")
KILL_GRACE_S = 5.0
"""Seconds a trial's process tree has to exit after SIGTERM before SIGKILL (:func:`kill_tree`)."""
MACHINE_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN)
"""Errors of a refused start that are a limit of the machine or of hpo's shell, not the trial's
fault: the sweep stops, and the trial runs again on resume."""
POLL_S = 0.05
QUEUED_LINES = 10_000  # output lines read ahead of their handling, at most
HANDED_LINES = 16  # lines handed over at once, at most: whether the process still runs is asked as often


@dataclass(frozen=True)
class Slot:
    """A task slot: its GPUs (empty on CPU), processes per trial, threads per process.

    ``share`` is how many slots share each of ``gpus`` (a fraction ``1/share`` of a GPU).
    """

    index: int
    gpus: tuple[int, ...]
    processes: int
    threads: int
    share: int = 1

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> Slot:
        """The slot of ``asdict(slot)``, as an event carries it (its GPUs a list)."""
        return cls(**{**fields, "gpus": tuple(fields["gpus"])})

    def describe(self) -> str:
        """``2 processes on GPUs 0,1`` / ``1 process on 1/4 of GPU 0`` / ``2 CPU processes``."""
        what = plural(self.processes, "process")
        if not self.gpus:
            return f"{plural(self.processes, 'CPU process')} of {plural(self.threads, 'thread')}"
        ids = ",".join(map(str, self.gpus))
        if self.share > 1:
            return f"{what} on 1/{self.share} of GPU {ids}"
        return f"{what} on GPU{'s' if len(self.gpus) > 1 else ''} {ids}"


def gpu_ids(text: str, field: str) -> tuple[int, ...]:
    """The GPU ids of a comma-separated list (``0,1``; empty: none); InputError naming ``field``
    for anything but distinct whole numbers of 0 or more, in ASCII digits."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise InputError(f"{field}: {text!r} is not a comma-separated list of GPU ids (whole numbers, e.g. 0,1)")
    ids = tuple(int(part) for part in parts)
    if len(set(ids)) < len(ids):
        raise InputError(f"{field}: GPU ids must be unique, got {text}")
    return ids


def detect_gpus() -> tuple[int, ...]:
    """GPU ids of this machine: ``HPO_GPUS`` if set (e.g. ``0,1`` or empty), else nvidia-smi."""
    forced = os.environ.get(GPU_ENV)
    if forced is not None:
        return gpu_ids(forced, GPU_ENV)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(int(line) for line in out.split() if line.isascii() and line.isdigit())


def gpus_known(gpus: Sequence[int]) -> bool:
    """Whether ``gpus`` (:func:`detect_gpus`'s answer) are all the GPUs hpo may use: it names
    some, or ``HPO_GPUS`` is set (empty: none). Where neither, nvidia-smi may be missing, and
    ``resources.gpus`` says what there is."""
    return bool(gpus) or GPU_ENV in os.environ


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (``taskset``, a cgroup's cpuset, a
    batch job's allocation) where the system tells it, else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plural(count: int, word: str) -> str:
    """``1 GPU``, ``2 GPUs``, ``2 processes``."""
    return f"{count} {word}{('es' if word.endswith('s') else 's') if count != 1 else ''}"


def env_threads(env: Mapping[str, str]) -> int | None:
    """The threads per process that a scenario's ``env`` gives its trials with
    ``OMP_NUM_THREADS`` (of a nested list such as ``4,2``, the outer 4); None where it sets
    no whole number of 1 or more."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def plan_slots(resources: Resources, gpus: Sequence[int], cpu_count: int | None = None,
               at_least: int = 1, gpus_field: str = "resources.gpus", threads: int | None = None) -> tuple[Slot, ...]:
    """The machine's task slots: GPUs (``resources.gpus`` or those detected), processes and
    threads divided among all of them.

    ``gpus`` are the machine's (:func:`detect_gpus`); ``resources.gpus`` must be among them
    where they are known (:func:`gpus_known`). ``cpu_count`` defaults to :func:`usable_cores`.
    A trial's processes are :attr:`Resources.gpus_and_processes`' (one under ``torchrun:
    false``), and its threads take the cores of its slot. ``at_least`` slots are planned even
    where ``parallel`` is ``auto`` or left out (``--workers K`` gives each worker a slot), up
    to the cores on a machine without GPUs. An InputError names the setting that cannot be met,
    a number given for ``parallel`` below ``at_least`` included (``gpus_field``: where
    ``resources.gpus`` came from, e.g. ``--gpus``). ``threads`` per process, where given
    (the scenario's ``env``: :func:`env_threads`), replace the division.
    """
    ids = tuple(resources.gpus) if resources.gpus is not None else tuple(gpus)
    cpus = cpu_count or usable_cores()
    wanted = resources.parallel
    share = resources.share
    per_trial, processes = resources.gpus_and_processes
    given = wanted if "parallel" in resources.model_fields_set and wanted != "auto" else None  # a number set
    if ids:
        if resources.gpus_per_trial == "auto":
            per_trial = min(per_trial, len(ids))
            processes = min(processes, per_trial)
        if len(ids) < per_trial:
            where = f"{gpus_field} names" if resources.gpus is not None else "this machine has"
            raise InputError(f"resources.gpus_per_trial: {per_trial} GPUs per trial, but {where} "
                             f"{plural(len(ids), 'GPU')} (gpus_per_trial: auto uses what there is)")
        absent = [gpu for gpu in ids if gpu not in gpus]
        if absent and gpus_known(gpus):
            has = f"it has GPUs {','.join(map(str, gpus))}; {GPU_ENV} overrides what nvidia-smi shows" if gpus \
                else f"it has none: {GPU_ENV} is empty"
            raise InputError(f"{gpus_field}: GPU {absent[0]} is not on this machine ({has})")
        room = len(ids) // per_trial * share
        count = room if wanted == "auto" else min(max(wanted, at_least), room)
        if count < at_least:
            raise InputError(f"--workers {at_least}: this machine runs {plural(room, 'trial')} at a time "
                             f"({plural(len(ids), 'GPU')}, gpus_per_trial {resources.gpus_per_trial}); "
                             f"{_more_at_once(resources, len(ids), at_least, room)}")
        parallel_allows(given, at_least)
        groups = [ids[i * per_trial:(i + 1) * per_trial] for i in range(len(ids) // per_trial)]
        assigned = [groups[i % len(groups)] for i in range(count)]
    else:
        parallel_allows(given, at_least)
        if given is None and at_least > cpus:
            raise InputError(f"--workers {at_least}: hpo may run on {plural(cpus, 'core')} here, and each worker runs "
                             f"at least one trial at a time; use --workers {cpus} or fewer, or set resources.parallel "
                             "to the trials to run at once")
        count = max(at_least, cpus // processes) if wanted == "auto" else max(wanted, at_least)
        assigned = [()] * count
    threads = threads or max(1, cpus // (count * processes))
    return tuple(Slot(i, tuple(group), processes, threads, share if ids else 1) for i, group in enumerate(assigned))


def parallel_allows(parallel: int | None, workers: int) -> None:
    """Raise InputError where the scenario gives ``parallel`` (None: ``auto`` or left out) as
    fewer trials at once than ``workers`` (``--workers``), each of which runs at least one."""
    if parallel is not None and workers > parallel:
        raise InputError(f"--workers {workers}: resources.parallel is {parallel}, and each worker runs at least one "
                         f"trial at a time; use --workers {parallel} or fewer, or raise resources.parallel")


def _more_at_once(resources: Resources, gpus: int, wanted: int, room: int) -> str:
    """How ``wanted`` trials could run at once on ``gpus`` GPUs that run ``room``: one GPU per
    trial (one process: ``processes_per_trial: 1``), where that is enough; else a (smaller)
    fraction of a GPU per trial, where a trial may take one (one process, not under
    ``torchrun: true``, k of 1/k at most 16); else, or besides, fewer workers."""
    fewer = f"give --workers {room} at most"
    share = -(-wanted // gpus)
    processes = resources.processes_per_trial or 1
    if share == 1:
        setting = "processes_per_trial: 1" if resources.gpus_per_trial == "auto" and processes > 1 \
            else "gpus_per_trial: 1"
        return f"{setting} would run {plural(gpus, 'trial')} at a time, or {fewer}"
    if resources.torchrun is True:
        return f"{fewer} (a share of a GPU per trial is not for torchrun: true)"
    if processes > 1:
        return f"{fewer} (a share of a GPU per trial runs one process, not processes_per_trial: {processes})"
    if share > 16:
        return fewer
    smaller = "a smaller fraction, " if resources.share > 1 else ""
    return f"{smaller}gpus_per_trial: {1 / share:.3g} would run {share} trials on each GPU, or {fewer}"


def uses_torchrun(resources: Resources, slot: Slot) -> bool:
    """Whether the slot's trials run under torchrun (``auto``: when a trial has several processes)."""
    return slot.processes > 1 if resources.torchrun == "auto" else bool(resources.torchrun)


def flag_args(scenario: Scenario, values: Mapping[str, Any], seed: int | None = None) -> list[str]:
    """The command-line flags of a trial's values.

    Every active parameter is passed when ``flags: true``, and a parameter with its own
    ``flag`` always; its flag is that ``flag`` or the name in ``flag_style`` (``--name value``,
    ``--name=value`` or ``-name value``). A value that starts with ``-`` (``-6.4e-05``, a
    choice ``-x``) is joined to a ``--`` flag (``--name=-6.4e-05``), as every parser of long
    options reads it (argparse, getopt_long, click): on its own argparse would take it for a
    flag. A parameter whose every value is true or false is a switch: present when true, absent
    when false; a true or false among other choices is a value (``--cm true``). With
    ``seed_flag`` set, ``seed`` (the trial's seed) is passed under it.
    """
    joined = scenario.flag_style == "--name=value"
    out: list[str] = []

    def add(flag: str, value: Any, switch: bool = False) -> None:
        if switch:
            out.extend([flag] if value else [])
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out.extend([f"{flag}={text}"] if joined or (text.startswith("-") and flag.startswith("--"))
                       else [flag, text])

    for name, value in values.items():
        flag = scenario.flag_of(name)
        if flag is not None:
            add(flag, value, isinstance(value, bool) and _switch(scenario.parameters.get(name)))
    if scenario.seed_flag and seed is not None:
        add(scenario.seed_flag, seed)
    return out


def _switch(param: Any) -> bool:
    """Whether ``param`` (None: not the scenario's) takes only true and false."""
    if param is None or param.choices is None:
        return True  # a constant true or false, or a value the scenario does not name
    return all(isinstance(choice, bool) for choice in param.choices)


def check_command(command: Sequence[str], files: Sequence[str], field: str = "command",
                  unexecutable: Collection[str] = ()) -> None:
    """Raise InputError naming ``field`` unless ``command`` can run in the trial folder.

    Its program must be ``python`` (this interpreter), a name on PATH, or a path to a file of
    the trial folder (``./run.sh``) that is not one of ``unexecutable`` (those without the
    execute bit) or an existing executable absolute path; the script it runs (what
    ``python`` runs, else the first ``.py`` argument without whitespace that is not a ``-c``
    string) must be a file of the trial folder or an existing absolute path. ``files`` are
    the trial folder's files before the run.
    """
    program = command[0]
    if Path(program).name in PYTHON_NAMES:
        script = _python_script(command[1:])
    else:
        if "/" in program and not _exists(program, files):
            raise InputError(f"{field}: program {program} is neither a file of the trial folder nor an existing path")
        if "/" in program and _not_executable(program, unexecutable):
            runner = "python" if program.endswith(".py") else "sh"
            raise InputError(f"{field}: program {program} is not executable (it lacks the execute bit): chmod +x "
                             f"the file, or run it with its interpreter ({runner} {program})")
        if "/" not in program and not shutil.which(program):
            if program in files:
                raise InputError(f"{field}: {program} is not on PATH; write ./{program} to run the trial folder's file")
            raise InputError(f"{field}: program {program} not found (not on PATH, not a file of the trial folder)")
        script = next((arg for previous, arg in itertools.pairwise(command)
                       if previous != "-c" and arg.endswith(".py") and not any(c.isspace() for c in arg)), None)
    if script and not _exists(script, files):
        close = difflib.get_close_matches(script, list(files), n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (the trial folder holds {', '.join(files) or 'no file'})"
        if os.path.normpath(script).startswith(".."):
            hint = "; a script outside the trial folder is given by its absolute path (trials run in their own folders)"
        raise InputError(f"{field}: {script} is neither a file of the trial folder nor an existing path{hint}")


def _python_script(args: Sequence[str]) -> str | None:
    """The script that python runs with ``args``; None for ``-c``, ``-m``, ``-`` (stdin) or none."""
    rest = iter(args)
    for arg in rest:
        if arg == "--":
            return next(rest, None)
        if arg == "--check-hash-based-pycs":
            next(rest, None)
        elif arg.startswith("-") and arg != "-":
            letters = "" if arg.startswith("--") else arg[1:]
            for index, letter in enumerate(letters):
                if letter in "cm":
                    return None
                if letter in "WX":  # its value is the rest of this argument, else the next one
                    if index == len(letters) - 1:
                        next(rest, None)
                    break
        else:
            return None if arg == "-" else arg
    return None


def _not_executable(program: str, unexecutable: Collection[str]) -> bool:
    """Whether ``program`` (a path that exists, see :func:`_exists`) cannot be executed: one
    of the trial folder's ``unexecutable`` files, or an absolute path without the execute bit."""
    if os.path.normpath(program) in unexecutable:
        return True
    path = Path(program)
    return path.is_absolute() and path.is_file() and not os.access(path, os.X_OK)


def _exists(path: str, files: Sequence[str]) -> bool:
    """Whether ``path`` is one of the trial folder's ``files``, lies below one (a linked folder),
    or is an existing absolute path."""
    norm = os.path.normpath(path)
    return norm in files or any(str(parent) in files for parent in Path(norm).parents) or \
        (Path(path).is_absolute() and Path(path).exists())


def this_python(command: Sequence[str]) -> list[str]:
    """``command`` as a list, ``python`` (``python3``, a path to one) replaced by this interpreter."""
    argv = list(command)
    if Path(argv[0]).name in PYTHON_NAMES:
        argv[0] = sys.executable
    return argv


def build_argv(scenario: Scenario, values: Mapping[str, Any], processes: int, torchrun: bool,
               seed: int | None = None) -> list[str]:
    """The trial's argument list: ``python`` is this interpreter, then the command's own
    arguments and the flags (:func:`flag_args`); under torchrun with ``processes`` ranks."""
    argv = this_python(scenario.command) + flag_args(scenario, values, seed)
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(processes), "--no-python", *argv]
    return argv


DISTRIBUTED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"})
DISTRIBUTED_PREFIXES = ("TORCHELASTIC_", "PET_")
"""What torch.distributed and torchrun read of a process's place in a job: the variables that
torchrun sets for its ranks, its own state (``TORCHELASTIC_*``) and its options' defaults
(``PET_NNODES``: a Kubeflow PyTorchJob sets them)."""


def distributed(name: str) -> bool:
    """Whether the environment variable ``name`` tells a process its place in a distributed job."""
    return name in DISTRIBUTED_ENV or name.startswith(DISTRIBUTED_PREFIXES)


def trial_env(slot: Slot, token: str, extra: Mapping[str, str],
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial's processes on ``slot``: ``base`` (default: this process's),
    the slot's ``OMP_NUM_THREADS`` and ``PYTHONUNBUFFERED=1`` (values as they come, for
    pruning), then ``extra`` (which may set its own of both: an empty ``PYTHONUNBUFFERED``
    buffers, so that each ``print`` is one write and DDP ranks' lines do not interleave),
    then hpo's values. ``base``'s own :func:`distributed` variables are left out: they describe the
    job hpo runs in (a torchrun or Kubeflow launch), not the trial, whose rank 1 printed nothing
    and whose world of 2 waited for a peer until its timeout (``extra``, the scenario's ``env``,
    may not set them: :mod:`hpo.scenario`)."""
    inherited = {name: value for name, value in (os.environ if base is None else base).items()
                 if not distributed(name)}
    env = {**inherited, "OMP_NUM_THREADS": str(slot.threads), "PYTHONUNBUFFERED": "1", **extra}
    env.update({TOKEN_ENV: token, "HPO_SLOT": str(slot.index)})
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot.gpus)) if slot.gpus else ""
    return env


@dataclass(frozen=True)
class ProcessResult:
    """How a trial's process ended: exit code, what ended it early (if anything), seconds;
    ``seen_running_s``: the latest moment, in seconds after its start, at which it is known to
    have been running (a poll found it alive then or later; where the poller was paused while
    it ended, ``duration_s`` runs past its real end, this does not); ``disk_full``: the log's
    disk was full (``ended_by`` is :func:`hpo.render.full_disk`'s line), which is no fault of
    the process; ``sigkill_after_s``: ended early, its tree ignored SIGTERM
    and was killed with SIGKILL this many seconds later (:data:`KILL_GRACE_S`), else None."""

    exit_code: int
    ended_by: str | None
    duration_s: float
    pid: int
    disk_full: bool = False
    sigkill_after_s: float | None = None
    seen_running_s: float = 0.0


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child process: get ``signum`` when the thread that started it dies (Linux), and once
    more as each other thread of that process, which it passes to, dies: a killed parent sends
    it as many times as it had threads, while its open files (a pipe the child writes) close
    only with the last. The signal's default action comes back first: one that the parent
    ignores (``nohup`` ignores SIGHUP) would stay ignored through ``exec``."""
    signal.signal(signum, signal.SIG_DFL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)
    except OSError:
        pass


def kill_tree(pid: int, grace_s: float | None = None, child: subprocess.Popen[bytes] | None = None,
              token: str | None = None) -> float | None:
    """End ``pid``'s process tree with one grace for all of it: SIGTERM at once to its process
    group, every descendant and, given ``token``, every process that carries it (those that
    left the tree: ``setsid``, a double fork); SIGKILL ``grace_s`` later (default
    :data:`KILL_GRACE_S`) to those still running and to whatever the group or ``token`` then
    has. Returns the grace where SIGKILL found some still running (they ignored SIGTERM), else None.

    Pass ``child`` when ``pid`` is our own child, so that its Popen object reaps it (and
    keeps its exit code) rather than psutil.
    """
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + ([] if child is not None else [root])
    except psutil.NoSuchProcess:
        procs = []
    return _end(procs + (_carrying(token, procs, pid) if token is not None else []), {pid}, grace_s, child, token)


def kill_by_token(token: str, grace_s: float = 2.0) -> int:
    """Kill every process of this user whose environment carries ``token``, and their trees,
    with one grace for all (:func:`kill_tree`); return how many carried it."""
    found = _carrying(token)
    trees = []
    for proc in found:
        try:
            trees += proc.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    _end(found + trees, {proc.pid for proc in found if _group_of(proc.pid) == proc.pid}, grace_s, None, token)
    return len(found)


def _carrying(token: str, known: Sequence[psutil.Process] = (), skip: int | None = None) -> list[psutil.Process]:
    """The processes of this user but this one (and ``skip``) whose environment carries
    ``token``, other than those ``known``."""
    left_out = {os.getpid(), skip, *(proc.pid for proc in known)}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in left_out and proc.environ().get(TOKEN_ENV) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _group_of(pid: int) -> int | None:
    """The process group of process ``pid``; None once it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _end(procs: Sequence[psutil.Process], groups: set[int], grace_s: float | None,
         child: subprocess.Popen[bytes] | None, token: str | None) -> float | None:
    """SIGTERM the process ``groups``, and ``procs`` and ``child`` outside them, at once (each
    process gets one); SIGKILL those still running ``grace_s`` later, with whatever is then
    left in the groups or carries ``token`` (started during the grace). The grace where
    SIGKILL was needed, else None (see :func:`kill_tree`)."""
    grace = KILL_GRACE_S if grace_s is None else grace_s
    for group in groups:
        _signal_group(group, signal.SIGTERM)
    if child is not None and _group_of(child.pid) not in groups:
        child.terminate()
    _signal_all([proc for proc in procs if _group_of(proc.pid) not in groups], kill=False)
    alive, child_alive = _outlast(procs, child, time.monotonic() + grace)
    if child is not None and child_alive:
        child.kill()
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    left = alive + (_carrying(token, alive, None if child is None else child.pid) if token is not None else [])
    _signal_all(left, kill=True)
    _outlast(left, None, time.monotonic() + grace)
    if child is not None and child_alive:
        child.wait()
    return grace if alive or child_alive else None


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to process group ``pgid``, if there is one."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_all(procs: Sequence[psutil.Process], kill: bool) -> None:
    """SIGKILL (``kill``) or SIGTERM each of ``procs`` that still exists."""
    for proc in procs:
        try:
            proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            pass


def _outlast(procs: Sequence[psutil.Process], child: subprocess.Popen[bytes] | None,
             deadline: float) -> tuple[list[psutil.Process], bool]:
    """Wait until ``deadline`` (``time.monotonic()``) for ``procs`` and ``child`` to exit, reaping
    our own children; those of ``procs`` still running, and whether ``child`` is. A zombie has
    exited (an orphan's zombie waits for init to reap it)."""
    alive = list(procs)
    while True:
        left = max(0.0, deadline - time.monotonic())
        if alive:
            _, alive = psutil.wait_procs(alive, timeout=min(POLL_S, left))
            alive = [proc for proc in alive if not _zombie(proc)]
        child_alive = child is not None and not _exits_within(child, 0.0 if alive else min(POLL_S, left))
        if not (alive or child_alive) or time.monotonic() >= deadline:
            return alive, child_alive


def _zombie(proc: psutil.Process) -> bool:
    """Whether ``proc`` has exited: gone, or a zombie."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_process(argv: Sequence[str], cwd: Path, env: Mapping[str, str], log_path: Path,
                timeout: float | None, on_lines: Callable[[list[str], bool], Sequence[str] | None],
                should_end: Callable[[], str | None]) -> ProcessResult:
    """Run ``argv`` in ``cwd``; stream its output to ``log_path`` and ``on_lines``.

    A reader thread only writes each output line to the log and queues it; a second thread
    passes the queued lines, in order, to ``on_lines(lines, running)``: the lines that came
    since its last call, and whether the process may still run (False for those left over
    when it ended); what it returns are notes, written to the log as ``hpo: NOTE`` lines (a
    line it could not use). Every line that reached the log has been passed when this returns,
    however many were left over; output that a process which left the tree keeps sending
    into the pipe is read for ``KILL_GRACE_S`` after the end, then dropped.

    ``should_end`` is first asked as soon as the process runs (never for one that could not
    start), then every ``POLL_S`` while it runs: a non-None answer (e.g. ``"stopped"``) ends
    the process tree and becomes ``ended_by``, as does ``"timeout"`` after ``timeout``
    seconds, and ``cannot write trial.log: ...`` once the log cannot be written (a file-size
    limit; a full disk, which ``disk_full`` tells: the output read until then is still
    handled). Once the process has ended, its tree and every process that carries ``env``'s
    trial token are killed before this returns, so no trial process outlives it.
    ``duration_s`` is how long the process ran.

    A start refused for one of :data:`MACHINE_LIMITS` raises :class:`ExecutorUnavailable`;
    one refused otherwise (no such program) returns exit code 127 and ``cannot start ...``.
    """
    start = time.monotonic()
    try:
        log = log_path.open("ab", buffering=0)
    except OSError as exc:
        _raise_if_machine_limit(exc, f"cannot open {log_path.name}")
        raise
    with log:
        try:
            proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 (prctl only)
        except OSError as exc:
            log.write(f"hpo: cannot start {argv[0]}: {exc.strerror}\n".encode())
            _raise_if_machine_limit(exc, "cannot start a trial's process")
            return ProcessResult(127, f"cannot start {argv[0]}: {exc.strerror}", 0.0, -1)
        output = _Output(log, log_path)
        ended = threading.Event()
        reader = threading.Thread(target=_pump, args=(proc, output), daemon=True)
        handler = threading.Thread(target=_deliver, args=(output, on_lines, ended), daemon=True)
        reader.start()
        handler.start()
        ended_by: str | None = None
        sigkill_after: float | None = None
        seen = start  # when it is last known to have run
        try:
            ended_by = should_end()
            while ended_by is None:
                polled = time.monotonic()
                if _exits_within(proc, POLL_S):
                    break
                seen = polled  # alive after the wait, so alive when it began, whatever paused this thread since
                if output.failure is not None:
                    ended_by = output.failure
                elif timeout is not None and time.monotonic() - start > timeout:
                    ended_by = "timeout"
                else:
                    ended_by = should_end()
        finally:
            ended.set()
            try:
                if proc.poll() is None:
                    sigkill_after = kill_tree(proc.pid, child=proc, token=env.get(TOKEN_ENV))
                else:  # what it left behind is stray background work
                    _signal_group(proc.pid, signal.SIGKILL)
                    if TOKEN_ENV in env:
                        kill_by_token(env[TOKEN_ENV])
            finally:
                duration = time.monotonic() - start
                _join_reader(reader, output)
                output.close()
                handler.join()
    return ProcessResult(proc.returncode, ended_by or output.failure, duration, proc.pid, output.disk_full,
                         sigkill_after, max(0.0, seen - start))


def _raise_if_machine_limit(exc: OSError, what: str) -> None:
    """ExecutorUnavailable (``what``: the system's reason) where ``exc`` is one of :data:`MACHINE_LIMITS`."""
    if exc.errno in MACHINE_LIMITS:
        raise ExecutorUnavailable(f"{what}: {exc.strerror} (a limit of this machine or of hpo's shell, not the "
                                  "trial's fault)") from None


def _join_reader(reader: threading.Thread, output: _Output) -> None:
    """Wait for ``reader`` to read the pipe to its end, however long its lines take to be
    handled, but no more than ``KILL_GRACE_S`` in all for lines that do not come: a process
    that left the tree may hold the pipe open."""
    waited = 0.0
    while reader.is_alive() and waited < KILL_GRACE_S:
        reader.join(POLL_S)
        if output.reading:
            waited += POLL_S


def _exits_within(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc`` to exit; whether it has."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


class _Output:
    """A process's output on its way: each line written to the log at once and queued for
    :func:`_deliver`, until :meth:`close` (a None in the queue marks the end). The queue holds
    at most :data:`QUEUED_LINES`: a process that prints faster than its lines are handled
    waits on its pipe, as it would without hpo. A log that cannot be written (a full disk, a
    file-size limit) is written no more, the lines still queued, and :attr:`failure` says why,
    :attr:`disk_full` whether its disk is full (:func:`run_process` ends the process then)."""

    def __init__(self, log: Any, path: Path) -> None:
        self.log = log
        self.failure: str | None = None
        self.disk_full = False
        self.lines: queue.Queue[str | None] = queue.Queue(QUEUED_LINES)
        self.reading = False
        self._path = path
        self._lock = threading.Lock()
        self._open = True

    def put(self, raw: bytes) -> bool:
        """Log and queue one line; False once closed (the line is dropped)."""
        with self._lock:
            if not self._open:
                return False
            self._write(raw)
        line = raw.decode("utf-8", errors="replace")
        while self._open:  # not under the lock: the handler's notes take it while it drains the queue
            try:
                self.lines.put(line, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def note(self, text: str) -> None:
        """Write one of hpo's own lines to the log."""
        with self._lock:
            self._write(text.encode())

    def _write(self, data: bytes) -> None:
        if self.failure is None:
            try:
                self.log.write(data)
            except OSError as exc:
                full = full_disk(self._path, exc)
                self.disk_full = full is not None
                self.failure = full or f"cannot write {self._path.name}: {exc.strerror or exc} (the output past it is lost)"

    def close(self) -> None:
        """Take no more lines."""
        with self._lock:
            closing, self._open = self._open, False
        if closing:
            self.lines.put(None)  # the handler drains the queue until it meets this


def _pump(proc: subprocess.Popen[bytes], output: _Output) -> None:
    """Copy ``proc``'s output to ``output`` until the pipe ends or ``output`` is closed;
    ``output.reading`` tells whether it waits on the pipe (not on the queue)."""
    assert proc.stdout is not None
    while True:
        output.reading = True
        raw = proc.stdout.readline()
        output.reading = False
        if not raw or not output.put(raw):
            break
    output.close()


def _deliver(output: _Output, on_lines: Callable[[list[str], bool], Sequence[str] | None],
             ended: threading.Event) -> None:
    """Pass ``output``'s queued lines to ``on_lines`` in batches (those that wait, at most
    :data:`HANDED_LINES`), until its end, and write the notes it returns to the log."""
    while True:
        batch = [output.lines.get()]
        while batch[-1] is not None and len(batch) < HANDED_LINES and not output.lines.empty():
            batch.append(output.lines.get())
        lines = [line for line in batch if line is not None]
        if lines:
            try:
                notes = on_lines(lines, not ended.is_set()) or ()
            except Exception as exc:  # a bad callback must not stop the log
                notes = [f"could not handle output lines: {exc}"]
            for note in notes:
                output.note(f"hpo: {note}\n")
        if batch[-1] is None:
            return
