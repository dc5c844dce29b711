"""FoldConstantOps (relaxgrad/schedules/fold_ops.py): operator calls on constants evaluated
with NumPy before legalization give the bits of the kernels that ``tvm.compile`` builds and
runs for them; the cases where the two may differ are left to the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import FoldConstantCalls, FoldConstantOps, NllLossGradAsMask
from relaxgrad.testing import tvm_compile_quietly

RNG = np.random.default_rng(0)
F32 = RNG.standard_normal((3, 4)).astype("float32") * 10
G32 = RNG.standard_normal((3, 4)).astype("float32") + 0.5
F64 = RNG.standard_normal((3, 4)) * 1e10
I64 = np.array([[-7, 7, 2**62, -(2**62)], [0, 5, -5, 9], [3, -3, 11, -11]], "int64")
J64 = np.array([[2, -2, 4, 3], [3, 3, -3, 5], [-4, 4, 6, -7]], "int64")
I32 = I64.astype("int32")
J32 = J64.astype("int32")
U8 = np.array([[0, 1, 200, 255]] * 3, "uint8")
V8 = np.array([[1, 255, 100, 2]] * 3, "uint8")
B1 = F32 > 0
B2 = G32 > 0.5


def c(value):
    value = np.asarray(value)
    return relax.const(value, str(value.dtype))  # (a 0-d int64 array alone gives int32)


# Each case: a name and the call (of constants) that FoldConstantOps folds.
FOLDED = [
    ("add_i64_wraps", lambda: op.add(c(I64), c(I64 * 2))),
    ("subtract_u8_wraps", lambda: op.subtract(c(U8), c(V8))),
    ("multiply_i32", lambda: op.multiply(c(I32), c(J32))),
    ("add_f32_broadcast", lambda: op.add(c(F32), c(G32[:1]))),
    ("multiply_f32", lambda: op.multiply(c(F32), c(G32))),
    ("divide_f32", lambda: op.divide(c(F32), c(G32))),
    ("subtract_f64", lambda: op.subtract(c(F64), c(F64.T[:3, :1]))),
    ("floor_divide_i64", lambda: op.floor_divide(c(I64), c(J64))),
    ("floor_mod_i32", lambda: op.floor_mod(c(I32), c(J32))),
    ("minimum_f32", lambda: op.minimum(c(F32), c(G32))),
    ("maximum_i64", lambda: op.maximum(c(I64), c(J64))),
    ("less_f32", lambda: op.less(c(F32), c(G32))),
    ("greater_equal_i64", lambda: op.greater_equal(c(I64), c(J64))),
    ("not_equal_i32", lambda: op.not_equal(c(I32), c(J32))),
    ("logical_and", lambda: op.logical_and(c(B1), c(B2))),
    ("logical_not", lambda: op.logical_not(c(B1))),
    ("negative_i64", lambda: op.negative(c(I64))),
    ("abs_f32", lambda: op.abs(c(F32))),
    ("where", lambda: op.where(c(B1), c(F32), c(G32))),
    ("astype_f32_i64", lambda: op.astype(c(F32), "int64")),
    ("astype_f32_i32_negative", lambda: op.astype(c(-np.abs(F32)), "int32")),
    ("astype_i64_f32", lambda: op.astype(c(I64), "float32")),
    ("astype_f64_f32", lambda: op.astype(c(F64), "float32")),
    ("astype_bool_f32", lambda: op.astype(c(B1), "float32")),
    ("astype_i64_u8", lambda: op.astype(c(I64), "uint8")),
    ("reshape", lambda: op.reshape(c(F32), (2, 6))),
    ("expand_dims", lambda: op.expand_dims(c(I64), 1)),
    ("squeeze", lambda: op.squeeze(c(F32[:1]), [0])),
    ("flatten", lambda: op.flatten(c(F32))),
    ("broadcast_to", lambda: op.broadcast_to(c(B1[:1]), (5, 3, 4))),
    ("permute_dims", lambda: op.permute_dims(c(F32), [1, 0])),
    ("zeros", lambda: op.zeros((2, 3), "int32")),
    ("ones", lambda: op.ones((2, 3), "float32")),
    ("ones_0d", lambda: op.ones((), "float64")),
    ("add_0d", lambda: op.add(c(np.float32(1.5)), c(np.float32(-4.25)))),
    ("full", lambda: op.full((2, 3), c(np.float32(2.5)), "float32")),
    ("full_int_exact", lambda: op.full((2, 3), c(np.float32(-3.0)), "int64")),
    ("full_like", lambda: op.full_like(c(I32), c(np.int64(7)))),
    ("ones_like", lambda: op.ones_like(c(F32))),
    ("arange", lambda: op.arange(2, 30, 3, "int64")),
    ("log_kernel", lambda: op.log(c(np.abs(F32) + 1))),
    ("exp_kernel", lambda: op.exp(c(F32 / 10))),
    ("power_kernel", lambda: op.power(c(np.abs(F32)), c(G32))),
]

# Calls left to the kernels: NaN where NumPy and LLVM differ, a float to bool, a fill value
# the dtype does not hold, float arange, integer division (TIR truncates), a reduction.
NAN = np.where(B1, np.float32("nan"), F32)
LEFT = [
    ("minimum_nan", lambda: op.minimum(c(NAN), c(G32))),
    ("not_equal_nan", lambda: op.not_equal(c(NAN), c(NAN))),
    ("astype_f32_bool", lambda: op.astype(c(NAN), "bool")),
    ("full_inexact", lambda: op.full((2, 3), c(np.float32(2.5)), "int64")),
    ("arange_float", lambda: op.arange(0.0, 1.0, 0.1, "float32")),
    ("divide_i64", lambda: op.divide(c(I64), c(J64))),
    ("sum", lambda: op.sum(c(F32), axis=[1])),
    ("add_f16", lambda: op.add(c(F32.astype("float16")), c(G32.astype("float16")))),
]
# Never run: an integer division by zero is a crash, not a value.
ZERO = [("floor_mod_by_zero", lambda: op.floor_mod(c(I64), c(np.zeros_like(J64))))]


def _module(cases) -> tvm.IRModule:
    """``main``: every case's call, bound in one dataflow block, returned as a tuple."""
    builder = relax.BlockBuilder()
    with builder.function("main", []):
        with builder.dataflow():
            outputs = [builder.emit(make(), name) for name, make in cases]
            result = builder.emit_output(relax.Tuple(outputs))
        builder.emit_func_output(result)
    return builder.get()


