"""The ``hpo`` command line: one explicit table of commands (see :data:`COMMANDS`).

Every command takes the scenario file first. Exit codes: 0 ok, 2 bad input (scenario,
CSV, template, arguments; one line on stderr, no traceback), 130 interrupted, 1 anything
else.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from hpo.errors import InputError

EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


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
    from hpo.store import storage_url

    scenario = load_scenario(args.scenario)
    workdir = Path(args.workdir).resolve() if args.workdir else scenario.default_workdir()
    return Context(scenario, workdir, storage_url(scenario, args.storage, workdir))


def _load_study(ctx: Context) -> Any:
    from hpo.store import open_study

    return open_study(ctx.scenario, ctx.storage, create=False)


def _slots(ctx: Context, parallel: int | None, gpus: str | None) -> tuple[Any, ...]:
    from hpo.launch import detect_gpus, plan_slots

    resources = ctx.scenario.resources
    updates: dict[str, Any] = {}
    if parallel is not None:
        updates["parallel"] = parallel
    if gpus is not None:
        updates["gpus"] = tuple(int(g) for g in gpus.split(",") if g.strip())
    return plan_slots(resources.model_copy(update=updates), detect_gpus())


def _run_sweep(ctx: Context, slots: tuple[Any, ...], seed: int) -> int:
    from hpo.engine import Sweep, SweepConfig
    from hpo.progress import ProgressView
    from hpo.store import trial_rows

    sweep = Sweep(SweepConfig(ctx.scenario, ctx.storage, ctx.workdir, slots, seed))
    sweep.prepare()
    view = ProgressView(trial_rows(sweep.study), sweep.budget, ctx.scenario.objective.direction,
                        ctx.scenario.objective.metric, len(slots))
    with view:
        sweep.run(view)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """Run the sweep to the end (resumable); ``--workers K`` runs K optimizer processes."""
    ctx = _context(args)
    if args.workers == 1:
        return _run_sweep(ctx, _slots(ctx, None, None), ctx.scenario.search.seed)
    return _run_workers(ctx, args.workers)


def _run_workers(ctx: Context, workers: int) -> int:
    """Start ``workers`` optimizer processes sharing the study; show their progress from the store."""
    from hpo.engine import Sweep, SweepConfig
    from hpo.progress import ProgressView, follow_study
    from hpo.store import trial_rows

    slots = _slots(ctx, None, None)
    sweep = Sweep(SweepConfig(ctx.scenario, ctx.storage, ctx.workdir, slots, ctx.scenario.search.seed))
    sweep.prepare()
    shares = [slots[i::workers] for i in range(workers)]
    procs = []
    for index, share in enumerate(shares):
        argv = [sys.executable, "-m", "hpo", "worker", str(ctx.scenario.path), "--storage", ctx.storage,
                "--workdir", str(ctx.workdir), "--seed", str(ctx.scenario.search.seed + index),
                "--parallel", str(max(1, len(share)))]
        gpus = [g for slot in share for g in slot.gpus]
        if gpus:
            argv += ["--gpus", ",".join(map(str, gpus))]
        log = (ctx.workdir / f"worker-{index}.log").open("w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    print(f"started {workers} workers on {ctx.storage} (logs: {ctx.workdir}/worker-*.log)", flush=True)
    view = ProgressView(trial_rows(sweep.study), sweep.budget, ctx.scenario.objective.direction,
                        ctx.scenario.objective.metric, len(slots))
    try:
        with view:
            follow_study(sweep.study, view, lambda: all(proc.poll() is not None for proc in procs))
    except KeyboardInterrupt:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            proc.wait()
        raise
    codes = [proc.wait() for proc in procs]
    failed = [f"worker-{i}" for i, code in enumerate(codes) if code != 0]
    if failed:
        print(f"{', '.join(failed)} ended with an error: see {ctx.workdir}/worker-*.log", file=sys.stderr)
    return EXIT_OK if not failed else EXIT_ERROR


def cmd_worker(args: argparse.Namespace) -> int:
    """Join the scenario's study as one more optimizer worker (e.g. from another machine)."""
    ctx = _context(args)
    seed = args.seed if args.seed is not None else ctx.scenario.search.seed + os.getpid()
    return _run_sweep(ctx, _slots(ctx, args.parallel, args.gpus), seed)


