"""hpo.train: the runtime, both data paths (resident and DataLoader), the loop, evaluation, the end.

Data, loop and evaluation run in-process on the CPU; a rank of a two-process job is a
:class:`~hpo.train.Runtime` with that rank (dealing out batches needs no process group).
The end of a process (:func:`hpo.train.finish`) is checked in real subprocesses, one of
them a two-process gloo job under torchrun.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from hpo import train

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
SEED = 5
CIFAR_LIKE = train.ImageTransform((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), crop_padding=4, flip=True)


def runtime(rank: int = 0, world_size: int = 1) -> train.Runtime:
    """A CPU runtime of rank ``rank`` of ``world_size``, with no process group."""
    return train.Runtime(rank, world_size, rank, CPU)


def images(count: int, seed: int = 0) -> TensorDataset:
    """``count`` random uint8 3 x 32 x 32 images with labels 0..9."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator),
                         torch.randint(0, 10, (count,), generator=generator))


def indices(count: int) -> TensorDataset:
    """A split whose every input is its own index, so batches show which samples they hold."""
    return TensorDataset(torch.arange(count), torch.zeros(count, dtype=torch.int64))


def small_cnn() -> nn.Module:
    """A CNN with dropout, for 3 x 32 x 32 inputs."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Dropout(0.3), nn.Linear(32, 10))


def train_run(resident: bool, epochs: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train :func:`small_cnn` from one seed on augmented images; the loss curve and weights."""
    here = runtime()
    torch.manual_seed(SEED)
    net = small_cnn()
    model = here.distribute(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = train.batches(images(200), here, 32, seed=SEED, transform=CIFAR_LIKE, resident=resident)
    assert isinstance(data, train.DeviceData if resident else train.LoaderData)
    losses = [train.train_epoch(model, data.epoch(epoch), optimizer, here) for epoch in range(1, epochs + 1)]
    return losses, net.state_dict()


def test_resident_and_dataloader_paths_give_the_same_loss_curve_and_weights() -> None:
    resident_losses, resident_weights = train_run(resident=True)
    loader_losses, loader_weights = train_run(resident=False)

    assert resident_losses == loader_losses
    assert len(set(resident_losses)) == len(resident_losses), "epochs must differ"
    for name, weight in resident_weights.items():
        assert torch.equal(weight, loader_weights[name]), name


@pytest.mark.parametrize("resident", [True, False])
def test_each_rank_takes_its_share_of_the_samplers_permutation(resident: bool) -> None:
    split = indices(103)
    shards = [train.batches(split, runtime(rank, 2), 10, seed=SEED, resident=resident) for rank in (0, 1)]
    sampler = DistributedSampler(range(103), num_replicas=2, rank=0, shuffle=True, seed=SEED, drop_last=True)

    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        batches = [[batch.tolist() for batch, _ in shard.epoch(epoch)] for shard in shards]
        assert [len(batch) for rank in batches for batch in rank] == [5] * 20
        dealt = [[index for batch in rank for index in batch] for rank in batches]
        permutation = torch.randperm(103, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert dealt[0] == permutation[0:100:2]
        assert dealt[1] == permutation[1:100:2]
        assert dealt[0] == list(sampler)[:50]
    assert len(shards[0]) == len(shards[1]) == 10


def test_a_second_rank_augments_differently_but_the_same_on_both_paths() -> None:
    split = images(64)
    first = [next(iter(train.batches(split, runtime(rank, 2), 16, seed=SEED, transform=CIFAR_LIKE,
                                     resident=resident).epoch(1)))[0]
             for rank in (0, 1) for resident in (True, False)]

    assert torch.equal(first[0], first[1])
    assert torch.equal(first[2], first[3])
    assert first[0].shape == first[2].shape == (8, 3, 32, 32)
    assert not torch.equal(first[0], first[2])


def test_batches_choose_the_resident_path_for_tensors_on_a_cpu() -> None:
    assert train.fits_on_device(images(8), runtime())
    assert isinstance(train.batches(images(8), runtime(), 4, seed=0), train.DeviceData)


def test_batches_reject_what_cannot_train() -> None:
    with pytest.raises(ValueError, match="batch_size 5 must be a positive multiple of the 2 processes"):
        train.batches(images(8), runtime(0, 2), 5, seed=0)
    with pytest.raises(ValueError, match="batch_size 64 is larger than the 40 training samples over 2"):
        train.batches(images(40), runtime(0, 2), 64, seed=0)
    with pytest.raises(TypeError, match="resident data must be a TensorDataset, got list"):
        train.batches([(torch.zeros(1), torch.tensor(0))] * 8, runtime(), 4, seed=0, resident=True)


def test_image_transform_normalizes_and_without_a_generator_does_not_augment() -> None:
    transform = train.ImageTransform((0.5, 0.0), (0.5, 2.0), crop_padding=4, flip=True)
    pixels = torch.tensor([0, 255], dtype=torch.uint8).view(1, 2, 1, 1).expand(3, 2, 8, 8)

    normalized = transform(pixels)

    assert normalized.dtype == torch.float32
    torch.testing.assert_close(normalized[:, 0], torch.full((3, 8, 8), -1.0))
    torch.testing.assert_close(normalized[:, 1], torch.full((3, 8, 8), 0.5))


def test_crop_flip_cuts_windows_of_the_padded_images_and_flips_some() -> None:
    batch = torch.arange(64 * 2 * 6 * 6, dtype=torch.float32).view(64, 2, 6, 6)
    padded = torch.nn.functional.pad(batch, (2, 2, 2, 2), mode="reflect")

    out = train.crop_flip(batch, 2, True, torch.Generator().manual_seed(0))

    flips = 0
    for image, source in zip(out, padded):
        windows = [source[:, top:top + 6, left:left + 6] for top in range(5) for left in range(5)]
        plain = any(torch.equal(image, window) for window in windows)
        flipped = any(torch.equal(image, window.flip(-1)) for window in windows)
        assert plain or flipped
        flips += flipped
    assert 16 < flips < 48
    assert not torch.equal(out, batch)
    assert torch.equal(out, train.crop_flip(batch, 2, True, torch.Generator().manual_seed(0)))


def test_train_epoch_returns_the_mean_loss_and_steps_the_schedule_per_batch() -> None:
    here = runtime()
    net = nn.Linear(4, 3)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.zero_()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    batches = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(3)]

    loss = train.train_epoch(net, batches, optimizer, here, schedule)

    assert loss == pytest.approx(float(torch.log(torch.tensor(3.0))))
    assert schedule.last_epoch == 3


def test_error_rate_counts_wrong_argmaxes_over_every_chunk() -> None:
    net = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.eye(2))
    inputs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    split = TensorDataset(inputs, torch.tensor([0, 1, 1, 1, 1]))

    assert train.error_rate(net, split, runtime(), batch_size=2) == pytest.approx(2 / 5)
    assert not net.training


def tiny_splits() -> dict[str, TensorDataset]:
    """Separable 2-D points: the class is the sign of the first coordinate."""
    generator = torch.Generator().manual_seed(0)
    splits = {}
    for name, count in (("train", 64), ("val", 32), ("test", 16)):
        x = torch.randn(count, 2, generator=generator)
        splits[name] = TensorDataset(x, (x[:, 0] > 0).long())
    return splits


def test_fit_reports_every_epoch_then_the_final_errors_and_saves_the_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    steps: list[int] = []

    def schedule(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
        steps.append(total)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)

    val_error = train.fit(runtime(), net, tiny_splits(), lambda p: torch.optim.SGD(p, lr=0.5), batch_size=16,
                          epochs=3, seed=SEED, make_schedule=schedule, weights=tmp_path / "w.pt")

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("step") for line in lines] == [1, 2, 3, None]
    assert lines[-1] == {"val_error": val_error, "test_error": train.error_rate(net, tiny_splits()["test"], runtime())}
    assert val_error == lines[-2]["val_error"] and val_error < 0.2
    assert steps == [3 * 4]
    saved = torch.load(tmp_path / "w.pt")
    assert all(torch.equal(saved[name], value) for name, value in net.state_dict().items())


def test_fit_on_another_rank_trains_without_reporting_or_saving(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train.Runtime, "distribute", lambda self, net: net)  # no process group in-process
    result = train.fit(runtime(1, 2), nn.Linear(2, 2), tiny_splits(), lambda p: torch.optim.SGD(p, lr=0.1),
                       batch_size=16, epochs=1, seed=SEED, weights=tmp_path / "w.pt")

    assert result is None and capsys.readouterr().out == "" and not (tmp_path / "w.pt").exists()


