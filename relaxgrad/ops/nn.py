"""Rules for relax.op.nn: activations, normalizations, losses, convolution, pooling."""

from __future__ import annotations

from tvm.relax.op import exp, sum

from .. import _ty
from ._utils import const
from .registry import register_gradient


@register_gradient("relax.nn.softmax")
def softmax_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = softmax(x, axis)``; backward: ``[(g - sum(g * y, axis)) * y]``."""
    return [(output_grad - sum(output_grad * orig_var, orig_call.attrs.axis, True)) * orig_var]


@register_gradient("relax.nn.log_softmax")
def log_softmax_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = log_softmax(x, axis)``; backward: ``[g - sum(g, axis) * exp(y)]``."""
    return [output_grad - sum(output_grad, orig_call.attrs.axis, True) * exp(orig_var)]


@register_gradient("relax.nn.cross_entropy_with_logits")
def cross_entropy_with_logits_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``z = -sum(x * y) / N``; backward: ``[-g / N * y, -g / N * x]``."""
    x, y = orig_call.args
    if _ty.ndim_of(x) > 1:
        output_grad = output_grad / const(int(_ty.shape_values(x)[0]), output_grad)
    return [-output_grad * y, -output_grad * x]
