"""The ``hpo`` command line: one explicit table of commands (see :data:`COMMANDS`).

Every command takes the scenario file first. Exit codes: 0 ok, 2 bad input (scenario,
CSV, template, arguments, an output that cannot be written; one line on stderr, no
traceback), 130 SIGINT, 143 SIGTERM, 1 anything else, such as a sweep in which no trial
completed and some failed (``HPO_DEBUG=1`` shows a traceback).

Environment: ``HPO_GPUS=0,1`` overrides the GPUs hpo detects (``HPO_GPUS=`` means none);
trial processes see ``HPO_TRIAL_NUMBER``, ``HPO_TRIAL_DIR``, ``HPO_SLOT``, ``HPO_TRIAL_TOKEN``,
``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``; ``HPO_DEBUG=1`` prints tracebacks.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from hpo import __version__
from hpo.errors import InputError

EXIT_OK, EXIT_ERROR, EXIT_INPUT = 0, 1, 2
STATUS_ROWS = 20
TAIL_WAIT_S = 30


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{self.prog}: {message}")


@dataclass(frozen=True)
class Context:
    """What every command needs: the scenario, its workdir and its storage URL."""

    scenario: Any
    workdir: Path
    storage: str


def _context(args: argparse.Namespace) -> Context:
    from hpo.scenario import load_scenario
    from hpo.storage import check_url, storage_url

    scenario = load_scenario(args.scenario)
    given = _given_cluster(args)
    if given is not None:  # --cluster stands for resources.cluster (a data_dir is then on the cluster's machines)
        scenario = scenario.model_copy(update={"resources": scenario.resources.model_copy(update={"cluster": given})})
    workdir = _new_folder(Path(args.workdir).expanduser().resolve(), "--workdir") if args.workdir \
        else scenario.default_workdir()
    storage = storage_url(scenario, args.storage, workdir)
    check_url(storage)
    return Context(scenario, workdir, storage)


def _writing_context(args: argparse.Namespace, existing_study: bool = False) -> Context:
    """The context of a command that writes trial folders: its workdir is created here, so
    that one that cannot be is named as such (not as the default store's folder); with
    ``existing_study``, an InputError first if the study does not exist."""
    ctx = _context(args)
    _check_submit(ctx)
    if existing_study:
        _store(ctx)
    _made_folder(ctx.workdir, _workdir_flag(args))
    _claim_workdir(ctx, _workdir_flag(args))
    if not _started_by_run(args):  # hpo run checked for its workers, which ride out a store down at their start
        _same_study(ctx, _workdir_flag(args), lambda: _study_created(ctx))
        _note_left_out(ctx)
    return ctx


def _note_left_out(ctx: Context) -> None:
    """Print a ``note:`` line for each link of a template folder that leads nowhere, which the
    trial folders go without (:func:`hpo.render.left_out_links`)."""
    from hpo.render import left_out_links

    for line in left_out_links(ctx.scenario.template, ctx.workdir):
        print(f"note: {line}", flush=True)


def _check_submit(ctx: Context) -> None:
    """InputError where the scenario's batch jobs could not be submitted from here (:func:`hpo.jobqueue.check_submit`)."""
    cluster = ctx.scenario.resources.cluster
    if cluster is not None and cluster.kind is not None:
        from hpo.jobqueue import check_submit

        check_submit(cluster)


def _workdir_mark(ctx: Context) -> tuple[str, str] | None:
    """What marks the workdir as a study's: its name and, once known, its ``created`` id
    (:data:`hpo.store.STUDY_CREATED`, '' before); None where no study marked it (an empty
    marker, which a full disk left before markers were written whole, marks none)."""
    from hpo.render import WORKDIR_OWNER

    try:
        lines = (ctx.workdir / WORKDIR_OWNER).read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not lines or not lines[0].strip():
        return None
    return lines[0].strip(), lines[1].strip() if len(lines) > 1 else ""


def _workdir_owner(ctx: Context, flag: str) -> tuple[str, str] | None:
    """The mark of the study whose trial folders the workdir holds (:func:`_workdir_mark`), or
    None; an InputError naming ``flag`` where that is another study (trial folders are named by
    number alone, so two studies would overwrite each other's). Writes nothing."""
    mark = _workdir_mark(ctx)
    name = ctx.scenario.name
    if mark is not None and mark[0] != name:
        raise InputError(f"{flag}: {ctx.workdir} holds the trial folders of study {mark[0]}; "
                         f"give study {name} a folder of its own")
    return mark


def _same_study(ctx: Context, flag: str, created: Callable[[], str | None]) -> None:
    """InputError naming ``flag`` where the workdir holds the trial folders of another study of
    the same name (one in another store, or removed and made anew): the marker's ``created``
    id is not ``created()``, the id of the study at the context's storage (None: not made yet),
    asked only where the marker has one and trial folders are there (emptied, it is taken anew)."""
    mark = _workdir_mark(ctx)
    if mark is None or not mark[1] or not _holds_trials(ctx.workdir) or mark[1] == created():
        return
    from hpo.storage import redact

    raise InputError(f"{flag}: {ctx.workdir} holds the trial folders of another study named {mark[0]} (created "
                     f"{mark[1]}), not the one in {redact(ctx.storage)}; give this one a folder of its own "
                     f"(--workdir), or remove {ctx.workdir} if those trials are not wanted")


def _holds_trials(workdir: Path) -> bool:
    """Whether ``workdir`` holds a trial folder (a marker left alone in it marks no trials)."""
    return any(path.is_dir() for path in workdir.glob("trial-*"))


def _study_created(ctx: Context) -> str | None:
    """The ``created`` id of the context's study, None where it has none or is not made yet;
    nothing is written."""
    from hpo.storage import NoStudy
    from hpo.store import STUDY_CREATED, StudyStore

    _quiet_optuna()
    try:
        store = StudyStore(ctx.scenario, ctx.storage, create=False, on_outage=_say_notice)  # said as the sweep says it
    except NoStudy:
        return None
    return store.user_attrs.get(STUDY_CREATED)


def _claim_workdir(ctx: Context, flag: str, created: str | None = None) -> None:
    """Mark the workdir as the folder of this study's trials, the marker written whole; an
    InputError if another study marked it first (:func:`_workdir_owner`). ``created``, the
    study's id, is added to a marker that lacks it, or replaces another where no trial folder
    is left (:func:`_same_study` checks it). On a full
    disk the workdir stays unmarked until a later command finds room: what the command writes
    next (the store, a trial's files) waits for room and says so."""
    from hpo.files import replacing
    from hpo.render import WORKDIR_OWNER
    from hpo.storage import disk_full

    mark = _workdir_owner(ctx, flag)
    if mark is not None and (mark[1] == created or not created or (mark[1] and _holds_trials(ctx.workdir))):
        return
    try:
        with replacing(ctx.workdir / WORKDIR_OWNER) as temporary:
            temporary.write_text(ctx.scenario.name + "\n" + (f"{created}\n" if created else ""))
    except OSError as exc:
        if not disk_full(exc):
            raise


def _workdir_flag(args: argparse.Namespace) -> str:
    return "--workdir" if args.workdir else "workdir"


def _store(ctx: Context) -> Any:
    from hpo.store import StudyStore

    _quiet_optuna()
    return StudyStore(ctx.scenario, ctx.storage, create=False, reader=True)


def _snapshot(ctx: Context) -> list[Any]:
    """Every trial's row: from the row cache alone while the store has not been written
    since it was cached (no storage opened), else read through the store."""
    from hpo import rowcache
    from hpo.rows import presented

    scenario = ctx.scenario
    raw = rowcache.quiet_rows(ctx.storage, scenario.name, rowcache.objective_of(scenario.objective))
    if raw is None:
        from hpo.snapshot import snapshot  # imports Optuna, which an answer from the cache alone spares

        return snapshot(_store(ctx))
    return presented(raw, scenario.parameters)


class _Signals:
    """SIGINT and SIGTERM as a graceful stop: the first one calls ``stop(signum)``, a
    second one only says that the stop is under way. ``notices``: whether these lines are said
    as notices (``hpo: ``); a worker that hpo run started writes them to its log alone (hpo run
    says the signal that it passed on, once: :mod:`hpo.worker_logs`). With ``orphaned`` (such a
    worker), :data:`hpo.worker_logs.ORPHANED`, which it gets as hpo run dies, calls
    ``orphaned()`` and then stops it as SIGTERM does; a dying hpo run sends it once per thread,
    and only the first is said."""

    def __init__(self, stop: Callable[[int], None], ended: str = "running trials were recorded INTERRUPTED and "
                 "queued again, trials claimed ahead went back to the queue; run the same command to resume",
                 notices: bool = True, orphaned: Callable[[], None] | None = None) -> None:
        self.signum: int | None = None
        self._stop = stop
        self._ended = ended
        self._lead = "hpo: " if notices else ""
        self._orphaned = orphaned
        self._orphan_signal: int | None = None
        if orphaned is not None:
            from hpo.worker_logs import ORPHANED

            self._orphan_signal = ORPHANED

    def _handle(self, signum: int, frame: Any) -> None:
        orphaned = signum == self._orphan_signal
        if orphaned and self._orphaned is not None:
            self._orphaned()
            if self.signum is not None:
                return
        if self.signum is None:
            self.signum = signum
            cause = "hpo run is gone" if orphaned else signal.Signals(signum).name
            print(f"{self._lead}{cause}: ending running trials (they run again on resume)...",
                  file=sys.stderr, flush=True)
            self._stop(signum)
        else:
            print(f"{self._lead}already stopping; running trials are being ended and recorded", file=sys.stderr,
                  flush=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Signals]:
        """Handle the signals inside the block; the previous handlers come back after it."""
        handled = (signal.SIGINT, signal.SIGTERM) + (() if self._orphan_signal is None else (self._orphan_signal,))
        previous = {sig: signal.signal(sig, self._handle) for sig in handled}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def exit_code(self, note: str = "", ended: str | None = None) -> int | None:
        """128 + the signal that stopped the sweep (130 SIGINT, 143 SIGTERM), or None; ``note``
        leads the closing line (where the stop found the sweep, e.g. waiting for the ask lock),
        ``ended`` says how it left the trials where that is not as usual."""
        if self.signum is None:
            return None
        ended = ended or self._ended
        print(f"interrupted: {note}; {ended}" if note else f"interrupted: {ended}", file=sys.stderr, flush=True)
        return 128 + self.signum


def _plan(ctx: Context, at_least: int = 1, parallel: int | str | None = None, gpus: str | None = None) -> tuple[Any, ...]:
    from hpo.launch import detect_gpus, env_threads, gpu_ids, plan_slots

    updates: dict[str, Any] = {}
    if parallel is not None:
        updates["parallel"] = parallel
    if gpus is not None:
        updates["gpus"] = gpu_ids(gpus, "--gpus")
    return plan_slots(ctx.scenario.resources.model_copy(update=updates), detect_gpus(), at_least=at_least,
                      gpus_field="resources.gpus" if gpus is None else "--gpus", threads=env_threads(ctx.scenario.env))


def describe_plan(slots: Sequence[Any], executor: Any = None, parallel: tuple[int | str, str] | None = None) -> str:
    """``2 slots: 1 process on 1/2 of GPU 0, ...`` in one line (as ``executor`` describes its
    slots where the trials run on a Dask cluster). ``parallel``: the number of slots asked
    for and the setting that asked (``resources.parallel``, ``--parallel``); the line says
    when the GPUs allowed fewer, and when 1 leaves the other trials of a GPU's share unrun."""
    if executor:
        return executor.describe(slots)
    from hpo.launch import plural

    kinds = sorted({slot.describe() for slot in slots})
    capped = ""
    if parallel is not None and isinstance(parallel[0], int) and 0 < len(slots) < parallel[0]:
        gpus, share = len({gpu for slot in slots for gpu in slot.gpus}), slots[0].share
        room = f"{share} trials per GPU" if share > 1 else f"{plural(len(slots[0].gpus), 'GPU')} per trial"
        capped = f" ({parallel[1]} {parallel[0]} capped to {len(slots)}: {plural(gpus, 'GPU')}, {room})"
    elif parallel is not None and parallel[0] == 1 and slots and slots[0].share > 1:  # parallel left at its default
        capped = f" ({parallel[1]} 1: one trial at a time; {parallel[1]}: auto runs {slots[0].share} on each GPU)"
    return f"{plural(len(slots), 'slot')}{capped}: {'; '.join(kinds)}"


def _plan_line(ctx: Context, args: argparse.Namespace, slots: Sequence[Any], executor: Any) -> str:
    """The plan a sweep starts with: its slots (:func:`describe_plan`) and, where it has one,
    its pruner and the steps that pruner plans for (:func:`hpo.samplers.describe_pruner`)."""
    from hpo.samplers import describe_pruner

    return "; ".join(filter(None, (describe_plan(slots, executor, _asked(ctx, args)),
                                   describe_pruner(ctx.scenario.search))))


def _asked(ctx: Context, args: argparse.Namespace) -> tuple[int | str, str] | None:
    """How many slots the command line or the scenario asked for, and where (see
    :func:`describe_plan`); None for a worker given its slots by ``hpo run --workers``."""
    if getattr(args, "slots", None):
        return None
    if getattr(args, "parallel", None) is not None:
        return args.parallel, "--parallel"
    return ctx.scenario.resources.parallel, "resources.parallel"


def _started_by_run(args: argparse.Namespace) -> bool:
    """Whether this is a worker that ``hpo run --workers`` started (only it passes ``--slots``)."""
    return bool(getattr(args, "slots", None))


def _sweep_config(ctx: Context, slots: tuple[Any, ...], seed: int, args: argparse.Namespace) -> Any:
    from hpo.engine import SweepConfig

    return SweepConfig(ctx.scenario, ctx.storage, ctx.workdir, slots, seed,
                       allow_space_change=getattr(args, "allow_space_change", False),
                       store_reached=_started_by_run(args))


def _cluster(ctx: Context, args: argparse.Namespace) -> Any:
    """The Dask executor of ``--cluster ADDRESS`` or ``resources.cluster``, or None (this machine)."""
    cluster = ctx.scenario.resources.cluster  # --cluster stands for it (:func:`_context`)
    if cluster is None:
        return None
    import logging

    from hpo.dask_executor import open_cluster

    logging.getLogger("distributed.client").setLevel(logging.CRITICAL)  # hpo says itself when the scheduler is gone
    return open_cluster(cluster, ctx.scenario.resources, say=_say_notice,
                        job_logs=ctx.workdir / "jobs",
                        field="--cluster" if getattr(args, "cluster", None) is not None else "resources.cluster")


def _given_cluster(args: argparse.Namespace) -> Any:
    """The cluster ``--cluster ADDRESS`` names, or None without the flag (``--cluster ""`` is
    refused, not taken for no flag)."""
    if getattr(args, "cluster", None) is None:
        return None
    from pydantic import ValidationError

    from hpo.scenario import Cluster

    try:
        return Cluster(address=args.cluster)
    except ValidationError as exc:
        raise InputError(f"--cluster: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _say_notice(line: str) -> None:
    """Print ``line``, which the Dask executor says, as a notice (``hpo: ``, which hpo run
    relays from its workers: :mod:`hpo.worker_logs`)."""
    print(line if line.startswith("hpo: ") else f"hpo: {line}", flush=True)


def _prepare(sweep: Any, ctx: Context, args: argparse.Namespace) -> None:
    """Prepare ``sweep`` (:meth:`hpo.engine.Sweep.prepare`), whose workdir holds no other
    study's trials (:func:`_writing_context` checked); then mark it with the study's id."""
    from hpo.store import STUDY_CREATED

    sweep.prepare()
    _claim_workdir(ctx, _workdir_flag(args), sweep.store.user_attrs.get(STUDY_CREATED))


def _run_sweep(ctx: Context, slots: tuple[Any, ...], seed: int, args: argparse.Namespace,
               executor: Any = None) -> int:
    from hpo import forest_service, gp
    from hpo.engine import Sweep
    from hpo.progress import ProgressView

    try:
        sweep = Sweep(_sweep_config(ctx, slots, seed, args), executor)
        if not sweep.uses_forest:
            forest_service.stop()
        _prepare(sweep, ctx, args)
        if sweep.uses_gp:  # after the checks of _prepare: a workdir it refuses is said at once
            gp.warm_up()
        signals = _Signals(lambda signum: sweep.stop(), notices=not _started_by_run(args),
                           orphaned=_log_output_itself if _started_by_run(args) else None)
        with signals.installed(), ProgressView(sweep.store, sweep.budget,
                                                _plan_line(ctx, args, slots, executor)) as view:
            sweep.run(view)
    finally:
        if executor:
            executor.close()
    code = signals.exit_code(sweep.stop_note, sweep.stop_ended)
    if code is not None:
        return code
    return EXIT_OK if _started_by_run(args) else _outcome_code(ctx, sweep)


def _log_output_itself() -> None:
    """Write this worker's output to its log itself from now on: its hpo run is dying
    (:meth:`hpo.worker_logs.PipeToRun.orphaned`)."""
    from hpo.worker_logs import PipeToRun

    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, PipeToRun):
            stream.orphaned()


def _outcome_code(ctx: Context, sweep: Any) -> int:
    """EXIT_ERROR, with one line on stderr, where ``sweep``'s study ended every trial, none
    completed and some failed or timed out (the sweep has no result); else EXIT_OK. Trials
    still running or waiting (another worker's) may yet complete, and trials that a user
    stopped or a pruner cut short did not fail: EXIT_OK."""
    from hpo.errors import StoreUnavailable
    from hpo.outcome import Outcome

    try:
        rows = sweep.store.rows()
    except StoreUnavailable:
        return EXIT_OK
    if any(not row.outcome.ended or row.outcome is Outcome.COMPLETE for row in rows) or \
            not any(row.outcome.failed for row in rows):
        return EXIT_OK
    return _said_no_best(ctx, rows)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the sweep to the end (resumable); --workers K runs K optimizer processes. Output
    that a full disk or a closed pipe refuses is dropped, not fatal (:mod:`hpo.output`)."""
    from hpo.output import output_dropped_when_refused

    with output_dropped_when_refused():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The sweep, or its workers (see :func:`cmd_run`)."""
    ctx = _writing_context(args)
    executor = _cluster(ctx, args)
    slots = executor.plan(at_least=args.workers, grows=args.workers == 1) if executor else \
        _plan(ctx, at_least=args.workers)
    if args.workers == 1:
        return _run_sweep(ctx, slots, ctx.scenario.search.seed, args, executor)
    try:
        return _run_workers(ctx, slots, args, executor)
    finally:
        if executor:
            executor.close()


def _run_workers(ctx: Context, slots: tuple[Any, ...], args: argparse.Namespace, executor: Any = None) -> int:
    """Start ``--workers`` optimizer processes sharing the study and this machine's slots
    (or the slots of ``executor``'s Dask cluster); show their progress from the store, and
    their notices (:mod:`hpo.worker_logs`, which writes their logs)."""
    from hpo.engine import Sweep
    from hpo.launch import die_with_parent
    from hpo.progress import ProgressView, follow_store
    from hpo.storage import redact
    from hpo.worker_logs import ORPHANED, WorkerLogs, ended, relaying

    workers = args.workers
    sweep = Sweep(_sweep_config(ctx, slots, ctx.scenario.search.seed, args))
    _prepare(sweep, ctx, args)
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    logs = WorkerLogs(ctx.workdir)
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int) -> None:
        """Pass ``signum`` on to every worker, and resume those stopped (SIGSTOP, Ctrl-Z), which
        could neither end nor say why the sweep waits."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
                proc.send_signal(signal.SIGCONT)

    signals = _Signals(forward)
    numbers = logs.claim(workers)
    with signals.installed(), relaying(procs, logs, lambda line: print(line, flush=True)) as relays:
        for position, index in enumerate(numbers):
            if signals.signum is not None:  # stopped while the workers start: start no more
                break
            share = slots[position::workers]
            argv = [sys.executable, "-m", "hpo", "worker", str(ctx.scenario.path), "--storage", ctx.storage,
                    "--workdir", str(ctx.workdir), "--seed", str(ctx.scenario.search.seed + index),
                    "--slots", json.dumps([asdict(slot) for slot in share]), "--log", str(logs.path(index))]
            if args.allow_space_change:
                argv.append("--allow-space-change")
            if executor:
                argv += ["--cluster", executor.address]
            said = logs.write(index, f"--- hpo worker {index} started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                                     f"{describe_plan(share)}\n".encode())
            if said:
                relays.say(said)
            relays.add(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=functools.partial(die_with_parent, ORPHANED)),  # noqa: PLW1509 (prctl only)
                       index)
        others = f"; worker-0 to worker-{numbers[0] - 1} are another hpo run's" if numbers[0] else ""
        print(f"started {len(procs)} workers on {redact(ctx.storage)} (logs: {ctx.workdir}/worker-*.log{others})",
              flush=True)
        with ProgressView(sweep.store, sweep.budget, _plan_line(ctx, args, slots, executor)) as view:
            relays.say = view.note
            follow_store(sweep.store, view, lambda: all(proc.poll() is not None for proc in procs))
    codes = [proc.wait() for proc in procs]
    code = signals.exit_code()
    if code is not None:
        return code
    failed = [f"worker-{i} {ended(c)}" for i, c in zip(numbers, codes, strict=False) if c != 0]
    if not failed:
        return _outcome_code(ctx, sweep)
    if _finished(sweep):
        print(f"hpo: the other workers finished the sweep; {', '.join(failed)}: see {ctx.workdir}/worker-*.log",
              flush=True)
        return _outcome_code(ctx, sweep)
    print(f"error: {', '.join(failed)}: see {ctx.workdir}/worker-*.log", file=sys.stderr)
    return EXIT_ERROR


def _finished(sweep: Any) -> bool:
    """Whether ``sweep``'s study has run its budget to the end, nothing running or waiting
    within it (False where its store does not answer): a worker that died on the way (the
    OOM killer, a kill -9) then cost nothing, and ``hpo run --workers`` exits 0."""
    from hpo.errors import StoreUnavailable
    from hpo.outcome import Outcome
    from hpo.progress import tally

    try:
        t = tally(sweep.store.rows(), sweep.budget, sweep.store.scenario.objective.direction)
    except StoreUnavailable:
        return False
    return t.done >= t.budget and not t.running and t.past_budget == t.counts.get(Outcome.WAITING, 0)


def cmd_worker(args: argparse.Namespace) -> int:
    """Join the scenario's study as one more optimizer worker (e.g. from another machine)."""
    from hpo.output import output_dropped_when_refused
    from hpo.worker_logs import PipeToRun

    if not _started_by_run(args):
        with output_dropped_when_refused():
            return _work(args)
    log = Path(args.log) if args.log else None
    sys.stdout, sys.stderr = PipeToRun(sys.stdout, log), PipeToRun(sys.stderr, log)
    return _work(args)