def _values(ex) -> list[np.ndarray]:
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [x.numpy() for x in vm["main"]()]


@pytest.mark.parametrize("cases, folded", [(FOLDED, len(FOLDED)), (LEFT, 0), (ZERO, 0)],
                         ids=["folded", "left", "by_zero"])
def test_which_calls_fold(cases, folded):
    for name, make in cases:
        step = FoldConstantOps()
        step(_module([(name, make)]))
        assert step.folded == (1 if folded else 0), name


@pytest.mark.parametrize("cases", [FOLDED, LEFT], ids=["folded", "left"])
def test_values_are_the_kernels_bits(cases):
    """Folded or not, each value is bit for bit the one ``tvm.compile``'s kernel computes."""
    mod = _module(cases)
    ours = _values(relaxgrad.compile(mod, "llvm"))
    theirs = _values(tvm_compile_quietly(mod, "llvm"))
    for (name, _), a, b in zip(cases, ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a,
                              b.view(f"u{b.itemsize}") if b.dtype.kind == "f" else b), name


def test_a_chain_through_a_math_function_folds_whole():
    """T5's relative position buckets: integers to a float ``log`` (a kernel, built once for
    its two calls), then cast back, clipped and selected. The whole chain folds before
    legalization and leaves nothing for FoldConstantCalls to build; the values match."""
    positions = np.arange(-6, 6, dtype="int64").reshape(3, 4)
    builder = relax.BlockBuilder()
    with builder.function("main", []):
        with builder.dataflow():
            results = []
            for scale in (2.0, 3.0):
                distance = builder.emit(op.abs(c(positions)))
                small = builder.emit(op.less(distance, c(np.int64(2))))
                ratio = builder.emit(op.divide(op.astype(distance, "float32"),
                                               c(np.float32(2.0))))
                large = builder.emit(op.log(ratio))  # (log 0: -inf, dropped by the where)
                large = builder.emit(op.multiply(large, c(np.float32(scale))))
                large = builder.emit(op.add(op.astype(large, "int64"), c(np.int64(2))))
                large = builder.emit(op.minimum(large, op.full_like(large, c(np.int64(7)))))
                results.append(builder.emit(op.where(small, distance, large)))
            result = builder.emit_output(relax.Tuple(results))
        builder.emit_func_output(result)
    mod = builder.get()
    step = FoldConstantOps()
    folded = step(mod)
    assert step.folded >= 16
    with tvm.target.Target("llvm"):
        legal = relax.transform.LegalizeOps()(folded)
    calls = FoldConstantCalls()
    calls(legal)
    assert calls.folded == 0
    ours = _values(relaxgrad.compile(mod, "llvm"))
    theirs = _values(tvm_compile_quietly(mod, "llvm"))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_folded_and_not_mutated():
    """A call reading a parameter stays; the module given is left as it was."""
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 4), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            y = builder.emit(op.add(x, c(F32)))
            z = builder.emit_output(op.multiply(y, op.ones((3, 4), "float32")))
        builder.emit_func_output(z)
    mod = builder.get()
    before = mod.script()
    step = FoldConstantOps()
    out = step(mod)
    assert step.folded == 1  # the ones
    assert mod.script() == before
    assert "R.add(x" in out.script()


def test_calls_left_read_the_rebound_vars():
    """A call left as it is whose operand folded is bound to a new var; later calls read that
    var (the mutator's remap), not the old one: the gradient of a mean ``nll_loss`` (its
    ``1 / count`` chain, in the adjoint and in the forward it copies) had read an unbound var
    and failed to build."""
    z = relax.Var("z", relax.TensorType((16, 10), "float64"))
    y = relax.Var("y", relax.TensorType((16,), "int64"))
    builder = relax.BlockBuilder()
    with builder.function("main", [z, y]):
        with builder.dataflow():
            scores = builder.emit(op.nn.log_softmax(z))
            loss = builder.emit_output(op.nn.nll_loss(scores, y, reduction="mean"))
        builder.emit_func_output(loss)
    mod = relaxgrad.Gradient("main", require_grads=[z])(builder.get())
    masked = NllLossGradAsMask()(mod)  # as the pipeline has it
    folded = FoldConstantOps()(masked)
    for gvar, func in folded.functions_items():
        if isinstance(func, relax.Function):
            assert not relax.analysis.free_vars(func), gvar
    rng = np.random.default_rng(3)
    args = [tvm.runtime.tensor(rng.standard_normal((16, 10))),
            tvm.runtime.tensor(rng.integers(0, 10, 16))]
    got = _adjoint(relaxgrad.compile(masked, "llvm"), args)
    np.testing.assert_allclose(got, _adjoint(tvm_compile_quietly(mod, "llvm"), args), rtol=1e-12)


def _adjoint(ex, args) -> np.ndarray:
    _, (grad,) = relax.VirtualMachine(ex, tvm.cpu())["main_adjoint"](*args)
    return grad.numpy()
