"""Faults around trials on a Dask cluster, with real ``dask scheduler`` and ``dask worker``
processes: a trial whose worker dies is LOST after the time it ran (not after 0 s), a trial
whose ``hpo run`` is killed is recorded LOST by its worker, but one whose task the sweep
cancelled itself is not (no loss counted, no loss reason); a sweep whose scheduler was
restarted under it still hears its trials (values, starts) on the new one; a prune reaches
its worker within a round trip, not a poll's period."""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import WriteScenario, cli_env
from distributed import Client
from test_dask import (
    START_S,
    Control,
    LocalDask,
    Running,
    cluster,
    held,
    own_cluster,
    scratch_executor,
    tokens_alive,
    trial_spec,
    wait_for,
    where,
)
from test_engine_starts import Events, sweep_of

from hpo import dask_executor
from hpo.dask_executor import DaskExecutor
from hpo.executor import saved_result
from hpo.outcome import Outcome
from hpo.render import LOG_FILE
from hpo.scenario import Resources

__all__ = ["cluster", "own_cluster", "scratch_executor"]  # the fixtures, shared with tests/test_dask.py


def test_a_trial_whose_worker_is_killed_is_lost_after_the_time_it_ran(own_cluster: LocalDask,
                                                                      tmp_path: Path) -> None:
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10)
    hold = tmp_path / "hold"
    hold.touch()
    spec = trial_spec(tmp_path, "print('ppid', __import__('os').getppid(), flush=True)\n" + held(hold), "killed")
    run = Running(executor, spec, Control())
    try:
        wait_for(lambda: "held" in run.log(), "the trial did not start")
        time.sleep(2.5)
        os.kill(own_cluster.pids()[where(spec.folder)["worker"]], signal.SIGKILL)
        run.thread.join(30)
    finally:
        hold.unlink()
        executor.close()
    assert run.error is None and run.result.outcome is Outcome.LOST, (run.result, run.error)
    assert 1.0 < run.result.duration_s < 10, run.result  # it ran 2.5 s; the watch reads the workers each second


def test_a_dask_trial_whose_hpo_run_is_killed_is_recorded_lost_by_its_worker(own_cluster: LocalDask,
                                                                             write_scenario: WriteScenario,
                                                                             tmp_path: Path) -> None:
    """kill -9 of ``hpo run``: its Dask task is cancelled, the worker ends the trial and writes
    LOST (not "interrupted: the sweep was stopped", which nobody asked for), as a trial of a
    killed sweep is on this machine."""
    hold = tmp_path / "hold"
    hold.touch()
    path = write_scenario(tmp_path, template_text=held(hold))
    run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--cluster", own_cluster.address],
                           env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = path.parent / "runs" / "demo" / "trial-0000"
    try:
        wait_for(lambda: "held" in ((folder / LOG_FILE).read_text() if (folder / LOG_FILE).exists() else ""),
                 "the trial did not start")
        time.sleep(1.0)
        run.kill()
        run.wait(10)
        wait_for(lambda: saved_result(folder, 0) is not None, "the worker did not end the trial", 15)
    finally:
        hold.unlink(missing_ok=True)
        if run.poll() is None:
            run.kill()
            run.wait()
    result = saved_result(folder, 0)
    assert result is not None and result.outcome is Outcome.LOST, result
    assert result.reason == "lost: its Dask task was cancelled: the hpo process that ran the sweep is gone"
    assert result.duration_s > 0.5