def _print_status(ctx: Context, limit: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from hpo.progress import format_params
    from hpo.store import best_row, trial_rows

    scenario = ctx.scenario
    rows = trial_rows(_load_study(ctx))
    best = best_row(rows, scenario.objective.direction)
    console = Console() if sys.stdout.isatty() else Console(width=240)
    if limit != 0:
        table = Table(title=f"{scenario.name}: {len(rows)} trials", title_justify="left")
        names = [name for name, p in scenario.parameters.items() if p.type != "constant"]
        for column in ("trial", "state", *names, scenario.objective.metric,
                       *scenario.objective.held_out, "seconds", "reason"):
            table.add_column(column, overflow="fold")
        for row in rows[-limit:] if limit else rows:
            mark = " *" if best is not None and row.number == best.number else ""
            table.add_row(f"{row.number}{mark}", row.state, *(_cell(row.params.get(n)) for n in names),
                          _number(row.value), *(_number(row.held_out.get(h)) for h in scenario.objective.held_out),
                          _number(row.duration_s, ".1f"), row.reason)
        console.print(table)
    if best is None:
        console.print("best: no completed trial yet")
    else:
        held = " ".join(f"{k}={v:.4g}" for k, v in best.held_out.items())
        console.print(f"best: trial {best.number} {scenario.objective.metric}={best.value:.4g} {held}"
                      f"  ({format_params(best.params)})", highlight=False, soft_wrap=True)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _number(value: float | None, fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the table of trials (* marks the best) and the best so far."""
    _print_status(_context(args), args.last)
    return EXIT_OK


def export_rows(ctx: Context, out: Any) -> int:
    """Write the results CSV of DESIGN.md to ``out``; return the number of rows."""
    from hpo.store import trial_rows

    scenario = ctx.scenario
    rows = trial_rows(_load_study(ctx))
    metric, held_out = scenario.objective.metric, list(scenario.objective.held_out)
    writer = csv.writer(out)
    writer.writerow(["number", "state", *scenario.parameters, metric, *held_out, "duration_s", "folder", "reason"])
    for row in rows:
        writer.writerow([row.number, row.state, *(row.params.get(p, "") for p in scenario.parameters),
                         _csv(row.value), *(_csv(row.held_out.get(h)) for h in held_out),
                         _csv(row.duration_s), row.folder, row.reason])
    return len(rows)


def _csv(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def cmd_export(args: argparse.Namespace) -> int:
    """Write one row per trial, in trial-number order, to ``-o FILE`` (or stdout)."""
    ctx = _context(args)
    if args.output in (None, "-"):
        export_rows(ctx, sys.stdout)
        return EXIT_OK
    target = Path(args.output)
    if target.parent and not target.parent.exists():
        raise InputError(f"-o: folder {target.parent} does not exist")
    with target.open("w", newline="") as handle:
        count = export_rows(ctx, handle)
    print(f"wrote {count} trials to {target}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the study's charts as PNG files into ``-o DIR``."""
    from hpo.plots import draw_all

    ctx = _context(args)
    paths = draw_all(_load_study(ctx), ctx.scenario, Path(args.output))
    for path in paths:
        print(f"wrote {path}")
    return EXIT_OK


def _find_trial(ctx: Context, number: int) -> Any:
    from hpo.store import trial_rows

    rows = [row for row in trial_rows(_load_study(ctx)) if row.number == number]
    if not rows:
        raise InputError(f"trial {number}: no such trial in study {ctx.scenario.name}")
    return rows[0]


def cmd_tail(args: argparse.Namespace) -> int:
    """Follow trial N's log live, like ``tail -f``; ends when the trial ends."""
    from hpo.render import LOG_FILE, trial_folder

    ctx = _context(args)
    study = _load_study(ctx)
    row = _find_trial(ctx, args.trial)
    log = Path(row.folder or trial_folder(ctx.workdir, args.trial)) / LOG_FILE
    deadline = time.monotonic() + 30
    while not log.exists():
        if row.state != "RUNNING" or time.monotonic() > deadline:
            raise InputError(f"trial {args.trial}: no log at {log}")
        time.sleep(0.2)
    with log.open("rb") as handle:
        while True:
            chunk = handle.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            if not args.follow or _trial_state(study, args.trial) != "RUNNING":
                rest = handle.read()
                sys.stdout.buffer.write(rest)
                sys.stdout.flush()
                return EXIT_OK
            time.sleep(0.2)


def _trial_state(study: Any, number: int) -> str:
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    return trial.state.name


def cmd_stop(args: argparse.Namespace) -> int:
    """End trial N early; the worker running it records it as STOPPED."""
    from hpo.engine import request_stop

    ctx = _context(args)
    request_stop(_load_study(ctx), args.trial)
    print(f"asked the worker of trial {args.trial} to stop it")
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    """Print the best trial; ``--copy-to DIR`` copies its folder there."""
    from hpo.store import best_row, trial_rows

    ctx = _context(args)
    best = best_row(trial_rows(_load_study(ctx)), ctx.scenario.objective.direction)
    if best is None:
        print("no completed trial yet")
        return EXIT_ERROR
    held = " ".join(f"{k}={v:.6g}" for k, v in best.held_out.items())
    print(f"trial {best.number}: {ctx.scenario.objective.metric}={best.value:.6g} {held}".rstrip())
    for name, value in best.params.items():
        print(f"  {name} = {value}")
    print(f"  folder: {best.folder}")
    if args.copy_to:
        target = Path(args.copy_to)
        if target.exists() and any(target.iterdir()):
            raise InputError(f"--copy-to: {target} exists and is not empty")
        shutil.copytree(best.folder, target, dirs_exist_ok=True)
        print(f"copied to {target}")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    """Check the scenario, its design (CSV) and its templates without running anything."""
    from hpo import designs
    from hpo.engine import preflight
    from hpo.launch import detect_gpus, plan_slots
    from hpo.render import Renderer

    ctx = _context(args)
    scenario = ctx.scenario
    points = designs.design_points(scenario)
    budget = designs.total_trials(scenario)
    slots = plan_slots(scenario.resources, detect_gpus())
    preflight(Renderer(scenario), ctx.workdir, points)
    print(f"ok: {scenario.name}: {len(scenario.parameters)} parameters, method {scenario.search.method}, "
          f"{budget} trials, {len(slots)} slots, store {ctx.storage}")
    return EXIT_OK


@dataclass(frozen=True)
class Command:
    """One row of the command table."""

    name: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None]


def _no_args(parser: argparse.ArgumentParser) -> None:
    return None


def _trial_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trial", type=int, help="trial number")


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=_positive, default=1, help="optimizer worker processes on this machine")


