"""What every trial script repeats: its process, its data on the device, the epoch loop, a clean end.

A trial script stays a plain PyTorch program; this module holds the parts that are the same
in all of them::

    from hpo import train
    from hpo.results import report

    def main(runtime: train.Runtime) -> None:
        net = MyNet()
        model = runtime.distribute(net)            # on the device; DDP when several processes
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data = train.batches(train_split, runtime, BATCH_SIZE, seed=SEED)
        for epoch in range(1, EPOCHS + 1):
            train.train_epoch(model, data.epoch(epoch), optimizer, runtime)
            if runtime.is_main:
                report(step=epoch, val_error=train.error_rate(net, val_split, runtime))
        if runtime.is_main:
            torch.save(net.state_dict(), "model.pt")

    if __name__ == "__main__":
        train.run(main, seed=SEED)

:func:`fit` is that loop as one call, with the final validation and test errors reported
and the weights saved; the templates use it, with :func:`datasets` for numpy splits and
:func:`choose` for a hyper-parameter that names one of several options.

**Processes.** A script runs as one process (``python script.py``) or as one process per GPU
(or CPU slot) under ``torchrun --nproc-per-node N``; :func:`setup` joins torchrun's process
group (NCCL on GPUs, gloo on CPUs) and says where this process runs (:class:`Runtime`).

**Data.** :func:`batches` keeps a training split resident on the device when it fits
(:class:`DeviceData`: no per-sample Python, no host-to-device copy per step) and reads it
through a DataLoader otherwise (:class:`LoaderData`). Both deal out the same per-epoch
permutation (``DistributedSampler``'s, from the seed and the epoch) to the ranks, and both
normalize and augment each batch on the device with the same generator, so a fixed seed
gives the same batches, and the same loss curve, on either path.

**A clean end.** :func:`finish` (which :func:`run` calls) waits for every rank, destroys the
process group and ends the process with ``os._exit`` instead of finalizing the interpreter.
Finalizing it races gloo: the worker thread that ran a rank's last all-reduce destroys that
work after the rank has moved on, and the work holds the caller's thread-local state, which
references a Python object; when the main thread is already in ``Py_FinalizeEx`` the worker's
decref waits for the GIL, CPython ends the thread with ``pthread_exit``, the unwind crosses the
work's ``noexcept`` destructor and ``std::terminate`` aborts the rank ("terminate called without
an active exception", SIGABRT) after its final metrics were printed. Skipping finalization
removes the window; exit handlers still run and stdout/stderr are flushed first.

Importing this module imports torch; ``import hpo`` alone does not.
"""
from __future__ import annotations

import abc
import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from hpo.results import report

EVAL_BATCH_SIZE = 1024
RESIDENT_SHARE = 0.5

Batch = tuple[torch.Tensor, torch.Tensor]
LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
ScheduleFactory = Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]
T = TypeVar("T")


