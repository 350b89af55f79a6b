"""Readers and writers for the standard MNIST and CIFAR-10 files, numpy only; the digits' splits.

Trial scripts call :func:`load_mnist` and :func:`load_cifar10` on the scenario's
``data_dir`` (nothing is ever downloaded) and :func:`train_val_test` (:func:`hold_out`) for a
validation split. Both loaders return Keras-style ``(train_images, train_labels),
(test_images, test_labels)`` with uint8 images (MNIST ``N x 28 x 28``, CIFAR-10
``N x 3 x 32 x 32``) and int64 labels. Missing or malformed files raise
:class:`~hpo.errors.InputError` with a one-line message that names the files expected and
where to put them. :func:`load_digits_splits` gives scikit-learn's 8x8 digits, which ship
with it, already split (and cached, so that trial processes need not import scikit-learn).

The writers produce the very same formats, so tests can build small synthetic data sets.
This module must stay cheap to import: trial scripts import it.
"""
from __future__ import annotations

import contextlib
import gzip
import pickle
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from hpo.errors import InputError
from hpo.files import cache_folder, replacing

Split = tuple[np.ndarray, np.ndarray]

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_IDX_UBYTE = 0x08
_MNIST_HELP = "download the four MNIST files from the MNIST site and place them there, gzipped or not"

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)  # per channel, of pixels scaled to [0, 1]

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
_CIFAR10_HELP = (f"download the CIFAR-10 python version and extract its {CIFAR10_FOLDER} "
                 "folder there, or point data_dir at that folder")
# The only globals a CIFAR-10 batch may reference: numpy array reconstruction, and the
# bytes constructor that protocol-2 pickles written by Python 3 use.
_CIFAR10_PICKLE_GLOBALS = frozenset({
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
})


def hold_out(split: Split, fraction: float, seed: int, limit: int | None = None) -> tuple[Split, Split]:
    """``split`` divided into (train, val): a random ``fraction`` of it for validation, fixed by
    ``seed`` (the split's own seed, so that every trial validates on the same examples), and the
    rest for training, at most ``limit`` examples of it when ``limit`` is given."""
    images, labels = split
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = round(fraction * len(labels))
    val, rest = order[:n_val], order[n_val:]
    if limit:
        rest = rest[:limit]
    return (images[rest], labels[rest]), (images[val], labels[val])


def train_val_test(data: tuple[Split, Split], fraction: float, seed: int, limit: int | None = None
                   ) -> dict[str, Split]:
    """Keras-style ``(training, test)`` data as ``train``, ``val`` and ``test`` splits, the
    validation split held out of the training data by :func:`hold_out`."""
    training, test = data
    train, val = hold_out(training, fraction, seed, limit)
    return {"train": train, "val": val, "test": test}


def load_digits_splits(seed: int = 0) -> dict[str, Split]:
    """scikit-learn's 8x8 digits (``N x 64`` pixels in 0..16, int64 labels) as stratified
    ``train``, ``val`` and ``test`` splits: 20 % test, held out, and 20 % of the rest for
    validation, fixed by ``seed`` (the split's own seed, whatever the hyper-parameters).

    The splits are made by scikit-learn once per seed and scikit-learn version and kept in
    hpo's cache folder (:func:`hpo.files.cache_folder`), so a trial's processes load them with
    numpy alone: importing scikit-learn took 2.5 s of each process's start on 2 cores. A
    cached file that cannot be read is made again; one that cannot be written is left out."""
    path = _digits_cache(seed)
    cached = _read_splits(path)
    if cached is not None:
        return cached
    splits = _digits_splits(seed)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as temporary:
            np.savez(temporary, **{f"{name}_{part}": array for name, split in splits.items()
                                   for part, array in zip("xy", split)})
    return splits


def _digits_splits(seed: int) -> dict[str, Split]:
    from sklearn.datasets import load_digits  # imported when first needed: scikit-learn is slow to import
    from sklearn.model_selection import train_test_split

    pixels, labels = load_digits(return_X_y=True)
    rest_x, test_x, rest_y, test_y = train_test_split(pixels, labels, test_size=0.2, stratify=labels,
                                                      random_state=seed)
    train_x, val_x, train_y, val_y = train_test_split(rest_x, rest_y, test_size=0.2, stratify=rest_y,
                                                      random_state=seed)
    return {"train": (train_x, train_y.astype(np.int64)), "val": (val_x, val_y.astype(np.int64)),
            "test": (test_x, test_y.astype(np.int64))}


def _digits_cache(seed: int) -> Path:
    """Where the digits' splits for ``seed`` under the installed scikit-learn are cached."""
    from importlib.metadata import version

    return cache_folder() / f"digits-splits-seed{seed}-sklearn{version('scikit-learn')}.npz"


