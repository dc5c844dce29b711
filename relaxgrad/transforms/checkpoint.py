"""Checkpointing: which forward values the backward pass may use, and regenerating the rest.

:func:`strip_markers` removes the ``R.grad.start_checkpoint`` / ``end_checkpoint`` bindings and
applies the three rules of TVM's ``CheckpointCollector`` (the ``"markers"`` policy):

1. function parameters are checkpointed;
2. a var wrapped by ``R.grad.start_checkpoint`` is checkpointed;
3. any other var is checkpointed iff every var its value uses is checkpointed or is the result
   of ``R.grad.end_checkpoint``.

Other policies (:mod:`relaxgrad.transforms.policies`) replace that decision. :class:`Regenerator`
then recomputes, lazily and once, every non-checkpointed value the backward pass needs, as
``<name>_cp`` bindings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import relax
from tvm.relax import BlockBuilder, Expr, Var

from .. import _ty
from ..errors import GradientError
from ..exprs import RECOMPUTED_SUFFIX, free_vars, is_op, substitute

__all__ = ["RECOMPUTED_SUFFIX", "CheckpointInfo", "Regenerator", "strip_markers"]

_START, _END = "relax.grad.start_checkpoint", "relax.grad.end_checkpoint"


@dataclass
class CheckpointInfo:
    """What the collector learned. ``checkpoints=None`` means every var is checkpointed."""

    segments: list  # [(is_dataflow, [binding, ...]), ...], markers removed, uses remapped
    ret: Expr
    checkpoints: set | None
    var_mapping: dict = field(default_factory=dict)  # wrapped var -> original var
    start_marked: set = field(default_factory=set)
    end_marked: set = field(default_factory=set)

    @property
    def bindings(self) -> list:
        return [b for _, bindings in self.segments for b in bindings]

    def is_checkpointed(self, var: Var) -> bool:
        return self.checkpoints is None or var in self.checkpoints


def _is_marker(value) -> bool:
    return is_op(value, _START) or is_op(value, _END)


def strip_markers(bb: BlockBuilder, params, segments, ret: Expr) -> CheckpointInfo:
    """Apply the marker rules to the blocks ``segments`` and strip the markers.

    ``bb`` normalizes rewritten values (it must be inside a scope).
    """
    if not any(_is_marker(b.value) for _, bindings in segments for b in bindings):
        return CheckpointInfo([(df, list(bs)) for df, bs in segments], ret, None)

    checkpoints: set = set(params)
    e_vars: set = set()
    remap: dict = {}
    info = CheckpointInfo([], ret, checkpoints)
    for is_dataflow, bindings in segments:
        out = []
        for b in bindings:
            value = b.value
            if not _is_marker(value):
                if all(v in checkpoints or v in e_vars for v in free_vars(value)):
                    checkpoints.add(b.var)
                new_value = substitute(value, remap)
                if not new_value.same_as(value):
                    new_value = bb.normalize(new_value)
                    if isinstance(b, relax.MatchCast):
                        b = relax.MatchCast(b.var, new_value, b.ty)
                    else:
                        b = relax.VarBinding(b.var, new_value)
                out.append(b)
                continue
            arg = value.args[0]
            if not isinstance(arg, relax.Var):
                raise GradientError(
                    f"Gradient: the argument of {value.op.name} bound to {b.var.name} must be "
                    "a Var"
                )
            orig = remap.get(arg, arg)
            if not isinstance(b.var, relax.DataflowVar) and isinstance(orig, relax.DataflowVar):
                # an output var wraps a dataflow var: keep an output binding of the original
                new_var = relax.Var(orig.name, orig.ty)
                out.append(relax.VarBinding(new_var, orig))
                remap[b.var] = new_var
            else:
                remap[b.var] = orig
            info.var_mapping[b.var] = orig
            if is_op(value, _START):
                checkpoints.add(orig)
                info.start_marked.add(orig)
            else:
                e_vars.add(b.var)
                info.end_marked.add(orig)
        info.segments.append((is_dataflow, out))
    info.ret = substitute(ret, remap)
    return info


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
        cp = self.bb.emit(new_value, var.name + RECOMPUTED_SUFFIX)
        self.cp_map[_ty.key(var)] = cp
        return cp, new_value

    def visit(self, expr: Expr) -> Expr:
        """``expr`` with every var it reads replaced by its checkpointed version."""
        remap = {}
        for v in free_vars(expr):
            cp = self.visit_var(v)
            if not cp.same_as(v):
                remap[v] = cp
        if not remap:
            return expr
        return self.bb.normalize(substitute(expr, remap))

    def visit_var(self, var: Var) -> Var:
        k = _ty.key(var)
        cp = self.cp_map.get(k)
        if cp is not None:
            return cp
        if k not in self.values:
            return var  # defined outside the walked bindings (e.g. an enclosing scope)
        cp = self.bb.emit(self.visit(self.values[k]), var.name + RECOMPUTED_SUFFIX)
        self.cp_map[k] = cp
        return cp
