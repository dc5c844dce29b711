"""MeanAsSum (relaxgrad/schedules/means.py): ``mean`` as ``sum * (1 / count)``, so that the
product a mean reduces fuses into the reduction; values unchanged."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import MeanAsSum


def _module(shape, dtype, body) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x))
        bb.emit_func_output(out)
    return bb.get()


def _fused_names(mod: tvm.IRModule) -> set[str]:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps()]  # fmt: skip
    fused = tvm.transform.Sequential(passes)(mod)
    return set(re.findall(r"cls\.(\w+)", fused.script().split("def main")[-1]))


def test_a_squared_mean_fuses_into_one_reduction():
    mod = _module((8, 32), "float32", lambda x: op.mean(op.multiply(x, x), axis=[1]))
    assert _fused_names(mod) == {"multiply", "mean"}  # TVM: the product apart
    rewritten = MeanAsSum()(mod)
    assert "R.mean" not in rewritten.script()
    # the product in the sum's kernel; the scale by 1 / 32 on its own (nothing follows)
    assert _fused_names(rewritten) == {"fused_multiply_sum", "multiply1"}


@pytest.mark.parametrize(
    "axis, keepdims, dtype",
    [([1], False, "float32"), ([0, 2], True, "float32"), ([-1], True, "float64"),
     (None, False, "float32")],
)  # fmt: skip
def test_values_are_the_mean(axis, keepdims, dtype):
    mod = _module((3, 4, 5), dtype, lambda x: op.mean(x, axis=axis, keepdims=keepdims))
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(dtype)
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    want = x.mean(axis=None if axis is None else tuple(axis), keepdims=keepdims)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-12)
    assert "R.mean" not in MeanAsSum()(mod).script()


def test_integer_and_dynamic_means_are_left_alone():
    ints = _module((3, 4), "int32", lambda x: op.mean(x, axis=[1]))
    assert MeanAsSum()(ints).script() == ints.script()
    n = tvm.tirx.Var("n", "int64")
    dynamic = _module((n, 4), "float32", lambda x: op.mean(x, axis=[0]))
    assert "R.mean" in MeanAsSum()(dynamic).script()
