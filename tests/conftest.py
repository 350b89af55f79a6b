"""Fixture factories shared by the test suite: a scenario writer, a CLI runner and a small
disk that a test fills."""
from __future__ import annotations

import contextlib
import copy
import errno
import io
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIO_FILE = "scenario.yaml"
TEMPLATE_FILE = "train.py.j2"
CLI_TIMEOUT_S = 120
DISK_BYTES = 1 << 20

TEMPLATE_TEXT = """\
from hpo.results import report

x = {{ x }}
report(val_error=x / 2, test_error=1 - x)
"""

BASE_SCENARIO: dict[str, Any] = {
    "name": "demo",
    "template": TEMPLATE_FILE,
    "command": "python train.py",
    "parameters": {
        "x": {"type": "float", "low": 0.0, "high": 1.0},
        "opt": {"type": "categorical", "choices": ["a", "b"]},
    },
    "search": {"method": "monte_carlo", "trials": 2, "seed": 1},
    "objective": {"metric": "val_error", "direction": "minimize", "held_out": ["test_error"]},
    "resources": {"parallel": 1, "timeout": 60},
}

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``base``: mappings merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _drop(data: dict[str, Any], dotted: str) -> None:
    """Remove the key at a dotted path such as ``search.trials``."""
    *parents, last = dotted.split(".")
    for part in parents:
        data = data[part]
    del data[last]


def write_scenario_file(folder: Path, *, drop: Sequence[str] = (), template_text: str | None = TEMPLATE_TEXT,
                        files: Mapping[str, str] | None = None, raw: str | None = None,
                        **overrides: Any) -> Path:
    """Write a small valid scenario (plus its template) into ``folder``; return its path.

    ``drop`` first removes dotted keys (``search.trials``) from :data:`BASE_SCENARIO`, then
    ``overrides`` deep-merge into it (mappings merge, other values replace);
    ``template_text`` replaces the template (None writes none); ``files`` are extra files
    written beside; ``raw`` is written verbatim as the scenario instead of YAML.
    """
    folder.mkdir(parents=True, exist_ok=True)
    base = copy.deepcopy(BASE_SCENARIO)
    for dotted in drop:
        _drop(base, dotted)
    data = _merge(base, overrides)
    if template_text is not None:
        (folder / TEMPLATE_FILE).write_text(template_text)
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    path = folder / SCENARIO_FILE
    path.write_text(raw if raw is not None else yaml.safe_dump(data, sort_keys=False))
    return path


CLI_ENV_SET = {"HPO_GPUS": ""}
CLI_ENV_UNSET = ("RANK", "HPO_DEBUG")


def cli_env() -> dict[str, str]:
    """The environment of a CLI run: the repo importable, no GPUs, no rank, no debug."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(CLI_ENV_SET)
    for name in CLI_ENV_UNSET:
        env.pop(name, None)
    return env


READ_COMMANDS = frozenset({"validate", "status", "export", "best", "plot"})
"""Commands that read the study and print: they start no process, install no signal handler
and leave no thread behind."""

_in_process = threading.Lock()


def runs_in_process(argv: Sequence[str]) -> bool:
    """Whether :func:`run_hpo` runs ``hpo ARGV`` in this process: a read command, or a sweep on
    this machine (no ``--cluster``: a Dask client would leave its threads and logging behind)
    called from the main thread (the only one that may install the sweep's signal handlers).
    A process of its own starts Python, Optuna and SQLAlchemy again: 0.7 to 2 CPU seconds a
    command, on a suite that is CPU-bound on 2 cores."""
    if not argv:
        return False
    if argv[0] in READ_COMMANDS:
        return True
    return argv[0] == "run" and not any(arg.startswith("--cluster") for arg in argv) \
        and threading.current_thread() is threading.main_thread()


def run_hpo(*args: str | os.PathLike[str], cwd: Path | None = None,
            timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``hpo ARGS`` and capture its exit code and output (text): where
    :func:`runs_in_process`, through :func:`hpo.cli.main` in this process, in the same
    environment, folder and streams a ``python -m hpo`` process would have; else (and always
    with :func:`run_hpo_process`) in a process of its own. ``timeout`` bounds a process of its
    own; in this process the suite's timeout per test does."""
    argv = [str(arg) for arg in args]
    if not runs_in_process(argv):
        return run_hpo_process(*argv, cwd=cwd, timeout=timeout)
    from hpo import cli

    out, err = io.StringIO(), io.StringIO()
    # The environment, the folder and the streams are the whole process's. Only the variables
    # the CLI's environment changes are touched: a thread may start a process meanwhile.
    with _in_process, pytest.MonkeyPatch.context() as patch:
        for name, value in CLI_ENV_SET.items():
            patch.setenv(name, value)
        for name in CLI_ENV_UNSET:
            patch.delenv(name, raising=False)
        if cwd is not None:
            patch.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    return subprocess.CompletedProcess(["hpo", *argv], code, out.getvalue(), err.getvalue())


def run_hpo_process(*args: str | os.PathLike[str], cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S,
                    extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hpo ARGS`` in a process of its own, in :func:`cli_env` with ``extra_env``
    over it, and capture its output (text)."""
    return subprocess.run([sys.executable, "-m", "hpo", *map(str, args)], cwd=cwd,
                          env={**cli_env(), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="session")
def write_scenario() -> WriteScenario:
    """Factory: ``write_scenario(tmp_path, **overrides) -> Path`` (see :func:`write_scenario_file`)."""
    return write_scenario_file


@pytest.fixture(scope="session")
def run_cli() -> RunCli:
    """Factory: ``run_cli(*args, cwd=None) -> CompletedProcess`` running the real CLI."""
    return run_hpo


@pytest.fixture
def scenario_path(tmp_path: Path) -> Path:
    """The base scenario, written into a fresh folder."""
    return write_scenario_file(tmp_path)


class Disk:
    """A mounted tmpfs of :data:`DISK_BYTES` that a test fills and frees."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self._filler = mount / "filler"

    def fill(self) -> None:
        """Take every byte left, as a runaway checkpoint or log would."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        """Give the space back, as a user who deleted something would."""
        self._filler.unlink()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    """A real disk to fill (so the errors are the real ones); skips where no tmpfs can be
    mounted (it needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here (it needs root): {mounted.stderr.strip()}")
    try:
        yield Disk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run_torch_job(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
                  timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a training script (plainly or under torchrun) and capture its output (text).

    No retry: a rank that aborts at exit after its work is done is a bug of the script.
    """
    return subprocess.run(list(argv), cwd=cwd, env=dict(env), capture_output=True, text=True,
                          timeout=timeout, check=False)
