"""Where a study lives: storage URLs, opening a storage, the ask lock, riding out outages.

Storage URLs are Optuna's (``sqlite:///x.db``, ``postgresql://...``, ``mysql://...``) plus
``journal:PATH`` for Optuna's journal file. The default is an SQLite file in the workdir,
opened in WAL mode with a long busy timeout so several workers can share it, and with
``synchronous=NORMAL``, which in WAL mode loses no commit when a process is killed and never
corrupts the file (a power cut may undo the last commits; the trials they touched are then
recovered as lost ones are).

:func:`ask_lock` serialises askers across threads, processes and (for server databases)
machines, so the trial budget is exact; a server's lock can be lost in an outage, and the
lock says so (:class:`LockLost`). :class:`Retrying` runs store calls through an
outage: it retries with backoff for ``resources.store_retry`` seconds, then raises
:class:`StoreUnavailable` with one line that says so. A store whose disk is full is such an
outage, told as one (:func:`disk_full`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sqlite3
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hpo.errors import InputError, StoreUnavailable

if TYPE_CHECKING:
    import optuna

HOST = socket.gethostname()  # names this machine in workers' ids and in the ask lock's holder
SQLITE_TIMEOUT_S = 120
_JOURNAL_LINE_MAX = 1 << 20  # a journal's first record (the study's creation) is far shorter
MAX_PAUSE_S = 5.0  # the longest pause between two tries of a store call: every thread tries again this soon
SCHEMES = ("sqlite:///PATH", "postgresql://...", "mysql://...", "journal:PATH")
_SERVER_SCHEMES = ("postgresql", "postgres", "mysql")
_THREAD_LOCK = threading.RLock()
_log = logging.getLogger("hpo.storage")
T = TypeVar("T")


class NoStudy(InputError):
    """The store holds no study of the name asked for (no file, no Optuna tables, no such study)."""


class LockLost(Exception):
    """The server ended the session that held the ask lock (a restart, a dropped connection):
    another process may have taken the lock since, so what was read under it is stale."""


def storage_url(scenario: Any, override: str | None = None, workdir: Path | None = None) -> str:
    """The study's storage URL: ``--storage``, the scenario's ``storage``, or SQLite in the
    workdir. ``postgres://`` (Heroku's and libpq's spelling) is read as ``postgresql://``, and a
    file's path that starts with ``~`` (``--storage=sqlite:///~/x.db``: no shell expands it
    there) from the home folder."""
    url = override or scenario.storage or f"sqlite:///{(workdir or scenario.default_workdir()) / 'study.db'}"
    for prefix in ("sqlite:///", "journal:"):  # a file's path from the home folder, which no shell expanded
        if url.startswith(prefix) and url[len(prefix):].startswith("~"):
            return prefix + os.path.expanduser(url[len(prefix):])
    return "postgresql://" + url[len("postgres://"):] if url.startswith("postgres://") else url


def sqlite_path(url: str) -> Path | None:
    """The database file of an ``sqlite:///`` URL, else None."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def journal_path(url: str) -> Path | None:
    """The journal file of a ``journal:PATH`` URL, else None."""
    return Path(url[len("journal:"):].removeprefix("//")) if url.startswith("journal:") else None


def local_path(url: str) -> Path | None:
    """The file of a file-based store (SQLite or journal), else None."""
    return sqlite_path(url) or journal_path(url)


