"""ExactCastPairs (relaxgrad/schedules/casts.py): a float's round trip through a wider float
dropped, and only that (a narrowing first rounds; bf16 and fp16 do not hold each other)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import ExactCastPairs
from relaxgrad.transforms.simplify import RemoveUnused


def _module(dtype, chain):
    x = relax.Var("x", relax.TensorType((4, 32), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            v = x
            for to in chain:
                v = bb.emit(op.astype(v, to))
            out = bb.emit_output(op.multiply(v, v))
        bb.emit_func_output(out)
    return bb.get()


def _astypes(mod) -> int:
    return sum(isinstance(b.value, relax.Call) and b.value.op.name == "relax.astype"
               for block in mod["main"].body.blocks for b in block.bindings)  # fmt: skip


def _values(dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32)) * 10.0 ** rng.integers(-30, 30, (4, 32))
    x[0, :6] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40]
    with np.errstate(over="ignore"):  # (the largest to infinity)
        return x.astype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                         "float32": np.float32}[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype,wide", [("bfloat16", "float32"), ("float16", "float32"),
                                        ("bfloat16", "float64"), ("float32", "float64")])
def test_round_trips_through_a_wider_float_are_dropped(dtype, wide):
    """``astype`` to ``wide`` and back twice, then to ``wide``: one cast left, and the compiled
    values those of the chain (each round trip exact, NaN, infinities and subnormals too)."""
    mod = _module(dtype, [wide, dtype, wide, dtype, wide])
    rewritten = ExactCastPairs()(mod)
    assert _astypes(RemoveUnused()(rewritten)) == 1
    x = _values(dtype)
    want = x.astype(wide) * x.astype(wide)
    for m in (mod, rewritten):
        vm = relax.VirtualMachine(relaxgrad.compile(m), tvm.cpu())
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,chain", [("float32", ["bfloat16", "float32"]),
                                         ("bfloat16", ["float16", "bfloat16"]),
                                         ("float16", ["bfloat16", "float16"]),
                                         ("float32", ["float16", "float32"])])
def test_round_trips_that_round_are_kept(dtype, chain):
    """A narrowing first (float32 through bf16 rounds) and bf16 through float16 (whose range
    is narrower) or the reverse (fewer mantissa bits): the chain kept, and its values
    rounded as NumPy rounds them (TVM's simplifier dropped bf16 <-> fp16 round trips: the
    casts between them go through float32)."""
    mod = _module(dtype, chain)
    if "float16" not in (dtype, *chain) or "bfloat16" not in (dtype, *chain):
        tvm.ir.assert_structural_equal(ExactCastPairs()(mod), mod)
    x = _values(dtype)
    low = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    want = x
    with np.errstate(over="ignore", invalid="ignore"):
        for to in chain:
            want = want.astype(low[to])
        want = want * want
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.array_equal(want.astype("float32"), (x * x).astype("float32"),
                                  equal_nan=True)  # (the chain rounds)
    np.testing.assert_array_equal(got.astype("float32"), want.astype("float32"))


def test_round_trips_through_aliases_and_layout_ops_are_dropped():
    """A product's output gradient held in bf16, widened, aliased (``g = g_f32``, as the
    gradient pass binds it), reshaped to rows and narrowed again for the products: the
    narrowing reads the bf16 value reshaped; the compiled values are the chain's."""
    x = relax.Var("x", relax.TensorType((2, 4, 32), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(op.astype(x, "float32"))
            alias = bb.emit(wide)
            rows = bb.emit(op.reshape(alias, (8, 32)))
            low = bb.emit(op.astype(op.permute_dims(rows), "bfloat16"))
            out = bb.emit_output(op.multiply(op.astype(low, "float32"), relax.const(2.0)))
        bb.emit_func_output(out)
    mod = bb.get()
    rewritten = RemoveUnused()(ExactCastPairs()(mod))
    assert _astypes(rewritten) == 1  # the last widening only
    values = np.stack([_values("bfloat16")] * 2)  # (2, 4, 32)
    want = values.astype("float32").reshape(8, 32).T * 2
    for m in (mod, rewritten):
        vm = relax.VirtualMachine(relaxgrad.compile(m, cache=False), tvm.cpu())
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(values)).numpy(), want)
