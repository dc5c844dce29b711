"""Rules for reductions and scans (relax.op.statistical)."""

from __future__ import annotations

from tvm.relax.op import astype, broadcast_to, cumsum, expand_dims, flatten, reshape, sum

from .. import _ty
from ._utils import count, scalar
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
    grad = output_grad / scalar(count(x, orig_call.attrs.axis), output_grad)
    return [broadcast_to(_restore_axes(grad, orig_call), _ty.shape_of(x))]


@register_gradient("relax.variance")
def variance_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = variance(x, axis, keepdims)``; backward:
    ``[g * (2 / n * x - 2 / n**2 * sum(x, axis, keepdims=True))]``."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    n = count(x, axis)
    centered = scalar(2.0 / n, x) * x - scalar(2.0 / n / n, x) * sum(x, axis, keepdims=True)
    return [_restore_axes(output_grad, orig_call) * centered]


@register_gradient("relax.cumsum")
def cumsum_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = cumsum(x, axis, exclusive)``; backward: the reversed cumsum
    ``[sum(g, axis) - cumsum(g, axis) (+ g unless exclusive)]``, in x's dtype."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    flat = axis is None  # a cumsum over the flattened x
    axis = None if flat else int(axis)
    grad = sum(output_grad, axis, keepdims=True) - cumsum(output_grad, axis)
    if not orig_call.attrs.exclusive:
        grad = grad + (flatten(output_grad) if flat else output_grad)
    if flat:
        grad = reshape(grad, _ty.shape_of(x))
    if orig_call.attrs.dtype is not None:
        grad = astype(grad, _ty.dtype_of(x))
    return [grad]
