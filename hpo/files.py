"""Files written whole or not at all: :func:`replacing` (the results, cache, exports and charts)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


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
