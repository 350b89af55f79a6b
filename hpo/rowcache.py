"""A file of a study's rows, so that reading a long study costs what is new.

Finished trials never change (Optuna refuses to update them), so their rows can be kept.
``hpo status``, ``export`` and ``best`` read the rows of finished trials from this file
and ask the storage only for the unfinished trials and those finished since, through
Optuna's public storage API. The file lives beside a file-based store
(``study.db.STUDY.hpo-rows.json``) or, for a server, in the user's cache folder; it is
written atomically and is only ever a cache: deleting it costs one full read.

For an SQLite store the file also records the store's files as they were (modification
time and size of the database and its write-ahead log) before the read, if nothing had
written them for :data:`QUIET_S` seconds, with the unfinished rows of that read. While
the files are still exactly so, nothing has been written since, and :func:`quiet_rows`
answers from the file alone, without opening the store: a finished or paused sweep
answers at once, a running one (whose writes change the files) reads the store.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.files import cache_folder, replacing
from hpo.rows import FIELDS, TrialRow, row_from_list, row_to_list
from hpo.storage import local_path, sqlite_path

if TYPE_CHECKING:
    from hpo.scenario import Objective

VERSION = 3
QUIET_S = 1.0
Stamp = list[list[int] | None]


@dataclass(frozen=True)
class Cached:
    """What the file holds: the rows of finished trials (for the study ``key``, judged by
    ``objective``: see :func:`objective_of`) and, if the store was quiet, its ``stamp`` with
    the ``unfinished`` rows read at that time."""

    key: str
    objective: str
    finished: list[TrialRow]
    stamp: Stamp | None = None
    unfinished: tuple[TrialRow, ...] = ()


def objective_of(objective: Objective) -> str:
    """What cached rows were judged by: ``minimize val_error``. Rows cached under another
    objective are not a study's rows as the scenario reads them."""
    return f"{objective.direction} {objective.metric}"


def cache_path(url: str, study: str) -> Path:
    """Where the rows of ``study`` in the store at ``url`` are cached."""
    local = local_path(url)
    if local is not None:
        return local.with_name(f"{local.name}.{study}.hpo-rows.json")
    digest = hashlib.sha256(f"{url}\n{study}".encode()).hexdigest()[:16]
    return cache_folder() / f"rows-{digest}.json"


def quiet_stamp(url: str) -> Stamp | None:
    """The SQLite store's files as they are now (``[mtime_ns, size]`` of the database and
    of its write-ahead log, None for a missing one), if nothing wrote them in the last
    :data:`QUIET_S` seconds; else (or for any other store) None. Take it before reading."""
    database = sqlite_path(url)
    if database is None:
        return None
    stamp: Stamp = []
    for path in (database, database.with_name(database.name + "-wal")):
        try:
            info = path.stat()
        except FileNotFoundError:
            stamp.append(None)
            continue
        except OSError:
            return None
        stamp.append([info.st_mtime_ns, info.st_size])
    newest = max((entry[0] for entry in stamp if entry is not None), default=0)
    return stamp if newest <= time.time_ns() - QUIET_S * 1e9 else None


def load(path: Path) -> Cached | None:
    """The file's contents, or None if it is missing, of another version or unreadable."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("fields") != list(FIELDS):
            return None
        return Cached(key=str(data["key"]), objective=str(data["objective"]),
                      finished=[row_from_list(values) for values in data["finished"]],
                      stamp=data.get("stamp"), unfinished=tuple(row_from_list(v) for v in data.get("unfinished", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def quiet_rows(url: str, study: str, objective: str) -> list[TrialRow] | None:
    """Every row of ``study`` from the file alone, by number, if the store has not been
    written since the file recorded it and its rows were judged by ``objective``
    (:func:`objective_of`); else None."""
    stamp = quiet_stamp(url)
    if stamp is None:
        return None
    cached = load(cache_path(url, study))
    if cached is None or cached.stamp != stamp or cached.objective != objective:
        return None
    return sorted([*cached.finished, *cached.unfinished], key=lambda row: row.number)


def save(path: Path, cached: Cached) -> None:
    """Write ``cached`` atomically; a failure to write is no error."""
    data: dict[str, Any] = {"version": VERSION, "key": cached.key, "objective": cached.objective,
                            "fields": list(FIELDS), "finished": [row_to_list(row) for row in cached.finished]}
    if cached.stamp is not None:
        data.update(stamp=cached.stamp, unfinished=[row_to_list(row) for row in cached.unfinished])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as temporary:
            temporary.write_text(json.dumps(data, separators=(",", ":")))
    except OSError:
        pass
