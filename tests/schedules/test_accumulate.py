"""WideColumnSums (relaxgrad/schedules/accumulate.py): float32 sums over the rows accumulated
in float64, exact to float32's last bit where float32 addition of the rows in turn is not;
sums along the innermost axis left alone."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import WideColumnSums


def _module(shape, summed, dtype="float32"):
    x = relax.Var("x", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(summed(x))
        bb.emit_func_output(out)
    return bb.get()


def _cancelling_rows(rows: int, columns: int) -> np.ndarray:
    """Rows of large values of both signs whose column sums are small: a bias gradient's."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, columns)) * 1e3
    x[-1] = -x[:-1].sum(0) + rng.standard_normal(columns)  # sums of order 1
    return x.astype("float32")


@pytest.mark.parametrize(
    "summed",
    [lambda x: op.collapse_sum_to(x, relax.ShapeExpr([16])), lambda x: op.sum(x, axis=[0])],
    ids=["collapse_sum_to", "sum"],
)
def test_column_sums_are_exact_to_float32(summed):
    x = _cancelling_rows(4096, 16)
    exact = x.astype("float64").sum(0)
    vm = relax.VirtualMachine(relaxgrad.compile(_module(x.shape, summed)), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, exact.astype("float32"))
    # (float32 addition row by row is far off: what the rewrite is for)
    sequential = np.zeros(16, "float32")
    for row in x:
        sequential += row
    assert np.abs(sequential - exact).max() > 1e-2 * np.abs(exact).max()


def test_other_sums_are_left_alone():
    """A row sum (innermost axis), a sum over few rows, a float64 sum: unchanged."""
    for shape, dtype, summed in [((64, 16), "float32", lambda x: op.sum(x, axis=[1])),
                                 ((4, 16), "float32", lambda x: op.sum(x, axis=[0])),
                                 ((64, 16), "float64", lambda x: op.sum(x, axis=[0]))]:
        mod = _module(shape, summed, dtype)
        tvm.ir.assert_structural_equal(WideColumnSums()(mod), mod)


def test_bias_gradient_of_a_linear_layer_is_float64_accumulated():
    """The gradient pass's ``collapse_sum_to`` of a bias: rewritten, and the adjoint's values
    still the same as TVM's own build's."""
    x = relax.Var("x", relax.TensorType((256, 8), "float32"))
    b = relax.Var("b", relax.TensorType((8,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, b]):
        with bb.dataflow():
            y = bb.emit(op.tanh(op.add(x, b)))
            out = bb.emit_output(op.sum(op.multiply(y, y)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    assert "float64" in WideColumnSums()(mod)["main_adjoint"].script()
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((256, 8)).astype("float32"),
            rng.standard_normal(8).astype("float32")]  # fmt: skip
    results = []
    for executable in (relaxgrad.compile(mod), tvm.compile(mod, "llvm")):
        vm = relax.VirtualMachine(executable, tvm.cpu())
        _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
        results.append([g.numpy() for g in grads])
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "summed",
    [lambda x: op.collapse_sum_to(x, relax.ShapeExpr([1, 2, 1, 64, 16])),
     lambda x: op.sum(x, axis=[2], keepdims=True)],
    ids=["collapse_sum_to", "sum"],
)
def test_16_bit_sums_accumulate_in_float32_and_round_once(dtype, summed):
    """A grouped-query attention's key gradient, summed in bf16 over the query heads sharing a
    key head: compiled (TVM's bf16 legalization failed to build the vectorized bf16
    accumulation), and the float32 sum of the 16-bit inputs rounded once, as PyTorch sums."""
    import ml_dtypes

    low = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    shape = (1, 2, 8, 64, 16)
    rng = np.random.default_rng(0)
    scales = np.array([1, 1e-3, 1, 1e-3, 1, 1e-3, 1, 1e-2]).reshape(1, 1, 8, 1, 1)
    x = (rng.standard_normal(shape) * scales).astype(low)  # small terms a 16-bit sum drops
    vm = relax.VirtualMachine(relaxgrad.compile(_module(shape, summed, dtype)), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    want = x.astype("float32").sum(axis=2, keepdims=True).astype(low)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype("float32"), want.astype("float32"))
    torch = pytest.importorskip("torch")
    peer = torch.from_numpy(x.astype("float32")).to(getattr(torch, dtype)).sum(2, keepdim=True)
    np.testing.assert_array_equal(got.astype("float32"), peer.float().numpy())
