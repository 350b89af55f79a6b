"""The exceptions the CLI turns into one line: bad input (exit code 2), and a store or an executor
that is gone (exit 1)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpo.outcome import TrialResult


class InputError(Exception):
    """Bad input: a scenario, design CSV, template or argument.

    The message is one line that names the field (or file and line) and what is wrong;
    the CLI prints it as ``error: <message>`` and exits with code 2.
    """


def in_scenario(message: str, file_name: str, fields: Iterable[str]) -> str:
    """``message`` led by the scenario file's name where it starts with one of the scenario's
    ``fields`` (``command: ...``, ``resources.cluster.kind: ...``), as the errors found while
    the file is read are: a check made after reading (a template, the command, the GPUs) names
    the file as well as the field."""
    names = "|".join(re.escape(field) for field in fields)
    return f"{file_name}: {message}" if re.match(rf"(?:{names})[.:]", message) else message


class ExecutorUnavailable(Exception):
    """The executor can run no more trials (its Dask scheduler is gone): the sweep stops.

    ``result`` is how the trial being run ended where the executor could tell (a result its
    worker wrote); None: it is recorded INTERRUPTED. An INTERRUPTED trial runs again on resume.
    """

    def __init__(self, message: str, result: TrialResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class StoreUnavailable(Exception):
    """The store stayed unreachable past the retry deadline; the message is one line."""
