"""Rules for tensor creation (relax.op.create): constant fills and triangular masks."""

from __future__ import annotations

from tvm.relax.op import astype, sum, tril, triu
from tvm.relax.op.grad import no_grad

from .. import _ty
from .registry import register_gradient, register_no_grad

register_no_grad(f"relax.{name}" for name in ("zeros", "ones", "zeros_like", "ones_like"))


def _fill_value_grad(fill, output_grad):
    """``sum(g)`` in the dtype of the scalar ``fill`` (``no_grad`` for a non-float fill)."""
    if not _ty.is_float_tensor(fill):
        return no_grad(fill)
    grad = sum(output_grad)
    if _ty.dtype_of(fill) != _ty.dtype_of(output_grad):
        grad = astype(grad, _ty.dtype_of(fill))
    return grad


@register_gradient("relax.full")
def full_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = full(shape, v)``; backward: ``[no_grad, sum(g)]``."""
    shape, fill = orig_call.args
    return [no_grad(shape), _fill_value_grad(fill, output_grad)]


@register_gradient("relax.full_like")
def full_like_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = full_like(x, v)``; backward: ``[no_grad, sum(g)]``."""
    x, fill = orig_call.args
    return [no_grad(x), _fill_value_grad(fill, output_grad)]


def _triangle(op_name: str, mask):
    """Register the rule of a triangular mask ``y = mask(x, k)``: ``[mask(g, k), no_grad(k)]``."""

    def rule(orig_var, orig_call, output_grad, ctx):
        k = orig_call.args[1]
        return [mask(output_grad, k), no_grad(k)]

    name = mask.__name__
    rule.__doc__ = f"Forward: ``y = {name}(x, k)``; backward: ``[{name}(g, k), no_grad]``."
    register_gradient(op_name, rule)
    return rule


triu_grad = _triangle("relax.triu", triu)
tril_grad = _triangle("relax.tril", tril)
