"""The one place that walks and rebuilds Relax expressions.

Every node kind the gradient pass can meet is listed here; any other kind raises a
:class:`~relaxgrad.GradientError` instead of being silently treated as a leaf.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import Op

from . import _ty
from .errors import GradientError

__all__ = [
    "RECOMPUTED_SUFFIX",
    "called_functions",
    "free_vars",
    "is_op",
    "op_name",
    "rename_seq",
    "substitute",
]

#: The suffix of a binding a checkpoint policy recomputes in the backward pass (``x`` ->
#: ``x_cp``, as TVM's pass names them): the Regenerator names them so and
#: relaxgrad.compile's HoldRecomputed finds them.
RECOMPUTED_SUFFIX = "_cp"

# Nodes that hold no relax Var.
_LEAVES = (
    _ty.Constant,  # tensors, prim values, dtypes (TVM 0.27 merged them into one node family)
    tvm.ir.StringImm,
    relax.ShapeExpr,
    relax.ExternFunc,
    relax.GlobalVar,
    Op,
)


def _unknown(expr) -> GradientError:
    return GradientError(
        f"Gradient: cannot walk an expression of kind {type(expr).__name__}: {expr}"
    )


def is_op(expr, name: str) -> bool:
    """Whether ``expr`` is a call of the operator ``name`` (e.g. ``"relax.matmul"``)."""
    return (
        isinstance(expr, relax.Call) and isinstance(expr.op, Op) and expr.op.name == name
    )


def op_name(expr) -> str | None:
    """The operator name of a call of an Op, else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, Op):
        return str(expr.op.name)
    return None


def called_functions(func) -> list:
    """The GlobalVars ``func`` calls (each once, in order of first call; inside Ifs too)."""
    found, seen = [], set()

    def visit(call: relax.Call) -> None:
        if isinstance(call.op, relax.GlobalVar) and call.op.name_hint not in seen:
            seen.add(call.op.name_hint)
            found.append(call.op)

    tvm_ffi.structural_walk(func, [(relax.Call, visit)])
    return found


def free_vars(expr) -> list[relax.Var]:
    """The relax Vars ``expr`` reads that it does not bind itself (in order, with repeats)."""
    out: list = []
    _free_vars(expr, out, set())
    return out


def _free_vars(expr, out: list, bound: set) -> None:
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, relax.Var):
            if _ty.key(e) not in bound:
                out.append(e)
        elif isinstance(e, relax.Call):
            stack.extend(reversed(e.args))
            if isinstance(e.op, relax.Var):
                stack.append(e.op)
        elif isinstance(e, relax.Tuple):
            stack.extend(reversed(e.fields))
        elif isinstance(e, relax.TupleGetItem):
            stack.append(e.tuple_value)
        elif isinstance(e, relax.If):
            _free_vars(e.cond, out, bound)
            _free_vars(e.true_branch, out, bound)
            _free_vars(e.false_branch, out, bound)
        elif isinstance(e, relax.SeqExpr):
            inner = set(bound)
            for block in e.blocks:
                for b in block.bindings:
                    _free_vars(b.value, out, inner)
                    inner.add(_ty.key(b.var))
            _free_vars(e.body, out, inner)
        elif not isinstance(e, _LEAVES):
            raise _unknown(e)


def substitute(expr, remap: dict):
    """``expr`` with relax Vars replaced per ``remap`` (keys: Vars); unchanged nodes are reused.

    Inside an ``If``, the branch bodies are rebuilt with the same remap (their own bindings are
    kept as they are).
    """
    if not remap:
        return expr
    if isinstance(expr, relax.Var):
        return remap.get(expr, expr)
    if isinstance(expr, relax.Call):
        args = [substitute(a, remap) for a in expr.args]
        op = substitute(expr.op, remap) if isinstance(expr.op, relax.Var) else expr.op
        if op.same_as(expr.op) and all(a.same_as(b) for a, b in zip(args, expr.args)):
            return expr
        return relax.Call(op, args, expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        fields = [substitute(f, remap) for f in expr.fields]
        if all(a.same_as(b) for a, b in zip(fields, expr.fields)):
            return expr
        return relax.Tuple(fields)
    if isinstance(expr, relax.TupleGetItem):
        tup = substitute(expr.tuple_value, remap)
        return expr if tup.same_as(expr.tuple_value) else relax.TupleGetItem(tup, expr.index)
    if isinstance(expr, relax.If):
        return relax.If(
            substitute(expr.cond, remap),
            substitute(expr.true_branch, remap),
            substitute(expr.false_branch, remap),
        )
    if isinstance(expr, relax.SeqExpr):
        blocks = [_substitute_block(block, remap) for block in expr.blocks]
        return relax.SeqExpr(blocks, substitute(expr.body, remap))
    if isinstance(expr, _LEAVES):
        return expr
    raise _unknown(expr)


def _substitute_block(block, remap: dict):
    bindings = []
    for b in block.bindings:
        value = substitute(b.value, remap)
        if isinstance(b, relax.MatchCast):
            bindings.append(relax.MatchCast(b.var, value, b.ty))
        else:
            bindings.append(relax.VarBinding(b.var, value))
    kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
    return kind(bindings)


def fresh_var(var: relax.Var, dataflow: bool | None = None) -> relax.Var:
    """A new Var (or DataflowVar) with the name and type of ``var``."""
    if dataflow is None:
        dataflow = isinstance(var, relax.DataflowVar)
    kind = relax.DataflowVar if dataflow else relax.Var
    return kind(var.name, var.ty)


def rename_seq(seq: relax.SeqExpr, remap: dict, plain: bool = False) -> relax.SeqExpr:
    """A copy of ``seq`` whose bindings define fresh vars (nested Ifs included); ``remap``
    maps outer vars to their replacements and is extended in place with the renamed ones.
    With ``plain``, the fresh vars are all plain Vars (no DataflowVars)."""
    blocks = []
    for block in seq.blocks:
        bindings = []
        for b in block.bindings:
            value = b.value
            if isinstance(value, relax.If):
                value = relax.If(
                    substitute(value.cond, remap),
                    rename_seq(value.true_branch, dict(remap), plain),
                    rename_seq(value.false_branch, dict(remap), plain),
                )
            else:
                value = substitute(value, remap)
            new_var = fresh_var(b.var, False if plain else None)
            remap[b.var] = new_var
            if isinstance(b, relax.MatchCast):
                bindings.append(relax.MatchCast(new_var, value, b.ty))
            else:
                bindings.append(relax.VarBinding(new_var, value))
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind(bindings))
    return relax.SeqExpr(blocks, substitute(seq.body, remap))
