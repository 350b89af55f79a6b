"""Round trips of the MNIST and CIFAR-10 writers and readers in the real file formats."""
from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env

from hpo import data
from hpo.data import (
    CIFAR10_FOLDER,
    MNIST_FILES,
    hold_out,
    load_cifar10,
    load_digits_splits,
    load_mnist,
    read_idx,
    train_val_test,
    write_cifar10_batches,
    write_mnist_idx,
)
from hpo.errors import InputError


def _images(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_round_trip(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(0)
    train_x, train_y = _images(rng, (7, 28, 28)), rng.integers(0, 10, 7)
    test_x, test_y = _images(rng, (3, 28, 28)), rng.integers(0, 10, 3)
    write_mnist_idx(tmp_path, train_x, train_y, train=True, compress=compress)
    write_mnist_idx(tmp_path, test_x, test_y, train=False, compress=compress)

    (got_train_x, got_train_y), (got_test_x, got_test_y) = load_mnist(tmp_path)

    np.testing.assert_array_equal(got_train_x, train_x)
    np.testing.assert_array_equal(got_train_y, train_y)
    np.testing.assert_array_equal(got_test_x, test_x)
    np.testing.assert_array_equal(got_test_y, test_y)
    assert got_train_x.dtype == np.uint8 and got_train_y.dtype == np.int64
    assert got_test_x.flags.writeable, "torch.from_numpy warns on read-only arrays"


def test_idx_header_is_the_published_layout(tmp_path: Path) -> None:
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    write_mnist_idx(tmp_path, images, np.array([3, 4]), train=True)

    raw = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    labels = (tmp_path / "train-labels-idx1-ubyte").read_bytes()

    assert raw[:16] == bytes.fromhex("00000803" "00000002" "0000001c" "0000001c")
    assert raw[16:] == images.tobytes()
    assert labels == bytes.fromhex("00000801" "00000002" "0304")


def test_mnist_accepts_a_mix_of_plain_and_gzipped_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    write_mnist_idx(tmp_path, _images(rng, (2, 28, 28)), [0, 1], train=True, compress=True)
    write_mnist_idx(tmp_path, _images(rng, (2, 28, 28)), [2, 3], train=False)

    (_, train_y), (_, test_y) = load_mnist(tmp_path)

    assert train_y.tolist() == [0, 1] and test_y.tolist() == [2, 3]


def test_missing_mnist_names_the_files_and_the_folder(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path, np.zeros((1, 28, 28), np.uint8), [0], train=True)

    with pytest.raises(InputError) as caught:
        load_mnist(tmp_path)

    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"MNIST data not found in {tmp_path}: download the four MNIST files ")
    assert message.endswith("gzipped or not (missing: t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte)")


def test_missing_mnist_folder_lists_every_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="MNIST data not found") as caught:
        load_mnist(tmp_path / "nowhere")

    assert all(name in str(caught.value) for name in MNIST_FILES)


def test_a_file_that_is_not_idx_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as stream:
        stream.write(b"<html>not found</html>")

    with pytest.raises(InputError, match="bad magic number"):
        read_idx(path)


def test_a_gz_file_that_is_not_gzip_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(bytes.fromhex("00000801" "00000001" "07"))

    with pytest.raises(InputError, match="cannot read .*t10k-labels-idx1-ubyte.gz"):
        read_idx(path)


def test_a_truncated_idx_file_is_bad_input(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path, np.zeros((2, 28, 28), np.uint8), [0, 1], train=True)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-5])

    with pytest.raises(InputError, match="says 1568"):
        read_idx(path)


def _write_cifar10(directory: Path, n_train: int, n_test: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(2)
    train_x, train_y = _images(rng, (n_train, 3, 32, 32)), rng.integers(0, 10, n_train)
    test_x, test_y = _images(rng, (n_test, 3, 32, 32)), rng.integers(0, 10, n_test)
    write_cifar10_batches(directory, train_x, train_y, train=True)
    write_cifar10_batches(directory, test_x, test_y, train=False)
    return train_x, train_y, test_x, test_y


@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_cifar10_round_trip(tmp_path: Path, point_at: str) -> None:
    folder = tmp_path / CIFAR10_FOLDER
    train_x, train_y, test_x, test_y = _write_cifar10(folder, n_train=12, n_test=4)

    data_dir = folder if point_at == "folder" else tmp_path
    (got_train_x, got_train_y), (got_test_x, got_test_y) = load_cifar10(data_dir)

    np.testing.assert_array_equal(got_train_x, train_x)
    np.testing.assert_array_equal(got_train_y, train_y)
    np.testing.assert_array_equal(got_test_x, test_x)
    np.testing.assert_array_equal(got_test_y, test_y)
    assert got_train_y.dtype == np.int64


def test_cifar10_batches_are_the_published_layout(tmp_path: Path) -> None:
    images = np.zeros((10, 3, 32, 32), np.uint8)
    images[:, 1] = 7
    write_cifar10_batches(tmp_path, images, np.arange(10), train=True)

    with (tmp_path / "data_batch_2").open("rb") as stream:
        batch = pickle.load(stream, encoding="bytes")

    assert batch[b"labels"] == [2, 3]
    assert batch[b"data"].shape == (2, 3072) and batch[b"data"].dtype == np.uint8
    assert (batch[b"data"][:, 1024:2048] == 7).all() and (batch[b"data"][:, :1024] == 0).all()


def test_missing_cifar10_names_the_files_and_the_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        load_cifar10(tmp_path)

    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"CIFAR-10 data not found in {tmp_path}: download the CIFAR-10 python version and "
                              f"extract its {CIFAR10_FOLDER} folder there")  # the fix first: a trial's reason is cut
    assert message.endswith("(missing: data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch)")


