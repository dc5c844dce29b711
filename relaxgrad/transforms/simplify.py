"""Simplify the transpose/matmul patterns the gradient pass creates (TVM's gradient_simplifier).

Rewrites, with ``T(a)`` a permute_dims that swaps the last two axes:

1. ``T(T(a))`` -> ``a`` (uses of the binding are replaced by ``a``);
2. ``T(matmul(a, b))`` -> ``matmul(T(b), T(a))``, where ``T`` of a var bound to ``T(c)`` is ``c``.

Unused bindings are removed afterwards.
"""

from __future__ import annotations

from tvm import relax
from tvm.ir import Op
from tvm.relax import Function

from .. import _ty
from .checkpoint import substitute


def _is_transpose(expr) -> bool:
    if not isinstance(expr, relax.Call) or not expr.op.same_as(Op.get("relax.permute_dims")):
        return False
    arg = expr.args[0]
    if not _ty.is_tensor(arg):
        return False
    ndim = _ty.ndim_of(arg)
    if ndim in (-1, 1):
        return False
    axes = expr.attrs.axes
    if axes is None:
        return ndim == 2
    axes = [int(a) for a in axes]
    return axes == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _transpose_of(expr):
    ndim = _ty.ndim_of(expr)
    if ndim == 1:
        return expr
    return relax.op.permute_dims(expr, list(range(ndim - 2)) + [ndim - 1, ndim - 2])


def _has_pattern(bindings) -> bool:
    bound = {b.var: b.value for b in bindings}
    matmul = Op.get("relax.matmul")
    for b in bindings:
        if _is_transpose(b.value) and isinstance(b.value.args[0], relax.Var):
            prev = bound.get(b.value.args[0])
            if _is_transpose(prev) or (isinstance(prev, relax.Call) and prev.op.same_as(matmul)):
                return True
    return False


def simplify_gradient(func: Function) -> Function:
    """Apply the two rewrites to the single dataflow block of ``func``."""
    block = func.body.blocks[0]
    if not _has_pattern(block.bindings):
        return func
    matmul = Op.get("relax.matmul")
    bb = relax.BlockBuilder()
    bound: dict = {}  # var -> value as emitted in the new block
    remap: dict = {}

    def transpose_in_ctx(expr):
        prev = bound.get(expr) if isinstance(expr, relax.Var) else None
        return prev.args[0] if _is_transpose(prev) else _transpose_of(expr)

    bb.begin_scope(list(func.params))
    bb._begin_dataflow_block()
    for b in block.bindings:
        value = substitute(b.value, remap)
        result = value
        if _is_transpose(value) and isinstance(value.args[0], relax.Var):
            prev = bound.get(value.args[0])
            if _is_transpose(prev):
                result = prev.args[0]
            elif isinstance(prev, relax.Call) and prev.op.same_as(matmul):
                a = transpose_in_ctx(prev.args[0])
                c = transpose_in_ctx(prev.args[1])
                result = relax.op.matmul(c, a, prev.attrs.out_dtype)
        if isinstance(result, relax.Var) and (
            isinstance(b.var, relax.DataflowVar) or not isinstance(result, relax.DataflowVar)
        ):
            remap[b.var] = result
            continue
        if result.same_as(b.value):
            bb.emit_normalized(b)
        else:
            result = bb.normalize(result)
            bb.emit_normalized(relax.VarBinding(b.var, result))
        bound[b.var] = result
    body = bb.normalize(relax.SeqExpr([bb._end_block()], substitute(func.body.body, remap)))
    bb.end_scope()
    new_func = relax.Function(func.params, body, None, func.is_pure, func.attrs)
    return relax.analysis.remove_all_unused(new_func)