def _work(args: argparse.Namespace) -> int:
    """The worker's sweep (see :func:`cmd_worker`)."""
    from hpo.launch import Slot

    ctx = _writing_context(args)
    seed = args.seed if args.seed is not None else ctx.scenario.search.seed + os.getpid()
    executor = _cluster(ctx, args)
    if args.slots:
        slots = tuple(Slot.of(item) for item in json.loads(args.slots))
    elif executor:
        slots = executor.plan(parallel=None if args.parallel == "auto" else args.parallel)
    else:
        slots = _plan(ctx, parallel=args.parallel, gpus=args.gpus)
    return _run_sweep(ctx, slots, seed, args, executor)


TEXT_MIN_WIDTH = 12  # hpo status: the narrowest a column of text (a categorical's values, the reason) folds to


def cmd_status(args: argparse.Namespace) -> int:
    """Print the last trials (* marks the best) and a summary; --all prints every trial."""
    from rich.console import Console

    class _PipeConsole(Console):
        """A reader that closed the pipe (``| head``) ends the command with exit 0, as
        ``hpo export`` does; rich's own handling exits 1."""

        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    from hpo import designs
    from hpo.progress import distinct_digits, format_params, summary_line, tally
    from hpo.rows import gpu_cell

    ctx = _context(args)
    scenario = ctx.scenario
    rows = _snapshot(ctx)
    try:
        budget, unread = designs.total_trials(scenario), None
    except InputError as exc:  # a design edited or moved since: the study's trials are shown all the same
        budget, unread = sum(1 for row in rows if row.rerun_of is None), str(exc)
    summary = tally(rows, budget, scenario.objective.direction)
    console = _PipeConsole() if sys.stdout.isatty() else _PipeConsole(width=400)
    shown = rows if args.all else rows[-(args.last or STATUS_ROWS):]
    names = _param_columns(scenario, rows, constants=False)
    running = any(row.gpus for row in shown)
    best = summary.best
    live = _running_trials(ctx, shown)
    since = _running_since(live)
    held_out = scenario.objective.held_out
    digits = {name: distinct_digits(row.params.get(name) for row in shown) for name in names}
    value_digits = distinct_digits([row.value for row in shown] + ([best.value] if best else []))
    held_digits = {name: distinct_digits(row.held_out.get(name) for row in shown) for name in held_out}
    cells, reasons = [], []
    for row in shown:
        mark = " *" if best is not None and row.number == best.number else ""
        gone = _worker_gone(ctx, live[row.number]) if row.number in live else None
        seconds = f"{time.time() - since[row.number]:.1f}{'' if gone else ' (running)'}" if row.number in since \
            else _number(row.duration_s, ".1f")
        reasons.append(f"its worker is gone ({gone}): {_RECORDED_LATER}" if gone else _reason(row))
        cells.append([f"{row.number}{mark}", row.state, *(_cell(row.params.get(n), digits[n]) for n in names),
                      _number(row.value, f".{value_digits}g"),
                      *(_number(row.held_out.get(h), f".{held_digits[h]}g") for h in held_out),
                      seconds, *([gpu_cell(row.gpus, scenario.resources.share)] if running else [])])
    headers = ("trial", "state", *names, scenario.objective.metric, *held_out, "seconds", *(["GPUs"] if running else []))
    table, needed = _status_table(headers, cells, reasons)
    # a terminal wraps a wider table's rows; without a height, rich gives a dumb terminal 80 columns whatever the width
    wide = console if console.width >= needed else _PipeConsole(width=needed, height=console.height)
    if shown:
        console.print(_status_title(scenario.name, shown, len(rows)), markup=False, highlight=False, soft_wrap=True)
        wide.print(table)
    if unread is not None:
        console.print(f"note: the design's size is unknown ({_located(unread, args)}): the count below is of the "
                      "trials the study holds", markup=False, highlight=False, soft_wrap=True)
    console.print(summary_line(summary, scenario.objective.metric, value_digits, held_out), markup=False,
                  highlight=False, soft_wrap=True)
    if best is not None:
        console.print(f"best params: {format_params(best.params, 6)}", markup=False, highlight=False, soft_wrap=True)
    return EXIT_OK