_CREATE_ATTEMPTS = 5
_CREATE_RACE = re.compile(r"already exists|UNIQUE constraint failed|duplicate key value", re.IGNORECASE)
# A server that is restarting or shutting down (PostgreSQL's SQLSTATE class 57P, or a session
# it ends as it goes) answers a good URL: opening the store again later succeeds, so it is an
# outage, not bad input. A refused connection is what a wrong port gets, and also what a
# restarting server answers between its stop and its start (well under a second): it is tried
# again for REFUSED_GRACE_S before it is bad input. A process tells the two apart at its first
# contact (reach), before its store calls are retried.
# Opening with ``create``, the server answered the tables' creation before any commit Optuna
# wraps (StorageInternalError) can fail, so such a failure is an outage too, whatever its cause.
REFUSED_GRACE_S = 3.0
_REFUSED = re.compile(r"Connection refused", re.IGNORECASE)
_NO_TABLES = re.compile(r'relation "\w+" does not exist|no such table|Table \S+ doesn\'t exist', re.IGNORECASE)
_DISK_FULL = re.compile(r"database or disk is full|No space left on device|Disk quota exceeded", re.IGNORECASE)
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# SQLite's own: a full database file, and the shared-memory file of WAL mode that a full disk
# keeps from being made (it says only "disk I/O error")
_DISK_FULL_SQLITE = ("SQLITE_FULL", "SQLITE_IOERR_SHMSIZE")
_ERRNO = re.compile(r"^\[Errno \d+\] ")
_SERVER_RESTARTING = re.compile(r"terminating connection due to administrator command|"
                                r"server closed the connection unexpectedly|"
                                r"the database system is (starting up|shutting down|in recovery)", re.IGNORECASE)


def check_url(url: str) -> None:
    """Raise InputError naming ``--storage`` unless ``url`` is of a scheme hpo can open."""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if local_path(url) is None and scheme not in _SERVER_SCHEMES:
        raise InputError(f"--storage: cannot open {redact(url)}: the URL must be one of {', '.join(SCHEMES)}")


def open_storage(url: str, create: bool = True) -> optuna.storages.BaseStorage:
    """Open the storage at ``url``, creating its tables when ``create`` (else it must have
    them: a reader skips Optuna's schema checks); a bad URL is an InputError. A refused
    connection is tried again for ``REFUSED_GRACE_S`` seconds first (a server restarts), and
    a server that is restarting raises its error for the caller's :class:`Retrying`. A database's
    pooled connections are closed when its storage is collected or, at the latest, at exit: the
    last to close an SQLite store removes its -wal and -shm files."""
    import optuna  # imported when a store is opened: commands that answer from the row cache never need it

    check_url(url)
    journal = journal_path(url)
    if journal is not None:
        from optuna.storages.journal import JournalStorage

        journal.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(_journal_file(journal))
    sqlite = sqlite_path(url)
    kwargs: dict[str, Any] = {}
    if sqlite is not None:
        sqlite.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(sqlite, timeout=SQLITE_TIMEOUT_S)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
        kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S, "factory": _SQLiteConnection}
    else:
        kwargs["pool_pre_ping"] = True

    def rdb_storage() -> optuna.storages.RDBStorage:
        attempt = 0
        while True:
            try:
                storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=not create,
                                                     skip_table_creation=not create)
                weakref.finalize(storage, storage.engine.dispose)
                return storage
            except Exception as exc:
                # Another process (a second worker, optuna-dashboard) created the schema between
                # SQLAlchemy's check and its CREATE or INSERT: it exists now, so open again.
                attempt += 1
                if not (create and _CREATE_RACE.search(str(exc))) or attempt == _CREATE_ATTEMPTS:
                    raise
                time.sleep(0.1 * attempt)

    try:
        return _while_refused(rdb_storage)
    except ImportError as exc:
        raise _missing_driver(url, exc) from None
    except Exception as exc:  # SQLAlchemy raises many kinds for a bad URL or server
        if isinstance(exc, _transient_errors()) and (_server_restarting(exc) or (
                create and isinstance(exc, optuna.exceptions.StorageInternalError))):
            raise  # the caller's Retrying waits for the server
        if not create and _said(exc, _NO_TABLES):
            raise NoStudy(f"--storage: {redact(url)} holds no study (it has no Optuna tables): "
                          f"run `hpo run` first") from None
        raise InputError(f"--storage: cannot open {redact(url)}: {_root_cause(exc)}") from None


