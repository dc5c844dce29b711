"""Rules for relax.op.search."""

from __future__ import annotations

from tvm.relax.op import where
from tvm.relax.op.grad import no_grad

from ._utils import const, fit_shape
from .registry import register_gradient, register_no_grad


@register_gradient("relax.where")
def where_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = where(c, a, b)``; backward: ``[no_grad, where(c, g, 0), where(c, 0, g)]``."""
    cond, a, b = orig_call.args
    return [
        no_grad(cond),
        fit_shape(ctx, where(cond, output_grad, const(0, a)), a),
        fit_shape(ctx, where(cond, const(0, b), output_grad), b),
    ]


register_no_grad(["relax.argmax", "relax.argmin"])  # integer results