def _status_table(headers: Sequence[str], cells: Sequence[Sequence[str]], reasons: Sequence[str]) -> tuple[Any, int]:
    """The status table of ``cells`` under ``headers`` (a ``reason`` column after them where
    one of ``reasons`` is not empty), and the width it needs. A number or a header is never
    split or cut (``0.000`` over ``3683`` read as two numbers); text (a categorical value, the
    reason) folds, down to :data:`TEXT_MIN_WIDTH` or its header's width."""
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    table = Table()
    widths = []
    for index, header in enumerate(headers):
        column = [row[index] for row in cells]
        widest = max(cell_len(text) for text in [header, *column])
        if index < 2 or all(_numeric(text) for text in column):  # trial and state: COMPLETE, never COMPLET/E
            table.add_column(header, no_wrap=True, min_width=widest)
            widths.append(widest)
        else:
            narrowest = max(cell_len(header), min(widest, TEXT_MIN_WIDTH))
            table.add_column(header, overflow="fold", min_width=narrowest)
            widths.append(narrowest)
    if any(reasons):
        table.add_column("reason", overflow="fold", min_width=TEXT_MIN_WIDTH)
        widths.append(TEXT_MIN_WIDTH)
    for row, reason in zip(cells, reasons):
        table.add_row(*(Text(cell) for cell in (*row, *([reason] if any(reasons) else []))))  # text, not markup
    return table, sum(widths) + 3 * len(widths) + 1  # with each column's padding and rule


