"""Gradients of gradients: Hessian-vector products by differentiating an adjoint (seed="param"),
and a WGAN-GP-style gradient penalty trained with SGD. Checked against finite differences of
compiled code in float64."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad

from ._numeric import compiled, fd_gradient, tensor


def _mlp(labels: bool):
    """``main(x, y, w1, b1, w2)``: a tanh MLP and a softmax cross-entropy against integer
    labels (``nll_loss``) or one-hot targets (``cross_entropy_with_logits``)."""
    f64 = "float64"
    y_ty = relax.TensorType((4,), "int64") if labels else relax.TensorType((4, 3), f64)
    names = [("x", (4, 3)), ("w1", (3, 5)), ("b1", (5,)), ("w2", (5, 3))]
    x, w1, b1, w2 = (relax.Var(n, relax.TensorType(s, f64)) for n, s in names)
    y = relax.Var("y", y_ty)
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y, w1, b1, w2]):
        with bb.dataflow():
            h = bb.emit(op.tanh(op.add(op.matmul(x, w1), b1)), "h")
            lp = bb.emit(op.nn.log_softmax(op.matmul(h, w2)), "lp")
            loss = op.nn.nll_loss(lp, y) if labels else op.nn.cross_entropy_with_logits(lp, y)
            out = bb.emit_output(loss, "loss")
        bb.emit_func_output(out)
    return bb.get()


def _hvp_module(mod):
    mod = relaxgrad.Gradient("main", ["w1", "b1", "w2"])(mod)
    wrt = ["x", "w1", "b1", "w2"]
    return relaxgrad.Gradient("main_adjoint", wrt, target_index=1, seed="param", strict=False)(mod)


@pytest.mark.parametrize("labels", [True, False], ids=["nll_loss", "cross_entropy_with_logits"])
def test_hvp_of_mlp_matches_finite_differences_of_the_gradient(labels):
    mod = _hvp_module(_mlp(labels))
    hvp = mod["main_adjoint_adjoint"]
    assert len(hvp.params) == 6  # main_adjoint's five, and the seed: a tuple like the grads
    vm = compiled(mod)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (4, 3))
    if labels:
        y = np.array([0, 2, 1, 2], dtype="int64")
    else:
        y = np.eye(3)[[0, 2, 1, 2]]
    params = [rng.uniform(-1, 1, s) for s in [(3, 5), (5,), (5, 3)]]
    v = [rng.standard_normal(p.shape) for p in params]

    def grad_at(ps):
        _, grads = vm["main_adjoint"](tensor(x), tensor(y), *[tensor(p) for p in ps])
        return [g.numpy() for g in grads]

    (loss, grads), hx_grads = vm["main_adjoint_adjoint"](
        tensor(x), tensor(y), *[tensor(p) for p in params], tuple(tensor(a) for a in v)
    )
    # x, w1, b1, w2 -> H v for w1, b1, w2 (H is symmetric)
    got = [g.numpy() for g in hx_grads][1:]
    eps = 1e-5
    plus = grad_at([p + eps * d for p, d in zip(params, v)])
    minus = grad_at([p - eps * d for p, d in zip(params, v)])
    for g, a, b in zip(got, plus, minus):
        np.testing.assert_allclose(g, (a - b) / (2 * eps), rtol=1e-6, atol=1e-8)
    # the first output is still the loss and the gradient
    ref = grad_at(params)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-12)
    # the x field: d/dx <grad_w(x), v>, the mixed second derivative
    gx = hx_grads[0].numpy()

    def dot_at(xx):
        _, gs = vm["main_adjoint"](tensor(xx), tensor(y), *[tensor(p) for p in params])
        return sum(float(np.sum(g.numpy() * d)) for g, d in zip(gs, v))

    dx = rng.standard_normal(x.shape)
    fd = (dot_at(x + eps * dx) - dot_at(x - eps * dx)) / (2 * eps)
    assert np.isclose(float(np.sum(gx * dx)), fd, rtol=1e-6, atol=1e-8)


@I.ir_module
class Critic:
    @R.function
    def critic(
        x: R.Tensor((6, 2), "float64"),
        w1: R.Tensor((2, 8), "float64"),
        w2: R.Tensor((8, 1), "float64"),
    ) -> R.Tensor((), "float64"):
        with R.dataflow():
            d = R.sum(R.matmul(R.tanh(R.matmul(x, w1)), w2))
            R.output(d)
        return d


def _wgan_gp_module(lam=10.0):
    """``objective(real, fake, mix, w1, w2) = mean D(fake) - mean D(real) + lam * mean_i
    ||dD/dmix_i||^2``; the penalty calls ``critic_adjoint`` (the input gradient of the critic)."""
    mod = relaxgrad.Gradient("critic", ["x"])(Critic)
    critic, critic_adjoint = mod.get_global_var("critic"), mod.get_global_var("critic_adjoint")
    ty = relax.TensorType((6, 2), "float64")
    real, fake, mix = (relax.Var(n, ty) for n in ("real", "fake", "mix"))
    w1 = relax.Var("w1", relax.TensorType((2, 8), "float64"))
    w2 = relax.Var("w2", relax.TensorType((8, 1), "float64"))
    bb = relax.BlockBuilder(mod)
    with bb.function("objective", [real, fake, mix, w1, w2]):
        with bb.dataflow():
            d_real = bb.emit(relax.Call(critic, [real, w1, w2]))
            d_fake = bb.emit(relax.Call(critic, [fake, w1, w2]))
            out = bb.emit(relax.Call(critic_adjoint, [mix, w1, w2]))
            g = bb.emit(relax.TupleGetItem(relax.TupleGetItem(out, 1), 0))
            pen = bb.emit(relax.op.sum(relax.op.multiply(g, g)))
            scale = relax.const(1.0 / 6, "float64")
            wass = bb.emit(relax.op.multiply(relax.op.subtract(d_fake, d_real), scale))
            loss = bb.emit_output(
                relax.op.add(wass, relax.op.multiply(pen, relax.const(lam / 6, "float64")))
            )
        bb.emit_func_output(loss)
    mod = bb.get()
    return relaxgrad.Gradient("objective", ["w1", "w2"], strict=False)(mod)


def test_gradient_penalty_gradient_matches_finite_differences():
    mod = _wgan_gp_module()
    vm = compiled(mod)
    rng = np.random.default_rng(1)
    data = [rng.standard_normal((6, 2)) + 2, rng.standard_normal((6, 2))]
    t = rng.uniform(0, 1, (6, 1))
    mix = t * data[0] + (1 - t) * data[1]
    w1, w2 = rng.uniform(-1, 1, (2, 8)), rng.uniform(-1, 1, (8, 1))

    def f(a, b):
        return float(vm["objective"](*[tensor(v) for v in (*data, mix, a, b)]).numpy())

    loss, (g1, g2) = vm["objective_adjoint"](*[tensor(v) for v in (*data, mix, w1, w2)])
    assert np.isclose(float(loss.numpy()), f(w1, w2))
    for i, grad in enumerate((g1.numpy(), g2.numpy())):
        np.testing.assert_allclose(grad, fd_gradient(f, [w1, w2], i), rtol=1e-6, atol=1e-8)


def test_gradient_penalty_trains_with_sgd():
    vm = compiled(_wgan_gp_module())
    rng = np.random.default_rng(2)
    real = rng.standard_normal((6, 2)) * 0.5 + 1.5
    fake = rng.standard_normal((6, 2)) * 0.5 - 1.5
    t = rng.uniform(0, 1, (6, 1))
    mix = t * real + (1 - t) * fake
    w1, w2 = rng.uniform(-0.5, 0.5, (2, 8)), rng.uniform(-0.5, 0.5, (8, 1))
    losses = []
    for _ in range(8):
        loss, (g1, g2) = vm["objective_adjoint"](*[tensor(v) for v in (real, fake, mix, w1, w2)])
        losses.append(float(loss.numpy()))
        w1, w2 = w1 - 0.01 * g1.numpy(), w2 - 0.01 * g2.numpy()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("compile_with", ["tvm", "relaxgrad"])
def test_hvp_through_an_overlapping_max_pool_matches_finite_differences(compile_with):
    """``sum(max_pool2d(x, 3, 2, 1) * w)``: x's gradient gathers each window's w to its argmax
    (a ``call_tir_with_grad``, whose TE gradient reads the seed at the argmax), so the second
    derivative w.r.t. w is defined; Hessian-vector products against central differences of the
    compiled gradient, built by ``tvm.compile`` (which legalizes ``call_tir_with_grad`` once
    relaxgrad is imported) and by ``relaxgrad.compile``."""
    f64 = "float64"
    x = relax.Var("x", relax.TensorType((1, 2, 6, 5), f64))
    w = relax.Var("w", relax.TensorType((1, 2, 3, 3), f64))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            pooled = relax.op.nn.max_pool2d(x, 3, 2, 1)
            out = bb.emit_output(relax.op.sum(relax.op.multiply(pooled, w)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    assert "call_tir_with_grad" in mod["main_adjoint"].script()
    mod = relaxgrad.Gradient("main_adjoint", ["x", "w"], target_index=1, seed="param",
                             strict=False)(mod)  # fmt: skip
    build = (lambda m: tvm.compile(m, "llvm")) if compile_with == "tvm" else relaxgrad.compile
    vm = relax.VirtualMachine(build(mod), tvm.cpu())
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((1, 2, 6, 5)), rng.standard_normal((1, 2, 3, 3))
    v = [rng.standard_normal(xs.shape), rng.standard_normal(ws.shape)]
    _, (_, hw) = vm["main_adjoint_adjoint"](tensor(xs), tensor(ws), tuple(tensor(a) for a in v))

    def dot_at(ww):  # <grad(x, ww), v>
        _, gs = vm["main_adjoint"](tensor(xs), tensor(ww))
        return sum(float(np.sum(g.numpy() * d)) for g, d in zip(gs, v))

    want = fd_gradient(dot_at, [ws], 0)
    np.testing.assert_allclose(hw.numpy(), want, rtol=1e-6, atol=1e-8)
    assert np.abs(want).max() > 0.1  # the seed reached w through the argmaxes