def _read_splits(path: Path) -> dict[str, Split] | None:
    """The splits cached at ``path``; None if it is missing or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {name: (stored[f"{name}_x"], stored[f"{name}_y"]) for name in ("train", "val", "test")}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError):
        return None


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _find_mnist_file(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read one unsigned-byte IDX file (plain or ``.gz``) into a writable uint8 array.

    Raises InputError when the file is not an unsigned-byte IDX file or is truncated.
    """
    try:
        with _open(path) as stream:
            raw = bytearray(stream.read())
    except (OSError, EOFError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != _IDX_UBYTE:
        raise InputError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != expected:
        raise InputError(f"{path} holds {len(raw) - header} bytes of data; "
                         f"its header {shape} says {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_mnist(data_dir: str | Path) -> tuple[Split, Split]:
    """Read the four MNIST IDX files (each plain or ``.gz``) from ``data_dir``.

    Returns ``(train_images, train_labels), (test_images, test_labels)``: uint8 images of
    shape ``N x 28 x 28`` and int64 labels.
    """
    directory = Path(data_dir)
    found = {name: _find_mnist_file(directory, name) for name in MNIST_FILES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise InputError(f"MNIST data not found in {directory}: {_MNIST_HELP} (missing: {', '.join(missing)})")
    arrays = {name: read_idx(path) for name, path in found.items() if path is not None}
    splits = []
    for prefix in ("train", "t10k"):
        images = arrays[f"{prefix}-images-idx3-ubyte"]
        labels = arrays[f"{prefix}-labels-idx1-ubyte"].astype(np.int64)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise InputError(f"MNIST {prefix} files in {directory} do not match: images "
                             f"{images.shape}, labels {labels.shape}")
        splits.append((images, labels))
    return splits[0], splits[1]


def write_mnist_idx(directory: str | Path, images: np.ndarray, labels: np.ndarray,
                    train: bool, compress: bool = False) -> list[Path]:
    """Write ``images`` (uint8, N x H x W) and ``labels`` as MNIST IDX files into ``directory``.

    The files are named as MNIST's ``train-*`` (``train=True``) or ``t10k-*`` files, with
    ``.gz`` appended when ``compress``; returns their paths.
    """
    prefix = "train" if train else "t10k"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
        data = np.ascontiguousarray(array, dtype=np.uint8)
        header = bytes([0, 0, _IDX_UBYTE, data.ndim]) + np.asarray(data.shape, ">u4").tobytes()
        path = directory / f"{prefix}-{kind}{'.gz' if compress else ''}"
        with (gzip.open(path, "wb") if compress else path.open("wb")) as stream:
            stream.write(header + data.tobytes())
        paths.append(path)
    return paths


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 batches and refuses any global other than numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        """Resolve only the numpy array globals that batch files use."""
        if (module, name) not in _CIFAR10_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")
        return super().find_class(module, name)


def _read_cifar10_batch(path: Path) -> Split:
    try:
        with path.open("rb") as stream:
            batch = _BatchUnpickler(stream, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path} is not a CIFAR-10 python batch: {exc}") from exc
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise InputError(f"{path} holds data {data.shape} and labels {labels.shape}; "
                         "expected N x 3072 and N")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(data_dir: str | Path) -> tuple[Split, Split]:
    """Read CIFAR-10's python batches from ``data_dir`` or its ``cifar-10-batches-py`` folder.

    Returns ``(train_images, train_labels), (test_images, test_labels)``: uint8 images of
    shape ``N x 3 x 32 x 32`` (50,000 and 10,000 for the real set) and int64 labels.
    """
    given = Path(data_dir)
    directory = given / CIFAR10_FOLDER if (given / CIFAR10_FOLDER).is_dir() else given
    names = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise InputError(f"CIFAR-10 data not found in {directory}: {_CIFAR10_HELP} (missing: {', '.join(missing)})")
    train = [_read_cifar10_batch(directory / name) for name in CIFAR10_TRAIN_BATCHES]
    test = _read_cifar10_batch(directory / CIFAR10_TEST_BATCH)
    train_images = np.concatenate([images for images, _ in train])
    train_labels = np.concatenate([labels for _, labels in train])
    return (train_images, train_labels), test


def write_cifar10_batches(directory: str | Path, images: np.ndarray, labels: np.ndarray,
                          train: bool) -> list[Path]:
    """Write ``images`` (uint8, N x 3 x 32 x 32) and ``labels`` as CIFAR-10 python batches.

    ``train=True`` splits them over ``data_batch_1`` .. ``data_batch_5``; ``train=False``
    writes ``test_batch``. The files go into ``directory`` itself; returns their paths.
    """
    images = np.ascontiguousarray(images, dtype=np.uint8)
    if images.ndim != 4 or images.shape[1:] != (3, 32, 32) or len(images) != len(labels):
        raise ValueError(f"expected N x 3 x 32 x 32 images and N labels, got {images.shape} "
                         f"and {np.shape(labels)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = CIFAR10_TRAIN_BATCHES if train else (CIFAR10_TEST_BATCH,)
    chunks = np.array_split(np.arange(len(images)), len(names))
    paths = []
    for number, (name, rows) in enumerate(zip(names, chunks), start=1):
        batch = {
            b"batch_label": f"{'training' if train else 'testing'} batch {number}".encode(),
            b"labels": [int(label) for label in np.asarray(labels)[rows]],
            b"data": images[rows].reshape(len(rows), -1),
            b"filenames": [f"image_{row:05d}.png".encode() for row in rows],
        }
        path = directory / name
        with path.open("wb") as stream:
            pickle.dump(batch, stream, protocol=2)
        paths.append(path)
    return paths
