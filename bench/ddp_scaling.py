"""Data-parallel scaling of a trial's training loop, with and without hpo.

Trains the digits CNN two ways, each at 1, 2, ... processes (CPU: one thread per process,
gloo; GPU: one GPU per process, NCCL):

* ``hpo template``: ``templates/digits_cnn.py.j2`` rendered and run as hpo runs a trial,
  plainly for one process and under torchrun for more;
* ``plain loop``: the same model, split, sampling order (``DistributedSampler``'s), data
  resident on the device, DDP training and per-epoch validation written out in this file
  with no hpo import and no ``report``.

An epoch is timed between the moments its line and the previous epoch's line reach
stdout, so start-up and the first (warm-up) epoch are left out. Runs are interleaved
(every loop and process count once, then again, ``--repeats`` times) and the fastest
epoch counts: on a shared machine, other work only ever slows an epoch down. Both loops
reach the same validation errors, which shows they do the same work.
Usage: ``python bench/ddp_scaling.py [--procs 1 2] [--epochs 5] [--repeats 3]``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = REPO_ROOT / "templates" / "digits_cnn.py.j2"
NB_FILTERS, CONV_SIZE, LR, BATCH_SIZE = 128, 5, 0.1, 256
SPLIT_SEED, SEED = 0, 0
EVAL_BATCH_SIZE = 1024
PLAIN_EPOCH_LINE = re.compile(r"^epoch (\d+) val_error (\S+)$")
SPEEDUP_GOAL = 1.8


def plain_training(epochs: int) -> None:
    """The digits CNN trained with plain PyTorch DDP; one ``epoch N val_error E`` line each.

    Mirrors the template's main loop step for step (global batch ``BATCH_SIZE``, SGD with
    momentum, no dropout, the training set on the device, validation on rank 0), with
    nothing from hpo.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world_size > 1:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    on_gpu = device.type == "cuda"
    bf16 = on_gpu and torch.cuda.is_bf16_supported()
    memory_format = torch.channels_last if on_gpu else torch.contiguous_format

    pixels, labels = load_digits(return_X_y=True)
    rest_x, _, rest_y, _ = train_test_split(pixels, labels, test_size=0.2, stratify=labels,
                                            random_state=SPLIT_SEED)
    train_x, val_x, train_y, val_y = train_test_split(rest_x, rest_y, test_size=0.2,
                                                      stratify=rest_y, random_state=SPLIT_SEED)
    train_images = (torch.tensor(train_x, dtype=torch.float32).view(-1, 1, 8, 8) / 16).to(device)
    train_labels = torch.tensor(train_y).to(device)
    val_images = torch.tensor(val_x, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    val_labels = torch.tensor(val_y)

    torch.manual_seed(SEED)
    net = nn.Sequential(
        nn.Conv2d(1, NB_FILTERS, CONV_SIZE, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(NB_FILTERS, NB_FILTERS, CONV_SIZE, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(NB_FILTERS * 4, 10),
    ).to(device, memory_format=memory_format)
    model = DistributedDataParallel(net) if world_size > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = DistributedSampler(range(len(train_labels)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=SEED, drop_last=True)
    local_batch = BATCH_SIZE // world_size
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler)).to(device)
        model.train()
        for start in range(0, len(order) // local_batch * local_batch, local_batch):
            index = order[start:start + local_batch]
            images = train_images[index].contiguous(memory_format=memory_format)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(images), train_labels[index])
            loss.backward()
            optimizer.step()
        if rank == 0:
            net.eval()
            wrong = 0
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                for start in range(0, len(val_labels), EVAL_BATCH_SIZE):
                    batch = val_images[start:start + EVAL_BATCH_SIZE].to(device)
                    predicted = net(batch.contiguous(memory_format=memory_format)).argmax(dim=1)
                    expected = val_labels[start:start + EVAL_BATCH_SIZE]
                    wrong += int((predicted.cpu() != expected).sum())
            print(f"epoch {epoch} val_error {wrong / len(val_labels)}", flush=True)
    if world_size > 1:
        dist.destroy_process_group()


def samples_per_epoch() -> int:
    """Training samples one epoch processes at global batch ``BATCH_SIZE`` (full batches)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    _, labels = load_digits(return_X_y=True)
    rest, _ = train_test_split(labels, test_size=0.2, stratify=labels, random_state=SPLIT_SEED)
    train, _ = train_test_split(rest, test_size=0.2, stratify=rest, random_state=SPLIT_SEED)
    return len(train) // BATCH_SIZE * BATCH_SIZE


def render_template(folder: Path, epochs: int) -> Path:
    """The digits template rendered as hpo renders a trial, with the benchmark's settings."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.from_string(TEMPLATE.read_text()).render(
        nb_filters=NB_FILTERS, conv_size=CONV_SIZE, dropout=0.0, lr=LR, optimizer="sgd",
        batch_size=BATCH_SIZE, epochs=epochs, seed=SEED, trial_number=0, trial_dir=str(folder))
    script = folder / "digits_cnn.py"
    script.write_text(text)
    return script


@dataclass(frozen=True)
class Timing:
    """One run: its fastest epoch after the first, in seconds, and its last val_error."""

    fastest_epoch_s: float
    val_error: float


def epoch_line(line: str) -> tuple[int, float] | None:
    """``(epoch, val_error)`` from a template report line or a plain-loop line, else None."""
    if line.startswith("{"):
        values = json.loads(line)
        return (int(values["step"]), values["val_error"]) if "step" in values else None
    match = PLAIN_EPOCH_LINE.match(line)
    return (int(match.group(1)), float(match.group(2))) if match else None


def timed_run(args: list[str], nproc: int, cwd: Path, gpus: int) -> Timing:
    """Run a training script on ``nproc`` processes and time its epochs after the first."""
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])
    python_path = filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(python_path))
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in range(nproc))
    marks: list[tuple[int, float, float]] = []
    other: list[str] = []
    with subprocess.Popen([sys.executable, *launcher, *args], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        assert process.stdout is not None
        for line in process.stdout:
            parsed = epoch_line(line.strip())
            if parsed is None:
                other.append(line)
            else:
                marks.append((parsed[0], time.perf_counter(), parsed[1]))
    if process.returncode != 0 or len(marks) < 2:
        raise RuntimeError(f"{' '.join(args)} on {nproc} processes failed (exit "
                           f"{process.returncode}, {len(marks)} epochs):\n{''.join(other[-20:])}")
    durations = [(end - start) / (epoch - previous)
                 for (previous, start, _), (epoch, end, _) in itertools.pairwise(marks)]
    return Timing(min(durations), marks[-1][2])


def main() -> None:
    """Print samples/s per loop and process count, the speedups, and hpo's cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+",
                        help="process counts (default: 1 and 2 on CPU, 1..N on N GPUs)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run, first is warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_training(args.epochs)
        return

    import torch

    gpus = torch.cuda.device_count()
    procs = args.procs or (list(range(1, gpus + 1)) if gpus else [1, 2])
    samples = samples_per_epoch()
    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else (
        f"CPU ({os.cpu_count()} cores, 1 thread per process)")
    print(f"digits CNN: {NB_FILTERS} filters {CONV_SIZE}x{CONV_SIZE}, global batch {BATCH_SIZE}, "
          f"{samples} samples/epoch; fastest of {args.repeats} x {args.epochs - 1} timed epochs")
    load_before = os.getloadavg()[0]
    timings: dict[tuple[str, int], list[Timing]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = render_template(Path(tmp), args.epochs)
        loops = {
            "hpo template": [script.name],
            "plain loop": [str(Path(__file__).resolve()), "--plain-worker",
                           "--epochs", str(args.epochs)],
        }
        for _ in range(args.repeats):
            for name, command in loops.items():
                for nproc in procs:
                    timing = timed_run(command, nproc, Path(tmp), gpus)
                    timings.setdefault((name, nproc), []).append(timing)
    print(f"device: {device}; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    rates = {key: samples / min(t.fastest_epoch_s for t in runs) for key, runs in timings.items()}

    def speedup(name: str, nproc: int) -> float:
        return rates[name, nproc] / rates[name, procs[0]]

    print(f"{'loop':<14}{'procs':>6}{'samples/s':>12}{'speedup':>9}  val_error")
    for (name, nproc), rate in rates.items():
        errors = sorted({f"{t.val_error:.4f}" for t in timings[name, nproc]})
        print(f"{name:<14}{nproc:>6}{rate:>12.0f}{speedup(name, nproc):>8.2f}x  "
              f"{', '.join(errors)}")
    for nproc in procs[1:]:
        print(f"{nproc}-proc / {procs[0]}-proc speedup: hpo template "
              f"{speedup('hpo template', nproc):.2f}x, plain loop "
              f"{speedup('plain loop', nproc):.2f}x (goal >= {SPEEDUP_GOAL}x)")
    for nproc in procs:
        cost = rates["plain loop", nproc] / rates["hpo template", nproc] - 1
        print(f"hpo's cost inside a trial at {nproc} proc: {cost:+.1%} time per epoch")


if __name__ == "__main__":
    main()
