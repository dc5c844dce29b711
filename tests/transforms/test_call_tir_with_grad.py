"""call_tir_with_grad: the TE gradient registered under its name differentiates the call."""

import tvm
from tvm import relax, te
from tvm.relax.training.utils import register_te_gradient

import relaxgrad
from relaxgrad.testing import check_gradients


def te_mul(a, b):
    return te.compute(a.shape, lambda i, j: a[i, j] * b[i, j], name="mul")


@register_te_gradient("relaxgrad_test_mul_grad")
def te_mul_grad(grad, a, b):
    return [
        te.compute(a.shape, lambda i, j: grad[i, j] * b[i, j], name="mul_grad_a"),
        te.compute(b.shape, lambda i, j: grad[i, j] * a[i, j], name="mul_grad_b"),
    ]


def te_square(a):
    return te.compute(a.shape, lambda i, j: a[i, j] * a[i, j], name="square")


@register_te_gradient("relaxgrad_test_square_grad")
def te_square_grad(grad, a):
    return te.compute(a.shape, lambda i, j: grad[i, j] * a[i, j] * 2.0, name="square_grad")


def _module():
    a = relax.Var("a", relax.TensorType((3, 4), "float64"))
    b = relax.Var("b", relax.TensorType((3, 4), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            m = bb.emit(bb.call_te_with_grad(te_mul, a, b, te_grad_name="relaxgrad_test_mul_grad"))
            square = bb.call_te_with_grad(te_square, m, te_grad_name="relaxgrad_test_square_grad")
            s = bb.emit(square)
            gv = bb.emit_output(relax.op.sum(relax.op.tanh(s)))
        bb.emit_func_output(gv)
    return bb.get()


def test_numeric():
    result = check_gradients(_module())
    assert result.ok, str(result)


def test_becomes_call_tir():
    mod = _module()
    after = relaxgrad.Gradient("main")(mod)
    script = after["main_adjoint"].script()
    assert "call_tir_with_grad" not in script
    assert "R.call_tir(" in script
    tvm.ir.assert_structural_equal(after, relax.transform.Gradient("main")(mod))


def test_missing_te_gradient_is_named():
    a = relax.Var("a", relax.TensorType((3, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a]):
        with bb.dataflow():
            m = bb.emit(bb.call_te_with_grad(te_square, a, te_grad_name="no_such_te_grad"))
            gv = bb.emit_output(relax.op.sum(m))
        bb.emit_func_output(gv)
    try:
        relaxgrad.Gradient("main")(bb.get())
    except relaxgrad.GradientError as err:
        assert "no_such_te_grad" in str(err) and "m" in str(err)
    else:
        raise AssertionError("expected a GradientError")
