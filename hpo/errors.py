"""The one exception type that means "the user's input is wrong" (exit code 2)."""
from __future__ import annotations


class InputError(Exception):
    """Bad input: a scenario, design CSV, template or argument.

    The message is one line that names the field (or file and line) and what is wrong;
    the CLI prints it as ``error: <message>`` and exits with code 2.
    """
