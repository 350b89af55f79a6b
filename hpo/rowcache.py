"""A file of the finished trials' rows, so that reading a long study costs what is new.

Finished trials never change (Optuna refuses to update them), so their rows can be kept.
``hpo status``, ``export`` and ``best`` read the rows of finished trials from this file
and ask the storage only for the unfinished trials and those finished since, through
Optuna's public storage API. The file lives beside a file-based store
(``study.db.hpo-rows.json``) or, for a server, in the user's cache folder; it is written
atomically and is only ever a cache: deleting it costs one full read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hpo.storage import local_path

VERSION = 1


def cache_path(url: str, study: str) -> Path:
    """Where the rows of ``study`` in the store at ``url`` are cached."""
    local = local_path(url)
    if local is not None:
        return local.with_name(f"{local.name}.{study}.hpo-rows.json")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpo"
    digest = hashlib.sha256(f"{url}\n{study}".encode()).hexdigest()[:16]
    return base / f"rows-{digest}.json"


def load(path: Path, key: str) -> list[dict[str, Any]]:
    """The cached rows (plain data), or none if the file is missing, stale or unreadable.

    ``key`` identifies the study the file was written for (a recreated study differs).
    """
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("key") != key or not isinstance(data.get("rows"), list):
            return []
        return list(data["rows"])
    except (OSError, ValueError):
        return []


def save(path: Path, key: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (plain data of finished trials) atomically; a failure to write is no error."""
    data = {"version": VERSION, "key": key, "rows": rows}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, separators=(",", ":")))
        temporary.replace(path)
    except OSError:
        pass
