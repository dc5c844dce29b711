"""A long chain of elementwise bindings with a closed-form gradient, shared by the tests of
long inputs (tests/transforms/test_deep_inputs.py) and of constant folding
(tests/schedules/test_fold.py)."""

from tvm import relax
from tvm.relax import op


def chain(n: int, c: float, width: int = 4) -> relax.Function:
    """``main(x) = sum(v_n)``, ``v_0 = x``, ``v * c`` and ``v + x`` in turn: ``n`` bindings
    (float64, ``x`` of shape ``(width,)``), whose adjoint's backward chain is all constants."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((width,), "float64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            v = x
            for i in range(n):
                v = bb.emit(op.add(v, x) if i % 2 else op.multiply(v, relax.const(c, "float64")))
            out = bb.emit_output(op.sum(v))
        bb.emit_func_output(out)
    return bb.get()


def closed_form(n: int, c: float) -> float:
    """``d/dx sum(v_n)`` per element: with ``v_{2k+2} = c v_{2k} + x``,
    ``c^(n/2) + sum_{k<n/2} c^k``."""
    return c ** (n // 2) + sum(c**k for k in range(n // 2))
