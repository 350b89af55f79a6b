"""The study store: an Optuna study, the single source of truth of a sweep.

Storage URLs are Optuna's (``sqlite:///x.db``, ``postgresql://...``, ``mysql://...``) plus
``journal:PATH`` for Optuna's journal file. The default is an SQLite file in the workdir,
opened in WAL mode with a long busy timeout so several workers can share it.

What hpo records on a trial beyond Optuna's own fields lives in two user attributes, each
written once: ``run`` when the trial starts (folder, worker, host, process token, worker
seed) and ``result`` when it ends (held-out metrics, duration, reason, outcome).
:func:`trial_rows` turns trials into the rows that status, export and plots show. Asking for a trial happens under :func:`ask_lock`, which serialises askers across
threads, processes and (for server databases) machines, so the trial budget is exact.
"""
from __future__ import annotations

import contextlib
import fcntl
import math
import sqlite3
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo.errors import InputError
from hpo.scenario import Scenario

RUN_ATTR = "run"
RESULT_ATTR = "result"
SYS_HEARTBEAT = "hpo:heartbeat"
SYS_STOP = "hpo:stop"
SYS_RETRY_OF = "hpo:retry_of"
SYS_RETRIES = "hpo:retries"
SYS_DESIGN_INDEX = "hpo:design_index"
STUDY_METRIC = "hpo:metric"
SQLITE_TIMEOUT_S = 120
_THREAD_LOCK = threading.Lock()


def storage_url(scenario: Scenario, override: str | None = None, workdir: Path | None = None) -> str:
    """The study's storage URL: ``--storage``, the scenario's ``storage``, or the default."""
    if override:
        return override
    if scenario.storage:
        return scenario.storage
    return f"sqlite:///{(workdir or scenario.default_workdir()) / 'study.db'}"


def _sqlite_path(url: str) -> Path | None:
    if url.startswith("sqlite:///"):
        return Path(url[len("sqlite:///"):])
    return None


