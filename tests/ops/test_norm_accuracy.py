"""The float32 accuracy of the batch-norm gradient against PyTorch: at least as close to the
float64 gradient as PyTorch's float32 CPU kernel, which accumulates its sums in double.

Two regimes: a batch norm over a batch of 2 (LeViT's classifier), whose input gradient is
eps's share of ``g`` (the rest cancels) and which relaxgrad computes in float64; and one over
4096 elements per channel, whose sums relaxgrad accumulates in float64 as PyTorch does."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad

torch = pytest.importorskip("torch")


def _module(shape):
    dtype, channels = "float32", shape[1]
    x = relax.Var("x", relax.TensorType(shape, dtype))
    gamma, beta, mean, var = (relax.Var(n, relax.TensorType((channels,), dtype))
                              for n in ("gamma", "beta", "mean", "var"))  # fmt: skip
    w = relax.Var("w", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, gamma, beta, mean, var, w]):
        with bb.dataflow():
            bn = bb.emit(op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True))
            y = bb.emit(relax.TupleGetItem(bn, 0))
            out = bb.emit_output(op.sum(op.multiply(y, w)))
        bb.emit_func_output(out)
    mod = bb.get()
    return relaxgrad.Gradient("main", require_grads=mod["main"].params[:3])(mod)


def _torch_gradients(arrays, dtype):
    x, gamma, beta, mean, var, w = (torch.tensor(a, dtype=dtype) for a in arrays)
    for t in (x, gamma, beta):
        t.requires_grad_(True)
    y = torch.nn.functional.batch_norm(x, mean, var, gamma, beta, training=True)
    (y * w).sum().backward()
    return [t.grad.double().numpy() for t in (x, gamma, beta)]


@pytest.mark.parametrize("shape", [(2, 8), (4, 8, 32, 32)], ids=["batch-of-2", "4096-elements"])
def test_batch_norm_gradient_is_as_close_to_float64_as_pytorch(shape):
    rng = np.random.default_rng(0)
    channels = shape[1]
    arrays = [rng.standard_normal(shape).astype("float32") * 3 + 1,
              rng.uniform(0.5, 2, channels).astype("float32"),
              rng.standard_normal(channels).astype("float32"),
              np.zeros(channels, "float32"), np.ones(channels, "float32"),
              rng.standard_normal(shape).astype("float32")]  # fmt: skip
    vm = relax.VirtualMachine(relaxgrad.compile(_module(shape)), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])
    exact = _torch_gradients(arrays, torch.float64)
    theirs = _torch_gradients(arrays, torch.float32)
    for name, ours, want, torch32 in zip(("x", "gamma", "beta"), grads, exact, theirs):
        error = np.linalg.norm(ours.numpy() - want)
        assert error <= 1.5 * np.linalg.norm(torch32 - want) + 1e-12, name
