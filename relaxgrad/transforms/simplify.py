"""Clean-ups of the adjoint function: dead bindings, and TVM's gradient_simplifier.

:func:`remove_unused` drops bindings the result does not need. :func:`simplify_gradient`
rewrites the transpose/matmul patterns the gradient pass creates, with ``T(a)`` a permute_dims
that swaps the last two axes:

1. ``T(v)`` with ``v = T(a)`` and ``a`` a var -> ``a`` (uses of the binding are replaced by
   ``a``);
2. ``T(v)`` with ``v = matmul(a, b)``, ``a`` and ``b`` of rank >= 2 -> ``matmul(T(b), T(a))``,
   where ``T`` of a var bound to ``T(c)`` is ``c``.

As in TVM, the rules apply to every binding of the function, forward ones included; they are
exact there too. Rule 2 needs both operands of rank >= 2: with a vector operand, ``matmul``
drops an axis, and ``matmul(T(b), T(a))`` is no longer the transpose (it has another shape, or
the same shape and other values). Unused bindings are removed afterwards.

Both functions take any number of binding blocks. The rewrites look only at bindings of the
same dataflow block (a dataflow var cannot leave its block); a var replaced by rule 1 is
replaced in later blocks and in the result too.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax import Function

from .. import _ty
from .._module import with_functions
from ..exprs import is_op, substitute


def _is_transpose(expr) -> bool:
    """Whether ``expr`` is a permute_dims that swaps the last two axes of a rank >= 2 tensor."""
    if not is_op(expr, "relax.permute_dims"):
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


def _is_matmul_of_matrices(expr) -> bool:
    """Whether ``expr`` is a matmul whose operands both have a known rank >= 2."""
    if not is_op(expr, "relax.matmul"):
        return False
    return all(_ty.is_tensor(arg) and _ty.ndim_of(arg) >= 2 for arg in expr.args)


def _transpose_of(expr):
    """``T(expr)`` for a tensor of rank >= 2."""
    ndim = _ty.ndim_of(expr)
    return relax.op.permute_dims(expr, list(range(ndim - 2)) + [ndim - 1, ndim - 2])


def _block_like(block, bindings):
    """A block of the same kind (dataflow or not) as ``block`` holding ``bindings``."""
    if isinstance(block, relax.DataflowBlock):
        return relax.DataflowBlock(bindings)
    return relax.BindingBlock(bindings)


def _always_kept(binding, dataflow: bool) -> bool:
    """A MatchCast (a runtime check) or, outside dataflow blocks, a value with an impure call."""
    if isinstance(binding, relax.MatchCast):
        return True
    return not dataflow and relax.analysis.contains_impure_call(binding.value)


def remove_unused(func: Function) -> Function:
    """``func`` without the bindings its result does not use, in every block.

    Kept: bindings whose var is used later (in any block, or by the result), MatchCast
    bindings, and, in non-dataflow blocks, bindings whose value makes an impure call. Blocks
    left empty are dropped. Same result as ``relax.analysis.remove_all_unused``, in time linear
    in the number of bindings; ``func`` itself is returned when nothing is removed.

    Parameters
    ----------
    func : Function
        A function whose body is a SeqExpr (any other body is returned as is).
    """
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return func
    live = {_ty.key(v) for v in relax.analysis.free_vars(body.body)}
    blocks, changed = [], False
    for block in reversed(body.blocks):
        dataflow = isinstance(block, relax.DataflowBlock)
        keep = []
        for b in reversed(block.bindings):
            if _ty.key(b.var) in live or _always_kept(b, dataflow):
                keep.append(b)
                live.update(_ty.key(v) for v in relax.analysis.free_vars(b.value))
        changed = changed or not keep or len(keep) != len(block.bindings)
        if keep:
            keep.reverse()
            blocks.append(_block_like(block, keep))
    if not changed:
        return func
    blocks.reverse()
    new_body = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, body.body))
    return Function(func.params, new_body, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="RemoveUnused")
class RemoveUnused:
    """:func:`remove_unused` on every Relax function of a module (the module itself when none
    changes). ``relax.transform.DeadCodeElimination`` removes a chain of unused bindings one
    link per sweep over the function, in time quadratic in its length: the 15,000 bindings of
    a 10,000-binding chain's gradient that constant folding left unused took it 27 s, this
    0.2 s. It keeps unused functions: run ``DeadCodeElimination`` after it for those (one
    sweep, then)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, Function):
                new = remove_unused(func)
                if new is not func:
                    updates[gvar] = new
        return with_functions(mod, updates)


