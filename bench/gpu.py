"""How busy hpo keeps a GPU: the templates' loops, trials sharing a GPU, and trial start-up.

(a) **Loop speed.** Each template is rendered and run as a trial (one process), and the
    same model, optimizer, batch, augmentation and per-epoch validation are run by a plain
    loop written in this file with the data resident on the device. An epoch is timed
    between two consecutive epoch lines on stdout; the fastest epoch after the first
    counts, over ``--repeats`` interleaved runs. Goal: the template within 5 % of the plain
    loop. Models: the digits CNN and MLP, Keras' MNIST and CIFAR-10 CNNs, WRN-16-4 and (on
    GPUs) WRN-28-10; MNIST and CIFAR-10 are synthetic images of the real sizes (60,000 and
    50,000 training images; nothing is downloaded) written in the real file formats.
(b) **Trials per hour** of a sweep of short trials (the quick-start digits job, one process
    per trial) at 1, 2, 4 and 8 trials per GPU: ``python -m hpo run`` on a scenario with
    ``gpus_per_trial: 1/k`` and ``parallel: k``, one GPU forced with ``HPO_GPUS``.
(c) **Start-up** of a trial: the interpreter, ``import torch``, the CUDA context, the
    template's imports, then the digits template from process start to its first metric
    line, plainly and under torchrun.

Without CUDA it runs (a) and (c) on the CPU with small sizes and (b) with a fake GPU id
(``HPO_GPUS=0``: the trials share the CPU cores, not a GPU), and says what it skipped.
Usage: ``python -m bench.gpu [--parts a b c] [--repeats 2] [--trials 16] [--shares 1 2 4 8]``.
"""
from __future__ import annotations

