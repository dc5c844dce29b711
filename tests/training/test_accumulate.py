"""Gradient accumulation: Trainer(..., accumulate=k) steps as one Trainer on the whole batch."""

import numpy as np
import pytest
import tvm

from relaxgrad.training import SGD, Adam, CrossEntropyLoss, MSELoss, Trainer, mlp
from relaxgrad.training.accumulate import split_batch


def _pair(k, micro, optimizer, loss=None, dtype="float64"):
    loss = loss or CrossEntropyLoss()
    small = mlp(batch_size=micro, in_features=6, hidden=(8,), num_classes=3, dtype=dtype)
    big = mlp(batch_size=micro * k, in_features=6, hidden=(8,), num_classes=3, dtype=dtype)
    acc = Trainer(small.mod, small.params, loss, optimizer(), accumulate=k)
    ref = Trainer(big.mod, big.params, loss, optimizer())
    return acc, ref


@pytest.mark.parametrize("optimizer", [lambda: SGD(0.1), lambda: Adam(0.01)], ids=["sgd", "adam"])
def test_accumulated_steps_equal_steps_on_the_whole_batch(optimizer):
    acc, ref = _pair(3, 4, optimizer)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((12, 6))
        y = rng.integers(0, 3, 12)
        assert np.isclose(acc.step(x, y), ref.step(x, y), rtol=1e-12)
    for name, value in ref.params.items():
        np.testing.assert_allclose(acc.params[name], value, rtol=1e-10, atol=1e-12)


def test_accumulated_gradients_equal_finite_differences_of_the_batch_loss():
    acc, ref = _pair(2, 3, lambda: SGD(0.1), loss=MSELoss())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 6))
    y = rng.standard_normal((6, 3))
    loss, grads = acc.gradients(x, y)
    ref_loss, ref_grads = ref.gradients(x, y)
    assert np.isclose(loss, ref_loss, rtol=1e-12)
    name = "fc0_bias"
    np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-10)
    # finite differences of the whole-batch loss (float64, compiled model)
    base = ref.params
    eps = 1e-6
    fd = np.zeros_like(base[name])
    for i in range(len(fd)):
        moved = []
        for sign in (1, -1):
            values = {n: v.copy() for n, v in base.items()}
            values[name][i] += sign * eps
            ref._params = [tvm.runtime.tensor(values[n], ref.device) for n in ref.param_names]
            moved.append(ref.gradients(x, y)[0])
        fd[i] = (moved[0] - moved[1]) / (2 * eps)
    np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-9)


def test_fit_takes_batches_of_k_micro_batches():
    acc, ref = _pair(2, 4, lambda: SGD(0.05))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((24, 6))
    y = rng.integers(0, 3, 24)
    a = acc.fit(x, y, epochs=2, seed=0, progress=False)
    b = ref.fit(x, y, epochs=2, seed=0, progress=False)
    assert len(a) == len(b) == 6
    np.testing.assert_allclose(a, b, rtol=1e-10)
    with pytest.raises(ValueError, match="accumulate=2"):
        acc.fit(x, y, batch_size=4, progress=False)


def test_accumulate_errors():
    model = mlp(batch_size=4, in_features=6, hidden=(8,), num_classes=3)
    with pytest.raises(ValueError, match="positive int"):
        Trainer(model.mod, model.params, CrossEntropyLoss(), SGD(0.1), accumulate=0)
    with pytest.raises(ValueError, match="equal micro-batches"):
        split_batch(np.zeros((7, 6)), np.zeros(7), 2)


def test_symbolic_batch_takes_unequal_micro_batches():
    model = mlp(batch_size="n", in_features=6, hidden=(8,), num_classes=3, dtype="float64")
    acc = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(0.01), accumulate=3)
    ref = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(0.01))
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((10, 6)), rng.integers(0, 3, 10)  # micro-batches of 3, 4, 3
    assert [len(t) for _, t in split_batch(x, y, 3, equal=False)] == [3, 4, 3]
    for _ in range(2):
        assert np.isclose(acc.step(x, y), ref.step(x, y), rtol=1e-12)
    for name, value in ref.params.items():
        np.testing.assert_allclose(acc.params[name], value, rtol=1e-10, atol=1e-12)
    # fit: the last partial batch of an epoch is cut too
    a = acc.fit(x, y, epochs=1, batch_size=4, shuffle=False, progress=False)
    b = ref.fit(x, y, epochs=1, batch_size=4, shuffle=False, progress=False)
    np.testing.assert_allclose(a, b, rtol=1e-10)
