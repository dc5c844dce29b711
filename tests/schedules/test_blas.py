"""MatmulToBLAS (relaxgrad/schedules/blas.py): large float32 matmuls as OpenBLAS calls, with
transposes folded into sgemm's flags and batches looped or stacked."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import blas

pytestmark = pytest.mark.skipif(not blas.available(), reason="no OpenBLAS sgemm found")

# (a shape, b shape, transpose a, transpose b): every operand either batched like the result
# or 2-D.
CASES = [
    ((128, 96), (96, 160), False, False),
    ((96, 128), (96, 160), True, False),
    ((128, 96), (160, 96), False, True),
    ((96, 128), (160, 96), True, True),
    ((4, 64, 96), (96, 80), False, False),  # stacked rows of a
    ((64, 96), (4, 96, 80), False, False),  # a broadcast over b's batch
    ((4, 96, 64), (96, 80), True, False),
    ((2, 3, 64, 96), (2, 3, 80, 96), False, True),  # attention's q @ k^T
]


def _module(a_shape, b_shape, trans_a, trans_b) -> tvm.IRModule:
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))

    def swap(t, ndim):
        return op.permute_dims(t, [*range(ndim - 2), ndim - 1, ndim - 2])

    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            lhs = bb.emit(swap(a, len(a_shape))) if trans_a else a
            rhs = bb.emit(swap(b, len(b_shape))) if trans_b else b
            out = bb.emit_output(op.matmul(lhs, rhs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", CASES)
def test_matmul_matches_numpy(a_shape, b_shape, trans_a, trans_b):
    mod = _module(a_shape, b_shape, trans_a, trans_b)
    rewritten = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert blas.PACKED_FUNC in rewritten and "permute_dims" not in rewritten
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
    executable = relaxgrad.compile(mod)
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](
        tvm.runtime.tensor(a), tvm.runtime.tensor(b)
    ).numpy()
    lhs = np.swapaxes(a, -1, -2) if trans_a else a
    rhs = np.swapaxes(b, -1, -2) if trans_b else b
    np.testing.assert_allclose(got, lhs @ rhs, rtol=1e-4, atol=1e-4)


def test_default_permutation_is_a_transpose():
    """``permute_dims(w)`` without axes (a dense layer's ``x @ w.T``) reverses the axes."""
    x = relax.Var("x", relax.TensorType((128, 96), "float32"))
    w = relax.Var("w", relax.TensorType((160, 96), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(op.matmul(x, op.permute_dims(w)))
        bb.emit_func_output(out)
    rewritten = blas.MatmulToBLAS()(bb.get()).script()
    assert blas.PACKED_FUNC in rewritten and "permute_dims" not in rewritten


def test_small_and_broadcast_batch_matmuls_stay_in_tvm():
    small = _module((8, 16), (16, 8), False, False)
    assert blas.PACKED_FUNC not in blas.MatmulToBLAS()(small).script()
    broadcast = _module((1, 64, 96), (4, 96, 80), False, False)
    assert blas.PACKED_FUNC not in blas.MatmulToBLAS(min_macs=0)(broadcast).script()


def test_split_over_threads(monkeypatch):
    """Rows, or batches, split over the thread pool give the same result."""
    if blas._POOL is None:
        pytest.skip("one thread")
    monkeypatch.setattr(blas, "_SPLIT_MACS", 0)
    rng = np.random.default_rng(1)
    for a_shape, b_shape in (((97, 33), (33, 41)), ((5, 17, 33), (5, 33, 41))):
        a, b = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
        out = tvm.runtime.tensor(np.zeros((*a_shape[:-1], b_shape[-1]), "float32"))
        blas._matmul(tvm.runtime.tensor(a), tvm.runtime.tensor(b), 0, 0, out)
        np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)
