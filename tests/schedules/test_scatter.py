"""take_backward as a parallel scatter-add (relaxgrad/schedules/scatter.py), the CPU
pipeline's legalization of an embedding's gradient."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import blas, scatter
from relaxgrad.testing import assert_gradients_close
from relaxgrad.training import export


def _take_backward_module(x_shape, length, axis, dtype, index_dtype) -> tvm.IRModule:
    g_shape = list(x_shape)
    g_shape[axis] = length
    g = relax.Var("g", relax.TensorType(g_shape, dtype))
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    indices = relax.Var("indices", relax.TensorType([length], index_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [g, x, indices]):
        with bb.dataflow():
            out = bb.emit_output(op.grad.take_backward(g, x, indices, axis))
        bb.emit_func_output(out)
    return bb.get()


def _scatter_added(g, indices, axis, x_shape):
    want = np.zeros(x_shape, g.dtype)
    inside = (indices >= 0) & (indices < x_shape[axis])
    np.add.at(np.moveaxis(want, axis, 0), indices[inside],
              np.moveaxis(np.take(g, np.flatnonzero(inside), axis), axis, 0))  # fmt: skip
    return want


# (x shape, indices, axis, dtype, index dtype, threads): strips with a tail (37 columns on 2 or
# 3 threads), one column per row (the last axis), rows before the axis, a result large enough
# for the parallel loops, float64 and float16, int64 indices.
CASES = [
    ((2, 768), 1024, 0, "float32", "int32", 2),
    ((300, 40), 700, 0, "float32", "int32", 3),
    ((5, 37), 9, 0, "float32", "int64", 2),
    ((3, 5, 37), 11, 1, "float32", "int32", 3),
    ((4, 6, 7), 9, 2, "float32", "int32", 2),
    ((64, 300, 3), 500, 1, "float64", "int64", 2),
    ((6, 40), 50, 0, "float16", "int32", 2),
]


@pytest.mark.parametrize("x_shape, length, axis, dtype, index_dtype, threads", CASES)
def test_take_backward_adds_every_index_row(x_shape, length, axis, dtype, index_dtype, threads,
                                            monkeypatch):  # fmt: skip
    """Repeated indices accumulate, each strip of columns gets every row: the values of numpy's
    ``add.at`` (and of TVM's own legalization, built by ``tvm.compile``)."""
    monkeypatch.setattr(blas, "THREADS", threads)
    mod = _take_backward_module(x_shape, length, axis, dtype, index_dtype)
    rng = np.random.default_rng(len(x_shape) + length)
    g_shape = list(x_shape)
    g_shape[axis] = length
    g = rng.standard_normal(g_shape).astype(dtype)
    indices = rng.integers(0, x_shape[axis], length).astype(index_dtype)
    inputs = [tvm.runtime.tensor(a) for a in (g, np.zeros(x_shape, dtype), indices)]
    ours = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main"](*inputs).numpy()
    tvms = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](*inputs).numpy()
    tol = 1e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(ours, _scatter_added(g, indices, axis, x_shape), rtol=tol,
                               atol=tol)  # fmt: skip
    np.testing.assert_allclose(ours, tvms, rtol=tol, atol=tol)


def test_take_backward_skips_indices_out_of_range():
    """Indices outside the axis add nothing (TVM's loops would write out of bounds)."""
    x_shape, axis = (4, 33), 0
    mod = _take_backward_module(x_shape, 6, axis, "float32", "int32")
    g = np.arange(6 * 33, dtype="float32").reshape(6, 33)
    indices = np.array([0, -1, 3, 4, 1000, 3], "int32")
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in (g, np.zeros(x_shape, "float32"), indices)])
    np.testing.assert_array_equal(out.numpy(), _scatter_added(g, indices, axis, x_shape))


@pytest.mark.parametrize("x_shape, length, axis", [((5, 0), 3, 0), ((5, 4), 0, 0),
                                                    ((2, 4, 0), 3, 1)])  # fmt: skip
def test_take_backward_of_empty_tensors_is_zeros(x_shape, length, axis):
    """No columns, or no indices: zeros of x's shape (TVM's legalization divides by zero)."""
    mod = _take_backward_module(x_shape, length, axis, "float32", "int32")
    g_shape = list(x_shape)
    g_shape[axis] = length
    inputs = [np.ones(g_shape, "float32"), np.ones(x_shape, "float32"),
              np.arange(length, dtype="int32")]  # fmt: skip
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()
    np.testing.assert_array_equal(out, np.zeros(x_shape, "float32"))


