"""Rules for relax.op.index."""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.relax.op import clip, flip, floor_mod, reshape, strided_slice, zeros
from tvm.relax.op.grad import no_grad, take_backward
from tvm.relax.op.nn import pad

from .. import _ty
from ..errors import GradientError
from ._utils import scalar, static_dims
from .registry import register_gradient


def _read_indices(indices, mode: str, size, dtype: str):
    """The in-range indices (of ``dtype``) that ``take`` in ``mode`` reads along an axis of
    ``size``: clipped ("clip"), wrapped ("wrap") or as given ("fast", which promises in-range
    indices).

    Constant indices are mapped here, in numpy, and in "fast" mode negative ones count from the
    end: TVM's PyTorch importer emits ``take(x, -1, axis=1, mode="fast")`` for ``x[:, -1]``, and
    take_backward would write out of bounds for it (TVM's forward reads out of bounds there).
    Non-constant "fast" indices are left as they are, as TVM's own gradient does.
    """
    if mode not in ("fast", "clip", "wrap"):
        raise GradientError(f"Gradient: relax.take has no gradient for mode={mode!r}")
    size = int(size) if isinstance(size, tirx.IntImm) else size
    if isinstance(indices, _ty.Constant) and isinstance(size, int):
        values = indices.value.numpy()
        if mode == "clip":
            values = np.clip(values, 0, size - 1)
        else:  # wrap, and fast: in-range negative indices count from the end either way
            values = np.mod(values, size)
        return relax.const(values.astype(dtype), dtype)
    if mode == "clip":
        return clip(indices, relax.prim_value(0), relax.prim_value(size - 1))
    if mode == "wrap":
        return floor_mod(indices, scalar(size, dtype))
    return indices


def _flatten(indices):
    """``indices`` as a 1-D tensor (a constant stays a constant)."""
    if isinstance(indices, _ty.Constant):
        values = indices.value.numpy().reshape(-1)
        return relax.const(values, _ty.dtype_of(indices))
    return reshape(indices, [-1])


@register_gradient("relax.take")
def take_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = take(x, indices, axis, mode)``; backward: ``[take_backward(g, x, read,
    axis), no_grad]``, where ``read`` are the in-range positions y reads (see
    :func:`_read_indices`: clipped, wrapped, or negative ones counted from the end in "fast"
    mode), with ``g`` and the indices flattened to the 1-D indices take_backward needs."""
    x, indices = orig_call.args
    dtype = _ty.dtype_of(indices)
    axis = orig_call.attrs.axis
    if axis is not None:
        axis = int(axis) % _ty.ndim_of(x)  # take_backward needs a non-negative axis
    dims = _ty.shape_values(x)
    at = axis or 0
    if _ty.ndim_of(indices) != 1:  # flattened before clip/wrap: reshape needs a normalized arg
        indices = _flatten(indices)
        output_grad = reshape(output_grad, dims[:at] + [-1] + dims[at + 1 :])
    read = _read_indices(indices, str(orig_call.attrs.mode), dims[at], dtype)
    return [take_backward(output_grad, x, read, axis), no_grad(orig_call.args[1])]


def _slice_positions(call, dims) -> dict[int, range]:
    """For each sliced axis of a ``strided_slice`` call, the positions it reads (Python slice
    semantics, checked against the result shape)."""
    x, axes, begin, end, *strides = call.args
    values = [[int(v) for v in t.fields] for t in (axes, begin, end, *strides)]
    axes, begin, end = values[:3]
    strides = values[3] if strides else [1] * len(axes)
    positions = {}
    for axis, b, e, s in zip(axes, begin, end, strides):
        axis %= len(dims)
        positions[axis] = range(*slice(b, e, s).indices(dims[axis]))
    sliced = sorted(positions)
    got = static_dims(call, "relax.strided_slice", sliced)
    if [len(positions[a]) for a in sliced] != list(got):
        raise GradientError(
            f"Gradient: relax.strided_slice: cannot map the slice {call} to positions of x"
        )
    return positions


def _spread(grad, axis: int, dims: list[int], count: int, step: int):
    """``grad`` (``count`` along ``axis``) with ``step - 1`` zeros after each element but the last:
    the dense layout of positions ``0, step, ..., (count - 1) * step``."""
    grad = reshape(grad, dims[: axis + 1] + [1] + dims[axis + 1 :])
    widths = [0] * (2 * len(dims) + 2)
    widths[2 * axis + 3] = step - 1
    dims = dims[:axis] + [count * step] + dims[axis + 1 :]
    grad = reshape(pad(grad, widths), dims)
    return strided_slice(grad, [axis], [0], [(count - 1) * step + 1])


@register_gradient("relax.strided_slice")
def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = x[begin:end:strides]`` on ``axes``; backward: ``[g spread to the read
    positions with zeros elsewhere (flip, interleave, pad), no_grad...]``."""
    x = orig_call.args[0]
    dims = list(_ty.shape_values(x))  # symbolic ones only on axes not sliced
    sliced = sorted({int(a) % len(dims) for a in orig_call.args[1].fields})
    for axis, n in zip(sliced, static_dims(x, "relax.strided_slice", sliced)):
        dims[axis] = n
    positions = _slice_positions(orig_call, dims)
    no_grads = [no_grad(arg) for arg in orig_call.args[1:]]
    if any(len(p) == 0 for p in positions.values()):
        return [zeros(_ty.shape_of(x), _ty.dtype_of(x)), *no_grads]
    grad_dims = [len(positions[a]) if a in positions else d for a, d in enumerate(dims)]
    grad = output_grad
    widths = [0] * (2 * len(dims))
    for axis, read in positions.items():
        if read.step < 0:
            grad, read = flip(grad, axis), read[::-1]
        if read.step > 1:
            grad = _spread(grad, axis, grad_dims, len(read), read.step)
            grad_dims[axis] = read[-1] - read[0] + 1
        widths[2 * axis], widths[2 * axis + 1] = read[0], dims[axis] - 1 - read[-1]
    return [pad(grad, widths) if any(widths) else grad, *no_grads]


@register_gradient("relax.slice_scatter")
def slice_scatter_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = x`` with ``y[start:end:step] = src`` on ``axis`` (PyTorch's in-place ops
    on a slice, functionalized); backward: ``[slice_scatter(g, zeros like src),
    g[start:end:step], no_grad...]``."""
    x, src, start, end, step = orig_call.args
    axis = int(orig_call.attrs.axis) % _ty.ndim_of(x)
    bounds = [int(v) if isinstance(v, tirx.IntImm) else v for v in (start, end, step)]
    if not all(isinstance(v, int) for v in bounds):
        raise GradientError("Gradient: relax.slice_scatter needs a static start, end and step")
    begin, stop, stride = bounds
    untouched = relax.op.slice_scatter(output_grad, zeros(_ty.shape_of(src), _ty.dtype_of(src)),
                                       begin, stop, stride, axis=axis)  # fmt: skip
    written = strided_slice(output_grad, [axis], [begin], [stop], [stride])
    return [untouched, written, *(no_grad(arg) for arg in orig_call.args[2:])]