def reach(url: str, create: bool = True) -> None:
    """Make first contact with the store at ``url``, so that bad input is told apart from an
    outage before any store call is retried. An InputError naming ``--storage``: for a server,
    a refused connection (past ``REFUSED_GRACE_S``), a wrong password, a missing database or
    driver; for a file, a folder in its place or one that cannot be created, or a file that
    cannot be opened or is not a database (SQLite) or journal. With ``create``, a file's
    folders and the file are created here; without, nothing is written. A server that is
    restarting is left to the caller's :class:`Retrying`."""
    check_url(url)
    local = local_path(url)
    if local is not None:
        _reach_file(local, sqlite=sqlite_path(url) is not None, create=create)
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    except ImportError as exc:
        raise _missing_driver(url, exc) from None
    try:
        _while_refused(lambda: engine.connect().close())
    except Exception as exc:
        if isinstance(exc, _transient_errors()) and _server_restarting(exc):
            return
        hint = " (is a server running there?)" if _refused(exc) else ""
        raise InputError(f"--storage: cannot open {redact(url)}: {_root_cause(exc)}{hint}") from None
    finally:
        engine.dispose()


def file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder`` and the folders above it (from the top) that exists and is
    not a folder, so that ``folder`` cannot be created; None if there is none."""
    return next((path for path in (*reversed(folder.parents), folder) if path.exists() and not path.is_dir()), None)


def _reach_file(path: Path, *, sqlite: bool, create: bool) -> None:
    if path.is_dir():
        example = path / ("study.db" if sqlite else "study.log")
        raise InputError(f"--storage: {path} is a folder; name a file in it, e.g. {example}")
    blocker = file_in_the_way(path.parent)
    if blocker is not None:
        raise InputError(f"--storage: cannot create the folder {path.parent}: {blocker} is a file")
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--storage: cannot create the folder {path.parent}: {exc.strerror}") from None
    elif not path.exists():
        return
    try:
        if sqlite:
            with contextlib.closing(sqlite3.connect(path, timeout=SQLITE_TIMEOUT_S)) as conn:
                conn.execute("PRAGMA schema_version")  # reads the header: is it a database?
        else:
            path.open("a" if create else "rb").close()
            _check_journal(path)
    except (OSError, sqlite3.Error) as exc:
        if disk_full(exc):
            return  # not bad input: the store's calls wait for room, saying so
        raise InputError(f"--storage: cannot open {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _check_journal(path: Path) -> None:
    """Raise InputError naming ``--storage`` unless ``path`` is empty or starts as Optuna's
    journal files do: a line holding a JSON object with an ``op_code``. Reads one line."""
    with path.open("rb") as handle:
        first = handle.readline(_JOURNAL_LINE_MAX)
    if not first:
        return
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not (isinstance(record, dict) and "op_code" in record):
        raise InputError(f"--storage: cannot open {path}: file is not an Optuna journal")


def _while_refused(fn: Callable[[], T]) -> T:
    """``fn()``, called again while it fails on a refused connection, for ``REFUSED_GRACE_S``."""
    until = time.monotonic() + REFUSED_GRACE_S
    while True:
        try:
            return fn()
        except Exception as exc:
            if not _refused(exc) or time.monotonic() >= until:
                raise
            time.sleep(0.25)


def _journal_file(path: Path) -> optuna.storages.journal.JournalFileBackend:
    """Optuna's journal file at ``path``, its records appended whole or not at all (Optuna's
    own append leaves the part a full disk took, and the next record written after it makes
    the line, and so the whole journal, unreadable)."""
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))  # Optuna's default lock, as its other users of the file take it

    class WholeRecords(JournalFileBackend):
        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
            lock.acquire()
            try:
                _append_whole(path, data)
            finally:
                lock.release()

    return WholeRecords(str(path), lock_obj=lock)


def _append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` and sync it; where that fails part-way, the file is cut
    back to its length before, and the error raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            rest = memoryview(data)
            while rest:
                rest = rest[os.write(fd, rest):]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


_MYSQL_PACKAGES = {"pymysql": "pymysql", "mysqlconnector": "mysql-connector-python", "mariadbconnector": "mariadb"}


_PG_PACKAGES = {"psycopg2": "psycopg2-binary"}  # a PostgreSQL driver's module: the package to install it with


def _missing_driver(url: str, exc: ImportError) -> InputError:
    """The InputError for a server URL whose driver module ``exc.name`` is missing, with what
    to install: for MySQL the driver's package (``mysql://`` and ``mysql+mysqldb://``, whose
    mysqlclient needs a compiler: PyMySQL, with the URL that uses it), else hpo's PostgreSQL extra
    (psycopg 3; for another driver, such as psycopg2, the URL that uses psycopg 3 or that driver).
    Optuna raises its own ImportError from SQLAlchemy's, which names the module."""
    scheme = url.split(":", 1)[0]
    module = exc.name or getattr(exc.__cause__, "name", None)
    base, _, driver = scheme.lower().partition("+")
    if base == "mysql":
        package = _MYSQL_PACKAGES.get(driver)
        hint = f"pip install {package}" if package else \
            f"pip install pymysql and use {redact('mysql+pymysql' + url[len(scheme):])}"
    elif driver in ("", "psycopg"):
        hint = "pip install 'hpo[postgres]' for PostgreSQL"
    else:  # another driver than hpo's extra installs (psycopg 3): use that one, or install this one
        hint = (f"use {redact('postgresql' + url[len(scheme):])} with pip install 'hpo[postgres]', "
                f"or pip install {_PG_PACKAGES.get(module or driver, module or driver)}")
    return InputError(f"--storage: the driver for {scheme} is not installed{f' ({module})' if module else ''}; {hint}")


