"""MLP on scikit-learn's 8x8 digits, its hyper-parameters read from command-line flags.

The "flags" workload: a plain script, not a template. hpo runs it as
``python digits_mlp_flags.py --lr 0.01 --hidden 128 ...`` (``flags: true``), plainly or
under ``torchrun --nproc-per-node N``. ``--batch_size`` is the global batch, split evenly
over the N processes; the data set lives on the device. Split (fixed): 20% test, held out
until the end; 20% of the rest for validation. Reports the validation error per epoch,
then the final validation and test errors, and saves the trained weights to ``model.pt``
in the working folder.
"""
from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

from hpo import train
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


def make_model(args: argparse.Namespace) -> nn.Module:
    """64 pixels -> ``hidden`` ReLU units -> dropout -> 10 logits, on the CPU."""
    return nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Dropout(args.dropout),
                         nn.Linear(args.hidden, 10))


def make_optimizer(parameters: Iterable[nn.Parameter], args: argparse.Namespace) -> torch.optim.Optimizer:
    """The optimizer the flags ask for."""
    return OPTIMIZERS[args.optimizer](parameters, args.lr)


def to_dataset(pixels: np.ndarray, labels: np.ndarray) -> TensorDataset:
    """Digits rows (64 pixels in 0..16) scaled to [0, 1], with int64 labels."""
    return TensorDataset(torch.tensor(pixels, dtype=torch.float32) / 16,
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


def fit(args: argparse.Namespace, runtime: train.Runtime) -> None:
    """Train, report the validation error per epoch, then the final errors; save the weights."""
    splits = load_splits()
    net = make_model(args)
    model = runtime.distribute(net)
    optimizer = make_optimizer(model.parameters(), args)
    data = train.batches(splits["train"], runtime, args.batch_size, seed=args.seed)
    for epoch in range(1, args.epochs + 1):
        train.train_epoch(model, data.epoch(epoch), optimizer, runtime)
        if runtime.is_main:
            val_error = train.error_rate(net, splits["val"], runtime)
            report(step=epoch, val_error=val_error)
    if runtime.is_main:
        report(val_error=val_error, test_error=train.error_rate(net, splits["test"], runtime))
        torch.save(net.state_dict(), "model.pt")


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, then train on this process's runtime; ends the process."""
    args = parse_args(argv)
    train.run(functools.partial(fit, args), seed=args.seed)


if __name__ == "__main__":
    main()
