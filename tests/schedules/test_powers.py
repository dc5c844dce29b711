"""IntegerPowers (relaxgrad/schedules/powers.py): ``x ** 2``, ``x ** 3`` and ``x ** 4`` as
products give TVM's values and gradients, and compile without TVM's ``pow`` warning."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import IntegerPowers


def _adjoint(exponent: float) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    weights = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.power(x, relax.const(exponent, "float32")))
            out = bb.emit_output(op.sum(op.multiply(y, relax.const(weights))))
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main")(bb.get())


@pytest.mark.parametrize("exponent", [2.0, 3.0, 4.0, 5.0, 2.5])
def test_values_and_gradients_match_tvm(exponent, capfd):
    """The forward's ``x ** c`` and the gradient's ``x ** (c - 1)`` (an exponent computed from
    constants) are products where whole and at most 4 (1: ``x`` itself)."""
    mod = _adjoint(exponent)
    rewritten = IntegerPowers()(mod)["main_adjoint"].script()
    forward, gradient = rewritten.split("R.sum", 1)
    assert ("R.power" in forward) == (exponent in (2.5, 5.0))
    assert ("R.power" in gradient) == (exponent == 2.5)
    xv = np.random.default_rng(1).uniform(0.5, 2.0, (4, 16)).astype("float32")
    results = []
    for build in (lambda m: tvm.compile(m, "llvm"), relaxgrad.compile):
        capfd.readouterr()
        vm = relax.VirtualMachine(build(mod), tvm.cpu())
        loss, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(xv))
        results.append((loss.numpy(), grad.numpy(), capfd.readouterr().err))
    (want_loss, want_grad, _), (loss, grad, printed) = results
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    if exponent not in (2.5, 5.0):  # (x ** 5 is left to TVM, which warns)
        assert "Detected pow" not in printed



def test_an_adjoint_without_powers_is_returned_as_it_is(monkeypatch):
    """An adjoint returns ``(loss, (grads...))``, vars in nested tuples: with no power to
    rewrite, the function is returned as it is, not rebuilt binding by binding (an adjoint of
    ten thousand bindings paid seconds of Python per pass), and still compiles to its values."""
    from relaxgrad.schedules import powers

    visits = []
    real = powers._Rewriter._cls.visit_call_  # (the class under TVM's @mutator)
    monkeypatch.setattr(powers._Rewriter._cls, "visit_call_",
                        lambda self, call: visits.append(call) or real(self, call))
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    weights = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op.sum(op.multiply(op.exp(x), relax.const(weights))))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    assert IntegerPowers()(mod)["main_adjoint"].same_as(mod["main_adjoint"]) and not visits
    squared = IntegerPowers()(_adjoint(2.0))  # a power to rewrite: that function is rebuilt
    assert visits and "R.power" not in squared["main_adjoint"].script()
    xv = np.random.default_rng(1).uniform(-1.0, 1.0, (4, 16)).astype("float32")
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    loss, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(xv))
    np.testing.assert_allclose(loss.numpy(), np.sum(np.exp(xv) * weights), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), np.exp(xv) * weights, rtol=1e-5, atol=1e-6)