class _SQLiteConnection(sqlite3.Connection):
    """An SQLite connection that syncs the WAL at checkpoints only (``synchronous=NORMAL``):
    with ``FULL``, SQLite's default, each commit waits for the disk. On a local disk a bare
    commit takes 0.35 ms with ``FULL`` and 0.02 ms with ``NORMAL``; through Optuna's storage,
    whose calls cost about 1 ms each, the gain is about 0.1 ms a call (a model-based sweep makes
    about 13 a trial in its critical path), more on a slow or network disk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.execute("PRAGMA synchronous=NORMAL")


_SECRET_QUERY = re.compile(r"(?i)\b((?:ssl)?password|passwd|pwd)=[^&#]*")


def redact(url: str) -> str:
    """``url`` with any password masked, for messages: the one after ``user:`` (up to the
    last ``@``, so a password holding an unencoded ``@`` or ``/`` is masked whole) and a
    ``password=`` query parameter."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, query_sep, query = rest.partition("?")
    user, at, host = head.rpartition("@")
    if at and ":" in user:
        head = f"{user.split(':', 1)[0]}:***@{host}"
    return f"{scheme}://{head}{query_sep}{_SECRET_QUERY.sub(lambda m: f'{m.group(1)}=***', query)}"


def optuna_url(url: str) -> str:
    """How Optuna's own tools (``optuna.load_study``, optuna-dashboard) open this store.

    A server or SQLite URL is Optuna's already; a journal file needs two lines of Python.
    """
    journal = journal_path(url)
    if journal is None:
        return redact(url)
    return ("from optuna.storages.journal import JournalFileBackend, JournalStorage; "
            f"storage = JournalStorage(JournalFileBackend({os.path.abspath(journal)!r}))")


LOCK_WAIT_NOTED_S = 10.0  # a wait this long for the file lock is said, with its holder
LOCK_POLL_S = 0.005  # how often a waiter tries the file lock again
SERVER_LOCK_POLL_S = 0.05  # how often a waiter tries a server's lock again (a query each time)


