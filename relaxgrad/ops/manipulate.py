"""Rules for shape manipulation (relax.op.manipulate)."""

from __future__ import annotations

from tvm.relax.op import collapse_sum_to, concat, permute_dims, reshape, split, squeeze
from tvm.relax.op.grad import no_grad

from .. import _ty
from .registry import register_gradient


@register_gradient("relax.permute_dims")
def permute_dims_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = permute_dims(x, axes)``; backward: ``[permute_dims(g, inverse(axes))]``."""
    axes = orig_call.attrs.axes
    if not axes:
        return [permute_dims(output_grad)]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[int(a)] = i
    return [permute_dims(output_grad, inverse)]


@register_gradient("relax.concat")
def concat_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = concat((x1, ..., xn), axis)``; backward: ``[split(g, offsets, axis)]``."""
    axis = int(orig_call.attrs.axis)
    indices = []
    for field in _ty.tuple_fields(orig_call.args[0])[:-1]:
        size = _ty.shape_values(field)[axis]
        indices.append(size if not indices else indices[-1] + size)
    return [split(output_grad, indices, axis)]


@register_gradient("relax.split")
def split_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``(y1, ..., yn) = split(x, indices, axis)``; backward: ``[concat(g, axis)]``."""
    return [concat(output_grad, int(orig_call.attrs.axis))]


@register_gradient("relax.reshape")
def reshape_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = reshape(x, shape)``; backward: ``[reshape(g, x.shape), no_grad]``."""
    x, shape = orig_call.args
    return [reshape(output_grad, _ty.shape_of(x)), no_grad(shape)]


@register_gradient("relax.broadcast_to")
def broadcast_to_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = broadcast_to(x, shape)``; backward:
    ``[collapse_sum_to(g, x.shape), no_grad]``."""
    x, shape = orig_call.args
    return [collapse_sum_to(output_grad, _ty.shape_of(x)), no_grad(shape)]


@register_gradient("relax.expand_dims")
def expand_dims_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = expand_dims(x, axis)``; backward: ``[squeeze(g, axis)]``."""
    return [squeeze(output_grad, orig_call.attrs.axis)]