def test_fit_rejects_fewer_than_one_epoch() -> None:
    with pytest.raises(ValueError, match="epochs must be at least 1, got 0"):
        train.fit(runtime(), nn.Linear(2, 2), tiny_splits(), lambda p: torch.optim.SGD(p, lr=0.1),
                  batch_size=16, epochs=0, seed=SEED)


def test_choose_names_what_and_the_choices_of_a_bad_name() -> None:
    assert train.choose({"sgd": 1, "adam": 2}, "adam", "optimizer") == 2
    with pytest.raises(ValueError, match=r"optimizer 'lbfgs' is not one of \['adam', 'sgd'\]"):
        train.choose({"sgd": 1, "adam": 2}, "lbfgs", "optimizer")


def test_datasets_share_the_arrays_and_map_only_the_inputs() -> None:
    pixels, labels = np.arange(12, dtype=np.float64).reshape(3, 4), np.array([0, 1, 2])

    plain = train.datasets({"train": (pixels, labels)})["train"]
    mapped = train.datasets({"val": (pixels, labels)}, inputs=lambda x: x.float().view(-1, 1, 2, 2))["val"]

    assert plain.tensors[0].data_ptr() == torch.from_numpy(pixels).data_ptr()
    assert mapped.tensors[0].shape == (3, 1, 2, 2) and mapped.tensors[0].dtype == torch.float32
    assert torch.equal(mapped.tensors[1], torch.tensor([0, 1, 2]))


def test_setup_alone_is_rank_0_of_1_and_seeds_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    here = train.setup(seed=11)
    drawn = torch.rand(3)

    assert (here.rank, here.world_size, here.is_main, here.distributed) == (0, 1, True, False)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(11)))
    net = nn.Linear(2, 2)
    assert here.distribute(net) is net


def test_run_propagates_an_exception_of_main(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def failing(runtime: train.Runtime) -> None:
        raise RuntimeError(f"rank {runtime.rank} failed")

    with pytest.raises(RuntimeError, match="rank 0 failed"):
        train.run(failing, seed=0)


def script_env() -> dict[str, str]:
    """A trial's environment: hpo importable, CPU only, one thread, no inherited rank."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


FINISH_SCRIPT = """\
import atexit, threading, time
from hpo import train

def main(runtime):
    atexit.register(print, "atexit handler ran", flush=True)
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
    print("unflushed output", end="")

train.run(main, seed=0)
print("after run")
"""

BARRIER_SCRIPT = """\
import atexit, os, time
from pathlib import Path
from hpo import train

def main(runtime):
    if runtime.rank == 0:
        time.sleep(1.0)
        Path("rank0-done").touch()
    else:
        atexit.register(lambda: print("rank 1 leaves; rank 0 done:", Path("rank0-done").exists(), flush=True))

train.run(main, seed=0)
"""


def test_finish_exits_0_like_a_normal_exit_without_running_past_it(tmp_path: Path) -> None:
    (tmp_path / "finish.py").write_text(FINISH_SCRIPT)

    done = subprocess.run([sys.executable, "finish.py"], cwd=tmp_path, env=script_env(), capture_output=True,
                          text=True, timeout=120, check=False)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == ["unflushed outputthread finished", "atexit handler ran"]


def test_no_rank_leaves_before_every_rank_finished(tmp_path: Path) -> None:
    (tmp_path / "barrier.py").write_text(BARRIER_SCRIPT)

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "barrier.py"], cwd=tmp_path, env=script_env(), capture_output=True, text=True,
                          timeout=180, check=False)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 leaves; rank 0 done: True" in done.stdout
