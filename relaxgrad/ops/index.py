"""Rules for relax.op.index."""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import clip, flip, floor_mod, reshape, strided_slice, zeros
from tvm.relax.op.grad import no_grad, take_backward
from tvm.relax.op.nn import pad

from .. import _ty
from ..errors import GradientError
from ._utils import static_dims
from .registry import register_gradient


def _read_indices(indices, mode: str, size):
    """The in-range indices that ``take`` in ``mode`` reads along an axis of ``size``."""
    if mode == "fast":
        return indices
    if mode == "clip":
        return clip(indices, relax.prim_value(0), relax.prim_value(size - 1))
    if mode == "wrap":
        return floor_mod(indices, relax.const(int(size), _ty.dtype_of(indices)))
    raise GradientError(f"Gradient: relax.take has no gradient for mode={mode!r}")


@register_gradient("relax.take")
def take_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = take(x, indices, axis)``; backward: ``[take_backward(g, x, indices, axis),
    no_grad]``, with ``g`` and the indices flattened to the 1-D indices take_backward needs."""
    x, indices = orig_call.args
    axis = orig_call.attrs.axis
    if axis is not None:
        axis = int(axis) % _ty.ndim_of(x)  # take_backward needs a non-negative axis
    dims = _ty.shape_values(x)
    at = axis or 0
    read = _read_indices(indices, str(orig_call.attrs.mode), dims[at])
    if _ty.ndim_of(indices) != 1:
        read = reshape(read, [-1])
        output_grad = reshape(output_grad, dims[:at] + [-1] + dims[at + 1 :])
    return [take_backward(output_grad, x, read, axis), no_grad(indices)]


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
    got = [len(positions.get(a, range(d))) for a, d in enumerate(dims)]
    if got != list(_ty.static_shape(call.ty)):
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
    dims = list(static_dims(x, "relax.strided_slice"))
    positions = _slice_positions(orig_call, dims)
    no_grads = [no_grad(arg) for arg in orig_call.args[1:]]
    if any(len(p) == 0 for p in positions.values()):
        return [zeros(_ty.shape_of(x), _ty.dtype_of(x)), *no_grads]
    grad, grad_dims = output_grad, [len(positions.get(a, range(d))) for a, d in enumerate(dims)]
    widths = [0] * (2 * len(dims))
    for axis, read in positions.items():
        if read.step < 0:
            grad, read = flip(grad, axis), read[::-1]
        if read.step > 1:
            grad = _spread(grad, axis, grad_dims, len(read), read.step)
            grad_dims[axis] = read[-1] - read[0] + 1
        widths[2 * axis], widths[2 * axis + 1] = read[0], dims[axis] - 1 - read[-1]
    return [pad(grad, widths) if any(widths) else grad, *no_grads]
