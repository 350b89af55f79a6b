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

import torch
from torch import nn

from hpo import train
from hpo.data import load_digits_splits

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


def fit(args: argparse.Namespace, runtime: train.Runtime) -> None:
    """Train, report the validation error per epoch, then the final errors; save the weights."""
    splits = train.datasets(load_digits_splits(SPLIT_SEED), inputs=lambda pixels: pixels.float() / 16)
    train.fit(runtime, make_model(args), splits, functools.partial(make_optimizer, args=args),
              batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, then train on this process's runtime; ends the process."""
    args = parse_args(argv)
    train.run(functools.partial(fit, args), seed=args.seed)


if __name__ == "__main__":
    main()
