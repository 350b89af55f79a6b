"""Dask workers as batch jobs (Slurm, PBS, SGE, LSF, HTCondor) through dask-jobqueue.

``resources.cluster`` as a mapping (:class:`hpo.scenario.Cluster`) becomes a dask-jobqueue
cluster whose scheduler runs inside ``hpo run``. Each job runs one Dask worker that offers
its cores and GPUs as the Dask resources ``CPU`` and ``GPU``, so that it runs as many
trials at once as they allow. hpo scales the jobs to the trials waiting or running
(:class:`TrialAdaptive`, at most ``jobs``) and cancels them when the sweep ends. A job the
batch system refuses (``sbatch`` exits non-zero: a wrong partition or account, a controller
that cannot be reached) is reported in one line (the command's last error line) to the
sweep, which stops where no worker is left to run its trials.
"""
from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dask.utils import parse_bytes
from distributed.core import Status
from distributed.deploy import Adaptive

from hpo.errors import InputError
from hpo.scenario import Cluster, Resources

CLUSTER_CLASSES = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster", "lsf": "LSFCluster",
                   "htcondor": "HTCondorCluster"}
UNFINISHED = frozenset({"waiting", "queued", "no-worker", "processing"})
SCHEDULER_PLACEHOLDER = "tcp://<insert-scheduler-address-here>:8786"
"""What the job script shows for the scheduler's address before ``hpo run`` starts it (dask-jobqueue's own words)."""


