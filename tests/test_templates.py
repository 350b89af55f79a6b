"""The trial templates, rendered as the engine renders them and run for real on tiny data.

Each template is rendered with Jinja2 (StrictUndefined) into a fresh folder and run as a
subprocess on the CPU: plainly (one process) or under ``torch.distributed.run`` with 2
gloo processes: the digits MLP both ways, the Wide ResNet (2 GPUs per trial in its
scenario) under torchrun, the others plainly; test_ddp_equivalence.py runs the digits CNN
both ways. No run is retried: a rank that aborts at exit fails its test. MNIST and
CIFAR-10 read small synthetic files written in the real formats by :mod:`hpo.data`'s
writers.
"""
from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
from conftest import run_torch_job

from hpo.data import CIFAR10_FOLDER, write_cifar10_batches, write_mnist_idx
from hpo.results import Metrics, parse_text

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = REPO_ROOT / "templates"
RUN_TIMEOUT_S = 180
SEED = 0

DIGITS_CNN = {"nb_filters": 16, "conv_size": 3, "dropout": 0.1, "lr": 0.05,
              "optimizer": "sgd", "batch_size": 32, "epochs": 1}
MNIST_CNN = {"nb_filters": 4, "kernel_size": 3, "pool_size": 2, "dropout1": 0.25,
             "dropout2": 0.5, "lr": 1.0, "optimizer": "adadelta", "batch_size": 32,
             "epochs": 1, "max_train_samples": 96}
CIFAR10_CNN = {"nb_filters": 4, "dropout1": 0.25, "dropout2": 0.5, "lr": 1e-3,
               "optimizer": "rmsprop", "batch_size": 32, "epochs": 1, "max_train_samples": 64}
CIFAR10_WRN = {"depth": 10, "widen_factor": 1, "dropout": 0.3, "lr": 0.1, "momentum": 0.9,
               "weight_decay": 5e-4, "batch_size": 32, "epochs": 1, "max_train_samples": 64}
TEMPLATE_PARAMS = {
    "digits_cnn.py.j2": DIGITS_CNN,
    "mnist_cnn.py.j2": MNIST_CNN,
    "cifar10_cnn.py.j2": CIFAR10_CNN,
    "cifar10_wrn.py.j2": CIFAR10_WRN,
}
OPTIONAL = {"batch_size", "epochs", "max_train_samples"}


def render(template: str, folder: Path, data_dir: Path | None = None, **params: Any) -> Path:
    """Render ``templates/<template>`` into ``folder`` as the engine does; return the script."""
    context: dict[str, Any] = {**params, "trial_number": 7, "trial_dir": str(folder),
                               "seed": SEED}
    if data_dir is not None:
        context["data_dir"] = str(data_dir)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.from_string((TEMPLATES / template).read_text()).render(context)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / template.removesuffix(".j2")
    script.write_text(text)
    return script


def trial_env() -> dict[str, str]:
    """A trial's environment: hpo importable, CPU only, one thread, no inherited rank."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in its folder: plainly for one process, else under torchrun (gloo)."""
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])
    return run_torch_job([sys.executable, *launcher, script.name, *args], cwd=script.parent,
                         env=trial_env(), timeout=RUN_TIMEOUT_S)