def test_take_backward_is_legalized_into_parallel_strips():
    """The legalized function is ours: a parallel loop over the strips (a structural check;
    the values are checked above)."""
    mod = _take_backward_module((3000, 64), 1024, 0, "float32", "int32")
    func = scatter.legalize_take_backward
    legalized = relaxgrad.schedules.LegalizeOpsOnce({"relax.grad.take_backward": func})(mod)
    kernels = [f for _, f in legalized.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1 and "T.parallel" in kernels[0].script()


def test_embedding_gradient_matches_finite_differences():
    """An embedding lookup's gradient (take, then a loss), compiled by ``relaxgrad.compile``,
    against float64 finite differences; the table is large enough for the parallel loops."""
    table = relax.Var("table", relax.TensorType((600, 64), "float64"))
    ids = relax.Var("ids", relax.TensorType((4, 30), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [table, ids]):
        with bb.dataflow():
            rows = bb.emit(op.take(table, ids, axis=0))
            out = bb.emit_output(op.sum(op.multiply(rows, rows)))
        bb.emit_func_output(out)
    rng = np.random.default_rng(3)
    ids_value = rng.integers(0, 600, (4, 30)).astype("int64")
    ids_value[0, :5] = 7  # repeated rows accumulate
    inputs = [rng.uniform(-1, 1, (600, 64)), ids_value]
    assert_gradients_close(bb.get(), inputs=inputs, wrt=[0], compile=relaxgrad.compile)


def _max_pool_adjoint(shape, dtype, **pool) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            pooled = op.nn.max_pool2d(op.multiply(x, w), **pool)
            out = bb.emit_output(op.sum(op.multiply(pooled, pooled)))
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main", require_grads=[x])(bb.get())


# ResNet's stem pool (3x3, stride 2, padding 1), a rectangular window with uneven padding, and
# integer-valued inputs whose windows tie (the first argmax takes the gradient, as TVM's)
POOLS = [
    ((2, 3, 12, 12), "float64", dict(pool_size=3, strides=2, padding=1), False),
    ((1, 2, 9, 7), "float64", dict(pool_size=(3, 2), strides=(2, 1), padding=(1, 0, 0, 1)), False),
    ((2, 64, 40, 40), "float32", dict(pool_size=3, strides=2, padding=1), True),
]


@pytest.mark.parametrize(("shape", "dtype", "pool", "ties"), POOLS)
def test_overlapping_max_pool_gradient_is_a_scatter(shape, dtype, pool, ties):
    """The CPU pipeline replaces the gather (one PrimFunc per pool, kept for TE's second
    order) by the scatter; its values are the gather's (``tvm.compile`` of the same module)
    and PyTorch's (float64)."""
    mod = _max_pool_adjoint(shape, dtype, **pool)
    gathers = [gv for gv, f in mod.functions_items()
               if "relaxgrad.window_scatter" in (f.attrs or {})]  # fmt: skip
    assert len(gathers) == 1
    assert "first_flat" in scatter.WindowScatter()(mod)[gathers[0]].script()
    rng = np.random.default_rng(9)
    x = rng.integers(-2, 3, shape) if ties else rng.standard_normal(shape)
    w = np.ones(shape) if ties else rng.standard_normal(shape)
    args = [tvm.runtime.tensor(v.astype(dtype)) for v in (x, w)]
    _, (got,) = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main_adjoint"](*args)
    _, (want,) = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main_adjoint"](*args)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    if dtype == "float64":
        import torch

        tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        tw = torch.tensor(w, dtype=torch.float64)
        kernel = pool["pool_size"]
        top, left, bottom, right = (pool["padding"],) * 4 if isinstance(pool["padding"], int) \
            else pool["padding"]  # fmt: skip
        padded = torch.nn.functional.pad(tx * tw, (left, right, top, bottom), value=-np.inf)
        pooled = torch.nn.functional.max_pool2d(padded, kernel, pool["strides"])
        (pooled * pooled).sum().backward()
        np.testing.assert_allclose(got.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-12)


def _serial(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A GPU PrimFunc's thread bindings as serial loops: the same arithmetic, built for llvm."""
    text = re.sub(r"T\.thread_binding\((\w+), thread=\"[\w.]+\"\)", r"T.serial(\1)", func.script())
    assert "thread_binding" not in text and "T.serial" in text
    return tvm.script.from_source(text).with_attr("global_symbol", "main")


@pytest.mark.parametrize("x_shape, length, axis, dtype, index_dtype, threads", CASES)
def test_gpu_take_backward_adds_every_index_row(x_shape, length, axis, dtype, index_dtype,
                                                threads):  # fmt: skip
    """The GPU scatter-add's kernels (one thread per element zeroing, one per column adding,
    with out-of-range indices skipped), each thread run in turn on the CPU: numpy's add.at."""
    g_shape = list(x_shape)
    g_shape[axis] = length
    func = scatter.take_backward_gpu_func(g_shape, x_shape, length, axis, dtype, index_dtype)
    assert func.script().count('thread="blockIdx.x"') == 2  # two kernels, bound to threads
    built = tvm.compile(tvm.IRModule({"main": _serial(func)}), "llvm")
    rng = np.random.default_rng(len(x_shape) + length)
    g = rng.standard_normal(g_shape).astype(dtype)
    indices = rng.integers(-1, x_shape[axis] + 1, length).astype(index_dtype)  # some outside
    out = tvm.runtime.tensor(np.full(x_shape, np.nan, dtype))  # every element written
    built["main"](*[tvm.runtime.tensor(a) for a in (g, np.zeros(x_shape, dtype), indices)], out)
    tol = 1e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(out.numpy(), _scatter_added(g, indices, axis, x_shape), rtol=tol,
                               atol=tol)  # fmt: skip


def test_gpu_pipeline_legalizes_take_backward_as_scatter():
    """The CUDA build of an embedding's gradient takes the GPU scatter-add (TVM's legalization
    is one no schedule rule takes: the build raised)."""
    mod = _take_backward_module((300, 40), 700, 0, "float32", "int32")
    executable = relaxgrad.compile(mod, {"kind": "cuda", "arch": "sm_90"})
    source = "".join(export.cuda_sources(executable))
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert kernels == {"take_backward_kernel", "take_backward_kernel_1"}, kernels
    assert "atomic" not in source
