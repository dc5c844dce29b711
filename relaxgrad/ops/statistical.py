"""Rules for reductions (relax.op.statistical)."""

from __future__ import annotations

from tvm.relax.op import broadcast_to, expand_dims

from .. import _ty
from ._utils import const, shape_prod
from .registry import register_gradient


def _restore_axes(grad, orig_call):
    """Re-insert the reduced axes into ``grad`` when the reduction dropped them."""
    axis = orig_call.attrs.axis
    if not orig_call.attrs.keepdims and axis:
        return expand_dims(grad, axis)
    return grad


@register_gradient("relax.sum")
def sum_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = sum(x, axis, keepdims)``; backward: ``[broadcast_to(g, x.shape)]``."""
    x = orig_call.args[0]
    return [broadcast_to(_restore_axes(output_grad, orig_call), _ty.shape_of(x))]


@register_gradient("relax.mean")
def mean_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = mean(x, axis, keepdims)``; backward: ``[broadcast_to(g / n, x.shape)]``."""
    x = orig_call.args[0]
    grad = output_grad / const(shape_prod(x, orig_call.attrs.axis), output_grad)
    return [broadcast_to(_restore_axes(grad, orig_call), _ty.shape_of(x))]