def trials_per_job(spec: Cluster, resources: Resources) -> int:
    """How many trials one job runs at once: its GPUs divided among trials (a share of a
    GPU counts as one), else its cores divided among the trials' processes."""
    from hpo.dask_executor import Demand

    demand = Demand.of(resources)
    assert spec.cores is not None
    by_cores = spec.cores // demand.processes
    if spec.gpus:
        return min(spec.gpus * demand.share // demand.gpus, by_cores)
    return by_cores


def job_options(spec: Cluster) -> dict[str, Any]:
    """The dask-jobqueue keyword arguments of ``spec`` (one worker process per job).

    GPUs are asked for the usual way of each scheduler (``--gres=gpu:N``, ``ngpus=N``,
    ``-l gpu=N``, ``-gpu num=N``, ``request_gpus``); ``job_extra`` adds any other directive.
    Raises InputError for a key the scheduler has no place for.
    """
    kind = spec.kind
    assert kind is not None and spec.cores is not None and spec.memory is not None
    resources = f"CPU={spec.cores}" + (f",GPU={spec.gpus}" if spec.gpus else "")
    options: dict[str, Any] = {
        "cores": spec.cores, "memory": spec.memory, "processes": 1,
        "worker_extra_args": ["--resources", resources],
        "job_script_prologue": list(spec.setup),
    }
    if spec.interface:
        options["interface"] = spec.interface
    extra = list(spec.job_extra)
    if kind == "htcondor":
        for key in ("walltime", "queue", "account"):
            if getattr(spec, key) is not None:
                raise InputError(f"resources.cluster.{key}: HTCondor jobs have no {key}; use job_extra "
                                 "(\"key = value\" lines)")
        directives = dict(_condor_line(line) for line in extra)
        if spec.gpus:
            directives.setdefault("request_gpus", str(spec.gpus))
        options.update(job_extra_directives=directives, disk=spec.disk)
        return options
    if spec.walltime is not None:
        options["walltime"] = spec.walltime
    if spec.queue is not None:
        options["queue"] = spec.queue
    if spec.account is not None:
        options["project" if kind in ("sge", "lsf") else "account"] = spec.account
    if spec.gpus:
        if kind == "slurm":
            extra.insert(0, f"--gres=gpu:{spec.gpus}")
        elif kind == "pbs":
            from dask_jobqueue.pbs import pbs_format_bytes_ceil

            memory = pbs_format_bytes_ceil(parse_bytes(spec.memory))
            options["resource_spec"] = f"select=1:ncpus={spec.cores}:ngpus={spec.gpus}:mem={memory}"
        elif kind == "sge":
            extra.insert(0, f"-l gpu={spec.gpus}")
        else:
            extra.insert(0, f'-gpu "num={spec.gpus}"')
    options["job_extra_directives"] = extra
    return options


def _condor_line(line: str) -> tuple[str, str]:
    key, sep, value = line.partition("=")
    if not sep or not key.strip():
        raise InputError(f"resources.cluster.job_extra: HTCondor directives are \"key = value\" lines, got {line!r}")
    return key.strip(), value.strip()


def submit_error(exc: BaseException) -> str:
    """The line that says why a job was not submitted: the submit command's last error line
    (dask-jobqueue's error quotes its whole output), else the error's first line."""
    text = str(exc)
    stderr = text.partition("\nstderr:\n")[2]
    lines = [line.strip() for line in (stderr or text).splitlines() if line.strip()]
    return (lines[-1] if stderr and lines else lines[0] if lines else type(exc).__name__)


def _reporting(job_cls: Any, on_failure: Callable[[str], None], on_submitted: Callable[[], None]) -> Any:
    """``job_cls`` whose failed submission is passed to ``on_failure`` (:func:`submit_error`)
    instead of raised into Dask's event loop, which would print its traceback and never
    submit the job again: the job stands as one that never joins (it has no job id, so
    closing it cancels nothing). A submission that succeeds calls ``on_submitted``."""

    class Reporting(job_cls):  # type: ignore[misc,valid-type]
        async def start(self) -> None:
            try:
                await super().start()
            except Exception as exc:
                on_failure(submit_error(exc))
                self.status = Status.running
                return
            on_submitted()

    return Reporting


def make_cluster(spec: Cluster, dashboard: bool = True, log_directory: Path | None = None,
                 on_failure: Callable[[str], None] | None = None,
                 on_submitted: Callable[[], None] = lambda: None) -> Any:
    """A dask-jobqueue cluster of ``spec`` with no job yet (its scheduler runs in this process,
    with Dask's dashboard when ``dashboard``); its jobs write their output into
    ``log_directory`` (default: the batch system's, usually the current folder). With
    ``on_failure``, a job that cannot be submitted is reported to it, and one submitted to
    ``on_submitted`` (see :func:`_reporting`)."""
    import dask_jobqueue

    assert spec.kind is not None
    cls = getattr(dask_jobqueue, CLUSTER_CLASSES[spec.kind])
    options = job_options(spec)
    if on_failure is not None:
        options["job_cls"] = _reporting(cls.job_cls, on_failure, on_submitted)
    if log_directory is not None:
        log_directory.mkdir(parents=True, exist_ok=True)
        options["log_directory"] = str(log_directory)
    with warnings.catch_warnings():  # Dask's four lines when 8787 is taken: the dashboard takes another port
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        return cls(**options, scheduler_options={} if dashboard else {"dashboard": False, "dashboard_address": ":0"})


def check_submit(spec: Cluster) -> None:
    """InputError where the command that submits ``spec``'s batch jobs (``sbatch``, ``qsub``,
    ``bsub``, ``condor_submit``, as dask-jobqueue runs it) is not on this machine's PATH: no
    job could start, and the sweep would wait for workers that never come."""
    import shutil

    import dask_jobqueue

    assert spec.kind is not None
    command = getattr(dask_jobqueue, CLUSTER_CLASSES[spec.kind]).job_cls.submit_command
    if shutil.which(command) is None:
        raise InputError(f"resources.cluster.kind: {spec.kind} jobs are submitted with {command}, which is not on "
                         f"PATH here; run hpo where {command} works (a login node of the cluster)")


def job_script(spec: Cluster, log_directory: Path | None = None) -> str:
    """The job script hpo would submit for ``spec``, as dask-jobqueue writes it, but with
    :data:`SCHEDULER_PLACEHOLDER` for the address of the scheduler that ``hpo run`` starts,
    and with the job's output going into ``log_directory`` (as :func:`start` sends it).

    It is built from dask-jobqueue's job class alone: no scheduler is started, so no port is
    opened and nothing is written (a scheduler makes ``dask-scratch-space`` and its lock files;
    the job class makes its log directory, so an empty temporary one stands in for it).
    """
    import dask_jobqueue

    assert spec.kind is not None
    job_cls = getattr(dask_jobqueue, CLUSTER_CLASSES[spec.kind]).job_cls
    if log_directory is None:
        return str(job_cls(SCHEDULER_PLACEHOLDER, name="dummy-name", **job_options(spec)).job_script())
    with tempfile.TemporaryDirectory(prefix="hpo-job-logs-") as stand_in:
        script = job_cls(SCHEDULER_PLACEHOLDER, name="dummy-name", log_directory=stand_in,
                         **job_options(spec)).job_script()
    return str(script).replace(stand_in, str(log_directory))


class TrialAdaptive(Adaptive):
    """Dask's adaptive scaling, aimed at the trials waiting or running: ``ceil(trials /
    per_job)`` jobs, idle jobs released (as Dask releases them: after ``wait_count`` checks).

    Args:
        cluster: the dask-jobqueue cluster (its scheduler runs in this process).
        per_job: trials one job runs at once.
        **kwargs: Dask's :class:`~distributed.deploy.Adaptive` arguments.
    """

    def __init__(self, cluster: Any, per_job: int, **kwargs: Any) -> None:
        super().__init__(cluster, **kwargs)
        self._per_job = per_job

    async def target(self) -> int:
        """Jobs for the trial tasks that have not finished (the scheduler's own count)."""
        scheduler = self.cluster.scheduler
        unfinished = sum(1 for task in scheduler.tasks.values() if task.state in UNFINISHED)
        return math.ceil(unfinished / self._per_job)


def start(spec: Cluster, resources: Resources, log_directory: Path | None = None,
          on_failure: Callable[[str], None] | None = None, on_submitted: Callable[[], None] = lambda: None) -> Any:
    """Start the cluster of ``spec`` with :class:`TrialAdaptive` scaling up to ``spec.jobs``;
    the jobs' output goes into ``log_directory``; jobs that cannot be submitted are reported
    to ``on_failure``, those submitted to ``on_submitted``."""
    cluster = make_cluster(spec, log_directory=log_directory, on_failure=on_failure, on_submitted=on_submitted)
    cluster.adapt(Adaptive=TrialAdaptive, minimum_jobs=0, maximum_jobs=spec.jobs,
                  per_job=max(1, trials_per_job(spec, resources)))
    return cluster