def run_trial(script: Path, nproc: int, epochs: int, *args: str) -> Metrics:
    """Run a trial to the end and check its contract: exit 0, one report per epoch, final
    val_error and test_error in [0, 1], weights saved to ``model.pt``."""
    done = launch(script, nproc, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = parse_text(done.stdout, "val_error")
    assert [step for step, _ in metrics.intermediate] == list(range(1, epochs + 1))
    assert all(0.0 <= values["val_error"] <= 1.0 for _, values in metrics.intermediate)
    assert set(metrics.final) == {"val_error", "test_error"}
    assert all(0.0 <= value <= 1.0 for value in metrics.final.values())
    assert (script.parent / "model.pt").is_file()
    return metrics


def _learnable_images(rng: np.random.Generator, labels: np.ndarray,
                      shape: tuple[int, ...]) -> np.ndarray:
    """Noise with a bright band whose position encodes the label."""
    images = rng.integers(0, 64, size=(len(labels), *shape), dtype=np.uint8)
    for image, label in zip(images, labels):
        image[..., 2 * label:2 * label + 4, 4:-4] = 255
    return images


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MNIST in the real IDX format: 240 training and 40 test images, gzipped."""
    folder = tmp_path_factory.mktemp("mnist")
    rng = np.random.default_rng(0)
    for train, count in ((True, 240), (False, 40)):
        labels = rng.integers(0, 10, count)
        write_mnist_idx(folder, _learnable_images(rng, labels, (28, 28)), labels, train=train,
                        compress=True)
    return folder


@pytest.fixture(scope="module")
def cifar10_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CIFAR-10 in the real python-batch format: 200 training and 40 test images.

    Returns the parent of ``cifar-10-batches-py``, as a scenario's ``data_dir`` would be.
    """
    folder = tmp_path_factory.mktemp("cifar10")
    rng = np.random.default_rng(1)
    for train, count in ((True, 200), (False, 40)):
        labels = rng.integers(0, 10, count)
        write_cifar10_batches(folder / CIFAR10_FOLDER, _learnable_images(rng, labels, (3, 32, 32)),
                              labels, train=train)
    return folder


@pytest.mark.parametrize("template", sorted(TEMPLATE_PARAMS))
def test_templates_render_to_python_with_every_documented_variable(template: str,
                                                                   tmp_path: Path) -> None:
    script = render(template, tmp_path, data_dir=tmp_path, **TEMPLATE_PARAMS[template])

    compile(script.read_text(), str(script), "exec")


@pytest.mark.parametrize("template", sorted(TEMPLATE_PARAMS))
def test_only_the_budget_variables_are_optional(template: str, tmp_path: Path) -> None:
    params = TEMPLATE_PARAMS[template]
    required = {name: value for name, value in params.items() if name not in OPTIONAL}
    render(template, tmp_path, data_dir=tmp_path, **required)
    for name in required:
        with pytest.raises(jinja2.UndefinedError, match=f"'{name}' is undefined"):
            render(template, tmp_path, data_dir=tmp_path,
                   **{key: value for key, value in required.items() if key != name})


@pytest.mark.parametrize("template", ["mnist_cnn.py.j2", "cifar10_cnn.py.j2", "cifar10_wrn.py.j2"])
def test_data_templates_need_the_scenario_data_dir(template: str, tmp_path: Path) -> None:
    with pytest.raises(jinja2.UndefinedError, match="'data_dir' is undefined"):
        render(template, tmp_path, **TEMPLATE_PARAMS[template])


def test_digits_cnn_learns_in_a_few_epochs(tmp_path: Path) -> None:
    script = render("digits_cnn.py.j2", tmp_path, **{**DIGITS_CNN, "epochs": 8})

    metrics = run_trial(script, nproc=1, epochs=8)

    assert metrics.final["val_error"] < 0.1


def test_a_copied_trial_folder_writes_its_outputs_into_itself(tmp_path: Path) -> None:
    script = render("digits_cnn.py.j2", tmp_path / "trial", **DIGITS_CNN)
    copy = Path(shutil.copytree(script.parent, tmp_path / "best-trial"))

    run_trial(copy / script.name, nproc=1, epochs=1)

    assert (copy / "model.pt").is_file()
    assert not (script.parent / "model.pt").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_digits_mlp_reads_its_flags(tmp_path: Path, nproc: int) -> None:
    script = Path(shutil.copy(TEMPLATES / "digits_mlp_flags.py", tmp_path))

    run_trial(script, nproc, 2, "--lr", "0.01", "--hidden", "32", "--dropout", "0.2",
              "--epochs", "2", "--batch_size", "32", "--optimizer", "adam")


def test_digits_mlp_rejects_an_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    flags_script = runpy.run_path(str(TEMPLATES / "digits_mlp_flags.py"), run_name="flags")

    with pytest.raises(SystemExit) as caught:
        flags_script["parse_args"](["--lr", "0.1", "--learning_rate", "0.1"])

    assert caught.value.code == 2
    assert "unrecognized arguments: --learning_rate" in capsys.readouterr().err


def test_mnist_cnn(tmp_path: Path, mnist_dir: Path) -> None:
    script = render("mnist_cnn.py.j2", tmp_path, data_dir=mnist_dir, **MNIST_CNN)

    run_trial(script, nproc=1, epochs=1)


def test_mnist_cnn_without_data_names_the_missing_files(tmp_path: Path) -> None:
    script = render("mnist_cnn.py.j2", tmp_path, data_dir=tmp_path / "data", **MNIST_CNN)

    done = launch(script, 1)

    assert done.returncode != 0
    assert "MNIST data not found in " in done.stderr and "(missing: train-images-idx3-ubyte, " in done.stderr


def test_cifar10_cnn(tmp_path: Path, cifar10_dir: Path) -> None:
    script = render("cifar10_cnn.py.j2", tmp_path, data_dir=cifar10_dir, **CIFAR10_CNN)

    run_trial(script, nproc=1, epochs=1)


def test_cifar10_wrn_under_torchrun(tmp_path: Path, cifar10_dir: Path) -> None:
    script = render("cifar10_wrn.py.j2", tmp_path, data_dir=cifar10_dir / CIFAR10_FOLDER,
                    **CIFAR10_WRN)

    run_trial(script, nproc=2, epochs=1)
