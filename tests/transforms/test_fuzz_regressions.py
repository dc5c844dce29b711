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
from relaxgrad.testing import check_gradients, loss_module

FAST_LLVM = {"kind": "llvm", "opt-level": 0}


def _check(fn, shapes, inputs=None, wrt=None):
    mod = loss_module(fn, [relax.TensorType(s, "float64") for s in shapes])
    result = check_gradients(mod, inputs=inputs, wrt=wrt, target=FAST_LLVM)
    assert result.ok, str(result)


def _const(x, dtype="float64"):
    return relax.const(np.asarray(x, dtype), dtype)


@pytest.mark.xfail(strict=True, reason="split into 1 section: TVM types the result as a Tensor "
                   "(not a 1-tuple), the split rule concats it: TypeError 'relax.concat expects "
                   "the input to be a Tuple of Tensors'")
def test_split_into_one_section():
    # main(x0: (2, 3)): v = R.split(x0, indices_or_sections=1, axis=0)  -> R.Tensor((2, 3))
    _check(lambda x: op.split(x, 1, 0), [(2, 3)])


@pytest.mark.xfail(strict=True, reason="batch_norm's new moving mean (field 1) in training: the "
                   "rule returns a partial of shape (1, 3) for data of shape (4, 3) (GradientError "
                   "'the rule of relax.nn.batch_norm returned a partial of type ...'); also "
                   "tests/ops/test_nn.py::test_numeric[batch_norm_new_mean_only] in the working "
                   "tree")
def test_batch_norm_moving_mean_field():
    def fn(x, gamma, beta, mean, var):
        var = op.add(op.sigmoid(var), _const(0.5))
        return relax.TupleGetItem(op.nn.batch_norm(x, gamma, beta, mean, var, 1), 1)

    _check(fn, [(4, 3), (3,), (3,), (3,), (3,)])


@pytest.mark.xfail(strict=True, reason="scatter_elements with indices smaller than the data "
                   "off the scatter axis: TVM 0.27's kernel writes to the wrong positions (it "
                   "indexes the data with the indices' strides), relaxgrad's rule follows the "
                   "documented semantics, so its gradients disagree with the compiled forward "
                   "(update/add: wrong updates gradient; max/min: NaN data gradient). Fixed "
                   "means: gradients of the compiled code, or a GradientError refusal")
@pytest.mark.parametrize("reduction", ["update", "add", "max"])
def test_scatter_elements_indices_smaller_off_axis(reduction):
    # data (2, 2, 2), indices (2, 1, 2) = [[[1, 1]], [[1, 0]]] along axis 2, updates (2, 1, 2)
    idx = _const([[[1, 1]], [[1, 0]]], "int64")
    try:
        _check(lambda x, u: op.scatter_elements(x, idx, u, 2, reduction),
               [(2, 2, 2), (2, 1, 2)])
    except relaxgrad.GradientError:
        pass