def _numeric(cell: str) -> bool:
    """Whether a status cell is a number (or empty, or a number followed by words: ``3.2 (running)``)."""
    word = cell.split(" ", 1)[0]
    try:
        float(word)
    except ValueError:
        return word in ("", "-")
    return True


def _status_title(name: str, shown: Sequence[Any], total: int) -> str:
    """``demo: trials 3-22 of 23`` (``demo: trial 0 of 1``): the line above the status table,
    printed on its own so that it is not padded to the table's width."""
    first, last = shown[0].number, shown[-1].number
    return f"{name}: trial {first} of {total}" if first == last else f"{name}: trials {first}-{last} of {total}"


def _running_trials(ctx: Context, rows: Sequence[Any]) -> dict[int, Any]:
    """The Optuna trial of each RUNNING one of ``rows``, by number (read from the store only
    when there is one: a quiet store's status never imports Optuna)."""
    numbers = [row.number for row in rows if row.state == "RUNNING"]
    if not numbers:
        return {}
    store = _store(ctx)
    return {number: store.trial(number) for number in numbers}


def _running_since(trials: Mapping[int, Any]) -> dict[int, float]:
    """When the process of each of the running ``trials`` started (epoch seconds), as its worker
    recorded it on starting it (``at`` of :data:`hpo.store.SYS_STARTED`; not Optuna's
    ``datetime_start``, which is when the trial was claimed, perhaps ahead of its slot). A
    trial claimed but not started is WAITING and has none."""
    if not trials:
        return {}
    from hpo.store import SYS_STARTED  # imports Optuna, which a quiet store's status never needs

    starts = {number: (trial.system_attrs.get(SYS_STARTED) or {}).get("at") for number, trial in trials.items()}
    return {number: float(at) for number, at in starts.items() if isinstance(at, (int, float))}


