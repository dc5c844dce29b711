"""Rules for relax.op.sorting: a sort moves each element to one place, so its gradient moves
``g`` back with a scatter by the sorting indices."""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import argsort, scatter_elements, topk, zeros_like

from .registry import register_gradient, register_no_grad

register_no_grad(["relax.argsort"])  # integer results


@register_gradient("relax.sort")
def sort_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = sort(x, axis, descending)``; backward:
    ``[scatter_elements(zeros_like(x), argsort(x, axis, descending), g, axis)]``."""
    x = orig_call.args[0]
    axis, descending = int(orig_call.attrs.axis), bool(orig_call.attrs.descending)
    order = argsort(x, axis, descending, "int64")
    return [scatter_elements(zeros_like(x), order, output_grad, axis, "add")]


@register_gradient("relax.topk")
def topk_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``(values, indices) = topk(x, k, axis, largest)``; backward:
    ``[scatter_elements(zeros_like(x), indices, g_values, axis)]`` (``ret_type="values"``
    recomputes the indices)."""
    x = orig_call.args[0]
    attrs = orig_call.attrs
    axis, ret_type = int(attrs.axis), str(attrs.ret_type)
    if ret_type == "indices":
        return [relax.op.grad.no_grad(x)]
    if ret_type == "both":
        values_grad, indices = relax.TupleGetItem(output_grad, 0), relax.TupleGetItem(orig_var, 1)
    else:
        values_grad = output_grad
        indices = topk(x, int(attrs.k), axis, "indices", bool(attrs.largest), attrs.dtype)
    return [scatter_elements(zeros_like(x), indices, values_grad, axis, "add")]