def test_a_trial_the_sweep_leaves_as_it_ends_is_interrupted_by_its_worker_not_lost(own_cluster: LocalDask,
                                                                                   tmp_path: Path) -> None:
    """The sweep's executor closes while a trial runs (the sweep ends, or stops, without waiting
    for it): its task is cancelled by the sweep, not by a vanished ``hpo run``; its worker
    records it INTERRUPTED (it runs again, no loss counted), not LOST with a loss reason."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            shared=True, scheduler_lost_s=10)
    hold = tmp_path / "hold"
    hold.touch()
    spec = trial_spec(tmp_path, held(hold), "left")
    run = Running(executor, spec, Control())
    try:
        wait_for(lambda: "held" in run.log(), "the trial did not start")
        executor.close()
        wait_for(lambda: saved_result(spec.folder, 5) is not None, "the worker did not end the trial", 15)
        run.thread.join(30)
    finally:
        hold.unlink(missing_ok=True)
        executor.close()
    result = saved_result(spec.folder, 5)
    assert result is not None and (result.outcome, result.reason) == (
        Outcome.INTERRUPTED, "interrupted: the sweep was stopped; it runs again on resume"), result
    assert not tokens_alive(spec.token)


class StopOnceHeld(Control):
    """``hpo stop`` of the trial as soon as its process runs."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self._log = log

    def end_request(self) -> str | None:
        return "stopped" if "held" in (self._log.read_text() if self._log.exists() else "") else None


def test_a_trial_stopped_before_the_sweep_heard_it_start_is_stopped_by_its_worker_not_lost(
        own_cluster: LocalDask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user stops a trial whose start is still on its way to the sweep: the sweep cancels
    its task (it never started, as far as the sweep knows), having asked for the stop; the
    worker, which had started it, ends it STOPPED as asked: neither LOST, as if the hpo
    process were gone, nor INTERRUPTED, as if the sweep were stopping."""
    handle = dask_executor._Following._handle

    def start_on_its_way(following: Any, message: Mapping[str, Any]) -> None:
        if message.get("kind") != "started":
            handle(following, message)

    monkeypatch.setattr(dask_executor._Following, "_handle", start_on_its_way)
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            shared=True, scheduler_lost_s=10)
    hold = tmp_path / "hold"
    hold.touch()
    spec = trial_spec(tmp_path, held(hold), "stopped-early")
    try:
        result = executor.run(spec, StopOnceHeld(spec.folder / LOG_FILE))
        wait_for(lambda: saved_result(spec.folder, 5) is not None, "the worker did not end the trial", 15)
    finally:
        hold.unlink(missing_ok=True)
        executor.close()
    assert (result.outcome, result.reason) == (Outcome.STOPPED, "stopped by the user")
    written = saved_result(spec.folder, 5)
    assert written is not None and (written.outcome, written.reason) == (Outcome.STOPPED, "stopped by the user"), \
        written
    assert not tokens_alive(spec.token)


STAMPED = """\
import sys
import time
from hpo.results import report
for step in range(2000):
    # one write: unbuffered (as hpo runs trials), print writes "at", " ", the stamp and "\\n" apart,
    # and the prune's kill may fall between them
    sys.stdout.write(f"at {time.time()}\\n")
    report(step=step, val_error=1.0 / (step + 1))
    time.sleep(0.01)
"""


class Judged(Control):
    """Prunes at ``prune_at``, noting when the pruner said so."""

    judged_at = 0.0

    def intermediate(self, step: int, value: float) -> bool:
        prune = super().intermediate(step, value)
        if prune and not self.judged_at:
            self.judged_at = time.time()
        return prune


def test_a_prune_reaches_its_dask_trial_within_a_round_trip(scratch_executor: DaskExecutor, tmp_path: Path) -> None:
    """The worker waits on the sweep's request rather than polling for it every 0.5 s: at
    whatever moment the pruner judges, the trial runs on for well under that (a trial that
    reports every 10 ms; its last output line marks its end)."""
    late = []
    for i, step in enumerate((20, 27, 34, 41, 48, 55)):  # judged at moments spread over half a second
        control = Judged(prune_at=step)
        spec = trial_spec(tmp_path / str(i), STAMPED, f"prompt-{i}")
        result = scratch_executor.run(spec, control)
        assert (result.outcome, result.step) == (Outcome.PRUNED, step), result
        stamps = [float(line.split()[1]) for line in (spec.folder / LOG_FILE).read_text().splitlines()
                  if line.startswith("at ")]
        late.append(max(stamps) - control.judged_at)
    assert statistics.median(late) < 0.15 and max(late) < 0.6, late  # polling every 0.5 s: a median near 0.25


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RestartableDask(LocalDask):
    """A scheduler on a fixed port, so that a new one can take the place of a killed one."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        super().__init__(folder)

    def _scheduler(self) -> str:
        argv = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                str(self.port), "--no-dashboard"]
        self.scheduler = self._spawn(argv, f"scheduler-{len(self.procs)}.log", cli_env())
        address = f"tcp://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_S
        while not self._listens():  # its own process: another test's may have taken the port meanwhile
            assert time.monotonic() < deadline and self.scheduler.poll() is None, "the scheduler did not start"
            time.sleep(0.05)
        return address

    def _listens(self) -> bool:
        """Whether the scheduler process started last listens on the port."""
        try:
            process = psutil.Process(self.scheduler.pid)
            connections = getattr(process, "net_connections", process.connections)(kind="tcp")  # psutil < 6
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in connections)

    def restart(self) -> None:
        """Kill the scheduler (its workers close) and start a new one at the same address."""
        self.client.close()
        self.scheduler.kill()
        self.scheduler.wait()
        self._scheduler()
        self.client = Client(self.address, timeout=10, set_as_default=False)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RestartableDask]:
    dask = RestartableDask(tmp_path / "dask")
    try:
        dask.worker("w1", 1)
        yield dask
    finally:
        dask.close()