_NOT_A_WORKER = "-"  # no worker's id (host:pid): a command that runs no trial judges others' as a stranger
_RECORDED_LATER = "the next sweep or worker on this study records how it ended"


def _worker_gone(ctx: Context, trial: Any) -> str | None:
    """How the worker of ``trial``, if RUNNING, is gone (``its process is gone``), or None while
    it may be there (or the trial does not run). Such a trial stays RUNNING in the store, with nothing running it, until a
    sweep or worker records how it ended (LOST, or the result its folder holds). Only a worker
    process on this host that no longer exists counts: a silent heartbeat may be a store
    outage just ended, or another machine's clock (:func:`hpo.recovery.gone_why`)."""
    from optuna.trial import TrialState

    from hpo.recovery import gone_why

    if trial.state != TrialState.RUNNING:
        return None
    return gone_why(trial, time.time(), ctx.scenario.resources.heartbeat, _NOT_A_WORKER, (), False)


def _reason(row: Any) -> str:
    """Which trial the row runs again (``rerun of #2``), then its reason, if it has them
    (``rerun of #2: exit code 3``): a failed rerun still says what it reran."""
    again = next((f"{label} #{number}" for label, number in
                  (("retry of", row.retry_of), ("requeue of", row.requeue_of), ("rerun of", row.rerun_of))
                  if number is not None), "")
    return ": ".join(part for part in (again, row.reason or row.note) if part)


