"""Trials as Dask tasks: each slot's trial runs on a worker of a Dask cluster.

``hpo run`` keeps the optimizer and the store. A :class:`DaskExecutor` submits each trial
as one task, :func:`run_task`, which runs :func:`hpo.executor.run_trial` on a worker: in
its own process tree exactly as on this machine, on GPUs of the worker's machine. All that
passes between the two travels through the Dask scheduler, so a worker needs neither the
store nor a shared filesystem:

* worker to sweep: events on the executor's topic (``Worker.log_event``): the trial
  started (where, on which GPUs), its intermediate values, chunks of its log;
* sweep to worker: a Dask ``Variable`` per trial holding what should end it (``stopped``,
  ``pruned``, ``interrupted``; empty while it runs), and an ``Event`` the sweep sets after
  each request, which the worker waits on (in the scheduler: no polling, no CPU) and then
  reads the request: it reaches the trial within a round trip. The sweep reports and judges
  the values as :func:`hpo.executor.run_trial` does on this machine, so a trial is recorded
  alike on both: pruned at the step the pruner judged, with no later value reported, however
  many steps its worker ran before the request reached it;
* a Dask ``Event`` per task marks its first start. Dask runs a task again when its worker
  dies; hpo does not: the second start returns LOST at once, and the sweep queues the
  configuration as a new trial, as it does for any lost trial;
* the task's result: how the trial ended and the end of its log.

No trial runs unseen: a task asked to end before it started never starts its trial (the
sweep cancels it; once the sweep stops, an Event tells every worker to start none of its
trials), and a worker ends its trial when it closes or loses the scheduler, or when its task
is cancelled with no request of the sweep's (the ``hpo`` process that ran the sweep is gone),
as the trial's end could no longer be reported: such a trial is LOST, as one whose worker
died, and its ``result.json`` says why. A task the sweep cancels itself (a trial it stops,
interrupts or leaves as it ends) is told first, and its trial ends as asked: no loss. When
the scheduler goes away the sweep stops (:class:`SchedulerGone`) with how each
of its trials ended as far as it can tell. The sweep says when it waits on the cluster: trials
that no connected worker can run, a scheduler that does not answer.

Trial folders: when the worker sees the trial's folder (a shared filesystem), the trial
runs there, as on this machine; otherwise it runs in the worker's scratch space while its
log streams into the folder here, where its ``result.json`` is written too.

A worker's own full disk (its trial folder, log or ``result.json`` refused: ENOSPC, a quota)
is the worker's, as a full trial folder is the sweep's on this machine
(:class:`hpo.render.FolderFull`): said in one line that names the worker, the file and the
room left, measured on the worker, and once more when a trial runs there again. Only that
worker's trials are affected: one refused before it started runs at once on another worker,
one whose log was refused is INTERRUPTED (it runs again; the sweep is told with a
:class:`~hpo.render.FolderFull` that names the worker's folders, and counts it, as for its
own folders: the third time it is FAIL), and trials are kept off the worker
for a while, then tried there again. Where every worker that can run a trial is full, the
sweep waits for room as for its own full disk.

A trial takes ``gpus_per_trial`` of a worker's ``GPU`` resource and ``processes`` of its
``CPU`` resource, for each of these that the cluster's workers offer
(``dask worker --resources GPU=4``); one worker thread either way.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import logging
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed import CancelledError, Client, Event, KilledWorker, Variable, get_client, get_worker
from distributed.comm import CommClosedError, get_address_host
from distributed.worker import WORKER_ANY_RUNNING, Worker

from hpo.errors import ExecutorUnavailable, InputError
from hpo.executor import (
    CUT_SHORT,
    HeldStart,
    TrialControl,
    TrialSpec,
    judge,
    not_started,
    run_trial,
    save_result,
    saved_result,
)
from hpo.launch import (
    GPU_ENV,
    KILL_GRACE_S,
    Slot,
    detect_gpus,
    env_threads,
    gpu_ids,
    parallel_allows,
    plural,
    usable_cores,
)
from hpo.outcome import Outcome, TrialResult
from hpo.render import LOG_FILE, RESULT_FILE, FolderFull, folder_full, folder_writes, write_files
from hpo.results import Metrics
from hpo.scenario import Cluster, Resources

LISTEN_S = 1.0
GET_S = 2.0
SHIP_S = 0.25
CHUNK_BYTES = 64 * 1024
CHECK_S = 0.2
WATCH_S = 1.0
LOST_GRACE_S = 5.0
LOG_DRAIN_S = 5.0
FULL_FIRST_S = 2.0
FULL_MAX_S = 60.0
INTERRUPT_GRACE_S = KILL_GRACE_S + 10.0
SCHEDULER_LOST_S = 30.0
NO_WORKER_S = 5.0
MARKER = ".hpo-token"
RUNNING_STATES = frozenset({"executing", "long-running"})

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Demand:
    """What one trial takes of a worker.

    Args:
        gpus: GPUs on a worker that has them (1 for a share of one).
        share: trials that share each GPU (``k`` of ``gpus_per_trial: 1/k``).
        processes: processes of the trial (torchrun ranks).
    """

    gpus: int
    share: int
    processes: int

    @classmethod
    def of(cls, resources: Resources) -> Demand:
        """The demand of ``resources`` (``gpus_per_trial: auto``: one GPU per process)."""
        gpus, processes = resources.gpus_and_processes
        return cls(gpus, resources.share, processes)

    def restrictions(self, offered: Sequence[str]) -> dict[str, float]:
        """The Dask resources a trial asks for, of those the workers ``offered``."""
        wanted = {"GPU": self.gpus / self.share * (1 - 1e-9) if self.share > 1 else float(self.gpus),
                  "CPU": float(self.processes)}
        return {name: amount for name, amount in wanted.items() if name in offered}

    def at_once(self, nthreads: int, resources: Mapping[str, float], restricted: Sequence[str]) -> int:
        """How many trials a worker with ``nthreads`` threads and ``resources`` runs at once."""
        count = nthreads
        for name, amount in self.restrictions(restricted).items():
            count = min(count, int(resources.get(name, 0.0) / amount + 1e-6))
        return max(0, count)


@dataclass(frozen=True)
class TaskOptions:
    """How every trial task of one executor runs on its worker.

    Args:
        topic: the executor's event topic (and the prefix of its ``stopping`` Event).
        demand: what each trial takes.
        restricted: the Dask resources that trials ask for (``GPU``, ``CPU``).
        shared: whether the workers see the trial folders (None: each task checks).
        scheduler_lost_s: seconds without the scheduler before a trial is interrupted.
    """

    topic: str
    demand: Demand
    restricted: tuple[str, ...]
    shared: bool | None
    scheduler_lost_s: float


@dataclass(frozen=True)
class TaskReport:
    """What a trial task returns.

    Args:
        result: how the trial ended.
        worker: the Dask worker that ran it.
        slot: the slot it ran on, with the worker's GPU ids (empty on CPU) and threads.
        shared: whether it ran in the trial's own folder (else in scratch space).
        chunks: log chunks sent as events.
        rest: the end of the log that no event carried.
        started: whether the trial's process started (False: it was asked to end before, or
            its worker's disk refused its folder or log).
        again: whether this is a second start, after the worker of the first died: the
            result is LOST and nothing ran.
        full: where the worker's own disk is full, its line: the worker, the file it could
            not write and the room left there, measured on the worker (empty otherwise).
        label: the worker in words (:func:`worker_label`), where ``full`` is set.
    """

    result: TrialResult
    worker: str
    slot: Slot | None = None
    shared: bool = True
    chunks: int = 0
    rest: str = ""
    started: bool = True
    again: bool = False
    full: str = ""
    label: str = ""


def _task_key(token: str) -> str:
    """A new task key for the trial ``token``: each submission has its own (a trial is
    submitted again after a worker's full disk refused it, or after the sweep waited for
    room), so that none is answered with an earlier one's result that the scheduler keeps."""
    return f"hpo-trial-{token}-{uuid.uuid4().hex[:12]}"