import argparse
import csv
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.ddp_scaling import timed_run
from hpo.data import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = REPO_ROOT / "templates"
MAIN_JOB = REPO_ROOT / "scenarios" / "digits-monte-carlo.yaml"
GOAL_RATIO = 0.95
SHARE_GOALS = {4: 3.5, 8: 5.9}
EVAL_BATCH_SIZE = 1024
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class Workload:
    """A template with its settings, and what the plain loop must do to match it.

    ``data`` is ``digits``, ``mnist`` or ``cifar10``; ``flags`` (for the plain script
    ``digits_mlp_flags.py``) replace template variables.
    """

    name: str
    template: str
    data: str
    batch_size: int
    epochs: int
    params: dict[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    max_train_samples: int = 0
    augment: bool = False
    cosine: bool = False


def workloads(gpu: bool) -> list[Workload]:
    """The models of (a): full sizes on a GPU, small ones on the CPU."""
    def wrn(depth: int, width: int) -> dict[str, Any]:
        return {"depth": depth, "widen_factor": width, "dropout": 0.3, "lr": 0.1, "momentum": 0.9,
                "weight_decay": 5e-4}

    cap = 0 if gpu else 1024
    digits_epochs, image_epochs = (30, 4) if gpu else (6, 3)
    found = [
        Workload("digits CNN", "digits_cnn.py.j2", "digits", 64, digits_epochs,
                 {"nb_filters": 64 if gpu else 16, "conv_size": 3, "dropout": 0.1, "lr": 0.05, "optimizer": "sgd"}),
        Workload("digits MLP (flags)", "digits_mlp_flags.py", "digits", 64, digits_epochs,
                 flags=("--hidden", "256" if gpu else "64", "--dropout", "0.1", "--lr", "0.05")),
        Workload("MNIST CNN", "mnist_cnn.py.j2", "mnist", 128, image_epochs,
                 {"nb_filters": 32 if gpu else 8, "kernel_size": 3, "pool_size": 2, "dropout1": 0.25,
                  "dropout2": 0.5, "lr": 1.0, "optimizer": "adadelta"}, max_train_samples=cap),
        Workload("CIFAR-10 CNN", "cifar10_cnn.py.j2", "cifar10", 64, image_epochs,
                 {"nb_filters": 32 if gpu else 8, "dropout1": 0.25, "dropout2": 0.5, "lr": 1e-3,
                  "optimizer": "rmsprop"}, max_train_samples=cap, augment=True),
        Workload("WRN-16-4" if gpu else "WRN-10-1", "cifar10_wrn.py.j2", "cifar10", 128, 3,
                 wrn(16, 4) if gpu else wrn(10, 1), max_train_samples=cap // 2, augment=True, cosine=True),
    ]
    if gpu:
        found.append(Workload("WRN-28-10", "cifar10_wrn.py.j2", "cifar10", 128, 3, wrn(28, 10),
                              augment=True, cosine=True))
    return found


def sizes(work: Workload, gpu: bool) -> tuple[int, int, tuple[int, ...]]:
    """Training and validation samples of the workload, and the shape of one input."""
    if work.data == "digits":
        from hpo.data import load_digits_splits

        splits = load_digits_splits()
        return len(splits["train"][1]), len(splits["val"][1]), (64,) if work.flags else (1, 8, 8)
    total = data_count(work.data, gpu)
    val = round(VAL_FRACTION * total)
    train = total - val if not work.max_train_samples else min(total - val, work.max_train_samples)
    return train, val, (1, 28, 28) if work.data == "mnist" else (3, 32, 32)


def data_count(data: str, gpu: bool) -> int:
    """Training images written for ``data``: the real set's count on a GPU, fewer on the CPU."""
    full = {"mnist": 60_000, "cifar10": 50_000}[data]
    return full if gpu else 1200


def write_data(folder: Path, gpu: bool) -> dict[str, Path]:
    """Synthetic MNIST and CIFAR-10 in their real file formats; the data_dir of each."""
    import numpy as np

    from hpo.data import CIFAR10_FOLDER, write_cifar10_batches, write_mnist_idx

    rng = np.random.default_rng(0)
    for train, count in ((True, data_count("mnist", gpu)), (False, 10_000 if gpu else 200)):
        write_mnist_idx(folder / "mnist", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8),
                        rng.integers(0, 10, count), train=train)
    for train, count in ((True, data_count("cifar10", gpu)), (False, 10_000 if gpu else 200)):
        write_cifar10_batches(folder / "cifar10" / CIFAR10_FOLDER,
                              rng.integers(0, 256, (count, 3, 32, 32), dtype=np.uint8),
                              rng.integers(0, 10, count), train=train)
    return {"digits": folder, "mnist": folder / "mnist", "cifar10": folder / "cifar10"}


def render(work: Workload, folder: Path, data_dir: Path, epochs: int) -> list[str]:
    """The workload's script in ``folder``, rendered as hpo renders a trial; its argument list."""
    import jinja2

    folder.mkdir(parents=True)
    source = TEMPLATES / work.template
    if work.flags:
        (folder / source.name).write_text(source.read_text())
        return [source.name, *work.flags, "--batch_size", str(work.batch_size), "--epochs", str(epochs)]
    context = {**work.params, "batch_size": work.batch_size, "epochs": epochs, "seed": 0, "trial_number": 0,
               "trial_dir": str(folder), "data_dir": str(data_dir), "max_train_samples": work.max_train_samples}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    script = folder / source.name.removesuffix(".j2")
    script.write_text(env.from_string(source.read_text()).render(context))
    return [script.name]


def plain_loop(work: Workload, script: Path, train_count: int, val_count: int, shape: tuple[int, ...],
               epochs: int) -> None:
    """The workload's training written out plainly, its data resident on the device.

    The model and optimizer come from the rendered script (``make_model``,
    ``make_optimizer``); everything else is here: random data of the workload's sizes,
    normalization, crop-and-flip augmentation, bf16 autocast and channels-last on GPUs, the
    optimizer step (and a per-step cosine schedule for the Wide ResNets), and validation
    after each epoch, printed as ``epoch N val_error E``.
    """
    import torch
    import torch.nn.functional as F

    namespace = runpy.run_path(str(script), run_name="plain_loop")
    if work.flags:
        args = namespace["parse_args"](list(work.flags))
        net = namespace["make_model"](args)
    else:
        net = namespace["make_model"]()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    torch.backends.cudnn.benchmark = True
    memory_format = torch.channels_last if on_gpu and len(shape) == 3 else torch.contiguous_format
    bf16 = on_gpu and torch.cuda.is_bf16_supported()
    torch.manual_seed(0)
    net = net.to(device, memory_format=memory_format)
    optimizer = (namespace["make_optimizer"](net.parameters(), args) if work.flags
                 else namespace["make_optimizer"](net.parameters()))
    steps = train_count // work.batch_size
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps)
                if work.cosine else None)
    generator = torch.Generator(device).manual_seed(0)
    images = work.data != "digits"

    def inputs(count: int) -> torch.Tensor:
        if images:
            return torch.randint(0, 256, (count, *shape), dtype=torch.uint8, device=device, generator=generator)
        return torch.rand((count, *shape), device=device, generator=generator)

    train_x, val_x = inputs(train_count), inputs(val_count)
    train_y = torch.randint(0, 10, (train_count,), device=device, generator=generator)
    val_y = torch.randint(0, 10, (val_count,), device=device, generator=generator)
    mean, std = (CIFAR10_MEAN, CIFAR10_STD) if work.data == "cifar10" else (MNIST_MEAN, MNIST_STD)
    mean_t = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, -1, 1, 1)

    def prepare(batch: torch.Tensor, augment: bool) -> torch.Tensor:
        if images:
            batch = (batch.float() / 255 - mean_t) / std_t
        if augment:
            n, channels, height, width = batch.shape
            padded = F.pad(batch, (4, 4, 4, 4), mode="reflect")
            top, left = torch.randint(0, 9, (2, n, 1), device=device, generator=generator)
            rows = top + torch.arange(height, device=device)
            cols = left + torch.arange(width, device=device)
            flip = torch.rand(n, 1, device=device, generator=generator) < 0.5
            cols = torch.where(flip, cols.flip(1), cols)
            batch = padded[torch.arange(n, device=device)[:, None, None, None],
                           torch.arange(channels, device=device)[None, :, None, None],
                           rows[:, None, :, None], cols[:, None, None, :]]
        return batch.contiguous(memory_format=memory_format)

    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(train_count, device=device, generator=generator)
        for step in range(steps):
            index = order[step * work.batch_size:(step + 1) * work.batch_size]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(prepare(train_x[index], work.augment)), train_y[index])
            loss.backward()
            optimizer.step()
            if schedule is not None:
                schedule.step()
        net.eval()
        wrong = torch.zeros((), dtype=torch.int64, device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            for start in range(0, val_count, EVAL_BATCH_SIZE):
                predicted = net(prepare(val_x[start:start + EVAL_BATCH_SIZE], False)).argmax(dim=1)
                wrong += (predicted != val_y[start:start + EVAL_BATCH_SIZE]).sum()
        print(f"epoch {epoch} val_error {int(wrong) / val_count}", flush=True)


def loop_speed(gpu: bool, repeats: int) -> None:
    """Part (a): images/s of each template's loop against the plain loop."""
    print(f"(a) loop speed: fastest epoch after the first, best of {repeats} interleaved runs; "
          f"images/s = training images per epoch / epoch seconds (validation included)")
    print(f"{'model':<20}{'train':>8}{'batch':>7}{'template img/s':>16}{'plain img/s':>13}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        data_dirs = write_data(Path(tmp) / "data", gpu)
        for index, work in enumerate(workloads(gpu)):
            train_count = sizes(work, gpu)[0]
            folder = Path(tmp) / f"work-{index}"
            argv = render(work, folder, data_dirs[work.data], work.epochs)
            plain = [str(Path(__file__).resolve()), "--plain-worker", str(index), "--script", argv[0],
                     "--epochs", str(work.epochs)]
            if not gpu:
                plain.append("--cpu-sizes")
            best = {"template": 0.0, "plain": 0.0}
            for _ in range(repeats):
                for name, command in (("template", argv), ("plain", plain)):
                    timing = timed_run(command, 1, folder, 1 if gpu else 0)
                    rate = train_count // work.batch_size * work.batch_size / timing.fastest_epoch_s
                    best[name] = max(best[name], rate)
            ratio = best["template"] / best["plain"]
            verdict = "ok" if ratio >= GOAL_RATIO else f"below the {GOAL_RATIO:.0%} goal"
            print(f"{work.name:<20}{train_count:>8}{work.batch_size:>7}{best['template']:>16.0f}"
                  f"{best['plain']:>13.0f}{ratio:>8.3f}  {verdict}", flush=True)


def share_scenario(folder: Path, share: int, trials: int) -> Path:
    """The main job's parameters as a sweep of one-process trials, ``share`` of them per GPU."""
    main_job = yaml.safe_load(MAIN_JOB.read_text())
    scenario = {
        "name": f"gpu-share-{share}",
        "template": str(TEMPLATES / "digits_cnn.py.j2"),
        "command": "python digits_cnn.py",
        "parameters": main_job["parameters"],
        "search": {"method": "monte_carlo", "trials": trials, "seed": 1},
        "objective": {"metric": "val_error", "direction": "minimize", "held_out": ["test_error"]},
        "resources": {"gpus_per_trial": 1 if share == 1 else round(1 / share, 4), "parallel": share,
                      "timeout": 600},
    }
    path = folder / f"share-{share}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


def hpo_env(gpu_ids: str) -> dict[str, str]:
    """The environment of an ``hpo`` command: this checkout importable, ``HPO_GPUS`` forced."""
    env = dict(os.environ, HPO_GPUS=gpu_ids)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def sweep_throughput(gpu: bool, trials: int, shares: list[int], gpu_id: str) -> None:
    """Part (b): trials per hour of the digits sweep at ``shares`` trials per GPU."""
    where = f"GPU {gpu_id}" if gpu else f"fake GPU id {gpu_id} (CPU: the trials share the CPU cores)"
    print(f"(b) sweep of {trials} digits trials, one process each, k trials per GPU on {where}")
    env = hpo_env(gpu_id)
    walls: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = {share: share_scenario(Path(tmp), share, trials) for share in shares}
        for share, scenario in scenarios.items():
            checked = subprocess.run([sys.executable, "-m", "hpo", "validate", str(scenario)], env=env,
                                     capture_output=True, text=True, check=False)
            if checked.returncode != 0:
                problem = (checked.stderr.strip().splitlines() or ["(no message)"])[-1]
                print(f"  skipped: this hpo does not accept the scenario of k = {share}: {problem}")
                return
        for share, scenario in scenarios.items():
            workdir = Path(tmp) / f"runs-{share}"
            began = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "hpo", "run", str(scenario), "--workdir", str(workdir)],
                                  env=env, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - began
            if done.returncode != 0:
                problem = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
                print(f"  k = {share}: hpo run failed (exit {done.returncode}): {problem}")
                return
            results = workdir / "results.csv"
            subprocess.run([sys.executable, "-m", "hpo", "export", str(scenario), "--workdir", str(workdir),
                            "-o", str(results)], env=env, capture_output=True, text=True, check=True)
            with results.open() as stream:
                states = [row["state"] for row in csv.DictReader(stream)]
            walls[share] = wall
            print(f"  k = {share}: {wall:6.0f} s, {trials / wall * 3600:7.0f} trials/h, "
                  f"{walls[shares[0]] / wall:.2f}x k = {shares[0]}; "
                  f"{states.count('COMPLETE')} of {len(states)} COMPLETE", flush=True)
    for share, goal in SHARE_GOALS.items():
        if share in walls and shares[0] == 1:
            print(f"  goal at k = {share}: >= {goal}x k = 1, measured {walls[1] / walls[share]:.2f}x")


def first_metric(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float | None, float]:
    """Seconds from starting ``argv`` to its first metric line (None if none) and to its exit."""
    began = time.perf_counter()
    first = None
    with subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if first is None and line.startswith("{"):
                first = time.perf_counter() - began
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}")
    return first, time.perf_counter() - began