def _param_columns(scenario: Any, rows: Sequence[Any], constants: bool = True) -> list[str]:
    """The scenario's parameters (constants too when ``constants``), then any that only
    older trials have (a study resumed with --allow-space-change)."""
    names = [n for n, p in scenario.parameters.items() if constants or p.type != "constant"]
    extra = sorted({name for row in rows for name in row.params} - set(scenario.parameters))
    return names + extra


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _number(value: float | None, fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def export_rows(ctx: Context, out: Any, rows: Sequence[Any] | None = None) -> int:
    """Write the results CSV of DESIGN.md to ``out`` (plus ``repeat_of``: the trial whose
    configuration a row runs again, and ``note``: what a completed trial reported that is not
    recorded) from ``rows`` (default: the study's); return the number of rows."""
    from hpo.rows import repeat_of
    from hpo.scenario import RESULTS_LEADING, RESULTS_TRAILING

    scenario = ctx.scenario
    rows = _snapshot(ctx) if rows is None else rows
    metric, held_out = scenario.objective.metric, list(scenario.objective.held_out)
    params = _param_columns(scenario, rows)
    writer = csv.writer(out)
    writer.writerow([*RESULTS_LEADING, *params, metric, *held_out, *RESULTS_TRAILING])
    for row in rows:
        repeat = repeat_of(row)
        writer.writerow([row.number, row.state, *(row.params.get(p, "") for p in params),
                         _csv(row.value), *(_csv(row.held_out.get(h)) for h in held_out),
                         _csv(row.duration_s), row.folder, row.reason, "" if repeat is None else repeat, row.note])
    return len(rows)


def _csv(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def cmd_export(args: argparse.Namespace) -> int:
    """Write one row per trial, in trial-number order, to -o FILE (or stdout). A file that
    cannot be written is bad input (it names -o); a stdout that refuses the CSV ends the
    command as it ends the others (``error: cannot write to stdout: ...``, exit 1: :mod:`hpo.output`)."""
    from hpo.launch import plural

    ctx = _context(args)
    if args.output in (None, "-"):
        export_rows(ctx, sys.stdout, _snapshot(ctx))
        return EXIT_OK
    target = Path(args.output)
    if target.is_dir():
        raise InputError(f"-o: {target} is a folder; name a file in it, e.g. {target / 'trials.csv'}")
    if not target.parent.exists():
        raise InputError(f"-o: folder {target.parent} does not exist")
    rows = _snapshot(ctx)
    with _whole_file(target, "-o") as handle:
        count = export_rows(ctx, handle, rows)
    print(f"wrote {plural(count, 'trial')} to {target}")
    return EXIT_OK


@contextlib.contextmanager
def _whole_file(target: Path, flag: str) -> Iterator[Any]:
    """A text file to write ``target`` through, whole or not at all: a regular file is
    written beside it under a temporary name and renamed over it once closed (a device or
    pipe, such as /dev/stdout, is written in place). A failure to write leaves no temporary
    file; it is :class:`~hpo.render.FolderFull` for a full disk (exit 1), else an InputError
    naming ``flag``, ``target`` and the system's reason."""
    from hpo.files import replacing
    from hpo.render import folder_full

    existing = target.is_file()
    real = target.resolve() if existing else target  # a link to a file: the file is replaced
    try:
        if target.exists() and not existing:  # a device or a pipe
            with real.open("w", newline="") as handle:
                yield handle
            return
        if existing:
            real.open("a").close()  # refused where the file is read-only, as writing it in place would be
        with replacing(real) as temporary:
            with temporary.open("w", newline="") as handle:
                yield handle
            if existing:
                shutil.copymode(real, temporary)
    except OSError as exc:
        raise folder_full(exc, target) or InputError(f"{flag}: cannot write {target}: {exc.strerror or exc}") from None


def _new_folder(folder: Path, flag: str) -> Path:
    """``folder``, where a command may create its files; an InputError naming ``flag`` when a
    file is in its place or in the way of it."""
    from hpo.storage import file_in_the_way

    blocker = file_in_the_way(folder)
    if blocker == folder:
        raise InputError(f"{flag}: {folder} is a file, not a folder")
    if blocker is not None:
        raise InputError(f"{flag}: cannot create the folder {folder}: {blocker} is a file")
    return folder


def _made_folder(folder: Path, flag: str) -> Path:
    """``folder``, created with its parents; an InputError naming ``flag`` where it cannot be
    (no permission, a read-only or virtual file system)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{flag}: cannot create the folder {folder}: {exc.strerror or exc}") from None
    return folder


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the study's charts as PNG files into -o DIR (default: <workdir>/plots)."""
    from hpo.plots import draw_all, frozen

    ctx = _context(args)
    folder = _made_folder(_new_folder(Path(args.output), "-o"), "-o") if args.output else ctx.workdir / "plots"
    store = _store(ctx)
    trials = store.trials()  # one read: a sweep that goes on meanwhile changes no chart
    for path in draw_all(frozen(store.study, trials), ctx.scenario, folder, rows=store.rows(trials)):
        print(f"wrote {path}")
    return EXIT_OK


def cmd_tail(args: argparse.Namespace) -> int:
    """Follow trial N's log live, like tail -f; ends when the trial ends, or when its worker
    is found gone (it would never end: one line on stderr says so)."""
    from hpo.render import LOG_FILE, trial_folder

    ctx = _context(args)
    store = _store(ctx)
    row = next((r for r in store.rows([store.trial(args.trial)])), None)
    assert row is not None
    log = Path(row.folder or trial_folder(ctx.workdir, args.trial)) / LOG_FILE
    deadline = time.monotonic() + TAIL_WAIT_S
    if not log.exists() and not row.outcome.ended and args.follow:
        print(f"hpo: trial {args.trial} is {row.outcome.value}: following its log once it starts "
              f"(up to {TAIL_WAIT_S} s)", file=sys.stderr, flush=True)
    while not log.exists():
        if row.outcome.ended:
            raise InputError(f"trial {args.trial}: no log at {log}")
        elsewhere = "" if log.parent.exists() else _runs_elsewhere(store.trial(args.trial))
        if elsewhere:
            raise InputError(f"trial {args.trial}: it runs on {elsewhere}, and its log {log} is not on this machine; "
                             f"run hpo tail there, or give the workdir a filesystem both share")
        if not args.follow:
            print(f"hpo: trial {args.trial} is {row.outcome.value}: it has no log yet", file=sys.stderr)
            return EXIT_OK
        if time.monotonic() > deadline:
            raise InputError(f"trial {args.trial}: it has not started within {TAIL_WAIT_S} s "
                             "(is a sweep running?)")
        time.sleep(0.2)
    printed = False
    with log.open("rb") as handle:
        while True:
            chunk = handle.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                printed = True
                continue
            trial = store.trial(args.trial)
            gone = _worker_gone(ctx, trial)
            if not args.follow or trial.state.is_finished() or gone:
                rest = handle.read()
                sys.stdout.buffer.write(rest)
                sys.stdout.flush()
                if gone:
                    print(f"hpo: trial {args.trial}'s worker is gone ({gone}): its log ends here; {_RECORDED_LATER}",
                          file=sys.stderr)
                elif not (printed or rest):
                    print(f"hpo: trial {args.trial}'s log {log} is empty: it printed nothing"
                          f"{'' if trial.state.is_finished() else ' yet'}", file=sys.stderr)
                return EXIT_OK
            time.sleep(0.2)


def _runs_elsewhere(trial: Any) -> str:
    """The host that runs ``trial``, where its process has started on a machine other than this
    one; '' otherwise."""
    from hpo.recovery import run_info
    from hpo.scheduler import HOST
    from hpo.store import SYS_STARTED

    host = str(run_info(trial).get("host", ""))
    return host if host and host != HOST and SYS_STARTED in trial.system_attrs else ""


def cmd_stop(args: argparse.Namespace) -> int:
    """End trial N early; the worker running it records it as STOPPED. A queued trial (an
    interrupted or lost one's copy, a queued rerun) is recorded STOPPED here and never runs.
    InputError unless it runs or is queued, or where its worker's process on this host is gone
    (:func:`_worker_gone`)."""
    from optuna.trial import TrialState

    from hpo.outcome import Outcome, TrialResult
    from hpo.render import trial_folder

    ctx = _context(args)
    store = _store(ctx)
    trial = store.trial(args.trial)
    if trial.state == TrialState.WAITING:
        if store.withdraw(args.trial, TrialResult(Outcome.STOPPED, reason="stopped by the user before it ran"),
                          trial_folder(ctx.workdir, args.trial)):
            print(f"trial {args.trial} was queued: recorded STOPPED, it will not run")
            return EXIT_OK
        trial = store.trial(args.trial)  # a worker claimed it first
    gone = _worker_gone(ctx, trial)
    if gone:
        raise InputError(f"trial {args.trial}: its worker is gone ({gone}), so nothing runs it to stop; "
                         f"{_RECORDED_LATER}")
    store.request_stop(args.trial)
    print(f"asked the worker of trial {args.trial} to stop it")
    return EXIT_OK


def _no_best(rows: Sequence[Any]) -> str:
    """Why a study has no best trial: none completed yet (some run or wait, or none was
    run), or every trial ended another way (``5 FAIL, 1 TIMEOUT``)."""
    from collections import Counter

    if not rows or not all(row.outcome.ended for row in rows):
        return "no completed trial yet"
    counts = Counter(row.outcome.value for row in rows)
    ended = ", ".join(f"{count} {state}" for state, count in counts.most_common())
    return f"no trial completed: all {len(rows)} ended otherwise ({ended}); hpo status gives their reasons"


def _said_no_best(ctx: Context, rows: Sequence[Any]) -> int:
    """EXIT_ERROR, after one line on stderr saying why the study has no best trial
    (:func:`_no_best`): the study holds no result, which is no bad input."""
    print(f"error: study {ctx.scenario.name}: {_no_best(rows)}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def cmd_best(args: argparse.Namespace) -> int:
    """Print the best trial; --copy-to DIR copies its folder there."""
    from hpo.progress import in_order
    from hpo.rows import best_row

    ctx = _context(args)
    target = _new_folder(Path(args.copy_to), "--copy-to") if args.copy_to else None
    if target is not None and target.exists() and any(target.iterdir()):
        raise InputError(f"--copy-to: {target} exists and is not empty")
    rows = _snapshot(ctx)
    best = best_row(rows, ctx.scenario.objective.direction)
    if best is None:
        return _said_no_best(ctx, rows)
    created = target is not None and not target.exists()
    if target is not None:
        if not best.folder or not Path(best.folder).is_dir():
            raise InputError(f"--copy-to: trial {best.number}'s folder {best.folder or '(none)'} is gone")
        if target.resolve().is_relative_to(Path(best.folder).resolve()):
            raise InputError(f"--copy-to: {target} is inside trial {best.number}'s folder {best.folder}; "
                             "copy it to a folder outside it")
        _made_folder(target, "--copy-to")
        _copy_folder(Path(best.folder), target, created)  # before anything is printed: a closed stdout ends the command
    held = " ".join(f"{k}={v:.6g}" for k, v in in_order(best.held_out, ctx.scenario.objective.held_out).items())
    print(f"trial {best.number}: {ctx.scenario.objective.metric}={best.value:.6g} {held}".rstrip())
    for name, value in best.params.items():
        print(f"  {name} = {value}")
    print(f"  folder: {best.folder}")
    if target is not None:
        print(f"copied to {target}")
    return EXIT_OK


def _copy_folder(source: Path, target: Path, created: bool) -> None:
    """Copy ``source`` into the empty folder ``target``, whole or not at all (through a
    temporary folder beside it); where it cannot be, ``target`` is removed again if it was
    ``created`` for the copy, and :class:`~hpo.render.FolderFull` (a full disk, exit 1) or an
    InputError names ``target`` and the system's reason."""
    from hpo.render import FolderFull
    from hpo.storage import disk_full, free_space

    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copytree(source, temporary)
        temporary.replace(target)  # renaming over an empty folder replaces it
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                target.rmdir()
        line = f"--copy-to: cannot copy {source} to {target}: {_why(exc)}"
        raise (FolderFull(f"{line} ({free_space(target)})") if disk_full(exc) else InputError(line)) from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _why(exc: OSError) -> str:
    """The system's reason for ``exc`` (``No space left on device``); of a shutil.Error, for
    the first file that could not be copied."""
    if isinstance(exc, shutil.Error):
        first = str(exc.args[0][0][2])
        found = re.match(r"\[Errno (\d+)\]", first)
        return os.strerror(int(found.group(1))) if found else first
    return exc.strerror or str(exc)


def cmd_validate(args: argparse.Namespace) -> int:
    """Check the scenario, its design (CSV), templates and command without running anything."""
    from hpo import designs
    from hpo.engine import preflight
    from hpo.launch import plural
    from hpo.render import Renderer
    from hpo.samplers import describe_pruner
    from hpo.storage import optuna_url, reach
    from hpo.store import check_resume

    ctx = _context(args)
    scenario = ctx.scenario
    _workdir_owner(ctx, _workdir_flag(args))
    points = designs.design_points(scenario)
    budget = designs.total_trials(scenario)
    cluster = scenario.resources.cluster
    where = describe_plan(_plan(ctx), parallel=_asked(ctx, args)) if cluster is None else "trials on a Dask cluster"
    preflight(Renderer(scenario, ctx.workdir), ctx.workdir, points)
    reach(ctx.storage, create=False)
    _quiet_optuna()
    created = check_resume(scenario, ctx.storage, allow_space_change=args.allow_space_change)
    _same_study(ctx, _workdir_flag(args), lambda: created)
    pruner = describe_pruner(scenario.search)
    print(f"ok: {scenario.name}: {plural(len(scenario.parameters), 'parameter')}, method {scenario.search.method}, "
          f"{pruner + ', ' if pruner else ''}{plural(budget, 'trial')}, {where}")
    print(f"store: {optuna_url(ctx.storage)}")
    if cluster is not None and cluster.address is not None:
        print(f"cluster: the Dask scheduler at {cluster.address} (not contacted)")
    elif cluster is not None:
        from hpo.jobqueue import job_script

        print(f"cluster: up to {cluster.jobs} {cluster.kind} jobs, each submitted with this job script:")
        print(job_script(cluster, ctx.workdir / "jobs").rstrip())
        try:  # the script may be checked anywhere; hpo run refuses a machine that cannot submit it
            _check_submit(ctx)
        except InputError as exc:
            print(f"note: {exc}")
    _note_left_out(ctx)
    return EXIT_OK


def cmd_rerun(args: argparse.Namespace) -> int:
    """Run trial N's configuration again as a new trial, to check that it reproduces.

    The new trial records rerun_of: N, runs the same rendered files and command (--seed S
    gives it another trial_seed), is never pruned, and does not count toward search.trials.
    """
    from hpo.engine import Sweep
    from hpo.render import Renderer

    ctx = _writing_context(args, existing_study=True)
    if args.seed is not None and not Renderer(ctx.scenario, ctx.workdir).sees_trial_seed:  # a script may read params.json
        print("note: --seed reaches the trial only through params.json: no template reads trial_seed and the "
              "scenario sets no seed_flag (seed_flag: --seed passes it to a script that takes --seed)", flush=True)
    slots = _plan(ctx, parallel=1)
    sweep = Sweep(_sweep_config(ctx, slots, ctx.scenario.search.seed, args))
    _prepare(sweep, ctx, args)
    signals = _Signals(lambda signum: sweep.stop(),
                       ended=f"the rerun of trial {args.trial} was recorded INTERRUPTED and queued again; run the "
                             "same command to resume it (or hpo run, which runs it too)")
    with signals.installed():
        row, result = sweep.rerun(args.trial, args.seed)
    code = signals.exit_code(sweep.stop_note, sweep.stop_ended)
    if code is not None:
        return code
    from hpo.progress import ended_text

    metric = ctx.scenario.objective.metric
    original = sweep.store.rows([sweep.store.trial(args.trial)])[0]
    print(f"trial {row.number} (rerun of {args.trial}) {ended_text(result, metric, ctx.scenario.objective.held_out)}; "
          f"{_reproduced(metric, args.trial, original.value, result.value)}folder {row.folder}")
    return EXIT_OK if result.outcome.value == "COMPLETE" else EXIT_ERROR


def _reproduced(metric: str, number: int, before: float | None, after: float | None) -> str:
    """How a rerun's objective compares with trial ``number``'s (``same val_error as trial 4; ``
    or ``trial 4 had val_error=0.0243, this run +0.0069 (+28%); ``); '' where either has none."""
    if before is None or after is None:
        return ""
    if after == before:
        return f"the same {metric} as trial {number}; "
    change = f"{after - before:+.2g}" + (f" ({(after - before) / abs(before):+.0%})" if before else "")
    return f"trial {number} had {metric}={before:.4g}, this run {change}; "


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve optuna-dashboard on the study (pip install 'hpo[dashboard]'); Ctrl-C or SIGTERM ends it: the
    server shuts down between requests, and the command exits as every command does (130 SIGINT, 143 SIGTERM)."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    try:
        from optuna_dashboard import wsgi
    except ImportError:
        raise InputError("hpo dashboard needs optuna-dashboard: pip install 'hpo[dashboard]'") from None
    ctx = _context(args)
    store = _store(ctx)

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """No line per request: the console keeps the one line that says where to look."""

    try:
        server = make_server(args.host, args.port, wsgi(store.optuna_storage), handler_class=QuietHandler)
    except OSError as exc:
        raise InputError(f"{_serve_flag(exc)}: cannot serve on {args.host}:{args.port}: {exc.strerror or exc}") \
            from None
    print(f"optuna-dashboard on http://{args.host}:{server.server_port}/dashboard/ (study {ctx.scenario.name}; "
          "it lists every study of the store); Ctrl-C ends it", flush=True)

    stopped_by: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        """End the server between requests (an exception raised inside one would be swallowed by it)."""
        if not stopped_by:
            stopped_by.append(signum)
            threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):  # even where the shell started us with SIGINT ignored
        signal.signal(sig, stop)
    with server:
        server.serve_forever(poll_interval=0.2)
    return 128 + stopped_by[0] if stopped_by else EXIT_OK


def _serve_flag(exc: OSError) -> str:
    """The flag to blame where a server cannot listen: ``--host`` where the host is what
    fails (its name does not resolve, or it is no address of this machine), else ``--port``
    (in use, or not allowed)."""
    import errno
    import socket

    host_errors = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
    return "--host" if isinstance(exc, socket.gaierror) or exc.errno in host_errors else "--port"


@dataclass(frozen=True)
class Command:
    """One row of the command table: ``summary`` is what ``hpo --help`` and ``hpo NAME --help``
    say it does, in the user's terms (the handler's docstring is its contract, for developers)."""

    name: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None]
    summary: str


def _trial_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trial", type=int, help="trial number")


def _space_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-space-change", action="store_true",
                        help="resume even if the scenario's search space differs from the study's")