@contextlib.contextmanager
def ask_lock(url: str, on_wait: Callable[[str], None] | None = None,
             give_up: Callable[[], bool] = lambda: False, study: str = "") -> Iterator[Callable[[], bool]]:
    """Hold the lock of the study named ``study`` under which the budget is checked and a
    trial is asked (``""``: the whole store's, under which its tables are made); yields
    ``held()``, whether the lock is still this process's.

    SQLite and journal files use a lock file beside them (all processes on the machine; it
    is never lost, and all the file's studies share it), which names the process that holds
    it. PostgreSQL and MySQL use a session's advisory lock on the server (all machines), one
    per database and study, whatever host name the URL gives the server; its session is
    named after the worker (``application_name``), which the note of a long wait names. When
    the server ends that session, in a restart or with its connection, the lock is gone and
    ``held()`` is False. A wait of over :data:`LOCK_WAIT_NOTED_S` is told to ``on_wait`` once,
    naming who holds the lock (and, on this machine, saying so where that process is stopped,
    as SIGSTOP or Ctrl-Z leave it). Not re-entrant: a lock taken twice in one process waits
    for itself. A wait ends in :class:`StoreUnavailable` once ``give_up()`` (the sweep stops).
    """
    with _THREAD_LOCK:
        local = local_path(url)
        if local is None:
            with _server_lock(url, study, on_wait, give_up) as held:
                yield held
            return
        lock_path = _lock_path(local)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a+") as handle:
            _take_file_lock(handle, lock_path, on_wait, give_up)
            try:
                yield lambda: True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_path(store: Path) -> Path:
    """The lock file of the study store file ``store``, beside it."""
    return store.with_name(store.name + ".hpo-lock")


def _take_file_lock(handle: Any, lock_path: Path, on_wait: Callable[[str], None] | None,
                    give_up: Callable[[], bool]) -> None:
    """Lock ``handle`` (:func:`_wait_for`); then write this process's id into the file, for
    whoever waits next."""
    def take() -> bool:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    _wait_for(take, LOCK_POLL_S, give_up, f"the study's ask lock {lock_path}", on_wait,
              lambda: _lock_holder(lock_path))
    with contextlib.suppress(OSError):  # a note for whoever waits, not worth failing the section for
        # written past Python's buffer: a write a full disk refused would fail the file's close
        os.ftruncate(handle.fileno(), 0)
        os.write(handle.fileno(), f"{HOST}:{os.getpid()}\n".encode())


def _wait_for(take: Callable[[], bool], poll_s: float, give_up: Callable[[], bool], lock: str,
              on_wait: Callable[[str], None] | None, note: Callable[[], str]) -> None:
    """Call ``take()`` every ``poll_s`` until it takes the lock (True). A wait of over
    :data:`LOCK_WAIT_NOTED_S` is told to ``on_wait`` once (``note()``, who holds it; nothing
    escapes: it is a note); once ``give_up()``, :class:`StoreUnavailable` says that ``lock``
    was waited for in vain."""
    noted = time.monotonic() + LOCK_WAIT_NOTED_S
    while not take():
        if give_up():
            raise StoreUnavailable(f"the sweep is stopping; it waited for {lock} in vain")
        if on_wait is not None and time.monotonic() >= noted:
            noted = float("inf")
            try:
                on_wait(note() + "; waiting for it")
            except Exception:  # a note, never worth a traceback
                _log.debug("cannot say who holds %s", lock, exc_info=True)
        time.sleep(poll_s)


def _lock_holder(lock_path: Path) -> str:
    """The note of a long wait for the lock at ``lock_path``, naming who holds it."""
    holder = _holder(lock_path)
    waited = f"this worker has waited {LOCK_WAIT_NOTED_S:.0f} s for the study's ask lock"
    if holder.startswith("process "):
        return f"{waited}, held by {holder}"
    return f"{waited} {lock_path}" + (f", last taken by {holder}" if holder else "")


def ask_lock_holder(url: str) -> str:
    """Who holds the ask lock of the study at ``url``, in words (see :func:`_holder`); ''
    for a server's lock, which no file names."""
    local = local_path(url)
    if local is None:
        return ""
    try:
        return _holder(_lock_path(local))
    except OSError:
        return ""


def _holder(lock_path: Path) -> str:
    """Who last took the lock at ``lock_path``, as its file names them (``host:pid``): ``process
    12 on this machine`` (saying so, and how to resume it, where it is stopped), ``host:12``
    on another machine, or '' where the file names no one."""
    return _worker_named(lock_path.read_text(errors="replace").strip())