STEPS = """\
import time
from hpo.results import report
for step in range(40):
    report(step=step, val_error=1.0 / (step + 1))
    time.sleep(0.05)
"""


def test_a_sweep_hears_its_trials_on_a_scheduler_restarted_under_it(restartable: RestartableDask,
                                                                    tmp_path: Path) -> None:
    """The scheduler forgets the sweep's event subscription when it restarts: the sweep
    subscribes again, so a trial on the new scheduler is seen starting and is pruned."""
    said: list[str] = []
    executor = DaskExecutor(Client(restartable.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            shared=False, scheduler_lost_s=10, say=said.append)
    try:
        restartable.restart()
        restartable.worker("w2", 1)
        wait_for(lambda: set(executor.watch.workers) == set(restartable.pids()), "the sweep did not reconnect", 20)
        control = Control(prune_at=3)
        result = executor.run(trial_spec(tmp_path, STEPS, "restarted"), control)
    finally:
        executor.close()
    assert (result.outcome, result.step) == (Outcome.PRUNED, 3), result
    assert control.values[:4] == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)]


class StoppedAhead(Control):
    """A trial a user stopped while it was claimed ahead, before its slot was free."""

    def end_request(self) -> str | None:
        return "stopped"


def test_a_trial_stopped_while_claimed_ahead_never_starts_on_dask(own_cluster: LocalDask, tmp_path: Path) -> None:
    """As on this machine: STOPPED after 0 s, never started (two idle workers were ready to)."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10)
    control = StoppedAhead()
    try:
        spec = trial_spec(tmp_path, "print('started', flush=True)\nprint('val_error=0.5')\n", "ahead")
        result = executor.run(spec, control)
        time.sleep(1.0)
    finally:
        executor.close()
    assert (result.outcome, result.duration_s, result.reason) == (Outcome.STOPPED, 0.0, "stopped by the user")
    assert control.gpus is None and not (spec.folder / LOG_FILE).exists()
    assert saved_result(spec.folder, 5) == result


def test_a_trial_whose_program_cannot_start_on_dask_is_not_announced_as_started(
        own_cluster: LocalDask, tmp_path: Path, write_scenario: WriteScenario) -> None:
    """As on this machine (tests/test_engine_starts.py): the worker sent its start before it
    tried to start the process, and the sweep printed 'trial 0 started' before its FAIL."""
    executor = DaskExecutor(Client(own_cluster.address, timeout=10, set_as_default=False), Resources(), offered=(),
                            scheduler_lost_s=10)
    events = Events()
    try:
        sweep_of(tmp_path, write_scenario, "#!/no/such/interpreter\n", executor).run(events)
    finally:
        executor.close()
    assert events.said == ["end 0", "end 1"]
    assert [(end.result.outcome, end.result.reason) for end in events.ends] == \
        [(Outcome.FAIL, "cannot start ./run.sh: No such file or directory")] * 2