def _cluster_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="ADDRESS",
                        help="run the trials on the Dask cluster whose scheduler is at ADDRESS, e.g. "
                             "tcp://10.0.0.5:8786 (default: resources.cluster, else this machine)")


def _validate_args(parser: argparse.ArgumentParser) -> None:
    _cluster_arg(parser)
    _space_arg(parser)


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=_positive, default=1,
                        help="optimizer worker processes on this machine; they share its slots (parallel)")
    _cluster_arg(parser)
    _space_arg(parser)


def _worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=_seed, help="this worker's seed (default: scenario seed + pid)")
    parser.add_argument("--parallel", type=_slots, help="task slots of this worker, or auto (default: the scenario's)")
    parser.add_argument("--gpus", help="GPU ids this worker may use, e.g. 0,1")
    parser.add_argument("--slots", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)  # hpo run --workers: the log to write once it is gone
    _cluster_arg(parser)
    _space_arg(parser)


def _tail_args(parser: argparse.ArgumentParser) -> None:
    _trial_arg(parser)
    parser.add_argument("--no-follow", dest="follow", action="store_false", help="print the log and return")


def _status_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--last", type=_positive, help=f"show the last N trials (default {STATUS_ROWS})")
    group.add_argument("--all", action="store_true", help="show every trial")


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="CSV file to write (default: stdout)")


def _plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="folder for the PNG files (default: <workdir>/plots)")


def _best_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--copy-to", help="copy the best trial's folder to this new folder")


