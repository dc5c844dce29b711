"""Data for training examples and tests: scikit-learn's 8x8 digits, split and normalized
deterministically, and the minibatch order shared by :class:`~relaxgrad.training.Trainer` and
the PyTorch comparison tests."""

from __future__ import annotations

import gzip
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

__all__ = ["Split", "load_digits", "minibatches"]


@dataclass(frozen=True)
class Split:
    """A train/test split: inputs ``x_*`` and integer labels ``y_*`` (int64)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(
    test_fraction: float = 0.2, seed: int = 0, image: bool = False, dtype: str = "float32"
) -> Split:
    """scikit-learn's ``load_digits`` (1,797 8x8 images of digits 0-9), shuffled and split.

    Pixels (0..16) are standardized with the mean and standard deviation of all training pixels
    (one scalar each, so rare pixels are not blown up). The split depends only on ``seed``.

    Parameters
    ----------
    test_fraction : float
        Fraction of the samples held out for testing.
    seed : int
        Seed of the shuffle before the split.
    image : bool
        Return inputs as ``(n, 1, 8, 8)`` NCHW images instead of ``(n, 64)`` vectors.
    dtype : str
        dtype of the inputs.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction must be in (0, 1), not {test_fraction}")
    x, y = _digits()
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = ((x - mean) / std).astype(dtype)
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return Split(x[train], y[train], x[test], y[test])


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(pixels float64 (1797, 64), labels int64)``: its data file
    read as ``sklearn.datasets.load_digits`` reads it, without importing scikit-learn (1.4 s of
    a process's start, where the demo and the tests' worker processes need only the file);
    through ``load_digits`` where the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(folders[0], "datasets", "data", "digits.csv.gz") if folders else ""
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits as sklearn_digits  # noqa: PLC0415

        digits = sklearn_digits()
        return digits.data.astype("float64"), digits.target.astype("int64")
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype("int64")


def minibatches(
    n: int, batch_size: int, rng: np.random.Generator | None = None, drop_last: bool = True
) -> list[np.ndarray]:
    """Index arrays of one epoch: ``n // batch_size`` full batches, in the order of
    ``rng.permutation(n)`` (or in order when ``rng`` is None). The last incomplete batch is
    dropped (so every batch has a model's static batch size) unless ``drop_last`` is False."""
    if batch_size <= 0 or batch_size > n:
        raise ValueError(f"minibatches: batch_size must be in [1, {n}], not {batch_size}")
    order = np.arange(n) if rng is None else rng.permutation(n)
    count = n // batch_size if drop_last else -(-n // batch_size)
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(count)]
