"""FastExp (relaxgrad/schedules/fast_math.py): float32 ``exp`` as a polynomial LLVM vectorizes,
within 2 ulp of the correctly rounded value, with exp's special values."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import FastExp


def _exp_func(n: int, dtype: str, vectorize: bool) -> tvm.IRModule:
    x = te.placeholder((n,), dtype)
    y = te.compute(x.shape, lambda i: te.exp(x[i]), name="y")
    mod = FastExp()(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    if vectorize:
        sch = s_tir.Schedule(mod)
        (loop,) = sch.get_loops(sch.get_sblock("y"))
        sch.vectorize(sch.split(loop, [None, 16])[1])
        mod = sch.mod
    return mod


@pytest.mark.parametrize("vectorize", [False, True])
def test_within_two_ulp_and_special_values(vectorize):
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.7228, -87.33, -87.34,
                        -100.0, 1e-8, -1e-8], "float32")  # fmt: skip
    xs = np.concatenate([np.linspace(-87.3, 88.7, 200_000, dtype="float32"), special])
    xs = np.pad(xs, (0, -len(xs) % 16))
    mod = _exp_func(len(xs), "float32", vectorize)
    assert "T.exp" not in mod.script()
    out = tvm.runtime.tensor(np.zeros_like(xs))
    tvm.compile(mod, target="llvm")(tvm.runtime.tensor(xs), out)
    got = out.numpy()
    with np.errstate(over="ignore"):
        want = np.exp(xs.astype("float64")).astype("float32")
    normal = np.isfinite(want) & (want >= np.finfo("float32").tiny)
    ulps = np.abs(got[normal].astype("float64") - want[normal]) / np.spacing(want[normal])
    assert ulps.max() <= 2
    got_special = got[200_000 : 200_000 + len(special)]
    assert np.isnan(got_special[0]) and got_special[1] == np.inf
    assert got_special[2] == 0 and got_special[3] == got_special[4] == 1
    assert got_special[9] == 0  # below the range: flushed to 0, like -inf


def test_other_dtypes_are_left_to_llvm():
    mod = _exp_func(8, "float64", False)
    assert "T.exp" in mod.script()


def test_softmax_compiled_has_no_libm_exp_and_matches_numpy():
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op.nn.softmax(x, -1))
        bb.emit_func_output(out)
    executable = relaxgrad.compile(bb.get(), "llvm")
    xv = np.random.default_rng(0).standard_normal((4, 64)).astype("float32") * 10
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()
    want = np.exp(xv - xv.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