def _start_event(key: str) -> str:
    """The Event that marks the first start of the task ``key``."""
    return f"{key}-started"


def _end_variable(token: str) -> str:
    """The Variable that holds what should end the trial ``token`` (empty while it runs)."""
    return f"hpo-end-{token}"


def _asked_event(token: str) -> str:
    """The Event the sweep sets after each end request it makes of the trial ``token`` (its
    worker waits on it, then reads the request from the trial's Variable)."""
    return f"hpo-asked-{token}"


def _stopping_event(topic: str) -> str:
    """The Event set once the sweep of the executor with ``topic`` stops."""
    return f"{topic}-stopping"


# --- the worker's side ------------------------------------------------------------------


def worker_gpus() -> tuple[int, ...]:
    """GPU ids of the worker's machine: ``HPO_GPUS``, else ``CUDA_VISIBLE_DEVICES`` when it
    lists distinct ids (a batch system's allocation; not UUIDs), else what nvidia-smi shows."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if GPU_ENV not in os.environ and visible is not None:
        with contextlib.suppress(InputError):
            return gpu_ids(visible, "CUDA_VISIBLE_DEVICES")
    return detect_gpus()


class GpuPool:
    """The GPUs of one worker process, lent to the trials it runs at once: each GPU to one
    trial, or to ``share`` trials of a fraction ``1/share``."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)
        self._use = dict.fromkeys(self.ids, 0)
        self._changed = threading.Condition()

    def take(self, count: int, share: int) -> tuple[int, ...]:
        """``count`` GPUs, the least used first; waits while other trials hold them.

        Raises ValueError when the machine has fewer than ``count`` GPUs.
        """
        if count > len(self.ids):
            raise ValueError(f"a trial needs {count} GPUs; this Dask worker's machine has {len(self.ids)} "
                             f"({GPU_ENV}, CUDA_VISIBLE_DEVICES or nvidia-smi)")
        with self._changed:
            while True:
                free = sorted((i for i in self.ids if self._use[i] < share), key=lambda i: (self._use[i], i))
                if len(free) >= count:
                    for gpu in free[:count]:
                        self._use[gpu] += 1
                    return tuple(sorted(free[:count]))
                self._changed.wait()

    def give_back(self, gpus: Sequence[int]) -> None:
        """Return GPUs that :meth:`take` lent."""
        with self._changed:
            for gpu in gpus:
                self._use[gpu] -= 1
            self._changed.notify_all()


_POOL: GpuPool | None = None
_POOL_LOCK = threading.Lock()


def gpu_pool() -> GpuPool:
    """This worker process's pool of GPUs (detected once)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = GpuPool(worker_gpus())
        return _POOL


def scheduler_identity(client: Client) -> dict[str, Any]:
    """The scheduler's description of itself and of every worker, fetched now. Not
    ``client.scheduler_info()``: that returns the client's cached copy, which the client's
    periodic refresh replaces with one that lists no worker, and may replace between its
    fetch and its return; an OSError it meets is swallowed and the old copy returned."""
    return client.sync(client.scheduler.identity, n_workers=-1)


def _within(seconds: float, call: Callable[[], Any], default: Any) -> Any:
    """``call()`` (in a thread), or ``default`` where it raised or did not return within
    ``seconds`` (a scheduler that does not answer)."""
    answer: list[Any] = []

    def ask() -> None:
        try:
            answer.append(call())
        except Exception:
            logger.debug("no answer from %s", call, exc_info=True)

    thread = threading.Thread(target=ask, name="hpo-ask", daemon=True)
    thread.start()
    thread.join(seconds)
    return answer[0] if answer else default


def _first_start(client: Client, key: str) -> bool:
    """Mark the task ``key`` started; False if it had started before (on a worker that died)."""
    event = Event(_start_event(key), client=client)
    if event.is_set():
        return False
    event.set()
    return True


def _trial_folder(spec: TrialSpec, worker: Worker, shared: bool | None) -> tuple[Path, bool]:
    """Where the trial runs on this worker, and whether that is its own folder."""
    if shared is None:
        try:
            shared = (spec.folder / MARKER).read_text() == spec.token
        except OSError:
            shared = False
    if shared:
        return spec.folder, True
    digest = hashlib.sha1(spec.token.encode()).hexdigest()[:12]
    return Path(worker.local_directory) / "hpo-trials" / f"{spec.folder.name}-{digest}", False


class _Courier:
    """The worker's side of one running trial: sends its events, ships its log (in a thread),
    and hears what should end it: a thread waits on the trial's asked Event, which the sweep
    sets after each request, and reads the request at once (so a prune reaches the trial
    within a round trip, not a poll's period); it reads it every ``LISTEN_S`` anyway, which
    also tells that the scheduler answers. Waiting costs no CPU: the wait is the scheduler's."""

    def __init__(self, worker: Worker, client: Client, spec: TrialSpec, options: TaskOptions,
                 log: Path | None) -> None:
        self._worker = worker
        self._topic = options.topic
        self._token = spec.token
        self._key = worker.get_current_task()
        self._end = Variable(_end_variable(spec.token), client=client)
        self._asked = Event(_asked_event(spec.token), client=client)
        self._stopping = Event(_stopping_event(options.topic), client=client)
        self._lost_s = options.scheduler_lost_s
        self._listen_s = min(LISTEN_S, options.scheduler_lost_s / 3)
        self._log = log
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chunks = 0
        self.cause: str | None = None
        self._request: str | None = None
        self._cancel_asked: tuple[str | None] | None = None  # (the sweep's request) once the task was cancelled
        self._heard = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._ship, name=f"hpo-courier-{spec.number}", daemon=True)
        self._listener = threading.Thread(target=self._listen, name=f"hpo-listener-{spec.number}", daemon=True)

    def send(self, kind: str, **fields: Any) -> None:
        """An event for the sweep."""
        self._worker.log_event(self._topic, {"token": self._token, "kind": kind, **fields})

    def start(self) -> None:
        """Start shipping and listening."""
        self._thread.start()
        self._listener.start()

    def end_request(self) -> str | None:
        """What should end the trial: the sweep's request, or ``interrupted`` when its task
        was cancelled with no request of the sweep's (the sweep that submitted it is gone),
        the worker is closing (it lost its scheduler, or was told to close: the trial's end
        could not be reported) or the scheduler has not answered for ``scheduler_lost_s``;
        :attr:`cause` then says which. A task the sweep cancelled itself (it asked for the
        trial's end, dropped the trial, or stops) ends as the sweep asked: no loss."""
        if self._request == "interrupted":
            return self._request
        if self._cancelled():
            if self._cancel_asked is None:  # a scheduler that hangs does not hold the trial's end
                self._cancel_asked = (_within(GET_S, self._sweep_asked, self._request),)
            if self._cancel_asked[0] is not None:
                return self._cancel_asked[0]
            self.cause = self.cause or "its Dask task was cancelled: the hpo process that ran the sweep is gone"
            return "interrupted"
        if self._worker.status not in WORKER_ANY_RUNNING or (
                self._request is None and time.monotonic() - self._heard > self._lost_s):
            self.cause = self.cause or f"its Dask worker {self._worker.address} closed or lost the scheduler"
            return "interrupted"
        return self._request

    def _cancelled(self) -> bool:
        state = self._worker.state.tasks.get(self._key)
        return state is None or state.state not in RUNNING_STATES

    def _sweep_asked(self) -> str | None:
        """What the sweep asked of the trial whose task is cancelled: the request heard, else
        read now; ``interrupted`` where the sweep dropped the trial's Variable (it stopped
        following it) or stops; None where it asked nothing (it is gone)."""
        if self._request is not None:
            return self._request
        try:
            value = self._end.get(timeout=CHECK_S)
        except TimeoutError:
            return "interrupted"
        if value:
            return str(value)
        return "interrupted" if self._stopping.is_set() else None

    def stop(self) -> str:
        """Stop the threads; return the log's end that was not shipped. The listener is not
        waited for: it ends after its wait (at most ``LISTEN_S``)."""
        self._done.set()
        self._thread.join()
        return self._read(final=True)

    def _ship(self) -> None:
        while not self._done.wait(SHIP_S):
            text = self._read(final=False)
            if text:
                self.send("log", seq=self.chunks, text=text)
                self.chunks += 1

    def _listen(self) -> None:
        while not self._done.is_set():
            try:
                if self._asked.wait(timeout=self._listen_s):
                    self._asked.clear()  # before the read: a request made after it sets the Event again
            except Exception:  # unreachable for now; end_request judges for how long
                logger.debug("cannot wait on %s", self._asked.name, exc_info=True)
                if self._done.wait(SHIP_S):
                    return
                continue
            if not self._done.is_set():
                self.poll()

    def poll(self) -> None:
        """Read the sweep's request now."""
        try:
            value = self._end.get(timeout=GET_S)
        except TimeoutError:  # the sweep no longer knows the trial (its scheduler restarted)
            self._request = "interrupted"
            return
        except Exception:  # unreachable for now; end_request judges for how long
            logger.debug("cannot read %s", self._end.name, exc_info=True)
            return
        self._heard = time.monotonic()
        self._request = str(value) or None

    def _read(self, final: bool) -> str:
        """New log text (up to CHUNK_BYTES unless ``final``); empty when the log stays here."""
        if self._log is None or not self._log.exists():
            return ""
        with self._log.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read() if final else handle.read(CHUNK_BYTES)
        self._offset += len(data)
        return self._decoder.decode(data, final=final)