def _worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, help="this worker's seed (default: scenario seed + pid)")
    parser.add_argument("--parallel", type=_positive, help="task slots of this worker (default: the scenario's)")
    parser.add_argument("--gpus", help="GPU ids this worker may use, e.g. 0,1")


def _tail_args(parser: argparse.ArgumentParser) -> None:
    _trial_arg(parser)
    parser.add_argument("--no-follow", dest="follow", action="store_false", help="print the log and return")


def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--last", type=int, default=None, help="show only the last N trials")


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="CSV file to write (default: stdout)")


def _plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="plots", help="folder for the PNG files")


def _best_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--copy-to", help="copy the best trial's folder to this new folder")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


COMMANDS = (
    Command("run", cmd_run, _run_args),
    Command("worker", cmd_worker, _worker_args),
    Command("status", cmd_status, _status_args),
    Command("tail", cmd_tail, _tail_args),
    Command("stop", cmd_stop, _trial_arg),
    Command("export", cmd_export, _export_args),
    Command("plot", cmd_plot, _plot_args),
    Command("best", cmd_best, _best_args),
    Command("validate", cmd_validate, _no_args),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command in :data:`COMMANDS`."""
    parser = _Parser(prog="hpo", description="Hyper-parameter optimization of PyTorch training scripts.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=(command.run.__doc__ or "").splitlines()[0],
                               description=command.run.__doc__)
        child.add_argument("scenario", help="the scenario YAML file")
        child.add_argument("--storage", help="Optuna storage URL (sqlite:///..., postgresql://..., journal:PATH)")
        child.add_argument("--workdir", help="folder for trial folders and the default store")
        command.arguments(child)
        child.set_defaults(handler=command.run)
    return parser


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hpo`` console script; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        args = build_parser().parse_args(argv)
        return int(args.handler(args))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("interrupted: running trials were ended and will be retried on resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("HPO_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