def startup(gpu: bool, repeats: int) -> None:
    """Part (c): where a short trial's first seconds go (medians of ``repeats`` runs)."""
    import torch

    python = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    rows: list[tuple[str, list[str], int]] = [
        ("python -c pass", [python, "-c", "pass"], 1),
        ("import torch", [python, "-c", "import torch"], 1),
    ]
    if gpu:
        rows.append(("import torch + CUDA context", [python, "-c", "import torch; torch.zeros(1, device='cuda')"], 1))
    rows += [
        ("import torch, hpo.train", [python, "-c", "import torch, hpo.train"], 1),
        ("  + sklearn (digits data, split)",
         [python, "-c", "import torch, hpo.train, sklearn.datasets, sklearn.model_selection"], 1),
        ("digits template, plain", [python, "digits_cnn.py"], 1),
        ("digits template, torchrun 1 proc", [*launch, "1", "--no-python", python, "digits_cnn.py"], 1),
    ]
    if not gpu or torch.cuda.device_count() >= 2:
        rows.append(("digits template, torchrun 2 procs", [*launch, "2", "--no-python", python, "digits_cnn.py"], 2))
    skipped = "" if gpu else " (no CUDA: the CUDA context is skipped, the template trains on the CPU)"
    print(f"(c) start-up, median of {repeats} runs{skipped}: seconds from process start")
    print(f"{'command':<36}{'first metric':>14}{'exit':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "trial"
        render(workloads(gpu)[0], folder, folder, epochs=1)
        for label, argv, processes in rows:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(processes))) if gpu else ""
            runs = [first_metric(argv, folder, env) for _ in range(repeats)]
            firsts = [first for first, _ in runs if first is not None]
            shown = f"{statistics.median(firsts):.2f}" if firsts else "-"
            print(f"{label:<36}{shown:>14}{statistics.median(end for _, end in runs):>8.2f}", flush=True)


