"""Rules for relax.op.datatype."""

from __future__ import annotations

from tvm.relax.op import astype
from tvm.relax.op.grad import no_grad

from .. import _ty
from .registry import register_gradient


@register_gradient("relax.astype")
def astype_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = astype(x, dtype)``; backward: ``[astype(g, x.dtype)]`` (``no_grad`` for a
    non-float ``x``, e.g. integer indices cast to float)."""
    x = orig_call.args[0]
    if not _ty.is_float_tensor(x):
        return [no_grad(x)]
    return [astype(output_grad, _ty.dtype_of(x))]