def _journal_path(url: str) -> Path | None:
    if url.startswith("journal:"):
        return Path(url[len("journal:"):].removeprefix("//"))
    return None


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open (creating if need be) the storage at ``url``; a bad URL is an InputError."""
    journal = _journal_path(url)
    if journal is not None:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        journal.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(journal)))
    sqlite = _sqlite_path(url)
    kwargs: dict[str, Any] = {}
    if sqlite is not None:
        sqlite.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(sqlite, timeout=SQLITE_TIMEOUT_S)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
        kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S}
    else:
        kwargs["pool_pre_ping"] = True
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except ImportError as exc:
        raise InputError(f"--storage: the driver for {url.split(':')[0]} is not installed ({exc.name}); "
                         f"pip install 'hpo[postgres]' for PostgreSQL") from None
    except Exception as exc:  # SQLAlchemy raises many kinds for a bad URL or server
        raise InputError(f"--storage: cannot open {redact(url)}: {str(exc).splitlines()[0]}") from None


def redact(url: str) -> str:
    """``url`` with any password masked, for messages."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def open_study(scenario: Scenario, url: str, sampler: optuna.samplers.BaseSampler | None = None,
               pruner: optuna.pruners.BasePruner | None = None, create: bool = True) -> optuna.Study:
    """Load the scenario's study (creating it when ``create``); InputError if it is missing."""
    if create:
        with ask_lock(url):
            storage = open_storage(url)
            study = optuna.create_study(storage=storage, study_name=scenario.name, sampler=sampler,
                                        pruner=pruner, direction=scenario.objective.direction,
                                        load_if_exists=True)
        if study.direction.name.lower() != scenario.objective.direction:
            raise InputError(f"objective.direction: the study {scenario.name} was created to "
                             f"{study.direction.name.lower()}, not {scenario.objective.direction}")
        return study
    local = _sqlite_path(url) or _journal_path(url)
    if local is not None and not local.exists():
        raise InputError(f"no study named {scenario.name}: {local} does not exist (run `hpo run` first)")
    storage = open_storage(url)
    try:
        return optuna.load_study(study_name=scenario.name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        raise InputError(f"no study named {scenario.name} in {url}: run `hpo run` first") from None


@contextlib.contextmanager
def ask_lock(url: str) -> Iterator[None]:
    """Hold the study-wide lock under which the budget is checked and a trial is asked.

    SQLite and journal files use a lock file beside them (all processes on the machine);
    PostgreSQL and MySQL use an advisory lock on the server (all machines).
    """
    with _THREAD_LOCK:
        local = _sqlite_path(url) or _journal_path(url)
        if local is not None:
            lock_path = local.with_name(local.name + ".hpo-lock")
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            with lock_path.open("a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
            return
        with _server_lock(url):
            yield


@contextlib.contextmanager
def _server_lock(url: str) -> Iterator[None]:
    import sqlalchemy

    key = zlib.crc32(url.encode()) & 0x7FFFFFFF
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    dialect = engine.dialect.name
    with engine.connect() as conn:
        if dialect == "postgresql":
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            release = "SELECT pg_advisory_unlock(:k)"
        elif dialect == "mysql":
            conn.execute(sqlalchemy.text("SELECT GET_LOCK(:k, 600)"), {"k": str(key)})
            release = "SELECT RELEASE_LOCK(:k)"
        else:
            raise InputError(f"--storage: {dialect} has no lock that hpo can share; use sqlite, postgresql or mysql")
        try:
            yield
        finally:
            conn.execute(sqlalchemy.text(release), {"k": key if dialect == "postgresql" else str(key)})
            conn.commit()
    engine.dispose()


def counted_trials(trials: list[FrozenTrial]) -> int:
    """Trials that count against the budget: all but waiting ones and those since retried."""
    superseded = {t.system_attrs[SYS_RETRY_OF] for t in trials if SYS_RETRY_OF in t.system_attrs}
    return sum(1 for t in trials if t.state != TrialState.WAITING and t.number not in superseded)


@dataclass(frozen=True)
class TrialRow:
    """One trial as status, export and plots show it."""

    number: int
    state: str
    params: Mapping[str, Any]
    value: float | None
    held_out: Mapping[str, float]
    duration_s: float | None
    folder: str
    reason: str
    retry_of: int | None = None


def run_info(trial: FrozenTrial) -> dict[str, Any]:
    """What was recorded when the trial started (empty for trials hpo did not run)."""
    return dict(trial.user_attrs.get(RUN_ATTR) or {})


def result_info(trial: FrozenTrial) -> dict[str, Any]:
    """What was recorded when the trial ended (empty while it runs)."""
    return dict(trial.user_attrs.get(RESULT_ATTR) or {})


def display_state(trial: FrozenTrial) -> str:
    """Optuna's state name, or hpo's finer outcome (e.g. STOPPED) when one was recorded."""
    return str(result_info(trial).get("outcome") or trial.state.name)


def trial_row(trial: FrozenTrial) -> TrialRow:
    """The :class:`TrialRow` of one Optuna trial."""
    result = result_info(trial)
    duration = result.get("duration_s")
    if duration is None and trial.datetime_start and trial.datetime_complete:
        duration = (trial.datetime_complete - trial.datetime_start).total_seconds()
    value = trial.value if trial.state == TrialState.COMPLETE else None
    return TrialRow(number=trial.number, state=display_state(trial), params=dict(trial.params),
                    value=value, held_out=dict(result.get("held_out") or {}),
                    duration_s=duration, folder=str(run_info(trial).get("folder", "")),
                    reason=str(result.get("reason", "")),
                    retry_of=trial.system_attrs.get(SYS_RETRY_OF))


def trial_rows(study: optuna.Study) -> list[TrialRow]:
    """Every trial that ran or runs (waiting design points left out), by number."""
    trials = study.get_trials(deepcopy=False)
    return [trial_row(t) for t in sorted(trials, key=lambda t: t.number) if t.state != TrialState.WAITING]


def best_row(rows: list[TrialRow], direction: str) -> TrialRow | None:
    """The completed row with the best objective value, or None."""
    done = [r for r in rows if r.value is not None and math.isfinite(r.value)]
    if not done:
        return None
    pick = min if direction == "minimize" else max
    return pick(done, key=lambda r: r.value)  # type: ignore[arg-type, return-value]
