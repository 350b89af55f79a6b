"""SMAC's forest in a helper process, so that a sweep imports scikit-learn beside its own start.

Importing scikit-learn takes about a second (it pulls in scipy.stats), and a model-based
sweep cannot hide that behind a running trial the way a design hides its store work: its
first proposal needs the forest. :func:`start` launches one helper per process, which imports
scikit-learn at once, on another core, while the sweep opens its store; :func:`ranked` then
sends it the work of :func:`hpo.forest.ranked` (the fitted forests stay in the helper) and
returns the same candidates, advancing ``rng`` exactly as the work in this process would, so a
seeded sweep proposes the same configurations either way. A request is plain data (a codec
pickles as its parameters' fields, the rows as arrays), so before its first answer the helper
imports scikit-learn and :mod:`hpo.forest` only, not pydantic or Optuna (0.23 s saved).

Without a helper (:func:`start` not called, as in-process users of the sampler do), or once
the helper has failed, the work is done in this process. The helper runs in its own session
(a Ctrl-C at the terminal is the sweep's to handle). :func:`stop`, and this process's exit, kill
it; if this process is killed, the helper's input closes and it exits.
"""
from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: starting the helper must not wait for numpy and Optuna
    import numpy as np

    from hpo.codec import Codec

_helper: _Helper | None = None
_lock = threading.Lock()
_UNUSED = ("pandas", "rich")  # optional to scikit-learn: the helper fits arrays and draws no progress bars


class _Helper:
    """The helper process and its two pipes; one request at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "hpo.forest_service"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)

    def call(self, request: tuple[Any, ...]) -> Any:
        """The helper's answer to ``request``; raises OSError or EOFError if it is gone."""
        assert self.process.stdin is not None and self.process.stdout is not None
        pickle.dump(request, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.flush()
        return pickle.load(self.process.stdout)

    def kill(self) -> None:
        """End it now, whatever it is doing (it holds nothing but cached forests), and reap it."""
        self.process.kill()
        self.process.wait()


def start() -> None:
    """Start this process's helper, if it has none yet."""
    global _helper
    with _lock:
        if _helper is None:
            _helper = _Helper()


def stop() -> None:
    """Stop this process's helper, if it has one; later work is done in this process."""
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.kill()


atexit.register(stop)


def ranked(codec: Codec, x: np.ndarray, y: np.ndarray, pending: np.ndarray, key: str, rng: np.random.Generator,
           **settings: int) -> np.ndarray:
    """:func:`hpo.forest.ranked`, in the helper if this process has a working one."""
    global _helper
    with _lock:
        if _helper is not None:
            try:
                answer = _helper.call((codec, x, y, pending, key, rng, settings))
            except (OSError, EOFError, pickle.PickleError):
                answer = None
            if answer is not None:
                candidates, state = answer
                rng.bit_generator.state = state
                return candidates
            _helper.kill()
            _helper = None
    from hpo.forest import ranked as ranked_here

    return ranked_here(codec, x, y, pending, key, rng, **settings)


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """Answer each request on ``requests`` with ``(candidates, rng state)``, or None if the
    work failed (the sweep then does it itself), until ``requests`` ends."""
    from hpo.forest import ranked as ranked_here

    while True:
        try:
            codec, x, y, pending, key, rng, settings = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: tuple[Any, Any] | None = (ranked_here(codec, x, y, pending, key, rng, **settings),
                                              rng.bit_generator.state)
        except Exception:  # answered, so the sweep does the work itself
            answer = None
        pickle.dump(answer, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


def _import_forests() -> None:
    """Import scikit-learn's forests (the slow import, made before the first request) without
    the optional packages of :data:`_UNUSED`, which scikit-learn would import for nothing (0.2 s
    for pandas); they are importable again afterwards, should scikit-learn ever want them."""
    blocked = [name for name in _UNUSED if name not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))  # a None entry makes its import raise ImportError
    try:
        import sklearn.ensemble  # noqa: F401
    finally:
        for name in blocked:
            del sys.modules[name]


def _main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to standard output goes to standard error
    _import_forests()
    serve(sys.stdin.buffer, answers)
    os._exit(0)  # at once: the interpreter's teardown takes a good part of a second, and until the
    # helper is gone, whoever reads the sweep's output through a pipe (a test, `| tee`) waits for it


if __name__ == "__main__":
    _main()
