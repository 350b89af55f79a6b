"""Files written whole or not at all: :func:`replacing` (the results, cache, exports and
charts); the user's text files read as UTF-8 whatever the locale: :func:`utf8_text`; hpo's
folder of caches: :func:`cache_folder`."""
from __future__ import annotations

import codecs
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from hpo.errors import InputError


def utf8_text(file: Path, save_as: str = "UTF-8") -> str:
    """The text of ``file`` read as UTF-8 (with or without a byte order mark), whatever the
    locale; InputError naming the file and the line of the first byte that is not UTF-8, and
    the format to save it as (``save_as``)."""
    data = file.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{file.name} line {line}: not UTF-8 text (byte {data[exc.start]:#04x}); "
                         f"save it as {save_as}") from None


def cache_folder() -> Path:
    """The folder of hpo's caches: ``$XDG_CACHE_HOME/hpo``, else ``~/.cache/hpo`` (not created)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpo"


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) to write to; when the block ends
    without an error it replaces ``path`` (a rename, so readers see the old file or the new
    one, never half of it); either way no temporary file is left."""
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield temporary
        temporary.replace(path)
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