def _has_pattern(bindings) -> bool:
    """Cheap pre-scan: a permute_dims of a var bound to permute_dims or matmul."""
    permute, matmul = Op.get("relax.permute_dims"), Op.get("relax.matmul")  # (hot: no names)
    candidates = set()  # keys of vars bound to permute_dims or matmul
    for b in bindings:
        value = b.value
        if not isinstance(value, relax.Call):
            continue
        if value.op.same_as(permute):
            if _ty.key(value.args[0]) in candidates and _is_transpose(value):
                return True
            candidates.add(_ty.key(b.var))
        elif value.op.same_as(matmul):
            candidates.add(_ty.key(b.var))
    return False


class _BlockSimplifier:
    """Re-emits the bindings of one dataflow block into ``bb`` with the two rules applied.

    ``remap`` (var -> replacement) is read and extended: it is shared by all blocks.
    """

    def __init__(self, bb: relax.BlockBuilder, remap: dict):
        self.bb = bb
        self.remap = remap
        self.local: set = set()  # keys of the vars bound so far in this block

    def lookup(self, expr):
        """The (rewritten) value bound to ``expr`` in this block, else None."""
        if isinstance(expr, relax.Var) and _ty.key(expr) in self.local:
            return self.bb.lookup_binding(expr)
        return None

    def transpose_in_ctx(self, expr):
        """``c`` when ``expr`` is bound to ``T(c)`` in this block, else a new binding of
        ``T(expr)`` (which later rewrites can see)."""
        prev = self.lookup(expr)
        if _is_transpose(prev):
            return prev.args[0]
        var = self.bb.emit(_transpose_of(expr))
        self.local.add(_ty.key(var))
        return var

    def rewrite(self, value):
        """The simplified value, or None when no rule applies."""
        if not (_is_transpose(value) and isinstance(value.args[0], relax.Var)):
            return None
        prev = self.lookup(value.args[0])
        if _is_transpose(prev):
            inner = prev.args[0]
            return inner if isinstance(inner, relax.Var) else None  # rule 1
        if _is_matmul_of_matrices(prev):
            b = self.transpose_in_ctx(prev.args[1])  # TVM emits T(b) before T(a)
            a = self.transpose_in_ctx(prev.args[0])
            return relax.op.matmul(b, a, prev.attrs.out_dtype)  # rule 2
        return None

    def run(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        bb = self.bb
        bb._begin_dataflow_block()
        for b in block.bindings:
            value = substitute(b.value, self.remap)
            result = None if isinstance(b, relax.MatchCast) else self.rewrite(value)
            if isinstance(result, relax.Var) and (
                isinstance(b.var, relax.DataflowVar) or not isinstance(result, relax.DataflowVar)
            ):
                self.remap[b.var] = result  # rule 1: uses of the binding become uses of a
                continue
            # (TVM also replaces an output var by a dataflow var, which leaves the block; here
            # the output var is bound to it instead.)
            _emit(bb, b, value if result is None else result)
            self.local.add(_ty.key(b.var))
        return bb._end_block()


def _emit(bb: relax.BlockBuilder, binding, value) -> None:
    """Emit ``binding`` with ``value`` (the binding itself when the value is unchanged)."""
    if value.same_as(binding.value):
        bb.emit_normalized(binding)
        return
    value = bb.normalize(value)
    if isinstance(binding, relax.MatchCast):
        bb.emit_normalized(relax.MatchCast(binding.var, value, binding.ty))
    else:
        bb.emit_normalized(relax.VarBinding(binding.var, value))


def simplify_gradient(func: Function) -> Function:
    """Apply the two rewrites within each dataflow block of ``func``, then :func:`remove_unused`.

    Parameters
    ----------
    func : Function
        A function whose body is a SeqExpr with any number of blocks; ``func`` itself is
        returned when no dataflow block holds a candidate pattern.
    """
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not any(
        isinstance(block, relax.DataflowBlock) and _has_pattern(block.bindings)
        for block in body.blocks
    ):
        return func
    bb = relax.BlockBuilder()
    remap: dict = {}
    blocks = []
    bb.begin_scope(list(func.params))
    for block in body.blocks:
        if isinstance(block, relax.DataflowBlock):
            blocks.append(_BlockSimplifier(bb, remap).run(block))
            continue
        bb._begin_binding_block()
        for b in block.bindings:
            _emit(bb, b, substitute(b.value, remap))
        blocks.append(bb._end_block())
    new_body = bb.normalize(relax.SeqExpr(blocks, substitute(body.body, remap)))
    bb.end_scope()
    return remove_unused(Function(func.params, new_body, None, func.is_pure, func.attrs))
