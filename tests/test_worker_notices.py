"""The notices of the workers that ``hpo run --workers K`` starts (what they wait for, what went
wrong) reach its screen, not only their logs; real ``dask scheduler`` and ``dask worker``
processes."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from conftest import WriteScenario, cli_env
from test_dask import LocalDask, wait_for


def test_a_dask_wait_of_a_worker_reaches_the_screen_once(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """gpus_per_trial 4 on a cluster whose worker offers GPU=2: the screen showed only '2
    waiting', the reason being in worker-N.log alone. The signal that hpo run passes on is said
    once, by hpo run."""
    dask = LocalDask(tmp_path / "dask")
    try:
        dask.worker("gpu", 1, gpus="0,1", resources="GPU=2")
        path = write_scenario(tmp_path, resources={"gpus_per_trial": 4, "parallel": 2})
        run = subprocess.Popen([sys.executable, "-m", "hpo", "run", str(path), "--workers", "2", "--cluster",
                                dask.address], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        assert run.stdout is not None and run.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(run.stdout or ()), daemon=True)
        reader.start()
        try:
            wait_for(lambda: any("no Dask worker" in line for line in lines), "hpo run showed no wait", 60)
            run.send_signal(signal.SIGINT)
            err = run.stderr.read()
            run.wait(60)
            reader.join(10)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    finally:
        dask.close()
    assert run.returncode == 130, "".join(lines) + err
    said = [line for line in lines if "no Dask worker" in line]  # by one worker or both
    wait = (f"no Dask worker of the scheduler at {dask.address} can run a trial: each takes GPU=4 of a worker's "
            "Dask resources, and the 1 worker connected offers at most GPU=2; 1 trial waits for a worker that can")
    assert said and all(re.match(rf"hpo: worker-[01]: {re.escape(wait)}", line) for line in said), lines
    assert err.count("SIGINT") == 1 and "worker-" not in err, err
    logs = "".join(log.read_text() for log in (tmp_path / "runs" / "demo").glob("worker-*.log"))
    assert logs.count("no Dask worker") == len(said) and "SIGINT: ending running trials" in logs, logs


def test_a_worker_is_read_from_the_moment_it_is_added_not_once_every_worker_runs(tmp_path: Path) -> None:
    """hpo run starts its workers, then reads the store (through an outage, for minutes): a
    worker that writes more than a pipe holds meanwhile must not block. Its output is read
    from its start, logged whole, and its notices said."""
    from hpo.worker_logs import WorkerLogs, relaying

    said: list[str] = []
    logs = WorkerLogs(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    with relaying(procs, logs, said.append) as relays:
        relays.add(subprocess.Popen([sys.executable, "-c", "print('x' * 200_000); print('hpo: a notice')"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT), 0)
        assert procs[0].wait(timeout=20) == 0  # a pipe holds 64 KiB: unread, the worker would block here
    assert said == ["hpo: worker-0: a notice"]
    assert logs.path(0).read_text() == "x" * 200_000 + "\nhpo: a notice\n"


def test_two_runs_in_one_workdir_take_distinct_worker_logs(tmp_path: Path) -> None:
    """Two hpo run --workers 2 at once in one workdir both wrote worker-0.log and worker-1.log
    (and gave their workers the same seeds): the second takes the next numbers, and numbers
    come free when the run that held them ends."""
    from hpo.worker_logs import WorkerLogs

    first, second = WorkerLogs(tmp_path), WorkerLogs(tmp_path)
    assert first.claim(2) == [0, 1]
    assert second.claim(2) == [2, 3]
    first.close()
    assert WorkerLogs(tmp_path).claim(3) == [0, 1, 4]