def _worker_named(worker: str, address: str = "") -> str:
    """The worker ``host:pid`` in words: ``process 12 on this machine`` (:func:`_holder_here`),
    else ``host:12`` (with ``from ADDRESS``, where given); '' where ``worker`` is no such id."""
    host, _, pid_text = worker.rpartition(":")
    if not host or not pid_text.isdigit():
        return ""
    if host == HOST:
        return _holder_here(int(pid_text))
    return f"{host}:{pid_text}" + (f" from {address}" if address else "")


def _holder_here(pid: int) -> str:
    """``process 12 on this machine``, saying so, and how to resume it, where it is stopped."""
    import psutil  # imported when first needed: most commands never wait

    said = f"process {pid} on this machine"
    try:
        stopped = psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return said
    return said + (f", which is stopped (SIGSTOP or Ctrl-Z): `kill -CONT {pid}` resumes it" if stopped else "")


def server_lock_key(url: str, study: str) -> int:
    """The advisory lock key of ``study``'s ask lock on the server at ``url``: its database and
    the study's name, whatever host name or user the URL gives."""
    import sqlalchemy

    return zlib.crc32(f"{sqlalchemy.engine.make_url(url).database or ''}/{study}".encode()) & 0x7FFFFFFF


@contextlib.contextmanager
def _server_lock(url: str, study: str, on_wait: Callable[[str], None] | None,
                 give_up: Callable[[], bool]) -> Iterator[Callable[[], bool]]:
    import sqlalchemy

    key = server_lock_key(url, study)
    dialect = sqlalchemy.engine.make_url(url).get_dialect().name
    if dialect not in ("postgresql", "mysql"):
        raise InputError(f"--storage: {dialect} has no lock that hpo can share; use sqlite, postgresql or mysql")
    named = {"application_name": f"hpo {HOST}:{os.getpid()}"} if dialect == "postgresql" else {}
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=named)
    take, release, arg = (("SELECT pg_try_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)", key)
                          if dialect == "postgresql" else
                          ("SELECT GET_LOCK(:k, 0)", "SELECT RELEASE_LOCK(:k)", f"hpo-{key}"))
    try:
        with engine.connect() as conn:
            def taken() -> bool:
                got = conn.execute(sqlalchemy.text(take), {"k": arg}).scalar()
                conn.commit()  # the lock is the session's: no transaction stays open while it is held
                return bool(got)

            _wait_for(taken, SERVER_LOCK_POLL_S, give_up, f"the ask lock of study {study} on the server", on_wait,
                      lambda: f"this worker has waited {LOCK_WAIT_NOTED_S:.0f} s for the ask lock of study {study}, "
                              f"held by {_server_holder(conn, dialect, key)}")

            def held() -> bool:
                try:
                    conn.execute(sqlalchemy.text("SELECT 1"))
                    conn.commit()
                    return True
                except Exception:  # the session is gone, and its lock with it
                    return False

            try:
                yield held
            finally:
                with contextlib.suppress(Exception):  # a dropped connection releases the lock itself
                    conn.execute(sqlalchemy.text(release), {"k": arg})
                    conn.commit()
    finally:
        engine.dispose()


def _server_holder(conn: Any, dialect: str, key: int) -> str:
    """Who holds the server's ask lock ``key``, in words: the worker its session is named
    after (``hpo host:pid``) and where it connects from; what the server says where it names none."""
    import sqlalchemy

    if dialect != "postgresql":
        return "another session of the server"
    try:
        row = conn.execute(sqlalchemy.text(
            "SELECT a.application_name, a.client_addr, a.pid FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 AND l.objid = :k"),
            {"k": key}).first()
        conn.commit()
    except Exception:  # a note, never worth failing the wait for
        return "another session of the server"
    if row is None:
        return "another session of the server (gone since)"
    name, address, pid = row
    worker = _worker_named(name.removeprefix("hpo "), address or "") if name and name.startswith("hpo ") else ""
    return worker or f"server session {pid} ({name or 'unnamed'})" + (f" from {address}" if address else "")


def _transient_errors() -> tuple[type[BaseException], ...]:
    import optuna
    import sqlalchemy.exc

    return (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError,
            sqlalchemy.exc.InterfaceError, sqlalchemy.exc.DisconnectionError, OSError)


