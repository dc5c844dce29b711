"""Checkpointing: which forward values the backward pass may use, and regenerating the rest.

``collect_checkpoints`` applies the three rules of TVM's ``CheckpointCollector``:

1. function parameters are checkpointed;
2. a var wrapped by ``R.grad.start_checkpoint`` is checkpointed;
3. any other var is checkpointed iff every var its value uses is checkpointed or is the result
   of ``R.grad.end_checkpoint``.

and removes the marker bindings. :class:`Regenerator` then recomputes, lazily and once, every
non-checkpointed value the backward pass needs, as ``<name>_cp`` bindings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import relax
from tvm.ir import Op
from tvm.relax import BlockBuilder, Expr, Var

from .. import _ty
from ..errors import GradientError


@dataclass
class CheckpointInfo:
    """What the collector learned. ``checkpoints=None`` means every var is checkpointed."""

    bindings: list  # list[relax.VarBinding], markers removed, uses remapped
    ret: Expr
    checkpoints: set | None
    var_mapping: dict = field(default_factory=dict)  # wrapped var -> original var

    def is_checkpointed(self, var: Var) -> bool:
        return self.checkpoints is None or var in self.checkpoints


def _marker_ops() -> tuple[Op, Op]:
    return Op.get("relax.grad.start_checkpoint"), Op.get("relax.grad.end_checkpoint")


def free_vars(expr: Expr) -> list[Var]:
    """The relax Vars used in a binding value (calls, tuples, tuple-get-items)."""
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Call):
        return [v for arg in expr.args for v in free_vars(arg)]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in free_vars(f)]
    if isinstance(expr, relax.TupleGetItem):
        return free_vars(expr.tuple_value)
    return []


def substitute(expr: Expr, remap: dict) -> Expr:
    """``expr`` with vars replaced per ``remap`` (calls, tuples, tuple-get-items)."""
    if isinstance(expr, relax.Var):
        return remap.get(expr, expr)
    if isinstance(expr, relax.Call):
        args = [substitute(a, remap) for a in expr.args]
        if all(a.same_as(b) for a, b in zip(args, expr.args)):
            return expr
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        fields = [substitute(f, remap) for f in expr.fields]
        if all(a.same_as(b) for a, b in zip(fields, expr.fields)):
            return expr
        return relax.Tuple(fields)
    if isinstance(expr, relax.TupleGetItem):
        tup = substitute(expr.tuple_value, remap)
        return expr if tup.same_as(expr.tuple_value) else relax.TupleGetItem(tup, expr.index)
    return expr


def collect_checkpoints(bb: BlockBuilder, params, bindings, ret: Expr) -> CheckpointInfo:
    """Apply the checkpoint rules to a dataflow block and strip the markers.

    ``bb`` normalizes rewritten values (it must be inside a scope).
    """
    s_cp, e_cp = _marker_ops()

    def is_marker(value) -> bool:
        return isinstance(value, relax.Call) and (value.op.same_as(s_cp) or value.op.same_as(e_cp))

    if not any(is_marker(b.value) for b in bindings):
        return CheckpointInfo(list(bindings), ret, None)

    checkpoints: set = set(params)
    e_vars: set = set()
    remap: dict = {}
    var_mapping: dict = {}
    out = []
    for b in bindings:
        value = b.value
        if not is_marker(value):
            if all(v in checkpoints or v in e_vars for v in free_vars(value)):
                checkpoints.add(b.var)
            new_value = substitute(value, remap)
            if not new_value.same_as(value):
                b = relax.VarBinding(b.var, bb.normalize(new_value))
            out.append(b)
            continue
        arg = value.args[0]
        if not isinstance(arg, relax.Var):
            raise GradientError(
                f"Gradient: the argument of {value.op.name} bound to {b.var.name} must be a Var"
            )
        orig = remap.get(arg, arg)
        if not isinstance(b.var, relax.DataflowVar) and isinstance(arg, relax.DataflowVar):
            # an output var wraps a dataflow var: keep an output binding of the original value
            new_var = relax.Var(orig.name, orig.ty)
            out.append(relax.VarBinding(new_var, orig))
            remap[b.var] = new_var
        else:
            remap[b.var] = orig
        var_mapping[b.var] = orig
        if value.op.same_as(s_cp):
            checkpoints.add(orig)
        else:
            e_vars.add(b.var)
    return CheckpointInfo(out, substitute(ret, remap), checkpoints, var_mapping)


class Regenerator:
    """Gives the backward pass a checkpointed version of each forward binding it differentiates.

    Checkpointed vars are used as they are; any other var is recomputed from checkpointed ones
    (once) and bound as ``<name>_cp``.
    """

    def __init__(self, bb: BlockBuilder, params, info: CheckpointInfo):
        self.bb = bb
        # keyed by _ty.key(forward var)
        self.cp_map: dict[int, Var] = {_ty.key(p): p for p in params}
        self.values: dict[int, Expr] = {}
        for b in info.bindings:
            var = b.var
            self.values[_ty.key(var)] = b.value
            if info.is_checkpointed(var):
                self.cp_map[_ty.key(var)] = var

    def update_binding(self, var: Var, value: Expr) -> tuple[Var, Expr]:
        """The checkpointed (var, value) for the forward binding ``var = value``."""
        new_value = self.visit(value)
        cp = self.cp_map.get(_ty.key(var))
        if cp is not None:
            return cp, new_value
        cp = self.bb.emit(new_value, var.name + "_cp")
        self.cp_map[_ty.key(var)] = cp
        return cp, new_value

    def visit(self, expr: Expr) -> Expr:
        if isinstance(expr, relax.Var):
            return self.visit_var(expr)
        if isinstance(expr, relax.Call):
            args = [self.visit(a) for a in expr.args]
            return self.bb.normalize(relax.Call(expr.op, args, expr.attrs, expr.ty_args))
        if isinstance(expr, relax.Tuple):
            fields = [self.visit(f) for f in expr.fields]
            if all(a.same_as(b) for a, b in zip(fields, expr.fields)):
                return expr
            return self.bb.normalize(relax.Tuple(fields))
        if isinstance(expr, relax.TupleGetItem):
            tup = self.visit(expr.tuple_value)
            if tup.same_as(expr.tuple_value):
                return expr
            return self.bb.normalize(relax.TupleGetItem(tup, expr.index))
        return expr

    def visit_var(self, var: Var) -> Var:
        k = _ty.key(var)
        cp = self.cp_map.get(k)
        if cp is not None:
            return cp
        if k not in self.values:
            raise GradientError(f"Gradient: {var.name} is used but not defined in the block")
        cp = self.bb.emit(self.visit(self.values[k]), var.name + "_cp")
        self.cp_map[k] = cp
        return cp