def test_a_cifar10_batch_that_pickles_other_objects_is_refused(tmp_path: Path) -> None:
    _write_cifar10(tmp_path, n_train=5, n_test=1)
    with (tmp_path / "test_batch").open("wb") as stream:
        pickle.dump({b"data": Path("x"), b"labels": [0]}, stream)

    with pytest.raises(InputError, match="test_batch is not a CIFAR-10 python batch"):
        load_cifar10(tmp_path)


def test_hold_out_is_fixed_by_its_seed_disjoint_and_limited() -> None:
    images, labels = np.arange(100).reshape(100, 1), np.arange(100)
    (train_x, train_y), (val_x, val_y) = hold_out((images, labels), 0.2, seed=3)
    assert len(val_y) == 20 and len(train_y) == 80
    assert set(train_y).isdisjoint(val_y) and set(train_y) | set(val_y) == set(range(100))
    assert (train_x[:, 0] == train_y).all() and (val_x[:, 0] == val_y).all()
    (_, again_val) = hold_out((images, labels), 0.2, seed=3)[1]
    assert (again_val == val_y).all()
    (_, limited_y), (_, same_val) = hold_out((images, labels), 0.2, seed=3, limit=10)
    assert len(limited_y) == 10 and set(limited_y) <= set(train_y) and (same_val == val_y).all()


def test_train_val_test_holds_val_out_of_training_and_keeps_the_test_split() -> None:
    images, labels = np.arange(100).reshape(100, 1), np.arange(100)
    test = (np.zeros((7, 1)), np.zeros(7, dtype=np.int64))

    splits = train_val_test(((images, labels), test), 0.2, seed=3, limit=50)

    assert list(splits) == ["train", "val", "test"]
    (_, train_y), (_, val_y) = hold_out((images, labels), 0.2, seed=3, limit=50)
    assert (splits["train"][1] == train_y).all() and (splits["val"][1] == val_y).all()
    assert splits["test"] is test


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """hpo's cache folder, empty, in this test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hpo"


def test_digits_splits_are_stratified_fixed_by_their_seed_and_int64(cache: Path) -> None:
    splits = load_digits_splits()

    assert {name: len(y) for name, (_, y) in splits.items()} == {"train": 1149, "val": 288, "test": 360}
    for x, y in splits.values():
        assert x.shape == (len(y), 64) and y.dtype == np.int64
        assert np.bincount(y, minlength=10).min() >= 0.09 * len(y)
    again = load_digits_splits()
    assert all((again[name][0] == x).all() for name, (x, _) in splits.items())
    assert not (load_digits_splits(seed=1)["test"][0] == splits["test"][0]).all()


def _same(a: dict[str, tuple[np.ndarray, np.ndarray]], b: dict[str, tuple[np.ndarray, np.ndarray]]) -> bool:
    return list(a) == list(b) and all(
        x.dtype == bx.dtype and y.dtype == by.dtype and (x == bx).all() and (y == by).all()
        for (x, y), (bx, by) in zip(a.values(), b.values()))


def test_digits_splits_are_made_once_then_loaded_from_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    made = load_digits_splits(seed=2)
    assert [path.name for path in cache.iterdir()] == [data._digits_cache(2).name]

    def not_again(seed: int) -> None:
        raise AssertionError("made again despite the cache")

    monkeypatch.setattr(data, "_digits_splits", not_again)
    assert _same(load_digits_splits(seed=2), made)


def test_cached_digits_splits_equal_the_ones_scikit_learn_makes(cache: Path) -> None:
    load_digits_splits(seed=3)
    assert _same(load_digits_splits(seed=3), data._digits_splits(3))


def test_a_trial_process_loads_cached_digits_without_importing_scikit_learn(cache: Path) -> None:
    load_digits_splits()
    code = "import sys; from hpo.data import load_digits_splits; load_digits_splits(); print('sklearn' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=cli_env())
    assert ran.stdout.strip() == "False"


def test_an_unreadable_cached_file_is_made_again(cache: Path) -> None:
    made = load_digits_splits()
    path = data._digits_cache(0)
    path.write_bytes(path.read_bytes()[:1000])
    assert _same(load_digits_splits(), made)
    assert _same(data._read_splits(path), made)


def test_a_cache_folder_that_cannot_be_written_still_gives_the_splits(cache: Path) -> None:
    cache.parent.mkdir()
    cache.write_text("a file where the folder would be")
    assert _same(load_digits_splits(), data._digits_splits(0))
    assert cache.read_text() == "a file where the folder would be"