def _server_restarting(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an error under it says the server is restarting or shutting down
    (Optuna wraps a driver's error that ends a commit in its own)."""
    return _said(exc, _SERVER_RESTARTING)


def _refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an error under it says nothing listens where the URL points."""
    return _said(exc, _REFUSED)


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an error under it says the store's disk is full (SQLite's
    ``database or disk is full``, ENOSPC, a quota), as reads go on answering."""
    while exc is not None:
        if (isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS) or _DISK_FULL.search(str(exc)) or \
                getattr(exc, "sqlite_errorname", None) in _DISK_FULL_SQLITE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_space(path: Path | None) -> str:
    """How much room the disk of the file ``path`` has, in words (``0 bytes free on /mnt``);
    of a server's store (None), that the disk is the server's."""
    if path is None:
        return "on the database server"
    folder = next((p for p in (path.parent, *path.parent.parents) if p.is_dir()), Path("/"))
    mount = next(p for p in (folder, *folder.parents) if os.path.ismount(p) or p == p.parent)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return f"on {mount}"
    return f"{_amount(free)} free on {mount}"


def _amount(size: float) -> str:
    """``size`` bytes in words: ``512 bytes``, ``3.5 MiB``."""
    if size < 1024:
        return f"{size:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} TiB"


def _said(exc: BaseException | None, words: re.Pattern[str]) -> bool:
    """Whether ``exc`` or an error in its cause chain has ``words`` in its message."""
    while exc is not None:
        if words.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause of ``exc`` (a driver's own words), without SQL."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().split("\n[SQL:")[0]
    return (text.splitlines() or [type(exc).__name__])[0]


class Retrying:
    """Runs store calls, retrying transient failures (server down, database locked, disk
    full) with exponential backoff until ``deadline_s`` seconds have passed without success.

    An outage is said in one line when a call first fails and one when it ends: when a call
    that failed in it answers, or (but on a full disk) any call does once none is failing (the
    failing ones gave up). A call that never failed does not end it: where reads answer while
    writes fail, as on a full disk, the outage lasts until a write goes through.

    A full disk (:func:`disk_full`) is waited out as any outage, and said as what it is, with
    the room left on the store's disk: the user can free space while running trials go on,
    and the failed write, which SQLite rolled back whole, is then made; once ``deadline_s``
    has passed the worker stops as for any outage, and ``hpo run`` resumes.

    Args:
        url: the store, named (password masked) in messages.
        deadline_s: how long one call may keep failing before :class:`StoreUnavailable`.
        on_outage: called with a one-line message when a call first fails and when the
            store answers again, e.g. to print it.
        before_attempt: called before each attempt, the first included; what it raises ends
            the call (e.g. :class:`LockLost`, when what the call is part of must start again:
            a lost lock need not make any call fail, as a pool reconnects unseen).
        full_disk_waits: whether a full disk is waited out; where not (a command that reads,
            such as ``hpo status``: its SQLite store, which no sweep holds open, needs room for
            its shared-memory file), it is :class:`StoreUnavailable` at once.
    """

    def __init__(self, url: str, deadline_s: float, on_outage: Callable[[str], None] | None = None,
                 before_attempt: Callable[[], None] = lambda: None, full_disk_waits: bool = True) -> None:
        self._full_disk_waits = full_disk_waits
        self._url = redact(url)
        self._path = local_path(url)
        self._deadline_s = deadline_s
        self._on_outage = on_outage or (lambda message: _log.warning("%s", message))
        self._errors = _transient_errors()
        self._before_attempt = before_attempt
        self._down_since: float | None = None
        self._down_full = False  # the outage is a full disk
        self._failing = 0  # calls that failed and have neither answered nor given up yet
        self._up_since = float("-inf")
        self._lock = threading.RLock()  # re-entrant: hurry() may run in a signal handler of a thread that holds it
        self._hurried: tuple[float, float] | None = None  # since when, and for how long calls still retry
        self._wake = threading.Event()

    def gave_up(self) -> bool:
        """Whether the grace that :meth:`hurry` gave has run out (a waiter stops waiting)."""
        with self._lock:
            hurried = self._hurried
        return hurried is not None and time.monotonic() >= hurried[0] + hurried[1]

    def hurry(self, within_s: float) -> None:
        """From now on, a failing call gives up (:class:`StoreUnavailable`) once it has failed
        for ``within_s`` seconds (a call failing now: ``within_s`` from now), whatever
        ``deadline_s`` says: the sweep is stopping, and what it still records is kept in the
        trials' folders anyway (recorded on resume)."""
        with self._lock:
            if self._hurried is None:
                self._hurried = (time.monotonic(), within_s)
            waking, self._wake = self._wake, threading.Event()
        waking.set()

    @property
    def healthy_since(self) -> float | None:
        """``time.monotonic()`` of the end of the last outage: ``-inf`` if there was none,
        None while the store is down."""
        with self._lock:
            return None if self._down_since is not None else self._up_since

    def note_outage(self) -> None:
        """Count an outage that no call saw as ended now (a lost lock shows one: a pool
        reconnects unseen), for :attr:`healthy_since`."""
        with self._lock:
            if self._down_since is None:
                self._up_since = time.monotonic()

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried through an outage (see the class docstring)."""
        start = time.monotonic()
        pause = 0.2
        failed = False
        try:
            while True:
                self._before_attempt()
                try:
                    result = fn(*args, **kwargs)
                except Exception as exc:
                    if not (isinstance(exc, self._errors) or disk_full(exc)):
                        raise
                    if disk_full(exc) and not self._full_disk_waits:
                        raise StoreUnavailable(f"the store {self._url} cannot be used here: {_root_cause(exc)[:200]} "
                                               f"({free_space(self._path)}); free space there") from None
                    if not failed:
                        failed = True
                        with self._lock:
                            self._failing += 1
                    self._pause_or_give_up(exc, start, pause)
                    pause = min(pause * 2, MAX_PAUSE_S)
                    continue
                self._answered(failed)
                return result
        finally:
            if failed:
                with self._lock:
                    self._failing -= 1

    def _pause_or_give_up(self, exc: BaseException, start: float, pause: float) -> None:
        """Say the outage if it starts with ``exc``; then pause ``pause`` seconds, or raise
        :class:`StoreUnavailable` when the call that began at ``start`` may retry no more."""
        elapsed = time.monotonic() - start
        full = disk_full(exc)
        first_line = _ERRNO.sub("", _root_cause(exc)) if full else _root_cause(exc)
        with self._lock:
            if self._down_since is None:
                self._down_since, self._down_full = time.monotonic(), full
                self._on_outage(
                    f"the store {self._url} cannot be written: {first_line[:160]} ({free_space(self._path)}); "
                    f"free space there: retrying for up to {self._deadline_s:g} s" if full else
                    f"the store {self._url} is not answering ({first_line[:160]}); "
                    f"retrying for up to {self._deadline_s:g} s")
            left = self._deadline_s - elapsed
            hurried, wake = self._hurried, self._wake
        if hurried is not None:
            left = min(left, max(hurried[0], start) + hurried[1] - time.monotonic())
        if left <= 0:
            why = "the sweep is stopping" if hurried else "resources.store_retry"
            if full:
                raise StoreUnavailable(f"the store {self._url} could not be written for {elapsed:.0f} s ({why}): "
                                       f"{first_line[:200]} ({free_space(self._path)})") from None
            raise StoreUnavailable(f"the store {self._url} has not answered for {elapsed:.0f} s "
                                   f"({why}): {first_line[:200]}") from None
        wake.wait(min(pause, left))

    def _answered(self, failed: bool) -> None:
        """A call answered (``failed``: after failing): the outage, if any, ends when this call
        had failed in it or, unless the disk is full (a read answers there), no call is failing."""
        with self._lock:
            if self._down_since is None or not (failed or (self._failing == 0 and not self._down_full)):
                return
            took = time.monotonic() - self._down_since
            self._on_outage(f"the store {self._url} can be written again after {took:.0f} s" if self._down_full
                            else f"the store answers again after {took:.0f} s")
            self._down_since = None
            self._up_since = time.monotonic()
