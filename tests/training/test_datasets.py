"""The digits split and the minibatch order."""

import subprocess
import sys

import numpy as np
import pytest

from relaxgrad.training import datasets, load_digits, minibatches


def test_digits_split_is_deterministic_and_normalized():
    a, b = load_digits(seed=0), load_digits(seed=0)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_train, load_digits(seed=1).y_train)
    assert a.x_train.shape == (1438, 64) and a.x_test.shape == (359, 64)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert abs(a.x_train.mean()) < 1e-5 and abs(a.x_train.std() - 1) < 1e-5
    assert a.num_classes == 10 and set(a.y_test) == set(range(10))


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    from sklearn.datasets import load_digits as sklearn_digits

    expected = sklearn_digits()
    x, y = datasets._digits()
    np.testing.assert_array_equal(x, expected.data)
    np.testing.assert_array_equal(y, expected.target)
    assert x.dtype == np.float64 and y.dtype == np.int64
    # the split is that of scikit-learn's arrays
    order = np.random.default_rng(0).permutation(len(y))[359:]  # 20% test
    mean, std = expected.data[order].mean(), expected.data[order].std()
    np.testing.assert_array_equal(load_digits().x_train,
                                  ((expected.data[order] - mean) / std).astype("float32"))
    # a process that loads the digits does not import scikit-learn
    code = ("import sys; from relaxgrad.training import load_digits; load_digits(); "
            "print('sklearn' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-2000:]
    # where the file is not where scikit-learn keeps it: through scikit-learn
    monkeypatch.setattr(datasets.os.path, "isfile", lambda path: False)
    x2, y2 = datasets._digits()
    np.testing.assert_array_equal(x2, expected.data)
    np.testing.assert_array_equal(y2, expected.target)


def test_digits_images():
    split = load_digits(image=True, dtype="float64", test_fraction=0.5)
    assert split.x_train.shape == (899, 1, 8, 8) and split.x_test.shape == (898, 1, 8, 8)
    assert split.x_test.dtype == np.float64
    flat = load_digits(dtype="float64", test_fraction=0.5)
    np.testing.assert_array_equal(split.x_train.reshape(-1, 64), flat.x_train)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.0)


def test_minibatches():
    rng = np.random.default_rng(0)
    batches = minibatches(10, 3, rng)
    assert [len(b) for b in batches] == [3, 3, 3]  # the incomplete last batch is dropped
    assert len(set(np.concatenate(batches))) == 9
    np.testing.assert_array_equal(batches[0], np.random.default_rng(0).permutation(10)[:3])
    np.testing.assert_array_equal(minibatches(4, 2)[1], [2, 3])
    with pytest.raises(ValueError, match="batch_size"):
        minibatches(4, 5)
