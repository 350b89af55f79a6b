"""Where a study lives: storage URLs, opening storages, the ask lock, and riding out outages."""
from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.storages import JournalStorage, RDBStorage

import hpo.storage
from hpo.errors import InputError, StoreUnavailable
from hpo.scenario import load_scenario
from hpo.storage import Retrying, ask_lock, check_url, open_storage, optuna_url, reach, redact, storage_url

WriteScenario = Callable[..., Path]
POSTGRES = os.environ.get("HPO_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", "journal"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage URL of every file-based backend (the same contract runs against each)."""
    return {"sqlite": f"sqlite:///{tmp_path}/db/study.db", "journal": f"journal:{tmp_path}/db/study.log"}[request.param]


def test_ask_lock_leaves_optunas_journal_lock_alone(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    with ask_lock(f"journal:{journal}"):
        assert not os.path.lexists(f"{journal}.lock")
    assert not os.path.lexists(f"{journal}.lock")


def test_storage_url_default_and_overrides(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path))
    assert storage_url(scenario) == f"sqlite:///{tmp_path.resolve()}/runs/demo/study.db"
    assert storage_url(scenario, workdir=tmp_path / "w") == f"sqlite:///{tmp_path}/w/study.db"
    assert storage_url(scenario, override="journal:/x.log", workdir=tmp_path / "w") == "journal:/x.log"
    with_storage = load_scenario(write_scenario(tmp_path / "2", storage="sqlite:////tmp/other.db"))
    assert storage_url(with_storage) == "sqlite:////tmp/other.db"
    assert storage_url(with_storage, override="sqlite:////tmp/cli.db") == "sqlite:////tmp/cli.db"


def test_workdir_moves_the_default_store(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, workdir="elsewhere"))
    assert storage_url(scenario) == f"sqlite:///{tmp_path.resolve()}/elsewhere/study.db"


@pytest.mark.parametrize(
    ("url", "kind", "path"),
    [("sqlite:///{tmp}/a/study.db", RDBStorage, "a/study.db"),
     ("journal:{tmp}/b/study.log", JournalStorage, "b/study.log"),
     ("journal://{tmp}/c/study.log", JournalStorage, "c/study.log")],
)
def test_open_storage_kinds(tmp_path: Path, url: str, kind: type, path: str) -> None:
    storage = open_storage(url.format(tmp=tmp_path))
    assert isinstance(storage, kind)
    assert (tmp_path / path).is_file()


def test_sqlite_runs_in_wal_mode_syncing_at_checkpoints(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    study = optuna.create_study(storage=storage)
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=2)
    with storage.engine.connect() as connection:  # a connection from the pool the study used
        pragma = connection.exec_driver_sql
        assert pragma("PRAGMA journal_mode").scalar() == "wal"
        assert pragma("PRAGMA synchronous").scalar() == 1  # NORMAL
    reopened = optuna.load_study(study_name=study.study_name, storage=open_storage(f"sqlite:///{tmp_path}/study.db"))
    assert len(reopened.trials) == 2


def test_an_sqlite_store_a_process_still_holds_at_exit_is_closed_and_leaves_no_wal(tmp_path: Path) -> None:
    """A storage that a thread still holds when the process exits had its pooled connections
    never closed, so SQLite's -wal and -shm files were left beside the store (one ``hpo run``
    in three did so): readers then need no room on a full disk, and the files look like a
    sweep still at work."""
    script = textwrap.dedent("""\
        import sys, threading, time
        import optuna
        from hpo.storage import open_storage

        def use_and_keep() -> None:
            study = optuna.create_study(storage=open_storage(sys.argv[1]), study_name="held")
            study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=2)
            used.set()
            time.sleep(60)  # still holds the storage when the process exits

        used = threading.Event()
        threading.Thread(target=use_and_keep, daemon=True).start()
        used.wait()
        """)
    store = tmp_path / "study.db"
    subprocess.run([sys.executable, "-c", script, f"sqlite:///{store}"], check=True, timeout=60)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["study.db"]
    with contextlib.closing(sqlite3.connect(store)) as database:
        assert database.execute("SELECT COUNT(*) FROM trials").fetchone() == (2,)


def test_bad_url_is_an_input_error() -> None:
    with pytest.raises(InputError, match="--storage: cannot open nosuchdb://x"):
        open_storage("nosuchdb://x")


def commit_failed(driver_says: str) -> optuna.exceptions.StorageInternalError:
    """Optuna's error for a commit the driver ended saying ``driver_says``, cause attached."""
    try:
        raise sqlalchemy.exc.OperationalError("COMMIT", None, Exception(driver_says))
    except sqlalchemy.exc.OperationalError as exc:
        wrapped = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
        wrapped.__cause__ = exc
        return wrapped


