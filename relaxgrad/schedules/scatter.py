"""``relax.grad.take_backward`` (an embedding's gradient) as a parallel scatter-add (CPU and
GPU).

TVM legalizes ``take_backward(g, x, indices, axis)`` into one serial loop nest: zero the
result, then, for each column of the rows after ``axis``, add every index's row of ``g`` into
it. The inner loop walks ``g`` down a column (a stride of a whole row per step): BERT-base's
token-type embedding (2 x 768, from 1024 rows) took 2.4 ms per step for 0.8 M additions, and
its word embedding's (30522 x 768) 4.5 ms, mostly zeroing 94 MB on one thread.

:func:`legalize_take_backward` builds, for static shapes, a PrimFunc that zeroes the result
in a parallel loop over its rows, then splits the columns after ``axis`` into ``THREADS``
parallel strips: each task adds every index's row of ``g`` into its strip, along the rows
(contiguous, vectorized). Tasks write disjoint strips, so no two add into the same element.
Indices outside ``[0, x.shape[axis])`` add nothing (TVM's writes out of bounds).

On a GPU, TVM's serial loop nest is one no schedule rule takes (dlight's Fallback refuses its
data-dependent writes): :func:`legalize_take_backward_gpu` builds two kernels, one thread per
element of the result zeroing it, then one thread per column (of each slice before ``axis``)
adding every index's row of ``g`` into it in index order, so that no two threads write one
element (no atomics: the sum's order is fixed, the result deterministic); a warp's threads read
one row of ``g`` together.

:class:`WindowScatter` writes an overlapping max pool's gradient (relaxgrad's gather, whose
PrimFunc carries its window geometry) as a scatter over each plane.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx
from tvm.ir import IRModule, Op
from tvm.script import tirx as T

from ..ops.nn import WINDOW_SCATTER
from . import blas
from ._common import OPAQUE, parsed_script, static_shape

_LANES = 16  # columns of a strip are a multiple of this where the rows are that long
_PARALLEL_FROM = 1 << 15  # elements of the result (or of g) from which the loops run parallel


def _take_backward_script(
    *, chunks, cols, dtype, g_shape, g_size, index_dtype, length, out_shape, out_size, parallel,
    pre, rows, step, x_shape,
):  # fmt: skip
    """The TVMScript of :func:`take_backward_func`, read by :func:`parsed_script` (never
    called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def take_backward(g_handle: T.handle, x_handle: T.handle, i_handle: T.handle,
                      out_handle: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        g = T.match_buffer(g_handle, g_shape, dtype)
        T.match_buffer(x_handle, x_shape, dtype)
        indices = T.match_buffer(i_handle, (length,), index_dtype)
        out = T.match_buffer(out_handle, out_shape, dtype)
        g_flat = T.decl_buffer((g_size,), dtype, data=g.data)
        out_flat = T.decl_buffer((out_size,), dtype, data=out.data)
        for row in T.parallel(pre * rows) if parallel else T.serial(pre * rows):
            for col in range(cols):
                out_flat[row * cols + col] = T.Cast(dtype, 0)
        for task in T.parallel(pre * chunks) if parallel else T.serial(pre * chunks):
            p = task // chunks
            start = task % chunks * step
            for position in range(length):
                index = T.Cast("int64", indices[position])
                if index >= 0 and index < rows:
                    for col in range(T.min(step, cols - start)):
                        out_flat[(p * rows + index) * cols + start + col] = (
                            out_flat[(p * rows + index) * cols + start + col]
                            + g_flat[(p * length + position) * cols + start + col]
                        )


def take_backward_func(g_shape, x_shape, length: int, axis: int, dtype: str, index_dtype: str,
                       threads: int | None = None) -> tirx.PrimFunc:  # fmt: skip
    """The PrimFunc ``(g, x, indices, out)`` of ``take_backward`` along ``axis`` of ``x``
    (``x_shape``) with ``length`` 1-D indices, in ``threads`` strips of columns at most
    (:data:`blas.THREADS` by default)."""
    threads = blas.THREADS if threads is None else threads
    pre, rows, cols = math.prod(x_shape[:axis]), x_shape[axis], math.prod(x_shape[axis + 1 :])
    step = max(-(-cols // threads), 1)  # (empty rows: one task that adds nothing)
    if cols >= _LANES * threads:
        step = -(-step // _LANES) * _LANES
    chunks = max(-(-cols // step), 1)
    out_shape, out_size = x_shape, math.prod(x_shape)
    g_size = math.prod(g_shape)
    parallel = max(out_size, g_size) >= _PARALLEL_FROM
    return parsed_script(_take_backward_script, locals())


_GPU_THREADS = 256


def _take_backward_gpu_script(
    *, cols, dtype, g_shape, g_size, index_dtype, length, out_blocks, out_shape, out_size, pre,
    rows, scatter_blocks, threads, x_shape,
):  # fmt: skip
    """The TVMScript of :func:`take_backward_gpu_func`, read by :func:`parsed_script` (never
    called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def take_backward(g_handle: T.handle, x_handle: T.handle, i_handle: T.handle,
                      out_handle: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        g = T.match_buffer(g_handle, g_shape, dtype)
        T.match_buffer(x_handle, x_shape, dtype)
        indices = T.match_buffer(i_handle, (length,), index_dtype)
        out = T.match_buffer(out_handle, out_shape, dtype)
        g_flat = T.decl_buffer((g_size,), dtype, data=g.data)
        out_flat = T.decl_buffer((out_size,), dtype, data=out.data)
        for bx in T.thread_binding(out_blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                e = T.Cast("int64", bx) * threads + tx
                if e < out_size:
                    out_flat[e] = T.Cast(dtype, 0)
        for bx in T.thread_binding(scatter_blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                t = T.Cast("int64", bx) * threads + tx
                if t < pre * cols:
                    p = t // cols
                    col = t % cols
                    for position in range(length):
                        index = T.Cast("int64", indices[position])
                        if index >= 0 and index < rows:
                            out_flat[(p * rows + index) * cols + col] = (
                                out_flat[(p * rows + index) * cols + col]
                                + g_flat[(p * length + position) * cols + col]
                            )


def take_backward_gpu_func(g_shape, x_shape, length: int, axis: int, dtype: str,
                           index_dtype: str) -> tirx.PrimFunc:  # fmt: skip
    """The GPU PrimFunc ``(g, x, indices, out)`` of ``take_backward`` along ``axis`` of ``x``
    (``x_shape``) with ``length`` 1-D indices (see the module docstring)."""
    threads = _GPU_THREADS
    pre, rows, cols = math.prod(x_shape[:axis]), x_shape[axis], math.prod(x_shape[axis + 1 :])
    out_shape, out_size, g_size = x_shape, math.prod(x_shape), math.prod(g_shape)
    out_blocks = max(-(-out_size // threads), 1)
    scatter_blocks = max(-(-(pre * cols) // threads), 1)
    return parsed_script(_take_backward_gpu_script, locals())


def _legalizer(build):
    """``take_backward``'s legalization by ``build`` (:func:`take_backward_func` or
    :func:`take_backward_gpu_func`) along an axis with static shapes, else TVM's."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        g, x, indices = call.args
        g_shape, x_shape, index_shape = static_shape(g), static_shape(x), static_shape(indices)
        shapes = (g_shape, x_shape, index_shape)
        if call.attrs.axis is None or any(s is None for s in shapes) or len(index_shape) != 1:
            return Op.get("relax.grad.take_backward").get_attr("FLegalize")(bb, call)
        axis, dtype = int(call.attrs.axis) % len(x_shape), x.ty.dtype
        func = build(g_shape, x_shape, index_shape[0], axis, dtype, indices.ty.dtype)
        gvar = bb.add_func(func, "take_backward")
        return relax.call_tir(gvar, [g, x, indices], relax.TensorType(x_shape, dtype))

    return legalize


legalize_take_backward = _legalizer(take_backward_func)
"""``take_backward``'s CPU legalization: :func:`take_backward_func` where shapes are static."""
legalize_take_backward_gpu = _legalizer(take_backward_gpu_func)
"""``take_backward``'s GPU legalization: :func:`take_backward_gpu_func` where shapes are
static."""


def _window_scatter_script(
    *, dtype, first_shape, in_h, in_w, ins, kx_size, left, out_h, out_w, parallel, planes, size,
    sx, sy, top,
):  # fmt: skip
    """The TVMScript of :func:`window_scatter_func`, read by :func:`parsed_script` (never
    called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def window_scatter(first_handle: T.handle, g_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        first = T.match_buffer(first_handle, first_shape, "int32")
        g = T.match_buffer(g_handle, first_shape, dtype)
        out = T.match_buffer(out_handle, ins, dtype)
        first_flat = T.decl_buffer((planes * out_h * out_w,), "int32", data=first.data)
        g_flat = T.decl_buffer((planes * out_h * out_w,), dtype, data=g.data)
        out_flat = T.decl_buffer((planes * in_h * in_w,), dtype, data=out.data)
        for p in T.parallel(planes) if parallel else T.serial(planes):
            base = T.Cast("int64", p) * (in_h * in_w)
            windows = T.Cast("int64", p) * (out_h * out_w)
            for e in range(in_h * in_w):
                out_flat[base + e] = T.Cast(dtype, 0)
            for i, j in T.grid(out_h, out_w):
                k = first_flat[windows + i * out_w + j]
                y = i * sy + k // kx_size - top
                x = j * sx + k % kx_size - left
                if k >= 0 and k < size and y >= 0 and y < in_h and x >= 0 and x < in_w:
                    out_flat[base + y * in_w + x] = (
                        out_flat[base + y * in_w + x] + g_flat[windows + i * out_w + j]
                    )


def window_scatter_func(first_shape, ins, dtype: str, ky_size: int, kx_size: int, sy: int,
                        sx: int, top: int, left: int) -> tirx.PrimFunc:  # fmt: skip
    """The PrimFunc ``(first, g, out)`` of an overlapping max pool's gradient over the last two
    axes of ``ins`` (NCHW): each plane (parallel) zeroed, then each window's ``g`` added at
    its first argmax, ``first`` (the offset ``ky * kx_size + kx``; none where it is out of
    ``[0, ky_size * kx_size)``)."""
    planes, (in_h, in_w), (out_h, out_w) = math.prod(ins[:-2]), ins[-2:], first_shape[-2:]
    size = ky_size * kx_size
    parallel = planes > 1 and math.prod(ins) >= _PARALLEL_FROM
    return parsed_script(_window_scatter_script, locals())


@tvm.transform.module_pass(opt_level=0, name="WindowScatter")
class WindowScatter:
    """An overlapping max pool's gradient (the gather of :mod:`relaxgrad.ops.nn`, which also
    has TE's gradient for a second order) as a scatter on the CPU, pooled over the last two
    axes: per position of the input, the gather read the argmax of its (up to four) windows
    with its index arithmetic per vector lane (ResNet-50's 8 x 64 x 112 x 112: 5.5 ms); the
    scatter zeroes each plane, then adds each window's gradient at its argmax, planes in
    parallel (disjoint)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            pool = func.attrs.get(WINDOW_SCATTER) if func.attrs is not None else None
            if not isinstance(func, tirx.PrimFunc) or pool is None:
                continue
            pool = {key: int(value) for key, value in pool.items()}
            first, _, out = func.params  # buffer vars: .shape and .dtype
            rank = len(out.shape)
            if (pool["ay"], pool["ax"]) != (rank - 2, rank - 1):
                continue  # pooled over other axes (NHWC): the gather
            shapes = [[int(d) for d in buf.shape] for buf in (first, out)]
            del pool["ay"], pool["ax"]
            updates[gvar] = window_scatter_func(*shapes, str(out.dtype), **pool)
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod
