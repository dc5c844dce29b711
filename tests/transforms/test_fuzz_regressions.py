"""Minimal reproducers of failures found by the fuzzer (``test_fuzz.py``, ``bench/fuzz.py``).

Each test is the shrunk program of one distinct failure. Those still failing are marked
``xfail(strict=True)``: when the bug is fixed the test flips to a failure, so remove the mark
(and the matching tag from ``fuzz_programs.FOUND_BUGS``, so the fuzzer generates it again).
"""

import numpy as np
import pytest
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.testing import FAST_LLVM, check_gradients, loss_module


def _check(fn, shapes, inputs=None, wrt=None):
    mod = loss_module(fn, [relax.TensorType(s, "float64") for s in shapes])
    result = check_gradients(mod, inputs=inputs, wrt=wrt, target=FAST_LLVM)
    assert result.ok, str(result)


def _const(x, dtype="float64"):
    return relax.const(np.asarray(x, dtype), dtype)


def test_split_into_one_section():
    # main(x0: (2, 3)): v = R.split(x0, indices_or_sections=1, axis=0)  -> R.Tensor((2, 3))
    _check(lambda x: op.split(x, 1, 0), [(2, 3)])


# Fixed by 3db391d (the rule returned a (1, C) partial for data of shape (N, C)).
def test_batch_norm_moving_mean_field():
    def fn(x, gamma, beta, mean, var):
        var = op.add(op.sigmoid(var), _const(0.5))
        return relax.TupleGetItem(op.nn.batch_norm(x, gamma, beta, mean, var, 1), 1)

    _check(fn, [(4, 3), (3,), (3,), (3,), (3,)])


@pytest.mark.parametrize("reduction", ["update", "add", "max"])
def test_scatter_elements_indices_smaller_off_axis(reduction):
    # data (2, 2, 2), indices (2, 1, 2) = [[[1, 1]], [[1, 0]]] along axis 2, updates (2, 1, 2)
    idx = _const([[[1, 1]], [[1, 0]]], "int64")
    # TVM 0.27's kernel computes a wrong forward here: the rule refuses, naming the op
    with pytest.raises(relaxgrad.GradientError, match="scatter_elements.*axis 1"):
        _check(lambda x, u: op.scatter_elements(x, idx, u, 2, reduction),
               [(2, 2, 2), (2, 1, 2)])


def test_max_pool2d_overlapping_windows():
    # distinct values (no ties), so the loss is differentiable
    x = np.arange(8.0).reshape(1, 1, 4, 2)[:, :, ::-1] * 0.1  # rows 3, 2, 1, 0
    _check(lambda v: op.nn.max_pool2d(v, 2, 1), [x.shape], inputs=[x.copy()])
    y = np.random.default_rng(0).permutation(10).reshape(1, 1, 5, 2) * 0.1
    _check(lambda v: op.nn.max_pool2d(v, 2, 1), [y.shape], inputs=[y])


def test_avg_pool2d_ceil_mode_count_include_pad():
    _check(lambda v: op.nn.avg_pool2d(v, 2, 2, 0, ceil_mode=True, count_include_pad=True),
           [(1, 1, 3, 3)])
