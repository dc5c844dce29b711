"""Clean-ups of the adjoint function: dead bindings, and TVM's gradient_simplifier.

:func:`remove_unused` drops bindings the result does not need. :func:`simplify_gradient`
rewrites the transpose/matmul patterns the gradient pass creates, with ``T(a)`` a permute_dims
that swaps the last two axes:

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


def remove_unused(func: Function) -> Function:
    """``func`` without the bindings of its dataflow block that its result does not use.

    Same result as ``relax.analysis.remove_all_unused`` on a single dataflow block, in time
    linear in the number of bindings.
    """
    block = func.body.blocks[0]
    bindings = list(block.bindings)
    live = {_ty.key(v) for v in relax.analysis.free_vars(func.body.body)}
    keep = []
    for b in reversed(bindings):
        if _ty.key(b.var) in live:
            keep.append(b)
            live.update(_ty.key(v) for v in relax.analysis.free_vars(b.value))
    if len(keep) == len(bindings):
        return func
    keep.reverse()
    body = relax.SeqExpr([relax.DataflowBlock(keep)], func.body.body)
    body = relax.BlockBuilder().normalize(body)
    return Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _has_pattern(bindings) -> bool:
    """Cheap pre-scan: a permute_dims of a var bound to permute_dims or matmul."""
    permute, matmul = Op.get("relax.permute_dims"), Op.get("relax.matmul")
    candidates = set()  # keys of vars bound to permute_dims or matmul
    for b in bindings:
        value = b.value
        if not isinstance(value, relax.Call):
            continue
        op = value.op
        if op.same_as(permute):
            arg = value.args[0]
            if _ty.key(arg) in candidates and _is_transpose(value):
                return True
            candidates.add(_ty.key(b.var))
        elif op.same_as(matmul):
            candidates.add(_ty.key(b.var))
    return False


def simplify_gradient(func: Function) -> Function:
    """Apply the two rewrites to the single dataflow block of ``func``."""
    block = func.body.blocks[0]
    if not _has_pattern(block.bindings):
        return func
    matmul = Op.get("relax.matmul")
    bb = relax.BlockBuilder()
    remap: dict = {}

    def transpose_in_ctx(expr):
        prev = bb.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return prev.args[0] if _is_transpose(prev) else _transpose_of(expr)

    def rewrite(value):
        """The simplified value, or None when no rule applies."""
        if not (_is_transpose(value) and isinstance(value.args[0], relax.Var)):
            return None
        prev = bb.lookup_binding(value.args[0])
        if _is_transpose(prev):
            return prev.args[0]  # rule 1
        if isinstance(prev, relax.Call) and prev.op.same_as(matmul):
            a, c = transpose_in_ctx(prev.args[0]), transpose_in_ctx(prev.args[1])
            return relax.op.matmul(c, a, prev.attrs.out_dtype)  # rule 2
        return None

    bb.begin_scope(list(func.params))
    bb._begin_dataflow_block()
    for b in block.bindings:
        value = substitute(b.value, remap)
        result = rewrite(value)
        if isinstance(result, relax.Var) and (
            isinstance(b.var, relax.DataflowVar) or not isinstance(result, relax.DataflowVar)
        ):
            remap[b.var] = result  # T(T(a)): uses of the binding become uses of a
            continue
        result = value if result is None else result
        if result.same_as(b.value):
            bb.emit_normalized(b)
        else:
            result = bb.normalize(result)
            bb.emit_normalized(relax.VarBinding(b.var, result))
    body = bb.normalize(relax.SeqExpr([bb._end_block()], substitute(func.body.body, remap)))
    bb.end_scope()
    new_func = relax.Function(func.params, body, None, func.is_pure, func.attrs)
    return remove_unused(new_func)
