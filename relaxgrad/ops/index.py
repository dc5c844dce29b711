"""Rules for relax.op.index."""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import clip, floor_mod, reshape
from tvm.relax.op.grad import no_grad, take_backward

from .. import _ty
from ..errors import GradientError
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