def main() -> None:
    """Run the chosen parts and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["a", "b", "c"], default=["a", "b", "c"])
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting in (a) and (c)")
    parser.add_argument("--trials", type=int, help="trials per sweep in (b) (default: 16 on a GPU, 4 on the CPU)")
    parser.add_argument("--shares", type=int, nargs="+", help="trials per GPU in (b) (default: 1 2 4 8; CPU: 1 2)")
    parser.add_argument("--gpu-id", default="0", help="the GPU (b) runs on, as HPO_GPUS")
    parser.add_argument("--plain-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--script", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-sizes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    gpu = torch.cuda.is_available()
    if args.plain_worker is not None:
        work = workloads(not args.cpu_sizes)[args.plain_worker]
        train_count, val_count, shape = sizes(work, not args.cpu_sizes)
        plain_loop(work, Path(args.script), train_count, val_count, shape, args.epochs)
        return
    device = torch.cuda.get_device_name(0) if gpu else f"CPU only ({os.cpu_count()} cores, 1 thread per process)"
    load = os.getloadavg()
    print(f"device: {device}; torch {torch.__version__}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if not gpu:
        print("no CUDA: (a) and (c) run small sizes on the CPU, (b) uses a fake GPU id; "
              "GPU figures need a GPU machine")
    if "a" in args.parts:
        loop_speed(gpu, args.repeats)
    if "b" in args.parts:
        sweep_throughput(gpu, args.trials or (16 if gpu else 4), args.shares or ([1, 2, 4, 8] if gpu else [1, 2]),
                         args.gpu_id)
    if "c" in args.parts:
        startup(gpu, args.repeats)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