def test_a_server_restarting_while_the_store_opens_is_an_outage(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """PostgreSQL ends new sessions while it restarts: that is retried, not a bad --storage."""
    real = RDBStorage
    attempts: list[str] = []

    def restarting(url: str, **kwargs: Any) -> RDBStorage:
        attempts.append(url)
        if len(attempts) == 1:  # this test's call
            raise sqlalchemy.exc.OperationalError(
                "SELECT 1", None, Exception("terminating connection due to administrator command"))
        if len(attempts) == 2:  # Retrying's first attempt: Optuna wraps what ended its commit
            raise commit_failed("the database system is shutting down")
        return real(url, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", restarting)
    url = f"sqlite:///{tmp_path}/study.db"
    with pytest.raises(sqlalchemy.exc.OperationalError):
        open_storage(url)
    messages: list[str] = []
    assert isinstance(Retrying(url, 10, messages.append)(open_storage, url), real)
    assert len(attempts) == 3 and messages[-1].startswith("the store answers again")


@pytest.mark.parametrize("create", [True, False], ids=["creating", "reading"])
def test_a_commit_cut_short_while_the_store_is_created_is_an_outage(monkeypatch: pytest.MonkeyPatch,
                                                                    create: bool) -> None:
    """Opening with ``create``, the server answered the tables' creation before a commit could
    fail, so a commit Optuna reports failed, whatever the driver said under it, is retried; a
    reader's open makes no such first contact, so there it stays bad input."""
    def cut_short(url: str, **kwargs: Any) -> RDBStorage:
        raise commit_failed("connection failed: Connection refused")

    monkeypatch.setattr(optuna.storages, "RDBStorage", cut_short)
    monkeypatch.setattr(hpo.storage, "REFUSED_GRACE_S", 0.0)
    expected = optuna.exceptions.StorageInternalError if create else InputError
    with pytest.raises(expected):
        open_storage("postgresql://u:pw@127.0.0.1:1/db", create)


def test_a_server_that_refuses_for_a_moment_is_waited_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A restarting server refuses connections between its stop and its start: the open is
    tried again within the grace, so a worker that starts then does not exit on bad input."""
    real = RDBStorage
    attempts: list[float] = []

    def restarting(url: str, **kwargs: Any) -> RDBStorage:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise sqlalchemy.exc.OperationalError(
                "SELECT 1", None, Exception('connection to server at "127.0.0.1", port 5433 failed: Connection refused'))
        return real(url, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", restarting)
    assert isinstance(open_storage(f"sqlite:///{tmp_path}/study.db"), real)
    assert len(attempts) == 3


def test_a_port_where_nothing_listens_is_bad_input_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first contact tells a wrong port from an outage: nothing answers within the grace."""
    monkeypatch.setattr(hpo.storage, "REFUSED_GRACE_S", 0.5)
    began = time.monotonic()
    with pytest.raises(InputError, match=r"^--storage: cannot open postgresql://u:\*\*\*@127\.0\.0\.1:1/db: "
                                         r".*Connection refused \(is a server running there\?\)$"):
        reach("postgresql://u:pw@127.0.0.1:1/db")
    assert time.monotonic() - began >= 0.5


@pytest.mark.skipif(not POSTGRES, reason="HPO_TEST_POSTGRES_URL names no PostgreSQL server")
@pytest.mark.parametrize("wrong", ["password", "database"])
def test_a_wrong_password_or_database_is_bad_input_at_once(wrong: str) -> None:
    url = sqlalchemy.make_url(POSTGRES)
    url = url.set(password="not-the-password") if wrong == "password" else url.set(database="no_such_database")
    began = time.monotonic()
    with pytest.raises(InputError, match=r"^--storage: cannot open postgresql://.*(password authentication failed|"
                                         r"database \"no_such_database\" does not exist)"):
        reach(url.render_as_string(hide_password=False))
    assert time.monotonic() - began < hpo.storage.REFUSED_GRACE_S


def test_first_contact_with_a_file_store_creates_its_folder_and_file(tmp_path: Path, url: str) -> None:
    reach(url)
    assert (tmp_path / "db").is_dir() and [path.name for path in (tmp_path / "db").iterdir()] == [url.split("/")[-1]]


def test_first_contact_without_create_writes_nothing(tmp_path: Path, url: str) -> None:
    reach(url, create=False)
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("text", [b"notadb", b"line one\nline two\n", b"[1, 2]\n", b"SQLite format 3\x00\xff\n"],
                         ids=["word", "lines", "json-list", "binary"])
def test_a_file_that_is_not_a_journal_is_bad_input_before_anything_is_written(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "notadb"
    path.write_bytes(text)
    for create in (True, False):
        with pytest.raises(InputError, match=rf"^--storage: cannot open {path}: file is not an Optuna journal$"):
            reach(f"journal:{path}", create=create)
    assert path.read_bytes() == text


def test_an_empty_file_or_a_journal_is_a_journal(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.touch()
    reach(f"journal:{empty}", create=False)
    journal = tmp_path / "study.log"
    optuna.create_study(study_name="s", storage=open_storage(f"journal:{journal}"))
    for create in (True, False):
        reach(f"journal:{journal}", create=create)


def test_hpo_run_leaves_a_file_that_is_not_a_journal_alone(tmp_path: Path, write_scenario: WriteScenario,
                                                           run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "notadb"
    path.write_text("notadb")
    refusal = f"error: --storage: cannot open {path}: file is not an Optuna journal\n"
    for command in ("run", "validate", "status"):
        result = run_cli(command, write_scenario(tmp_path), "--storage", f"journal:{path}")
        assert (result.returncode, result.stderr) == (2, refusal)
    assert path.read_text() == "notadb"


def test_a_database_without_optunas_tables_holds_no_study(tmp_path: Path) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / "other.db")) as conn:
        conn.execute("CREATE TABLE notes (text)")
        conn.commit()
    url = f"sqlite:///{tmp_path}/other.db"
    with pytest.raises(InputError, match=r"^--storage: sqlite:///.*/other\.db holds no study \(it has no Optuna "
                                         r"tables\): run `hpo run` first$"):
        open_storage(url, create=False)


def _hold_lock(url: str, held: Any, release: Any) -> None:
    """In another process: take the ask lock, say so, and keep it until told to let go."""
    with ask_lock(url):
        held.set()
        release.wait(60)


def _wait_for(event: Any, process: Any, timeout_s: float = 60) -> bool:
    """Wait for ``event`` while ``process`` lives; False if it died or time ran out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.is_alive():
        if event.wait(0.05):
            return True
    return event.is_set()


def test_ask_lock_serialises_processes(url: str) -> None:
    open_storage(url)
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    other = context.Process(target=_hold_lock, args=(url, held, release))
    other.start()
    try:
        assert _wait_for(held, other), "the other process never took the lock"
        acquired = threading.Event()

        def take() -> None:
            with ask_lock(url):
                acquired.set()

        taker = threading.Thread(target=take)
        taker.start()
        assert not acquired.wait(0.5)
        release.set()
        taker.join(30)
        assert acquired.is_set()
    finally:
        release.set()
        other.join(30)
    assert other.exitcode == 0


def test_ask_lock_serialises_threads(url: str) -> None:
    open_storage(url)
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        with ask_lock(url):
            with guard:
                inside += 1
                most = max(most, inside)
            time.sleep(0.02)
            with guard:
                inside -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most == 1


def test_ask_lock_is_released_on_error(url: str) -> None:
    open_storage(url)
    with pytest.raises(RuntimeError), ask_lock(url):
        raise RuntimeError("boom")
    with ask_lock(url):
        pass


@pytest.mark.parametrize("url", ["foo://bar", "redis://localhost", "study.db", "sqlite:relative.db"])
def test_unknown_schemes_are_bad_input_naming_the_flag(url: str) -> None:
    with pytest.raises(InputError, match=r"^--storage: cannot open .*: the URL must be one of sqlite:///PATH"):
        check_url(url)


@pytest.mark.parametrize(("url", "module", "hint"), [
    ("mysql://u:p@127.0.0.1/db", "MySQLdb", "pip install pymysql and use mysql+pymysql://u:***@127.0.0.1/db"),
    ("mysql+pymysql://u@127.0.0.1/db", "pymysql", "pip install pymysql"),
    ("mysql+mysqlconnector://u@127.0.0.1/db", "mysql", "pip install mysql-connector-python"),
    ("postgresql+psycopg2://u@127.0.0.1/db", "psycopg2", ("use postgresql://u@127.0.0.1/db with pip install "
                                                         "'hpo[postgres]', or pip install psycopg2-binary")),
])
@pytest.mark.parametrize("opened", [reach, open_storage], ids=["reach", "open"])
def test_a_missing_driver_says_what_to_install_for_its_database(url: str, module: str, hint: str,
                                                                opened: Callable[[str], Any]) -> None:
    """A MySQL URL was told to pip install 'hpo[postgres]' for PostgreSQL, and so was a
    psycopg2 URL, whose driver that extra does not install (it installs psycopg 3)."""
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(InputError) as raised:
        opened(url)
    assert str(raised.value) == f"--storage: the driver for {url.split(':')[0]} is not installed ({module}); {hint}"


def test_optuna_url_for_journal_files_is_python_that_opens_them(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert optuna_url(f"sqlite:///{tmp_path}/s.db") == f"sqlite:///{tmp_path}/s.db"
    assert optuna_url("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    code = optuna_url(f"journal:{tmp_path}/s.log")
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # noqa: S102 (the printed line really opens the journal)
    assert isinstance(namespace["storage"], JournalStorage)
    monkeypatch.chdir(tmp_path)  # a relative path is printed absolute: the line is pasted into Python elsewhere
    assert f"JournalFileBackend('{tmp_path}/j.log')" in optuna_url("journal:j.log")


class _Flaky:
    """A call that fails ``failures`` times with a transient store error, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, value: int) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise optuna.exceptions.StorageInternalError("could not connect to server: Connection refused")
        return value * 2


def test_retrying_rides_out_an_outage_and_says_so() -> None:
    said: list[str] = []
    call = Retrying("postgresql://u:pw@h/db", deadline_s=30, on_outage=said.append)
    flaky = _Flaky(3)
    assert call(flaky, 21) == 42
    assert flaky.calls == 4
    assert len(said) == 2 and "is not answering" in said[0] and "pw" not in said[0]
    assert said[1].startswith("the store answers again")
    assert call.healthy_since is not None and call.healthy_since > float("-inf")


def test_an_outage_ends_when_a_failing_call_answers_not_when_another_does() -> None:
    """Where some calls answer while others fail (reads go on, writes fail), the outage is
    said once and ends when a failing call answers; once none is failing, any call ends it."""
    said: list[str] = []
    call = Retrying("sqlite:///x.db", deadline_s=30, on_outage=said.append)
    failing = threading.Event()
    failing.set()

    def write() -> int:
        if failing.is_set():
            raise optuna.exceptions.StorageInternalError("attempt to write a readonly database")
        return 1

    writer = threading.Thread(target=call, args=(write,))
    writer.start()
    until = time.monotonic() + 10
    while not said and time.monotonic() < until:
        time.sleep(0.01)
    assert [call(lambda: 2) for _ in range(3)] == [2, 2, 2]
    assert len(said) == 1 and call.healthy_since is None
    failing.clear()
    writer.join(10)
    assert len(said) == 2 and said[1].startswith("the store answers again")
    gave_up = Retrying("sqlite:///x.db", deadline_s=0.3, on_outage=said.append)
    with pytest.raises(StoreUnavailable):
        gave_up(_Flaky(10**6), 1)
    assert gave_up(lambda: 3) == 3 and said[-1].startswith("the store answers again")


def test_retrying_gives_up_after_its_deadline_with_one_line() -> None:
    call = Retrying("sqlite:///x.db", deadline_s=0.5, on_outage=lambda message: None)
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"^the store sqlite:///x.db has not answered for \d+ s"):
        call(_Flaky(10**6), 1)
    assert time.monotonic() - began < 5


def test_a_hurried_call_gives_up_soon_even_in_the_middle_of_its_pause() -> None:
    """A sweep stopped (SIGTERM) through an outage ends in seconds, not resources.store_retry."""
    call = Retrying("sqlite:///x.db", deadline_s=300, on_outage=lambda message: None)
    raised: list[BaseException] = []

    def attempt() -> None:
        try:
            call(_Flaky(10**6), 1)
        except StoreUnavailable as exc:
            raised.append(exc)

    thread = threading.Thread(target=attempt)
    thread.start()
    time.sleep(2.0)  # by now it pauses up to MAX_PAUSE_S between tries
    began = time.monotonic()
    call.hurry(0.5)
    thread.join(10)
    assert time.monotonic() - began < 2.0
    assert len(raised) == 1 and "(the sweep is stopping)" in str(raised[0])


def test_retrying_passes_other_errors_through() -> None:
    call = Retrying("sqlite:///x.db", deadline_s=30)

    def broken() -> None:
        raise KeyError("no such study")

    with pytest.raises(KeyError):
        call(broken)


def _create_tables(database: Path, ready: Any) -> None:
    ready.wait()
    open_storage(f"sqlite:///{database}")


def test_processes_creating_one_store_at_once_all_open_it(tmp_path: Path) -> None:
    """A worker, a reader and optuna-dashboard may all create the tables of a new store at
    the same moment: every one of them opens it."""
    database = tmp_path / "study.db"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    processes = [context.Process(target=_create_tables, args=(database, ready)) for _ in range(4)]
    for process in processes:
        process.start()
    ready.set()
    for process in processes:
        process.join(timeout=120)
    assert [process.exitcode for process in processes] == [0, 0, 0, 0]
    optuna.create_study(study_name="after", storage=open_storage(f"sqlite:///{database}", create=False))


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://hpo:s3cret@db:5432/hpo", "postgresql://hpo:***@db:5432/hpo"),
    ("postgresql://db:5432/hpo?user=hpo&password=s3cret", "postgresql://db:5432/hpo?user=hpo&password=***"),
    ("postgresql://hpo:p@ss/s3cret@db:5432/hpo", "postgresql://hpo:***@db:5432/hpo"),  # unencoded @ and /
    ("mysql+pymysql://u:s3cret@db/hpo?charset=utf8&PWD=s3cret", "mysql+pymysql://u:***@db/hpo?charset=utf8&PWD=***"),
    ("sqlite:////tmp/a@b/study.db", "sqlite:////tmp/a@b/study.db"),
])
def test_no_message_shows_a_password(url: str, shown: str) -> None:
    assert redact(url) == shown and "s3cret" not in optuna_url(url)


def test_postgres_scheme_is_postgresql(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path))
    assert storage_url(scenario, override="postgres://u:p@db/hpo") == "postgresql://u:p@db/hpo"