class Transform(Protocol):
    """Turns a batch of raw inputs on the device into model inputs; augments when given a generator."""

    def __call__(self, inputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The model inputs for ``inputs``; random augmentation draws from ``generator`` if given."""


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: rank ``rank`` of ``world_size`` processes, on ``device``.

    ``local_rank`` is the rank on this machine (the GPU index under torchrun).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        """True when several processes train together (a process group exists)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, which evaluates, reports and saves."""
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        """True on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def memory_format(self) -> torch.memory_format:
        """Channels-last on GPUs (faster convolutions under autocast), contiguous elsewhere."""
        return torch.channels_last if self.on_gpu else torch.contiguous_format

    def autocast(self) -> AbstractContextManager[None]:
        """bf16 autocast on GPUs that support it; a no-op context elsewhere."""
        enabled = self.on_gpu and torch.cuda.is_bf16_supported()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def to_device(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` on the device; 4-D batches in :attr:`memory_format`."""
        inputs = inputs.to(self.device, non_blocking=True)
        return inputs.contiguous(memory_format=self.memory_format) if inputs.dim() == 4 else inputs

    def distribute(self, net: nn.Module) -> nn.Module:
        """Move ``net`` to the device (in place) and return the module to train.

        That is ``net`` itself for one process and a ``DistributedDataParallel`` wrapper around
        it for several, which averages the gradients and starts every rank from rank 0's
        weights. Evaluate and save ``net``, not the wrapper.
        """
        net.to(self.device, memory_format=self.memory_format)
        if not self.distributed:
            return net
        return DistributedDataParallel(net, device_ids=[self.device] if self.on_gpu else None,
                                       gradient_as_bucket_view=True)

    def local_batch(self, global_batch: int) -> int:
        """Each rank's share of a global batch; raises ValueError unless it divides evenly."""
        if global_batch < 1 or global_batch % self.world_size:
            raise ValueError(f"batch_size {global_batch} must be a positive multiple of the "
                             f"{self.world_size} processes")
        return global_batch // self.world_size


def setup(seed: int) -> Runtime:
    """Find this process's place and join torchrun's process group when there are several.

    Reads torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (a plain ``python`` run is rank
    0 of 1, with no process group). Trains on ``cuda:LOCAL_RANK`` (NCCL between processes)
    when CUDA is available, else on the CPU (gloo). Seeds torch with ``seed + rank``: rank 0
    draws the initial weights, which DDP copies to the other ranks, and each rank draws its
    own dropout masks.

    Args:
        seed: the trial's seed.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    torch.manual_seed(seed + rank)
    return Runtime(rank, world_size, local_rank, device)


def finish(runtime: Runtime) -> NoReturn:
    """End a trial process that finished its work; never returns.

    Every rank waits at a barrier for the others, so none leaves while another still trains or
    evaluates; the process group is destroyed; then, as a normal exit would, non-daemon threads
    are joined, :mod:`atexit` handlers run and stdout and stderr are flushed, and the process
    exits with status 0 without finalizing the interpreter (see the module notes: finalizing
    it lets a gloo worker thread abort the process).

    Args:
        runtime: this process's runtime, from :func:`setup`.
    """
    if dist.is_initialized():
        dist.barrier(device_ids=[runtime.local_rank] if runtime.on_gpu else None)
        dist.destroy_process_group()
    if runtime.on_gpu:
        torch.cuda.synchronize(runtime.device)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(main: Callable[[Runtime], None], seed: int) -> NoReturn:
    """Run a trial script's ``main`` on this process's :class:`Runtime`, then end the process.

    ``main`` returning ends the process with status 0 through :func:`finish`. An exception
    destroys the process group (without waiting for the other ranks, which torchrun then
    stops) and propagates: the process exits non-zero with its traceback.

    Args:
        main: the training; called once with the runtime.
        seed: the trial's seed, passed to :func:`setup`.
    """
    runtime = setup(seed)
    try:
        main(runtime)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish(runtime)


@functools.cache
def _affine(mean: tuple[float, ...], std: tuple[float, ...], scale: float,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(factor, offset)`` on ``device`` with ``x * factor + offset == (x / scale - mean) / std``."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (1 / (scale * std_t)).to(device), (-mean_t / std_t).to(device)


def crop_flip(images: torch.Tensor, padding: int, flip: bool,
              generator: torch.Generator) -> torch.Tensor:
    """A random crop of each image, reflect-padded by ``padding`` pixels, flipped left-right
    with probability 1/2 when ``flip``; all on the images' device, no per-image Python.

    Args:
        images: a float ``B x C x H x W`` batch; the result has the same shape.
        padding: pixels of reflect padding on each side (0: no crop).
        flip: whether to flip half of the images, at random.
        generator: the random source, on the images' device.
    """
    n, channels, height, width = images.shape
    device = images.device
    padded = F.pad(images, (padding,) * 4, mode="reflect") if padding else images
    top, left = torch.randint(0, 2 * padding + 1, (2, n, 1), generator=generator, device=device)
    rows = top + torch.arange(height, device=device)
    cols = left + torch.arange(width, device=device)
    if flip:
        flipped = torch.rand(n, 1, generator=generator, device=device) < 0.5
        cols = torch.where(flipped, cols.flip(1), cols)
    return padded[torch.arange(n, device=device)[:, None, None, None],
                  torch.arange(channels, device=device)[None, :, None, None],
                  rows[:, None, :, None],
                  cols[:, None, None, :]]


@dataclass(frozen=True)
class ImageTransform:
    """uint8 ``B x C x H x W`` images to normalized floats; augmented when given a generator.

    Args:
        mean: per-channel mean of the images scaled to [0, 1].
        std: per-channel standard deviation of the scaled images.
        scale: the pixel value that means 1 (255 for 8-bit images).
        crop_padding: augmentation: a random crop of the image reflect-padded by this many
            pixels on each side (0: none).
        flip: augmentation: a left-right flip of half of the images, at random.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float = 255.0
    crop_padding: int = 0
    flip: bool = False

    def __call__(self, inputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The normalized batch; cropped and flipped at random when ``generator`` is given."""
        factor, offset = _affine(self.mean, self.std, self.scale, inputs.device)
        images = torch.addcmul(offset, inputs.float(), factor)
        if generator is not None and (self.crop_padding or self.flip):
            images = crop_flip(images, self.crop_padding, self.flip, generator)
        return images


class Batches(abc.ABC):
    """This rank's shuffled batches of a training split, one pass per :meth:`epoch`.

    Epoch ``e`` deals ``DistributedSampler``'s permutation for ``(seed, e)`` out to the ranks
    (rank ``r`` takes positions ``r, r + world_size, ...``, dropping the remainder) in
    batches of ``batch_size // world_size``, dropping the last incomplete one. Each batch
    reaches the device, then the transform (augmenting from a generator on the device seeded
    with ``seed + rank``). Subclasses say how a batch is fetched.
    """

    def __init__(self, size: int, runtime: Runtime, batch_size: int, seed: int,
                 transform: Transform | None) -> None:
        self.runtime = runtime
        self.local_batch = runtime.local_batch(batch_size)
        self._sampler = DistributedSampler(range(size), num_replicas=runtime.world_size,
                                           rank=runtime.rank, shuffle=True, seed=seed, drop_last=True)
        self._transform = transform
        self._generator = torch.Generator(runtime.device).manual_seed(seed + runtime.rank)
        if len(self) == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the {size} training samples "
                             f"over {runtime.world_size} processes")

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return len(self._sampler) // self.local_batch

    def epoch(self, number: int) -> Iterator[Batch]:
        """Epoch ``number``'s ``(inputs, labels)`` batches of this rank, ready on the device."""
        self._sampler.set_epoch(number)
        device = self.runtime.device
        for inputs, labels in self._fetch():
            inputs = inputs.to(device, non_blocking=True)
            if self._transform is not None:
                inputs = self._transform(inputs, self._generator)
            yield self.runtime.to_device(inputs), labels.to(device, non_blocking=True)

    def _order(self) -> list[int]:
        """This rank's sample indices for the current epoch, in order."""
        return list(self._sampler)

    @abc.abstractmethod
    def _fetch(self) -> Iterator[Batch]:
        """This epoch's raw ``(inputs, labels)`` batches, in the order of :meth:`_order`."""


class DeviceData(Batches):
    """A training split held on the device for the whole run; each batch is one gather there.

    Args:
        split: the inputs and labels (a ``TensorDataset`` of two tensors, anywhere).
        runtime: this process's runtime.
        batch_size: the global batch, split evenly over the processes.
        seed: seeds the per-epoch permutation and the augmentation.
        transform: applied to each batch on the device (see :class:`ImageTransform`).
    """

    def __init__(self, split: TensorDataset, runtime: Runtime, batch_size: int, seed: int,
                 transform: Transform | None = None) -> None:
        inputs, labels = split.tensors
        super().__init__(len(labels), runtime, batch_size, seed, transform)
        self._inputs = inputs.to(runtime.device)
        self._labels = labels.to(runtime.device)

    def _fetch(self) -> Iterator[Batch]:
        order = torch.tensor(self._order(), dtype=torch.int64).to(self.runtime.device, non_blocking=True)
        for start in range(0, len(self) * self.local_batch, self.local_batch):
            index = order[start:start + self.local_batch]
            yield self._inputs[index], self._labels[index]


class LoaderData(Batches):
    """A training split read through a ``DataLoader``: for data that does not fit on the device.

    Same batches as :class:`DeviceData` for the same seed; samples are ``(input, label)``
    pairs that the default collate stacks, copied to the device per batch (pinned on GPUs).

    Args:
        split: any map-style dataset of ``(input, label)`` pairs.
        runtime: this process's runtime.
        batch_size: the global batch, split evenly over the processes.
        seed: seeds the per-epoch permutation and the augmentation.
        transform: applied to each batch on the device (see :class:`ImageTransform`).
        workers: DataLoader worker processes (0: load in this process).
    """

    def __init__(self, split: Dataset[tuple[torch.Tensor, torch.Tensor]], runtime: Runtime,
                 batch_size: int, seed: int, transform: Transform | None = None,
                 workers: int = 0) -> None:
        super().__init__(len(split), runtime, batch_size, seed, transform)  # type: ignore[arg-type]
        # Its own generator (for worker seeds) keeps the DataLoader off torch's global one,
        # which draws the dropout masks: both paths must leave it alone.
        self._loader = DataLoader(split, batch_size=self.local_batch, sampler=self._sampler,
                                  drop_last=True, num_workers=workers, pin_memory=runtime.on_gpu,
                                  persistent_workers=workers > 0,
                                  generator=torch.Generator().manual_seed(seed + runtime.rank))

    def _fetch(self) -> Iterator[Batch]:
        return iter(self._loader)


def fits_on_device(split: TensorDataset, runtime: Runtime) -> bool:
    """True when ``split``'s tensors take at most half of the device's free memory (always on CPUs)."""
    if not runtime.on_gpu:
        return True
    size = sum(tensor.nbytes for tensor in split.tensors)
    free, _ = torch.cuda.mem_get_info(runtime.device)
    return size <= RESIDENT_SHARE * free


def batches(split: Dataset[tuple[torch.Tensor, torch.Tensor]], runtime: Runtime, batch_size: int,
            seed: int, transform: Transform | None = None, resident: bool | None = None) -> Batches:
    """The training batches of ``split``: resident on the device when it fits, else a DataLoader.

    Args:
        split: a ``TensorDataset`` of inputs and labels, or any dataset of ``(input, label)``.
        runtime: this process's runtime.
        batch_size: the global batch, split evenly over the processes.
        seed: seeds the per-epoch permutation and the augmentation.
        transform: applied to each batch on the device (see :class:`ImageTransform`).
        resident: force the path: True for :class:`DeviceData` (``split`` must be a
            ``TensorDataset``), False for :class:`LoaderData`; None decides by
            :func:`fits_on_device`.
    """
    if resident is None:
        resident = isinstance(split, TensorDataset) and fits_on_device(split, runtime)
    if resident:
        if not isinstance(split, TensorDataset):
            raise TypeError(f"resident data must be a TensorDataset, got {type(split).__name__}")
        return DeviceData(split, runtime, batch_size, seed, transform)
    return LoaderData(split, runtime, batch_size, seed, transform)


def train_epoch(model: nn.Module, batches: Iterable[Batch], optimizer: torch.optim.Optimizer,
                runtime: Runtime, schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
                loss_function: LossFunction = F.cross_entropy) -> float:
    """One pass of ``model`` over ``batches``; returns the mean training loss of this rank.

    Each step zeroes the gradients, computes the loss under :meth:`Runtime.autocast`,
    back-propagates (DDP averages the gradients), steps the optimizer and then, if given,
    the learning-rate schedule (per step). The device is synchronized once, at the end.

    Args:
        model: the module from :meth:`Runtime.distribute`.
        batches: ``(inputs, labels)`` on the device, e.g. ``Batches.epoch(n)``.
        optimizer: steps ``model``'s parameters.
        runtime: this process's runtime.
        schedule: a learning-rate schedule stepped after every optimizer step.
        loss_function: ``loss_function(outputs, labels)``, a scalar; cross-entropy by default.
    """
    model.train()
    losses = []
    for inputs, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        with runtime.autocast():
            loss = loss_function(model(inputs), labels)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.detach())
    if not losses:
        raise ValueError("an epoch without batches")
    return torch.stack(losses).float().mean().item()


@torch.no_grad()
def error_rate(net: nn.Module, split: TensorDataset, runtime: Runtime,
               transform: Transform | None = None, batch_size: int = EVAL_BATCH_SIZE) -> float:
    """Classification error of ``net`` (argmax of its outputs) over a whole split.

    Call it on one rank (:attr:`Runtime.is_main`) with the bare module, not the DDP wrapper,
    whose forward would wait for the other ranks. Leaves ``net`` in eval mode.

    Args:
        net: the model.
        split: a ``TensorDataset`` of inputs and labels, on any device.
        runtime: this process's runtime.
        transform: applied to each batch on the device, without augmentation.
        batch_size: inputs per forward pass.
    """
    net.eval()
    inputs, labels = split.tensors
    wrong = torch.zeros((), dtype=torch.int64, device=runtime.device)
    for start in range(0, len(labels), batch_size):
        batch = inputs[start:start + batch_size].to(runtime.device, non_blocking=True)
        if transform is not None:
            batch = transform(batch)
        with runtime.autocast():
            predicted = net(runtime.to_device(batch)).argmax(dim=1)
        wrong += (predicted != labels[start:start + batch_size].to(runtime.device)).sum()
    return int(wrong) / len(labels)


def datasets(splits: Mapping[str, tuple[np.ndarray, np.ndarray]],
             inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, TensorDataset]:
    """Each ``(inputs, labels)`` pair of numpy arrays as a ``TensorDataset`` sharing their memory,
    its inputs passed through ``inputs`` (e.g. a reshape or a scaling) when given."""
    convert = inputs or (lambda x: x)
    return {name: TensorDataset(convert(torch.from_numpy(x)), torch.from_numpy(y)) for name, (x, y) in splits.items()}


def choose(options: Mapping[str, T], name: str, what: str) -> T:
    """``options[name]``; a name outside ``options`` raises ValueError naming ``what`` and the choices."""
    if name not in options:
        raise ValueError(f"{what} {name!r} is not one of {sorted(options)}")
    return options[name]


def fit(runtime: Runtime, net: nn.Module, splits: Mapping[str, TensorDataset], make_optimizer: OptimizerFactory,
        *, batch_size: int, epochs: int, seed: int, transform: Transform | None = None,
        make_schedule: ScheduleFactory | None = None, weights: str | os.PathLike[str] = "model.pt") -> float | None:
    """Train ``net`` on ``splits["train"]`` for ``epochs`` epochs and report what hpo reads.

    The main process reports the validation error (``splits["val"]``) after every epoch as
    that step's, then the final validation and test (``splits["test"]``) errors, and saves
    ``net``'s weights to ``weights``; the other ranks only train.

    Args:
        runtime: this process's runtime.
        net: the bare model, on the CPU; :meth:`Runtime.distribute` places it.
        splits: ``train``, ``val`` and ``test`` datasets of inputs and labels.
        make_optimizer: the optimizer of the distributed model's parameters.
        batch_size: the global batch (see :func:`batches`).
        epochs: passes over the training split, at least 1.
        seed: seeds the batches' order and augmentation.
        transform: applied to every batch on the device; it augments training batches only.
        make_schedule: ``make_schedule(optimizer, total_steps)``, a schedule stepped per batch.
        weights: where the main process saves ``net.state_dict()``.

    Returns:
        The final validation error on the main process, None on the others.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    model = runtime.distribute(net)
    optimizer = make_optimizer(model.parameters())
    data = batches(splits["train"], runtime, batch_size, seed=seed, transform=transform)
    schedule = None if make_schedule is None else make_schedule(optimizer, epochs * len(data))
    val_error = None
    for epoch in range(1, epochs + 1):
        train_epoch(model, data.epoch(epoch), optimizer, runtime, schedule)
        if runtime.is_main:
            val_error = error_rate(net, splits["val"], runtime, transform)
            report(step=epoch, val_error=val_error)
    if runtime.is_main:
        report(val_error=val_error, test_error=error_rate(net, splits["test"], runtime, transform))
        torch.save(net.state_dict(), weights)
    return val_error