class _WorkerControl(TrialControl):
    """The control on the worker: events out, the courier's requests in. It never asks to
    prune: the sweep judges each value and asks for the end as for any other. The ``started``
    event goes out once the trial's process runs (:class:`hpo.executor.HeldStart`), so the
    sweep announces only a process that really runs, as on its own machine."""

    def __init__(self, courier: _Courier, place: Mapping[str, Any]) -> None:
        self._courier = courier
        self._place = place
        self._start = HeldStart(lambda start: courier.send("started", **start))

    def started(self, slot: Slot) -> None:
        self._start.hold({"slot": asdict(slot), **self._place})

    def intermediate(self, step: int, value: float) -> bool:
        self._start.release()
        self._courier.send("value", step=step, value=value)
        return False

    def record(self, step: int, value: float) -> None:
        self._start.release()
        self._courier.send("value", step=step, value=value, judged=False)

    def end_request(self) -> str | None:
        self._start.release()
        return self._courier.end_request()


def trial_threads(worker: Worker, options: TaskOptions, host_threads: int) -> int:
    """Threads per process of a trial: the worker's cores divided among the trials it runs at once.

    A worker's cores are the ``CPU`` resource it offers (a batch job's cores), capped by those
    it may run on; a worker that offers none shares the cores it may run on with the other
    workers of its host, by threads (``host_threads``: theirs and its own), so the several
    workers of a ``LocalCluster`` or of ``dask worker --nworkers`` do not each take them all.
    """
    cpus = usable_cores()
    offered = worker.state.total_resources.get("CPU")
    nthreads = worker.state.nthreads
    if offered:
        cpus = min(cpus, max(1, int(offered)))
    else:
        cpus = max(1, cpus * nthreads // max(host_threads, nthreads))
    demand = options.demand
    at_once = demand.at_once(nthreads, worker.state.total_resources, options.restricted) or 1
    return max(1, cpus // (at_once * demand.processes))


def host_threads(client: Client, worker: Worker) -> int:
    """The threads of the Dask workers on ``worker``'s host (its own included), as the
    scheduler knows them (its own alone where the scheduler does not answer within 10 s); a
    host is its workers' address without the port."""
    host = get_address_host(worker.address)
    workers = _within(10.0, lambda: scheduler_identity(client)["workers"], {})
    return sum(int(info.get("nthreads", 0)) for address, info in workers.items()
               if get_address_host(address) == host) or worker.state.nthreads


def worker_label(worker: Worker) -> str:
    """``Dask worker tcp://10.0.0.7:40123 (gpu-3, host node7)``: the worker, for messages."""
    name = str(worker.name)
    named = f"{name}, " if name and name != worker.address else ""
    return f"Dask worker {worker.address} ({named}host {socket.gethostname()})"


def _full_line(worker: Worker, exc: BaseException, folder: Path) -> str | None:
    """``exc``, an error writing in the trial's ``folder`` on this worker, as the line of a
    full disk (:func:`hpo.render.full_disk`'s, measured here, after :func:`worker_label`),
    or None where the disk is not full."""
    if not isinstance(exc, FolderFull):
        filename = getattr(exc, "filename", None)
        exc = folder_full(exc, Path(filename) if filename else folder) or exc
    return f"{worker_label(worker)}: {exc}" if isinstance(exc, FolderFull) else None


def run_task(spec: TrialSpec, options: TaskOptions) -> TaskReport:
    """The Dask task of one trial (see the module docstring); runs on a worker.

    A full disk of the worker's own is said in :attr:`TaskReport.full`: a trial whose folder
    or log it refuses before the trial starts does not start (its scratch folder is
    removed); one whose log or ``result.json`` it refuses later ends as
    :func:`~hpo.executor.run_trial` ends it then (INTERRUPTED, its scratch folder removed: it
    runs again; or as it ended).
    """
    worker = get_worker()
    client = get_client()
    if not _first_start(client, str(worker.get_current_task())):
        return TaskReport(TrialResult(Outcome.LOST, reason="lost: the Dask worker that ran it died"), worker.address,
                          again=True)
    folder, shared = _trial_folder(spec, worker, options.shared)
    pool = gpu_pool()
    demand = options.demand
    try:
        gpus = pool.take(demand.gpus, demand.share) if pool.ids else ()
    except ValueError as exc:
        return TaskReport(TrialResult(Outcome.FAIL, reason=str(exc)), worker.address)
    try:
        threads = env_threads(spec.env) or trial_threads(worker, options, host_threads(client, worker))
        slot = replace(spec.slot, gpus=gpus, threads=threads,
                       share=demand.share if gpus else 1)
        courier = _Courier(worker, client, spec, options, None if shared else folder / LOG_FILE)
        courier.poll()
        stopping = Event(_stopping_event(options.topic), client=client).is_set()
        asked = courier.end_request() or ("interrupted" if stopping else None)
        if asked is not None:  # the sweep stops, or the worker closes, before it started: it does not start
            return TaskReport(not_started(spec, asked), worker.address, slot, shared, started=False)
        result: TrialResult | None = None
        full = rest = ""
        try:
            if not shared:  # in the trial's own folder, the sweep has written them already
                write_files(folder, spec.files)
            with folder_writes(folder / LOG_FILE), (folder / LOG_FILE).open("a") as log:
                log.write(f"hpo: runs on Dask worker {worker.address} (host {socket.gethostname()}, "
                          f"{slot.describe()}, folder {folder})\n")
            courier.start()
            try:
                place = {"worker": worker.address, "host": socket.gethostname(), "folder": str(folder),
                         "shared": shared}
                result = run_trial(replace(spec, slot=slot), _WorkerControl(courier, place), folder,
                                   lost_cause=lambda: courier.cause)
            finally:
                rest = courier.stop()
        except (FolderFull, OSError) as exc:
            line = _full_line(worker, exc, folder)
            if line is None:
                raise
            result, full = getattr(exc, "result", None), line
        if result is None:  # its folder or log was refused: it never ran
            if not shared:
                shutil.rmtree(folder, ignore_errors=True)
            refused = TrialResult(Outcome.INTERRUPTED, reason=f"interrupted before it started: {full}; it runs again")
            return TaskReport(refused, worker.address, slot, shared, started=False, full=full,
                              label=worker_label(worker))
        if full and not shared and result.outcome is Outcome.INTERRUPTED:  # its log refused: it runs again, so
            shutil.rmtree(folder, ignore_errors=True)  # what it wrote here (a runaway checkpoint) goes
    finally:
        if gpus:
            pool.give_back(gpus)
    return TaskReport(result, worker.address, slot, shared, courier.chunks, rest, full=full,
                      label=worker_label(worker) if full else "")


# --- the sweep's side -------------------------------------------------------------------


class SchedulerGone(ExecutorUnavailable):
    """The Dask scheduler is gone; ``result`` is how the trial being run ended, as far as the
    sweep can tell (the worker's own result, else INTERRUPTED)."""


class ClusterBroken(ExecutorUnavailable):
    """No worker will come to run the trials waiting (their batch jobs could not be submitted);
    ``result`` is how the trial ended (INTERRUPTED before it started)."""


def _amounts(resources: Mapping[str, float]) -> str:
    """``GPU=4,CPU=2``: Dask resource amounts as ``dask worker --resources`` takes them (one
    shell word)."""
    return ",".join(f"{name}={amount:.3g}" for name, amount in resources.items())


def _gone_before_start(message: str) -> TrialResult:
    """A trial whose task had not started when the scheduler went away (``message``)."""
    return TrialResult(Outcome.INTERRUPTED, reason=f"interrupted before it started: {message}; it runs again")


@dataclass
class _Refusal:
    """A worker whose disk refused a trial: its line, since when, and when to try it again."""

    label: str
    line: str
    since: float
    retry_at: float
    pause_s: float


class _FullWorkers:
    """Dask workers whose own disk is full (a trial's folder, log or ``result.json`` was
    refused there): trials are kept off each, said once in a line naming the worker, the
    file and the room left there; it is tried again after ``FULL_FIRST_S``, then after
    twice as long each time it refuses one again (up to ``FULL_MAX_S``), and said once more
    when a trial starts there again."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._lock = threading.Lock()
        self._refusals: dict[str, _Refusal] = {}

    def refused(self, worker: str, label: str, line: str) -> None:
        """``worker`` (``label``: in words)'s disk refused a trial (``line``, measured there)."""
        now = time.monotonic()
        with self._lock:
            known = self._refusals.get(worker)
            pause = FULL_FIRST_S if known is None else min(2 * known.pause_s, FULL_MAX_S)
            self._refusals[worker] = _Refusal(label, line, now if known is None else known.since, now + pause, pause)
        if known is None:
            self._say(f"hpo: {line}; free space there: meanwhile no trial goes to that worker")

    def started(self, worker: str) -> None:
        """A trial started on ``worker``: its disk, if it was full, has room again."""
        with self._lock:
            refusal = self._refusals.pop(worker, None)
        if refusal is not None:
            self._say(f"hpo: {refusal.label} can write its trial folders again after "
                      f"{time.monotonic() - refusal.since:.0f} s")

    def kept_off(self, workers: Sequence[str]) -> dict[str, str]:
        """Those of ``workers`` that trials are kept off now, with their lines."""
        now = time.monotonic()
        with self._lock:
            return {worker: refusal.line for worker, refusal in self._refusals.items()
                    if worker in workers and now < refusal.retry_at}


class _Watch:
    """A thread of the executor that watches the scheduler and the workers it knows.

    Args:
        client: the executor's client.
        address: the scheduler's address (for messages).
        patience: seconds the client waits for a scheduler that stopped answering (for messages).
        say: tells the user when the scheduler stops answering, and when it answers again.
        on_refresh: called with the workers after each read of them.
        on_reconnect: called once the client is connected again after it lost the scheduler,
            or found another one at its address (one that was restarted), before ``on_refresh``.
    """

    def __init__(self, client: Client, address: str, patience: float, say: Callable[[str], None] = print,
                 on_refresh: Callable[[Mapping[str, Mapping[str, Any]]], None] = lambda workers: None,
                 on_reconnect: Callable[[], None] = lambda: None) -> None:
        self._client = client
        self._address = address
        self._patience = patience
        self._say = say
        self._on_refresh = on_refresh
        self._on_reconnect = on_reconnect
        self._scheduler_id: str | None = None
        self.workers: Mapping[str, Mapping[str, Any]] = {}
        self.heard = time.monotonic()
        self.gone: str | None = None
        self._silent = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpo-dask-watch", daemon=True)
        self.refresh()
        self._thread.start()

    def refresh(self) -> None:
        """Read the scheduler's status and workers now (:attr:`heard`: when that last worked)."""
        status = self._client.status
        if status in ("closing", "closed"):
            self.gone = f"the Dask scheduler at {self._address} is gone"
            return
        if status != "running":  # reconnecting: Dask's connect timeout decides when it is gone
            if not self._silent:
                self._silent = True
                self._say(f"hpo: the Dask scheduler at {self._address} does not answer; waiting up to "
                          f"{self._patience:g} s for it")
            return
        try:
            info = scheduler_identity(self._client)
        except Exception:  # unreachable for now: the client's own timeout decides when it is gone
            logger.debug("cannot read the workers of %s", self._address, exc_info=True)
            return
        self.heard = time.monotonic()
        known, self._scheduler_id = self._scheduler_id, info.get("id")
        if self._silent or known not in (None, self._scheduler_id):
            self._on_reconnect()  # before the workers are published: a trial they take is heard
        self.workers = info["workers"]
        if self._silent:
            self._silent = False
            self._say(f"hpo: the Dask scheduler at {self._address} answers again")
        self._on_refresh(self.workers)

    def stop(self) -> None:
        """Stop watching."""
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(WATCH_S):
            self.refresh()


class _Leftovers:
    """The Variables and Events that trials leave on the Dask scheduler, dropped as each trial
    ends (when the scheduler is there): its end Variable only after ``LOST_GRACE_S`` where the
    sweep cancelled its task, as a worker that runs it reads there what the sweep asked
    (:meth:`_Courier.end_request`)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._later: list[tuple[float, str]] = []  # (when, name): Variables to drop then

    def forget(self, token: str, keys: Sequence[str], later: bool = False) -> None:
        """Drop trial ``token``'s Variable (``later`` where its task was cancelled) and the
        Events of its tasks ``keys``, and the Variables of earlier trials now due."""
        if self._client.status != "running":
            return
        now = time.monotonic()
        with self._lock:
            self._later.append((now + LOST_GRACE_S if later else now, _end_variable(token)))
            due = [name for at, name in self._later if at <= now]
            self._later = [(at, name) for at, name in self._later if at > now]
        self._drop_variables(due)
        for key in keys:
            self.drop_event(_start_event(key))
        self.drop_event(_asked_event(token))

    def drop_all(self) -> None:
        """Drop the Variables still kept for later, now (the sweep ends)."""
        with self._lock:
            later, self._later = [name for _, name in self._later], []
        self._drop_variables(later)

    def _drop_variables(self, names: Sequence[str]) -> None:
        """Delete the Variables ``names`` on the scheduler (when it is there)."""
        for name in names:
            try:
                Variable(name, client=self._client).delete()
            except Exception:  # the scheduler went away meanwhile: nothing is left to drop
                logger.debug("cannot drop the Variable %s", name, exc_info=True)

    def drop_event(self, name: str) -> None:
        """Drop the Event ``name`` on the scheduler (when it is there)."""
        try:
            Event(name, client=self._client).clear()
        except Exception:  # the scheduler went away meanwhile: nothing is left to drop
            logger.debug("cannot drop the Event %s", name, exc_info=True)


class DaskExecutor:
    """Runs each trial as a task on a Dask cluster (see the module docstring).

    Args:
        client: a client connected to the cluster's scheduler.
        resources: the scenario's resources (what a trial takes).
        offered: the Dask resources of the workers (``GPU``, ``CPU``) that trials ask for;
            None: those the workers connected now offer.
        shared: whether the workers see this machine's trial folders; None: each trial checks.
        owned: what else :meth:`close` closes (a cluster hpo started), after the client.
        scheduler_lost_s: seconds a worker runs a trial on without hearing from the scheduler.
        capacity: trials the cluster runs at once (None: what its workers connected now take).
        say: tells the user what the sweep waits for: trials that no connected worker can run
            (after ``NO_WORKER_S``), a scheduler that does not answer.
        no_worker_hint: what the user may do when no worker is connected (how to start one: the
            Dask resources a trial asks for are appended as ``--resources``).
        failures: why batch jobs that hpo started could not be submitted, appended as they
            fail: each is said once; once no connected worker can run the trials waiting and no
            job was ever submitted (``any_submitted``), the sweep stops (:class:`ClusterBroken`),
            as no job would come to run them. A job submitted may still be pending in the batch
            queue, however long: then the sweep waits for it.
        any_submitted: whether a batch job was submitted (False where hpo starts no jobs).
    """

    def __init__(self, client: Client, resources: Resources, offered: Sequence[str] | None = None,
                 shared: bool | None = None, owned: Sequence[Any] = (),
                 scheduler_lost_s: float = SCHEDULER_LOST_S, capacity: int | None = None,
                 say: Callable[[str], None] = print, no_worker_hint: str = "",
                 failures: Sequence[str] = (), any_submitted: Callable[[], bool] = lambda: False) -> None:
        self.client = client
        self.address = str(client.scheduler.address)
        self.demand = Demand.of(resources)
        self._resources = resources
        if offered is None:
            infos = scheduler_identity(client)["workers"].values()
            offered = sorted({name for info in infos for name in info.get("resources", {})})
        restricted = tuple(name for name in ("GPU", "CPU") if name in offered)
        self.options = TaskOptions(f"hpo-{client.id}", self.demand, restricted, shared, scheduler_lost_s)
        self._owned = tuple(owned)
        self._capacity = capacity
        self._events: dict[str, queue.Queue[Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._stopping_lock = threading.Lock()
        self._say = say
        self._no_worker_hint = no_worker_hint
        self._queued: dict[str, float] = {}
        self._told_waiting: str | None = None  # which wait was said last
        self._failures = failures
        self._any_submitted = any_submitted
        self._failures_told = 0
        self.broken: str | None = None
        self._auto_slots: int | None = None  # slots planned from the workers connected then (parallel: auto)
        self._slots_now: int | None = None  # more slots than planned: what the workers connected later take
        self._grows = True  # whether the slots planned grow (False: fixed shares of hpo run --workers)
        self._room_told = 0  # the most trials at once said, where the slots do not grow
        self._full = _FullWorkers(say)
        self._leftovers = _Leftovers(client)
        self._subscribe()
        self.watch = _Watch(client, self.address, scheduler_lost_s, say, self._on_workers, self._subscribe)

    def capacity(self) -> int:
        """Trials the cluster runs at once (given, or what the workers connected now take)."""
        if self._capacity is not None:
            return self._capacity
        return sum(self._takes(info) for info in scheduler_identity(self.client)["workers"].values())

    def _takes(self, info: Mapping[str, Any]) -> int:
        """Trials the worker of ``info`` (as the scheduler describes it) runs at once."""
        return self.demand.at_once(info.get("nthreads", 0), info.get("resources", {}), self.options.restricted)

    def plan(self, parallel: int | None = None, at_least: int = 1, grows: bool = True) -> tuple[Slot, ...]:
        """The sweep's slots: ``parallel``, else ``resources.parallel`` when set to a number,
        else the cluster's :meth:`capacity` (they then grow as workers join: :meth:`slots_now`,
        unless not ``grows``: ``hpo run --workers`` hands them out in fixed shares, and workers
        that join later are said, with how to use them); at least ``at_least``, which a number
        the scenario gives for ``parallel`` must allow (:func:`hpo.launch.parallel_allows`)."""
        self._grows = grows
        if parallel is None and "parallel" in self._resources.model_fields_set:
            parallel = self._resources.parallel if isinstance(self._resources.parallel, int) else None
            parallel_allows(parallel, at_least)
        count = max(at_least, parallel if parallel is not None else self.capacity())
        self._auto_slots = count if parallel is None and self._capacity is None else None
        return tuple(Slot(i, (), self.demand.processes, 1, self.demand.share) for i in range(count))

    def describe(self, slots: Sequence[Slot]) -> str:
        """``4 slots on the Dask cluster at tcp://...: 1 process on 1/2 of a GPU each``."""
        demand = self.demand
        each = plural(demand.processes, "process")
        if "GPU" in self.options.restricted:
            each += f" on 1/{demand.share} of a GPU" if demand.share > 1 else f" on {plural(demand.gpus, 'GPU')}"
        return f"{plural(len(slots), 'slot')} on the Dask cluster at {self.address}: {each} each"

    def _subscribe(self) -> None:
        """Receive the events of this executor's trials (again, after a reconnect: a scheduler
        forgets the subscriptions of a client that lost it)."""
        self.client.subscribe_topic(self.options.topic, self._on_event)

    def _on_workers(self, workers: Mapping[str, Mapping[str, Any]]) -> None:
        """What the watch read of the ``workers`` connected: say what the sweep waits for, and
        whether it can wait at all (:attr:`broken`)."""
        failures = list(self._failures)
        for why in failures[self._failures_told:]:
            self._say(f"hpo: a batch job could not be submitted: {why}")
        self._failures_told = len(failures)
        infos = list(workers.values())
        takes = [self._takes(info) for info in infos]
        self._grow(sum(takes))
        if any(takes):
            self._told_waiting = None
            return
        now = time.monotonic()
        with self._lock:
            waiting = sum(now - since > NO_WORKER_S for since in self._queued.values())
        kind = "none connected" if not infos else "none can"  # said again when it changes: a worker came, unfit
        if waiting and failures and not self._any_submitted():
            self.broken = f"resources.cluster: no batch job could be submitted to run the trials ({failures[-1]})"
        elif waiting and self._told_waiting != kind:
            self._told_waiting = kind
            self._tell_waiting(waiting, infos)

    def slots_now(self) -> int | None:
        """See :class:`hpo.executor.Executor`: where the slots were planned from the workers
        connected then (``resources.parallel: auto``), what the workers connected now take at
        once, once that is more; they never shrink (a trial waits in Dask's queue for a worker)."""
        return self._slots_now

    def _grow(self, takes: int) -> None:
        """Grow the slots planned from the workers connected then to ``takes``, the trials the
        workers connected now take at once, where that is more; say so."""
        if self._auto_slots is None or takes <= max(self._auto_slots, self._slots_now or 0, self._room_told):
            return
        if not self._grows:
            self._room_told = takes
            self._say(f"hpo: the Dask workers connected now take {plural(takes, 'trial')} at once; this sweep's "
                      f"workers run the {plural(self._auto_slots, 'slot')} planned when it started; `hpo worker "
                      f"SCENARIO --cluster {self.address}` (with this sweep's --storage and --workdir) joins it with "
                      "slots of its own")
            return
        self._slots_now = takes
        self._say(f"hpo: the Dask workers connected now take {plural(takes, 'trial')} at once: this sweep runs "
                  f"{plural(takes, 'slot')} (resources.parallel: auto)")

    def _tell_waiting(self, waiting: int, infos: Sequence[Mapping[str, Any]]) -> None:
        """Say that ``waiting`` trials wait in Dask's queue: no worker is connected, or none of
        those connected (``infos``) offers the resources a trial takes."""
        trials = f"{plural(waiting, 'trial')} {'waits' if waiting == 1 else 'wait'}"
        asks = self.demand.restrictions(self.options.restricted)
        if not infos:
            needs = f" --resources {_amounts(asks)}" if asks else ""
            hint = f" ({self._no_worker_hint}{needs})" if self._no_worker_hint else ""
            self._say(f"hpo: no Dask worker is connected to the scheduler at {self.address}: {trials} for one{hint}")
            return
        most = {name: max(info.get("resources", {}).get(name, 0.0) for info in infos) for name in asks}
        offer = "offers" if len(infos) == 1 else "offer"
        self._say(f"hpo: no Dask worker of the scheduler at {self.address} can run a trial: each takes "
                  f"{_amounts(asks)} of a worker's Dask resources, and the {plural(len(infos), 'worker')} connected "
                  f"{offer} at most {_amounts(most)}; {trials} for a worker that can (dask worker {self.address} "
                  f"--resources {_amounts(asks)} on a machine that has them)")

    def _on_event(self, event: tuple[float, Mapping[str, Any]]) -> None:
        message = event[1]
        with self._lock:
            target = self._events.get(str(message.get("token")))
        if target is not None:
            target.put(message)

    def run(self, spec: TrialSpec, control: TrialControl) -> TrialResult:
        """See :class:`~hpo.executor.Executor`; raises :class:`SchedulerGone` when the scheduler
        is gone. A trial asked to end before its task started never starts: it ends INTERRUPTED
        (or STOPPED) after 0 s, without ``control.started``.

        A trial that a worker's own full disk refused before it started is submitted again at
        once, and trials are kept off that worker for a while (:class:`_FullWorkers`); where
        every connected worker that could run it is kept off, :class:`~hpo.render.FolderFull`
        (the worker's line) tells the sweep to wait for room, as for a full disk of its own."""
        if self.watch.gone:
            raise SchedulerGone(self.watch.gone, _gone_before_start(self.watch.gone))
        end = _end_variable(spec.token)
        write_files(spec.folder, spec.files)
        asked = control.end_request()
        if asked is not None:  # stopped while it was claimed ahead: as on this machine, it never starts
            return save_result(spec.folder, spec.number, not_started(spec, asked))
        (spec.folder / RESULT_FILE).unlink(missing_ok=True)  # a result.json here is this start's
        (spec.folder / MARKER).write_text(spec.token)
        events: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._events[spec.token] = events
        keys: list[str] = []
        following: _Following | None = None
        try:
            self._submitting(Variable(end, client=self.client).set, "")
            while True:
                workers = self._placement()
                keys.append(_task_key(spec.token))
                future = self._submitting(self._submit, spec, keys[-1], workers)
                with self._lock:
                    self._queued.setdefault(spec.token, time.monotonic())
                future.add_done_callback(events.put)  # the future itself marks its end
                following = _Following(self, spec, control, future, events, workers)
                try:
                    return following.result()
                except _Resubmit:
                    pass
                asked = control.end_request()
                if asked is not None:
                    return save_result(spec.folder, spec.number, not_started(spec, asked))
        finally:
            with self._lock:
                self._events.pop(spec.token, None)
                self._queued.pop(spec.token, None)
            self._leftovers.forget(spec.token, keys, later=following is not None and following.cancelled)
            (spec.folder / MARKER).unlink(missing_ok=True)

    def _submitting(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a call to the scheduler before the trial started; SchedulerGone
        where it fails as the scheduler is gone."""
        try:
            return call(*args)
        except Exception as exc:
            if not self.connected():
                gone = f"the Dask scheduler at {self.address} is gone"
                raise SchedulerGone(gone, _gone_before_start(gone)) from exc
            raise

    def _submit(self, spec: TrialSpec, key: str, workers: list[str] | None) -> Any:
        """Submit the trial's task as ``key``, to ``workers`` only unless None."""
        only = {} if workers is None else {"workers": workers, "allow_other_workers": False}
        return self.client.submit(run_task, spec, self.options, key=key,
                                  pure=False, retries=0, resources=self.demand.restrictions(self.options.restricted),
                                  **only)

    def _placement(self) -> list[str] | None:
        """The workers a trial may go to now: any (None) unless trials are kept off some, whose
        disk is full (:class:`_FullWorkers`); FolderFull where that is each connected worker
        that could run it."""
        able = [address for address, info in self.watch.workers.items() if self._takes(info)]
        kept_off = self._full.kept_off(able)
        if not kept_off:
            return None
        allowed = [address for address in able if address not in kept_off]
        if allowed:
            return allowed
        line = list(kept_off.values())[-1]
        others = "no other Dask worker can run the trial" if len(able) == 1 else \
            f"the disks of the other {plural(len(able) - 1, 'Dask worker')} that can run it are full too"
        raise FolderFull(f"{line}; {others}", where="the Dask workers' trial folders")

    def started(self, token: str, worker: str) -> None:
        """The task of trial ``token`` started on ``worker`` (it no longer waits for one; that
        worker's disk has room)."""
        with self._lock:
            self._queued.pop(token, None)
        self._full.started(worker)

    def refused(self, worker: str, label: str, line: str) -> None:
        """``worker``'s own disk is full (:class:`_FullWorkers`)."""
        self._full.refused(worker, label, line)

    def connected(self) -> bool:
        """Whether the client is connected, waiting while it reconnects (Dask's own timeout)."""
        deadline = time.monotonic() + self.options.scheduler_lost_s + 2 * WATCH_S
        while self.client.status not in ("running", "closing", "closed") and time.monotonic() < deadline:
            time.sleep(CHECK_S)
        return self.client.status == "running"

    def request(self, token: str, request: str) -> None:
        """Ask trial ``token``'s worker for its end (``pruned``, ``stopped``, ``interrupted``):
        the request in its Variable, then its asked Event set, which its worker waits on."""
        try:
            Variable(_end_variable(token), client=self.client).set(request)
            Event(_asked_event(token), client=self.client).set()
        except Exception:  # the scheduler is gone: the trial's end is judged without it
            logger.debug("cannot ask for %s", request, exc_info=True)

    def stopping(self) -> None:
        """The sweep stops: once this returns, no task of this executor starts its trial."""
        with self._stopping_lock:
            if self._stopping:
                return
            try:
                Event(_stopping_event(self.options.topic), client=self.client).set()
            except Exception:  # the scheduler is gone: no task starts anyway
                logger.debug("cannot mark the sweep stopping", exc_info=True)
            self._stopping = True

    def close(self) -> None:
        """Stop watching, disconnect, and close what the executor owns (idempotent). Trials
        still followed are asked to end first (``interrupted``): their tasks are cancelled as
        the client closes, by the sweep, and their workers record them so, not as lost."""
        if self._closed:
            return
        self._closed = True
        self.watch.stop()
        if self.client.status == "running":
            with self._lock:
                left = list(self._events)
            for token in left:
                self.request(token, "interrupted")
            self._leftovers.drop_all()
            self.client.unsubscribe_topic(self.options.topic)
            if self._stopping:
                self._leftovers.drop_event(_stopping_event(self.options.topic))
        self.client.close()
        distributed = logging.getLogger("distributed")
        level = distributed.level
        if self._owned:  # a scheduler of its own, closing: distributed logs its cancelled waits and closed comms
            distributed.setLevel(logging.CRITICAL)  # with tracebacks, as errors
        try:
            for thing in self._owned:
                thing.close()
        finally:
            distributed.setLevel(level)


class _Resubmit(Exception):
    """The trial's task is to be submitted again: a worker's full disk refused it before it
    started, or none of the workers it was kept to is connected any more."""


class _Following:
    """The sweep's side of one trial task: passes its events on, forwards end requests,
    writes its log here when it runs elsewhere, and collects its result (``workers``: those
    the task may run on, None for any)."""

    def __init__(self, executor: DaskExecutor, spec: TrialSpec, control: TrialControl, future: Any,
                 events: queue.Queue[Any], workers: Sequence[str] | None = None) -> None:
        self._executor = executor
        self._spec = spec
        self._control = control
        self._future = future
        self._events = events
        self._workers = workers
        self._asked: str | None = None
        self._asked_at = 0.0
        self._worker: str | None = None
        self._missing_since: float | None = None
        self._started = False
        self._started_at = self._seen_at = 0.0
        self._shared = False
        self._chunks = 0
        self._verdict: TrialResult | None = None
        self._pruned_at: int | None = None
        self.cancelled = False  # whether this side cancelled the task

    def result(self) -> TrialResult:
        """Follow the task to its end; how the trial ended."""
        while self._verdict is None:
            try:
                item = self._events.get(timeout=CHECK_S)
            except queue.Empty:
                item = None
            if item is self._future:
                return self._finish()
            if isinstance(item, Mapping):  # not the end of an earlier submission's task
                self._handle(item)
            self._check()
        self._note(f"hpo: {self._verdict.reason}\n")
        return self._verdict

    def _handle(self, message: Mapping[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "started" and not self._started:
            self._started, self._started_at = True, time.monotonic()
            self._seen_at = self._started_at
            self._worker = str(message.get("worker", ""))
            self._shared = bool(message.get("shared"))
            self._executor.started(self._spec.token, self._worker)
            self._control.started(Slot.of(message["slot"]))
        elif kind == "value":
            self._value(int(message["step"]), float(message["value"]), bool(message.get("judged", True)))
        elif kind == "log":
            self._chunks += 1
            self._note(str(message.get("text", "")))

    def _value(self, step: int, value: float, judged: bool) -> None:
        """Report a value as :func:`~hpo.executor.run_trial` does on this machine: none once
        the pruner said prune or the trial is being cut short; the pruner judges those the
        worker sent while the trial ran (the step of the first it prunes is the trial's)."""
        if self._pruned_at is not None or self._control.end_request() in CUT_SHORT:
            return
        if not judged:
            self._control.record(step, value)
        elif self._control.intermediate(step, value):
            self._pruned_at = step
            self._ask("pruned")

    def _ran(self) -> float:
        """How long the trial is known to have run: from its start until its worker was last
        seen by the scheduler (0 when it never started)."""
        return max(0.0, self._seen_at - self._started_at) if self._started else 0.0

    def _as_judged(self, result: TrialResult) -> TrialResult:
        """``result`` of a trial this side pruned, at the step the pruner judged (its worker
        ended it later, when the request reached it); other results as they are."""
        if result.outcome is not Outcome.PRUNED or self._pruned_at is None:
            return result
        return judge(Metrics(), self._spec.objective, 0, "pruned", (), result.duration_s, self._spec.timeout,
                     self._pruned_at)

    def _note(self, text: str) -> None:
        """Append to the trial's log here (only used when the trial ran elsewhere)."""
        if text:
            with (self._spec.folder / LOG_FILE).open("a") as log:
                log.write(text)

    def _ask(self, request: str) -> None:
        if self._asked in (None, "pruned") and request != self._asked:
            self._asked, self._asked_at = request, time.monotonic()
            if request == "interrupted":  # before any trial is ended: a worker it frees starts none
                self._executor.stopping()
            self._executor.request(self._spec.token, request)

    def _check(self) -> None:
        """End requests out; a vanished worker or scheduler ends the trial here."""
        request = self._control.end_request()
        if request is not None:
            self._ask(request)
        watch = self._executor.watch
        if watch.gone:
            raise self._gone(watch.gone)
        if self._asked is not None and not self._started:  # still queued in Dask: it never starts
            self._cancel(not_started(self._spec, self._asked))
            return
        if self._workers is not None and not self._started and not set(self._workers) & set(watch.workers):
            self._future.cancel()  # kept to workers that left: placed again
            raise _Resubmit("none of the workers it was kept to is connected")
        if self._executor.broken and not self._started:
            self._future.cancel()
            raise ClusterBroken(self._executor.broken, not_started(self._spec, "interrupted"))
        now = time.monotonic()
        if self._worker is not None and self._worker in watch.workers:
            self._seen_at = max(self._seen_at, watch.heard)
        if self._asked == "interrupted" and now - self._asked_at > INTERRUPT_GRACE_S:
            self._cancel(TrialResult(Outcome.INTERRUPTED, duration_s=self._ran(), reason="interrupted: the sweep was "
                                     "stopped; its Dask task did not answer; it runs again on resume"))
        elif self._worker is not None:
            self._missing_since = None if self._worker in watch.workers else self._missing_since or now
            if self._missing_since is not None and now - self._missing_since > LOST_GRACE_S:
                self._cancel(TrialResult(Outcome.LOST, duration_s=self._ran(),
                                         reason=f"lost: its Dask worker {self._worker} is gone"))

    def _cancel(self, verdict: TrialResult) -> None:
        """Cancel the task, the trial ending as ``verdict``; its worker, if it runs it, is told
        that the sweep ends it (it records no loss)."""
        if self._asked is None:
            self._executor.request(self._spec.token, "interrupted")
        self._future.cancel()
        self.cancelled = True
        self._verdict = verdict

    def _finish(self) -> TrialResult:
        try:
            report: TaskReport = self._future.result()
        except KilledWorker as exc:
            return TrialResult(Outcome.LOST, duration_s=self._ran(), reason=f"lost: Dask workers died running it ({exc})")
        except CancelledError as exc:
            if not self._executor.connected():
                raise self._gone(f"the Dask scheduler at {self._executor.address} is gone") from exc
            verdict = TrialResult(Outcome.INTERRUPTED, duration_s=self._ran(),
                                  reason="interrupted: the Dask scheduler dropped its task (restarted?); it runs again")
            self._note(f"hpo: {verdict.reason}\n")
            return verdict
        if report.again:
            lost = replace(report.result, duration_s=self._ran())
            self._note(f"hpo: {lost.reason} (worker {self._worker})\n")
            return lost
        if report.full and not report.started:  # it never ran: on another worker
            self._executor.refused(report.worker, report.label, report.full)
            if not report.shared:
                self._note(f"hpo: not started: {report.full}\n")
            raise _Resubmit(report.full)
        if not report.started:
            self._note(f"hpo: not started on Dask worker {report.worker}: {report.result.reason}\n")
            return report.result
        if not self._started:
            self._control.started(report.slot or self._spec.slot)
            self._executor.started(self._spec.token, report.worker)
        if report.full:  # its log or result.json, later
            self._executor.refused(report.worker, report.label, report.full)
        result = self._as_judged(report.result)
        if not report.shared:
            self._drain(report.chunks)
            self._note(report.rest)
        if report.full and result.outcome is Outcome.INTERRUPTED:  # its log: it runs again
            result = replace(result, reason=f"interrupted: {report.full}; it runs again")
        if result.outcome is Outcome.LOST and self._asked is not None:  # the sweep was ending it: no loss
            self._note(f"hpo: {result.reason}, as it was being {self._asked}\n")
            result = judge(Metrics(), self._spec.objective, 0, self._asked, (), result.duration_s, self._spec.timeout,
                           self._pruned_at)
        elif result.outcome is Outcome.LOST:  # its worker ended it
            self._note(f"hpo: {result.reason}\n")
        elif report.shared and result == report.result and not report.full:  # the worker wrote it into the folder
            return result
        saved = save_result(self._spec.folder, self._spec.number, result)
        if report.full and saved.outcome is Outcome.INTERRUPTED:  # the sweep counts it (a third time: FAIL)
            raise FolderFull(report.full, saved, where=f"the trial folders of {report.label}")
        return saved

    def _gone(self, message: str) -> SchedulerGone:
        """The scheduler is gone, with how the trial ended as far as this side can tell. A
        worker ends its trial when it loses the scheduler; where the trial ran in its own
        folder, what it wrote there (within ``INTERRUPT_GRACE_S``) stands: a trial that
        completed meanwhile is COMPLETE. Else it is INTERRUPTED after the time it ran."""
        interrupted = f"interrupted: {message}; it runs again"
        written = self._written() if self._started and self._shared else None
        if not self._started:
            result = _gone_before_start(message)
        elif written is None:
            result = TrialResult(Outcome.INTERRUPTED, duration_s=time.monotonic() - self._started_at,
                                 reason=interrupted)
        elif written.outcome.run_again:  # ended by its worker, which lost the scheduler
            result = TrialResult(Outcome.INTERRUPTED, duration_s=written.duration_s, reason=interrupted)
        else:
            result = self._as_judged(written)
            if result != written:
                save_result(self._spec.folder, self._spec.number, result)
        self._note(f"hpo: {message}; the trial ended {result.outcome}\n")
        return SchedulerGone(message, result)

    def _written(self) -> TrialResult | None:
        """The result the worker writes into the trial's folder, waited for ``INTERRUPT_GRACE_S``."""
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while (written := saved_result(self._spec.folder, self._spec.number)) is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(CHECK_S)
        return written

    def _drain(self, chunks: int) -> None:
        """Wait (a little) for the log chunks still on their way."""
        deadline = time.monotonic() + LOG_DRAIN_S
        while self._chunks < chunks and time.monotonic() < deadline:
            try:
                item = self._events.get(timeout=CHECK_S)
            except queue.Empty:
                continue
            if isinstance(item, Mapping) and item.get("kind") == "log":
                self._handle(item)
        if self._chunks < chunks:
            self._note(f"hpo: {chunks - self._chunks} chunks of this log were lost on the way from the worker\n")


def open_cluster(cluster: Cluster, resources: Resources, timeout: float | None = None,
                 shared: bool | None = None, say: Callable[[str], None] = print,
                 job_logs: Path | None = None, field: str = "resources.cluster") -> DaskExecutor:
    """A :class:`DaskExecutor` on ``cluster``: the Dask scheduler at its address (after its
    first worker joined), or batch jobs that dask-jobqueue starts as the sweep needs them,
    writing their output into ``job_logs``.

    ``timeout`` bounds connecting and reconnecting: a scheduler unreachable for that long
    is gone (default: Dask's ``distributed.comm.timeouts.connect``). An address where no
    Dask scheduler answers at first is bad input: an InputError naming ``field`` (the
    address's origin), at once where nothing listens at a TCP address for
    ``REFUSED_GRACE_S`` (a scheduler that is starting listens within that), else as soon as
    what listens there fails Dask's handshake, or after ``timeout`` where it stays silent.
    InputError too when a batch job cannot run one trial.
    """
    if timeout is None:
        timeout = float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect")))
    if cluster.address is None:
        return _batch_jobs(cluster, resources, timeout, shared, job_logs, say)
    address = cluster.address
    unreachable = f"{field}: cannot reach the Dask scheduler at {address}"
    if nothing_listens(address):
        raise InputError(f"{unreachable}: connection refused (is the scheduler running there?)")
    problem = scheduler_problem(address, timeout)
    if problem is not None:
        raise InputError(f"{field}: no Dask scheduler answers at {address} ({problem})")
    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise InputError(f"{unreachable}: {exc}") from None
    if not scheduler_identity(client)["workers"]:
        say(f"waiting for a Dask worker to join the scheduler at {address}")
        try:
            client.wait_for_workers(1)
        except (OSError, TimeoutError) as exc:
            client.close()
            raise ExecutorUnavailable(f"the Dask scheduler at {address} is gone: it went away while the sweep "
                                      f"waited for its first worker ({exc})") from None
    return DaskExecutor(client, resources, shared=shared, scheduler_lost_s=timeout, say=say,
                        no_worker_hint=f"start one: dask worker {client.scheduler.address}")


REFUSED_GRACE_S = 5.0


def nothing_listens(address: str) -> bool:
    """Whether nothing listens at a ``tcp://`` ``address`` for ``REFUSED_GRACE_S`` (every
    connection refused); False for other protocols, or where the host does not answer."""
    from distributed.comm.addressing import parse_address, parse_host_port

    protocol, location = parse_address(address)
    if protocol != "tcp":
        return False
    host, port = parse_host_port(location)
    until = time.monotonic() + REFUSED_GRACE_S
    while True:
        try:
            socket.create_connection((host, port), timeout=REFUSED_GRACE_S).close()
            return False
        except ConnectionRefusedError:
            if time.monotonic() >= until:
                return True
            time.sleep(0.25)
        except OSError:
            return False


def scheduler_problem(address: str, timeout: float) -> str | None:
    """None when a Dask scheduler answers at ``address`` within ``timeout`` seconds (Dask's
    handshake, then its ``identity``); else why not, in words."""
    try:
        reply = asyncio.run(asyncio.wait_for(_identity(address), timeout))
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except CommClosedError:
        return "it closed the connection: it does not speak Dask's protocol"
    except OSError as exc:
        return str(exc)
    except Exception:  # garbage read as Dask frames: a huge length, bytes that are no msgpack
        return "what answers does not speak Dask's protocol"
    if isinstance(reply, Mapping) and reply.get("type") == "Scheduler":
        return None
    return "a Dask process answers, but it is not a scheduler"


async def _identity(address: str) -> Any:
    """What the Dask server at ``address`` says it is; the connection is closed after."""
    from distributed.comm import registry
    from distributed.comm.addressing import parse_address
    from distributed.security import Security

    protocol, location = parse_address(address)
    connector = registry.get_backend(protocol).get_connector()
    comm = await connector.connect(location, **Security().get_connection_args("client"))
    try:
        local = comm.handshake_info()
        await comm.write(local)
        remote = await comm.read()
        comm.handshake_options = comm.handshake_configuration(local, remote)
        await comm.write({"op": "identity", "n_workers": 0, "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _batch_jobs(cluster: Cluster, resources: Resources, timeout: float, shared: bool | None,
                job_logs: Path | None, say: Callable[[str], None]) -> DaskExecutor:
    from hpo import jobqueue

    per_job = jobqueue.trials_per_job(cluster, resources)
    if per_job < 1:
        demand = Demand.of(resources)
        raise InputError(f"resources.cluster: a job of {cluster.cores} cores and {cluster.gpus} GPUs cannot run a "
                         f"trial of {plural(demand.processes, 'process')} on "
                         f"{'1/' + str(demand.share) if demand.share > 1 else demand.gpus} GPUs")
    failures: list[str] = []
    submitted: list[bool] = []
    jobs = jobqueue.start(cluster, resources, job_logs, on_failure=failures.append,
                          on_submitted=lambda: submitted.append(True))
    client = Client(jobs, timeout=timeout, set_as_default=False)
    offered = ("CPU", "GPU") if cluster.gpus else ("CPU",)
    hint = f"its {cluster.kind} jobs are queued or starting" + (f"; their output: {job_logs}" if job_logs else "")
    return DaskExecutor(client, resources, offered, shared, owned=(jobs,), scheduler_lost_s=timeout,
                        capacity=cluster.jobs * per_job, say=say, no_worker_hint=hint, failures=failures,
                        any_submitted=lambda: bool(submitted))