def _rerun_args(parser: argparse.ArgumentParser) -> None:
    _trial_arg(parser)
    parser.add_argument("--seed", type=_seed, help="the rerun's trial_seed (default: the original trial's)")
    _space_arg(parser)


def _dashboard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default 8080)")


def _whole(text: str, low: int, high: int | None = None) -> int:
    """``text`` as a whole number from ``low`` to ``high``, else argparse's type error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def _slots(text: str) -> int | str:
    """``--parallel``: a whole number of 1 or more, or ``auto``."""
    return text if text == "auto" else _positive(text)


def _seed(text: str) -> int:
    return _whole(text, 0, 2**32 - 1)  # NumPy's seeds (the scenario's leaves room for seed + worker index or pid)


def _port(text: str) -> int:
    return _whole(text, 0, 65535)


COMMANDS = (
    Command("run", cmd_run, _run_args,
            "Run the sweep to the end (resumable); --workers K runs K optimizer processes sharing this "
            "machine's slots, --cluster runs the trials on a Dask cluster."),
    Command("worker", cmd_worker, _worker_args,
            "Join the scenario's study as one more optimizer worker (e.g. from another machine)."),
    Command("status", cmd_status, _status_args,
            "Print the last trials (* marks the best) and a summary; --all prints every trial."),
    Command("tail", cmd_tail, _tail_args,
            "Follow trial N's log live, like tail -f; ends when the trial ends."),
    Command("stop", cmd_stop, _trial_arg,
            "End trial N early, from any terminal that reaches the store; it is recorded as STOPPED (a queued "
            "trial at once, and it never runs)."),
    Command("export", cmd_export, _export_args,
            "Write one row per trial, in trial-number order, to -o FILE (or stdout)."),
    Command("plot", cmd_plot, _plot_args,
            "Draw the study's charts as PNG files into -o DIR (default: <workdir>/plots)."),
    Command("best", cmd_best, _best_args,
            "Print the best trial, its held-out metrics and its folder; --copy-to DIR copies the folder there."),
    Command("validate", cmd_validate, _validate_args,
            "Check the scenario, its design, templates and command, and the store (contacted, nothing written), "
            "and that hpo run would resume its study and accept its workdir; print the slots and the store. "
            "Runs nothing."),
    Command("rerun", cmd_rerun, _rerun_args,
            "Run trial N's configuration again as a new trial, to check that it reproduces (--seed S gives it "
            "another trial_seed); it does not count toward search.trials, and a failure is not retried."),
    Command("dashboard", cmd_dashboard, _dashboard_args,
            "Serve optuna-dashboard on the study (pip install 'hpo[dashboard]'); Ctrl-C or SIGTERM ends it."),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command in :data:`COMMANDS`."""
    parser = _Parser(prog="hpo", description="Hyper-parameter optimization of PyTorch training scripts.",
                     epilog="environment:\n" + (__doc__ or "").split("Environment: ")[-1].replace("``", ""),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.summary, description=command.summary)
        child.add_argument("scenario", help="the scenario YAML file")
        child.add_argument("--storage", help="Optuna storage URL: sqlite:///PATH, postgresql://..., mysql://... "
                                             "or journal:PATH (default: sqlite in the workdir)")
        child.add_argument("--workdir", help="folder for trial folders and the default store "
                                             "(default: runs/<name> beside the scenario)")
        command.arguments(child)
        child.set_defaults(handler=command.run)
    return parser


EMPTY_REFUSED = {  # an option's dest: its flag, and what to give instead of an empty value (an unset "$DB")
    "storage": ("--storage", "give a URL such as sqlite:///path/study.db"),
    "workdir": ("--workdir", "give a folder, or leave --workdir out for runs/<name> beside the scenario"),
    "output": ("-o", "give a path, or leave -o out"),
    "copy_to": ("--copy-to", "give a folder to copy the best trial's folder to"),
    "host": ("--host", "give an address to listen on, e.g. 127.0.0.1, or leave --host out for it"),
    "gpus": ("--gpus", "give GPU ids, e.g. 0,1, or leave --gpus out for this machine's"),
}


def _refuse_empty(args: argparse.Namespace) -> None:
    """InputError for a path or URL option given an empty value (:data:`EMPTY_REFUSED`), which
    would otherwise read as not given and send the command to the default store or folder."""
    for dest, (flag, hint) in EMPTY_REFUSED.items():
        if getattr(args, dest, None) == "":
            raise InputError(f"{flag}: empty; {hint}")


def _start_forest_helper(scenario_path: str) -> None:
    """Start smac's forest helper (:mod:`hpo.forest_service`) before anything slow, where the
    scenario file asks for smac: it imports scikit-learn while this process imports Optuna and
    opens the store. :func:`_run_sweep` stops it if the sweep's sampler has no use for it."""
    import yaml

    from hpo.files import utf8_text
    from hpo.scenario import UniqueKeyLoader

    try:
        method = yaml.load(utf8_text(Path(scenario_path)), Loader=UniqueKeyLoader)["search"]["method"]
    except Exception:  # the scenario's own loading says what is wrong with it
        return
    if method == "smac":
        from hpo import forest_service

        forest_service.start()


def _quiet_optuna() -> None:
    """The command line speaks for itself: Optuna's info logs and API warnings stay out."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hpo`` console script; returns the exit code."""
    from hpo.errors import ExecutorUnavailable, StoreUnavailable

    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        if getattr(args, "handler", None) is None:
            raise InputError(f"a command is needed: {', '.join(c.name for c in COMMANDS)}; see hpo --help")
        _refuse_empty(args)
        if args.handler is cmd_worker or (args.handler is cmd_run and args.workers == 1):
            _start_forest_helper(args.scenario)
        if args.handler not in (cmd_status, cmd_export, cmd_best):  # these may answer from the row cache
            _quiet_optuna()
        if args.handler in (cmd_run, cmd_worker):  # a sweep runs on where its output is refused
            return int(args.handler(args))
        from hpo.output import refusals_raised

        with refusals_raised():
            return int(args.handler(args))
    except InputError as exc:
        print(f"error: {_located(str(exc), args)}", file=sys.stderr)
        return EXIT_INPUT
    except StoreUnavailable as exc:
        kept = "; results of finished trials are kept in their folders and recorded on resume" \
            if getattr(args, "handler", None) in (cmd_run, cmd_worker, cmd_rerun) else ""
        print(f"error: {exc}{kept}", file=sys.stderr)
        return EXIT_ERROR
    except ExecutorUnavailable as exc:
        print(f"error: {exc}; run the same command to resume (trials that were running were recorded "
              "INTERRUPTED and run again)", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        _stdout_gone()
        return EXIT_OK
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Exception as exc:
        from hpo.output import StdoutRefused
        from hpo.render import FolderFull

        if isinstance(exc, FolderFull):  # an output file of a command, on a full disk: not bad input
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR

        if isinstance(exc, StdoutRefused):
            _stdout_gone()
            print(f"error: cannot write to stdout: {exc.strerror}", file=sys.stderr)
            return EXIT_ERROR
        if os.environ.get("HPO_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _located(message: str, args: argparse.Namespace | None) -> str:
    """An error ``message``, led by the scenario file's name where it names a field of the
    scenario the command was given (:func:`hpo.errors.in_scenario`)."""
    from hpo.errors import in_scenario
    from hpo.scenario import Scenario, allowed_keys

    scenario = getattr(args, "scenario", None)
    if not isinstance(scenario, str):
        return message
    return in_scenario(message, Path(scenario).name, allowed_keys(Scenario))


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit says nothing more."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

if __name__ == "__main__":
    sys.exit(main())
