"""FoldConstantCalls (relaxgrad/schedules/fold.py): constant calls folded with each PrimFunc
built once per module (TVM's FoldConstant built one per folded call); values unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import FoldConstantCalls

from ..chains import chain, closed_form

C = 1.001


def _chain(n: int) -> tvm.IRModule:
    """The adjoint of :func:`tests.chains.chain`: its whole backward chain is constant
    (``ones`` times ``C``, again and again)."""
    return relaxgrad.Gradient("main")(chain(n, C, width=3))


@pytest.fixture(scope="module")
def chain_300():
    return _chain(300)


def test_each_prim_func_is_built_once(chain_300):
    """The 300 constant calls of the adjoint fold with one build per PrimFunc (``ones``, its
    broadcast, the product and the sum), however long the chain."""
    with tvm.target.Target("llvm"):
        legal = relax.transform.LegalizeOps()(chain_300)
        step = FoldConstantCalls()
        folded = step(legal)
    assert step.folded >= 300
    assert step.builds <= 4
    assert "R.call_tir(multiply" not in folded["main_adjoint"].script().split("gv_adjoint")[-1]


def test_compile_builds_no_function_per_folded_call(chain_300):
    """relaxgrad.compile runs no constant folding that builds through TVM's ``tirx.build`` per
    call (TVM's FoldConstant did, 300 times here), and the gradient is the closed form."""
    builds = []
    build = tvm.get_global_func("tirx.build")

    def counted(*args):
        builds.append(args)
        return build(*args)

    tvm_ffi.register_global_func("tirx.build", counted, override=True)
    try:
        ex = relaxgrad.compile(chain_300, "llvm")
    finally:
        tvm_ffi.register_global_func("tirx.build", build, override=True)
    assert len(builds) <= 1
    vm = relax.VirtualMachine(ex, tvm.cpu())
    _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(np.ones(3)))
    np.testing.assert_allclose(grad.numpy(), np.full(3, closed_form(300, C)), rtol=1e-12)


def test_folded_values_match_numpy():
    """Constant operands of several kinds folded (a matmul, exp, a broadcast): the compiled
    function and its gradient match numpy and central differences in float64."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 3))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 3), "float64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            w = bb.emit(op.exp(op.matmul(relax.const(a, "float64"), relax.const(b, "float64"))))
            w = bb.emit(op.add(w, op.broadcast_to(relax.const(np.ones(3), "float64"), (3, 3))))
            out = bb.emit_output(op.sum(op.multiply(op.tanh(op.matmul(x, w)), x)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    w_np = np.exp(a @ b) + 1.0

    def f(x_np):
        return np.sum(np.tanh(x_np @ w_np) * x_np)

    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    x_np = rng.standard_normal((3, 3))
    value, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(x_np))
    np.testing.assert_allclose(value.numpy(), f(x_np), rtol=1e-12)
    eps, want = 1e-6, np.zeros_like(x_np)
    for i in np.ndindex(x_np.shape):
        d = np.zeros_like(x_np)
        d[i] = eps
        want[i] = (f(x_np + d) - f(x_np - d)) / (2 * eps)
    np.testing.assert_allclose(grad.numpy(), want, rtol=1e-6, atol=1e-8)
