"""nll_loss_backward as a masked broadcast (relaxgrad/schedules/losses.py): the cross-entropy
gradient fuses into the log-softmax gradient's kernel; values against the legalization
(``tvm.compile``) and PyTorch (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import NllLossGradAsMask


def _module(n: int, c: int, weighted: bool, reduction: str, ignore: int) -> tvm.IRModule:
    z = relax.Var("z", relax.TensorType((n, c), "float64"))
    y = relax.Var("y", relax.TensorType((n,), "int64"))
    params = [z, y]
    if weighted:
        params.append(relax.Var("w", relax.TensorType((c,), "float64")))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            weights = params[2] if weighted else None
            loss = op.nn.nll_loss(op.nn.log_softmax(z), y, weights, reduction, ignore)
            out = bb.emit_output(loss)
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main", require_grads=[z])(bb.get())


CASES = [  # (weighted, reduction, ignore_index)
    (False, "mean", -100),
    (False, "sum", -100),
    (True, "mean", -100),
    (True, "sum", 2),
    (False, "mean", 2),
]


@pytest.mark.parametrize(("weighted", "reduction", "ignore"), CASES)
def test_nll_loss_gradient_is_a_masked_broadcast(weighted, reduction, ignore):
    n, c = 64, 1031
    mod = _module(n, c, weighted, reduction, ignore)
    if not weighted:  # (the weighted loss's rule writes its own one-hot product)
        rewritten = NllLossGradAsMask()(mod)["main_adjoint"].script()
        assert "nll_loss_backward" not in rewritten and "R.where" in rewritten
    rng = np.random.default_rng(11)
    z = rng.standard_normal((n, c))
    y = rng.integers(0, c, n)
    y[::5] = ignore  # the ignored target: a class, or PyTorch's -100 (a masked token)
    w = rng.uniform(0.5, 2.0, c)
    inputs = [z, y] + ([w] if weighted else [])
    args = [tvm.runtime.tensor(v) for v in inputs]
    loss, (got,) = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main_adjoint"](*args)
    if ignore >= 0:  # TVM's legalization reads weights[-100] and counts the row (see losses.py)
        _, (want,) = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main_adjoint"](
            *args)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-14)
    tz = torch.tensor(z, requires_grad=True)
    ignore_index = ignore if ignore >= 0 else -100
    weight = torch.tensor(w) if weighted else None
    torch_loss = torch.nn.functional.cross_entropy(tz, torch.tensor(y), weight,
                                                   ignore_index=ignore_index,
                                                   reduction=reduction)  # fmt: skip
    torch_loss.backward()
    np.testing.assert_allclose(loss.numpy(), torch_loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got.numpy(), tz.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_other_shapes_keep_the_legalization():
    """Predictions with spatial axes ``(N, C, d)`` are left to TVM's kernel."""
    z = relax.Var("z", relax.TensorType((4, 5, 3), "float32"))
    y = relax.Var("y", relax.TensorType((4, 3), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [z, y]):
        with bb.dataflow():
            out = bb.emit_output(op.nn.nll_loss(op.nn.log_softmax(z, axis=1), y))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main", require_grads=[z])(bb.get())
    assert "nll_loss_backward" in NllLossGradAsMask()(mod)["main_adjoint"].script()


@pytest.mark.parametrize(("weighted", "reduction", "ignore"), CASES)
def test_nll_loss_backward_called_directly_keeps_its_values(weighted, reduction, ignore):
    """``nll_loss_backward`` as a program may call it (weights included): the rewrite's
    values are the legalization's."""
    n, c = 72, 1000
    g = relax.Var("g", relax.TensorType((), "float32"))
    p = relax.Var("p", relax.TensorType((n, c), "float32"))
    y = relax.Var("y", relax.TensorType((n,), "int64"))
    w = relax.Var("w", relax.TensorType((c,), "float32"))
    params = [g, p, y] + ([w] if weighted else [])
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            grad = op.grad.nll_loss_backward(g, p, y, w if weighted else None, reduction, ignore)
            out = bb.emit_output(op.multiply(grad, p))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "nll_loss_backward" not in NllLossGradAsMask()(mod).script()
    rng = np.random.default_rng(12)
    y_values = rng.integers(0, c, n)
    y_values[::4] = ignore
    inputs = [np.array(1.7, "float32"), rng.standard_normal((n, c)).astype("float32"), y_values]
    inputs += [rng.uniform(0.5, 2.0, c).astype("float32")] if weighted else []
    args = [tvm.runtime.tensor(v) for v in inputs]
    got = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main"](*args).numpy()
    # nll_loss_backward's values, PyTorch's: -w[y] * g / W at each row's target, W the sum of
    # the kept rows' weights for "mean"; an ignored row (the class, or -100) is zero
    g_value, p_value = float(inputs[0]), inputs[1].astype(np.float64)
    kept = y_values != ignore
    row_w = np.where(kept, inputs[3][np.where(kept, y_values, 0)] if weighted else 1.0, 0.0)
    scale = g_value / (row_w.sum() if reduction == "mean" else 1.0)
    want = np.zeros((n, c))
    want[np.arange(n)[kept], y_values[kept]] = -row_w[kept] * scale
    np.testing.assert_allclose(got, want * p_value, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(got) > 0
