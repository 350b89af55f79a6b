"""Data parallelism does not change what a trial learns.

The digits template, rendered with no dropout and plain SGD, is trained twice with the
same seed and the same global batch of 2b samples: once as a single process taking
batches of 2b, once under torchrun as 2 gloo processes taking batches of b each. Every
epoch's shuffled order is the same permutation in both runs (``DistributedSampler``'s, on
the device); ``hpo.train.batches`` deals it out round-robin (rank r takes positions r,
r + 2, ...), so step k of the two processes
together covers exactly the 2b samples of step k of the single process. Each process's
loss is the mean over its b samples and DDP averages the two gradients, which is the
gradient of the mean loss over the 2b samples: the trained weights must agree up to
float rounding.
"""
from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2
import pytest
import torch
from conftest import run_torch_job

from hpo.results import parse_text

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = REPO_ROOT / "templates" / "digits_cnn.py.j2"
SEED = 3
PARAMS = {"nb_filters": 8, "conv_size": 3, "dropout": 0.0, "lr": 0.1, "optimizer": "sgd",
          "batch_size": 64, "epochs": 2}


@dataclass(frozen=True)
class Trained:
    """A finished trial: its folder (holding the rendered script), weights and metrics."""

    folder: Path
    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


def train(folder: Path, nproc: int) -> Trained:
    """Render the digits template into ``folder`` and train it on ``nproc`` CPU processes."""
    folder.mkdir()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    context = {**PARAMS, "trial_number": 0, "trial_dir": str(folder), "seed": SEED}
    (folder / "digits_cnn.py").write_text(env.from_string(TEMPLATE.read_text()).render(context))
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])
    trial_env = {key: value for key, value in os.environ.items()
                 if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    trial_env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                              os.environ.get("PYTHONPATH")])),
                     CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = run_torch_job([sys.executable, *launcher, "digits_cnn.py"], cwd=folder, env=trial_env)
    assert done.returncode == 0, done.stdout + done.stderr
    return Trained(folder, torch.load(folder / "model.pt", weights_only=True),
                   dict(parse_text(done.stdout, "val_error").final))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """One process, batches of 64."""
    return train(tmp_path_factory.mktemp("trial") / "single", nproc=1)


def test_two_processes_learn_the_same_weights_as_one(tmp_path: Path, single: Trained) -> None:
    two = train(tmp_path / "two", nproc=2)

    assert two.weights.keys() == single.weights.keys()
    for name, expected in single.weights.items():
        torch.testing.assert_close(two.weights[name], expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda text, name=name: f"{name}: {text}")
    assert two.metrics == pytest.approx(single.metrics, abs=1 / 200)


def test_the_weights_compared_are_trained_ones(single: Trained) -> None:
    script = runpy.run_path(str(single.folder / "digits_cnn.py"), run_name="digits_cnn")
    torch.manual_seed(SEED)
    initial = script["DigitsCNN"](PARAMS["nb_filters"], PARAMS["conv_size"], PARAMS["dropout"]).state_dict()

    moved = max((single.weights[name] - initial[name]).abs().max().item() for name in initial)

    assert moved > 1e-2
    assert single.metrics["val_error"] < 0.8, "no better than guessing (0.9)"
