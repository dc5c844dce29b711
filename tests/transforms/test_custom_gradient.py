"""Custom gradients (relaxgrad.custom_gradient) and stop_gradient, checked numerically on
compiled code against hand-computed values and finite differences."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad import GradientError

from ._numeric import compiled, fd_gradient, tensor


@I.ir_module
class STE:  # straight-through rounding: forward round, backward identity
    @R.function
    def quant(x: R.Tensor((2, 3), "float64")) -> R.Tensor((2, 3), "float64"):
        with R.dataflow():
            y = R.round(x)
            R.output(y)
        return y

    @R.function
    def quant_bwd(x: R.Tensor((2, 3), "float64"), g: R.Tensor((2, 3), "float64")):
        return (g,)

    @R.function
    def main(x: R.Tensor((2, 3), "float64"), w: R.Tensor((2, 3), "float64")):
        cls = STE
        with R.dataflow():
            q = cls.quant(R.multiply(x, w))
            loss = R.sum(R.multiply(q, q))
            R.output(loss)
        return loss


def test_straight_through_rounding():
    mod = relaxgrad.custom_gradient(STE, "quant", "quant_bwd")
    assert mod["quant"].attrs["relaxgrad.custom_gradient"] == "quant_bwd"
    mod = relaxgrad.Gradient("main")(mod)
    rng = np.random.default_rng(0)
    x, w = rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))
    loss, (gx, gw) = compiled(mod)["main_adjoint"](tensor(x), tensor(w))
    q = np.round(x * w)
    assert np.isclose(float(loss.numpy()), np.sum(q * q))
    # d loss / d q = 2q; through the identity backward of round: d/dx = 2q * w
    np.testing.assert_allclose(gx.numpy(), 2 * q * w, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), 2 * q * x, rtol=1e-12)


@I.ir_module
class Clipped:  # a backward clipping the incoming gradient to [-1, 1]
    @R.function
    def clip_grad(x: R.Tensor((4,), "float64")) -> R.Tensor((4,), "float64"):
        return x

    @R.function
    def clip_grad_bwd(x: R.Tensor((4,), "float64"), g: R.Tensor((4,), "float64")):
        with R.dataflow():
            c = R.clip(g, R.prim_value(-1.0), R.prim_value(1.0))
            R.output(c)
        return (c,)

    @R.function
    def main(x: R.Tensor((4,), "float64"), a: R.Tensor((4,), "float64")):
        cls = Clipped
        with R.dataflow():
            y = cls.clip_grad(R.multiply(x, a))
            loss = R.sum(R.multiply(R.multiply(y, y), R.const(3.0, "float64")))
            R.output(loss)
        return loss


def test_clipped_backward_against_hand_computed_values():
    mod = relaxgrad.Gradient("main")(relaxgrad.custom_gradient(Clipped, "clip_grad",
                                                               "clip_grad_bwd"))
    x = np.array([0.1, -0.05, 2.0, -1.5])
    a = np.array([1.0, 2.0, 0.5, 1.0])
    loss, (gx, ga) = compiled(mod)["main_adjoint"](tensor(x), tensor(a))
    y = x * a
    dy = np.clip(6 * y, -1, 1)  # d loss/d y = 6y, clipped by the custom backward
    np.testing.assert_allclose(dy, [0.6, -0.6, 1.0, -1.0])
    np.testing.assert_allclose(gx.numpy(), dy * a, rtol=1e-12)
    np.testing.assert_allclose(ga.numpy(), dy * x, rtol=1e-12)
    # without the custom gradient: the true gradient (finite differences)
    plain = compiled(relaxgrad.Gradient("main")(Clipped))
    _, (px, pa) = plain["main_adjoint"](tensor(x), tensor(a))

    def f(*args):
        return float(plain["main"](*[tensor(v) for v in args]).numpy())

    np.testing.assert_allclose(px.numpy(), fd_gradient(f, [x, a], 0), rtol=1e-6)
    np.testing.assert_allclose(pa.numpy(), fd_gradient(f, [x, a], 1), rtol=1e-6)


def test_custom_gradient_checks_the_contract():
    with pytest.raises(GradientError, match="tuple of 1 gradients"):
        relaxgrad.custom_gradient(STE, "quant", "main")
    with pytest.raises(GradientError, match="one output gradient"):
        relaxgrad.custom_gradient(Clipped, "main", "clip_grad_bwd")
    with pytest.raises(GradientError, match="no Relax function"):
        relaxgrad.custom_gradient(STE, "quant", "missing")


@I.ir_module
class Stop:
    @R.function
    def main(x: R.Tensor((3,), "float64"), w: R.Tensor((3,), "float64")):
        with R.dataflow():
            a = R.multiply(x, w)
            b = R.grad.no_grad(a)  # the graph relaxgrad.stop_gradient(a) builds
            loss = R.sum(R.multiply(a, b))
            R.output(loss)
        return loss


def test_stop_gradient_numeric():
    x_var = relax.Var("x", relax.TensorType((3,), "float64"))
    w_var = relax.Var("w", relax.TensorType((3,), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x_var, w_var]):
        with bb.dataflow():
            a = bb.emit(relax.op.multiply(x_var, w_var))
            b = bb.emit(relaxgrad.stop_gradient(a))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(a, b)))
        bb.emit_func_output(loss)
    built = bb.get()
    tvm.ir.assert_structural_equal(built["main"].body, Stop["main"].body, map_free_vars=True)
    mod = relaxgrad.Gradient("main")(built)
    vm = compiled(mod)
    x, w = np.array([0.5, -1.0, 2.0]), np.array([1.5, 0.25, -0.5])
    loss, (gx, gw) = vm["main_adjoint"](tensor(x), tensor(w))
    assert np.isclose(float(loss.numpy()), np.sum((x * w) ** 2))  # the value is unchanged
    # the gradient flows through a only (b is a constant): d/dx = b * w = x w^2
    np.testing.assert_allclose(gx.numpy(), x * w * w, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), x * w * x, rtol=1e-12)
    # = half the finite-difference gradient of the same function without the stop
    def f(*args):
        return float(np.sum((args[0] * args[1]) ** 2))

    np.testing.assert_allclose(gx.numpy(), fd_gradient(f, [x, w], 0) / 2, rtol=1e-6)


@I.ir_module
class Scaled:  # a non-float parameter: the gradient the backward returns for it is ignored
    @R.function
    def scale(x: R.Tensor((3,), "float64"), k: R.Tensor((), "int64")):
        with R.dataflow():
            y = R.multiply(x, R.astype(k, "float64"))
            R.output(y)
        return y

    @R.function
    def scale_bwd(x: R.Tensor((3,), "float64"), k: R.Tensor((), "int64"),
                  g: R.Tensor((3,), "float64")):
        with R.dataflow():
            gx = R.multiply(g, R.const(2.0, "float64"))  # deliberately not the true gradient
            R.output(gx)
        return (gx, k)

    @R.function
    def main(x: R.Tensor((3,), "float64"), k: R.Tensor((), "int64")):
        cls = Scaled
        with R.dataflow():
            loss = R.sum(R.sin(cls.scale(x, k)))
            R.output(loss)
        return loss


def test_custom_gradient_with_a_non_float_parameter():
    mod = relaxgrad.Gradient("main", ["x"], strict=False)(
        relaxgrad.custom_gradient(Scaled, "scale", "scale_bwd")
    )
    x = np.array([0.3, -0.7, 1.1])
    _, (gx,) = compiled(mod)["main_adjoint"](tensor(x), tensor(np.array(3, "int64")))
    np.testing.assert_allclose(gx.numpy(), 2 * np.cos(3 * x), rtol=1e-12)


def test_custom_gradient_in_split_mode():
    mod = relaxgrad.Gradient("main", split=True)(relaxgrad.custom_gradient(STE, "quant",
                                                                           "quant_bwd"))
    rng = np.random.default_rng(3)
    x, w = rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))
    vm = compiled(mod)
    _, residuals = vm["main_fwd"](tensor(x), tensor(w))
    gx, gw = (g.numpy() for g in vm["main_bwd"](*list(residuals)))
    q = np.round(x * w)
    np.testing.assert_allclose(gx, 2 * q * w, rtol=1e-12)
    np.testing.assert_allclose(gw, 2 * q * x, rtol=1e-12)
