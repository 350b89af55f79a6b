"""MLP on scikit-learn's 8x8 digits, its hyper-parameters read from command-line flags.

The "flags" workload: a plain script, not a template. hpo runs it as
``python digits_mlp_flags.py --lr 0.01 --hidden 128 ...`` (``flags: true``), plainly or
under ``torchrun --nproc-per-node N``. ``--batch_size`` is the global batch, split evenly
over the N processes. Split (fixed): 20% test, held out until the end; 20% of the rest for
validation. Reports the validation error per epoch, then the final validation and test
errors, and saves the trained weights to ``model.pt`` in the working directory.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpo.results import report

SPLIT_SEED = 0
OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The hyper-parameters; an unknown flag or a bad value exits with code 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout before the output")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--seed", type=int, default=0, help="seeds weights and shuffling")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1:
        parser.error("--epochs, --batch_size and --hidden must be at least 1")
    return args


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: rank ``rank`` of ``world_size`` processes, on ``device``."""

    rank: int
    world_size: int
    device: torch.device


def setup_distributed() -> Runtime:
    """Join torchrun's process group when there are several processes.

    A plain ``python`` run is rank 0 of 1 with no process group. NCCL on
    ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on CPU with ``OMP_NUM_THREADS``
    (default 1) threads per process.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world_size > 1:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Runtime(rank, world_size, device)


def to_dataset(pixels: np.ndarray, labels: np.ndarray) -> TensorDataset:
    """Digits rows (64 pixels in 0..16) scaled to [0, 1], with int64 labels."""
    return TensorDataset(torch.tensor(pixels, dtype=torch.float32) / 16.0,
                         torch.tensor(labels, dtype=torch.int64))


def load_splits() -> dict[str, TensorDataset]:
    """The train, val and test splits, stratified, with a seed no hyper-parameter moves."""
    pixels, labels = load_digits(return_X_y=True)
    rest_x, test_x, rest_y, test_y = train_test_split(
        pixels, labels, test_size=0.2, stratify=labels, random_state=SPLIT_SEED)
    train_x, val_x, train_y, val_y = train_test_split(
        rest_x, rest_y, test_size=0.2, stratify=rest_y, random_state=SPLIT_SEED)
    return {"train": to_dataset(train_x, train_y), "val": to_dataset(val_x, val_y),
            "test": to_dataset(test_x, test_y)}


def make_mlp(hidden: int, dropout: float) -> nn.Module:
    """64 pixels -> ``hidden`` ReLU units -> dropout -> 10 logits."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(hidden, 10))


@torch.no_grad()
def error_rate(net: nn.Module, split: TensorDataset, runtime: Runtime) -> float:
    """Classification error of ``net`` over the whole split; rank 0 alone calls it.

    Pass the bare module, not the DDP wrapper, whose forward would wait for the other
    ranks. Evaluating on one rank keeps collectives out of a trial's last moments: a gloo
    worker thread still releasing a collective's tensors while the interpreter shuts down
    aborts the process (pytorch/pytorch#190489).
    """
    net.eval()
    inputs, labels = split.tensors
    predicted = net(inputs.to(runtime.device)).argmax(dim=1).cpu()
    return int((predicted != labels).sum()) / len(labels)


def train_one_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                    runtime: Runtime) -> None:
    """One pass over this rank's shard of the training split."""
    model.train()
    for inputs, labels in loader:
        inputs, labels = inputs.to(runtime.device), labels.to(runtime.device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()


def main(argv: list[str] | None = None) -> None:
    """Train, report the validation error per epoch, then the final errors; save weights."""
    args = parse_args(argv)
    runtime = setup_distributed()
    try:
        if args.batch_size % runtime.world_size:
            raise ValueError(f"batch_size {args.batch_size} must be a multiple of the "
                             f"{runtime.world_size} processes")
        splits = load_splits()
        torch.manual_seed(args.seed)
        net = make_mlp(args.hidden, args.dropout).to(runtime.device)
        model = DistributedDataParallel(net) if runtime.world_size > 1 else net
        optimizer = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
        sampler = DistributedSampler(splits["train"], num_replicas=runtime.world_size,
                                     rank=runtime.rank, shuffle=True, seed=args.seed,
                                     drop_last=True)
        loader = DataLoader(splits["train"], batch_size=args.batch_size // runtime.world_size,
                            sampler=sampler, drop_last=True)
        torch.manual_seed(args.seed + runtime.rank)  # distinct dropout masks on each rank
        for epoch in range(1, args.epochs + 1):
            sampler.set_epoch(epoch)
            train_one_epoch(model, loader, optimizer, runtime)
            if runtime.rank == 0:
                val_error = error_rate(net, splits["val"], runtime)
                report(step=epoch, val_error=val_error)
        if runtime.rank == 0:
            report(val_error=val_error, test_error=error_rate(net, splits["test"], runtime))
            torch.save(net.state_dict(), Path("model.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
