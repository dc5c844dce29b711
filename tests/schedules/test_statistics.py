"""ShareStatistics (relaxgrad/schedules/statistics.py): training-mode batch_norm and variance
as means of the gradient's form give TVM's values, and after common subexpressions a batch
norm's forward, its saved statistics and its gradient compute the statistics once."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import cpu_pipeline, host_target
from relaxgrad.schedules import ShareStatistics
from relaxgrad.testing import FAST_LLVM


def _module(shape, axis: int, keepdims: bool, scale: bool = True, center: bool = True,
            relu: bool = False):  # fmt: skip
    """``main(x, gamma, beta, mean, var)``: training batch_norm's three results, the batch's
    ``variance`` over the other axes (as an importer saves it), and a loss of ``y`` (of
    ``relu(y)`` with ``relu``); the gradient of the loss (relaxgrad's rule recomputes the
    statistics)."""
    channels = shape[axis]
    axes = [a for a in range(len(shape)) if a != axis]
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [relax.Var(n, relax.TensorType((channels,), "float32"))
              for n in ("gamma", "beta", "mean", "var")]  # fmt: skip
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            bn = bb.emit(op.nn.batch_norm(x, *params, axis=axis, momentum=0.3, epsilon=1e-3,
                                          scale=scale, center=center))  # fmt: skip
            y = bb.emit(relax.TupleGetItem(bn, 0))
            y = bb.emit(op.nn.relu(y)) if relu else y
            var = bb.emit(op.variance(x, axes, keepdims=keepdims))
            weights = np.random.default_rng(0).standard_normal(shape).astype("float32")
            loss = bb.emit(op.sum(op.multiply(y, relax.const(weights))))  # not flat in x
            outs = [bb.emit_output(v) for v in (loss, relax.TupleGetItem(bn, 1),
                                                relax.TupleGetItem(bn, 2), var)]  # fmt: skip
        bb.emit_func_output(relax.Tuple(outs))
    mod = bb.get()
    return relaxgrad.Gradient("main", require_grads=mod["main"].params[:3], target_index=0)(mod)


def _run(executable, inputs):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    (loss, mean, var, batch_var), grads = vm["main_adjoint"](
        *[tvm.runtime.tensor(a) for a in inputs]
    )
    return [t.numpy() for t in (loss, mean, var, batch_var, *grads)]


@pytest.mark.parametrize(
    "shape, axis, keepdims, affine",
    [((4, 3, 5, 6), 1, False, True), ((6, 8), 1, True, True), ((2, 5, 3, 4), 1, False, False),
     ((3, 4, 7), 2, True, True)],
)  # fmt: skip
def test_values_match_tvm(shape, axis, keepdims, affine):
    mod = _module(shape, axis, keepdims, scale=affine, center=affine)
    rng = np.random.default_rng(1)
    channels = shape[axis]
    inputs = [rng.standard_normal(shape).astype("float32") * 2 + 1,
              *(rng.standard_normal(channels).astype("float32") for _ in range(3)),
              rng.uniform(0.5, 2, channels).astype("float32")]  # fmt: skip
    want = _run(tvm.compile(mod, FAST_LLVM), inputs)
    rewritten = ShareStatistics()(mod)
    assert "batch_norm" not in rewritten.script() and "variance" not in rewritten.script()
    for executable in (tvm.compile(rewritten, FAST_LLVM), relaxgrad.compile(mod)):
        for got, w in zip(_run(executable, inputs), want, strict=True):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_statistics_are_computed_once():
    """The mean and the centered square's mean of ``x`` (float64): once each after the rewrite and
    ``EliminateCommonSubexpr``, for the forward, the saved variance and the gradient (TVM's
    pipeline alone has them in batch_norm's kernel, variance's and the gradient's)."""
    mod = _module((4, 3, 5, 6), 1, keepdims=False)
    shared = relax.transform.EliminateCommonSubexpr()(ShareStatistics()(mod))
    script = shared["main_adjoint"].script()
    widened = re.findall(r"(\w+): R.Tensor\(\(4, 3, 5, 6\), dtype=\"float64\"\) = "
                         r"R\.astype\(x, dtype=\"float64\"\)", script)
    assert len(widened) == 1  # accumulated in float64, as PyTorch's CPU kernel
    means_of_x = re.findall(rf"R\.mean\({widened[0]}, axis=\[0, 2, 3\], keepdims=True\)", script)
    assert "R.nn.batch_norm" not in script and "R.variance" not in script
    assert len(means_of_x) == 1 and script.count("R.mean(") == 2
    assert script.count("R.rsqrt(") == 1


def test_relu_after_batch_norm_fuses_into_the_normalization():
    """Training-mode ``relu(batch_norm(x))``: the running statistics' tuple does not keep the
    normalized ``y`` alive, so ``y`` is recomputed from ``x`` where relu's gradient reads it:
    relu runs in the normalization's kernel, and ``y`` is never written (one pass over the
    activation less each way). The values are TVM's own compile's, and PyTorch's gradient."""
    import torch

    shape = (4, 8, 6, 5)
    mod = _module(shape, 1, keepdims=False, relu=True)
    with host_target() as target:
        passes = list(cpu_pipeline(target).passes)
        names = [p.info.name for p in passes]
        fused = tvm.transform.Sequential(passes[: names.index("FuseTIR") + 1])(mod)
    kernels = re.findall(r"R\.call_tir\((\w+)", fused["main_adjoint"].script())
    normalized = [k for k in kernels if "rsqrt" in k and "relu" in k]
    masks = [k for k in kernels if "where" in k]
    assert normalized and "relu" not in kernels and all("rsqrt" in k for k in masks), kernels
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(shape).astype("float32") * 2 + 1,
              *(rng.standard_normal(8).astype("float32") for _ in range(3)),
              rng.uniform(0.5, 2, 8).astype("float32")]  # fmt: skip
    want = _run(tvm.compile(mod, FAST_LLVM), inputs)
    got = _run(relaxgrad.compile(mod), inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())
    x, gamma, beta = (torch.tensor(a, requires_grad=True) for a in inputs[:3])
    weights = torch.tensor(np.random.default_rng(0).standard_normal(shape).astype("float32"))
    y = torch.nn.functional.batch_norm(x, None, None, gamma, beta, training=True, eps=1e-3)
    (torch.relu(y) * weights).sum().backward()
    for g, t in zip(got[4:], (x, gamma, beta), strict=True):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-4, atol=1e-4)
