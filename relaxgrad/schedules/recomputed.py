"""Checkpointed recomputations kept apart from the forward values they recompute, through the
pipelines' ``EliminateCommonSubexpr`` (CPU and GPU).

A checkpoint policy (``relaxgrad.Gradient(..., checkpoint=...)``) has the backward pass
recompute the values it did not keep, as ``<name>_cp`` bindings (TVM's naming, which the pass
keeps): the same calls on the same operands as the forward bindings they recompute. The
pipelines eliminate common subexpressions (a batch norm's statistics in its forward and its
gradient, computed once), which found each recomputation equal to its forward binding and
made the backward pass read the forward value again: the checkpointing undone, every value
kept from the forward pass, as without it (a 16-layer ``tanh`` MLP with ``checkpoint="sqrt"``:
28 ``tanh`` calls in its adjoint, 16 after the elimination).

:class:`HoldRecomputed` (first, before any rewrite that could make a recomputation's calls
the same as the forward's) reads each operand of a ``<name>_cp`` binding that is not itself
recomputed through an opaque ``call_pure_packed`` (one per operand and block), so that no
recomputation equals a forward binding; :class:`ReleaseRecomputed` (right after the
elimination) reads the operands again. Recomputations equal to one another are still
computed once, and so is what the backward pass computes twice from the same kept values.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..exprs import RECOMPUTED_SUFFIX, substitute
from ._common import is_op, rewrite_functions

__all__ = ["HoldRecomputed", "ReleaseRecomputed"]

_HOLD = "relaxgrad.recomputed_operand"  # never called: ReleaseRecomputed removes it
_CALL_PURE_PACKED = Op.get("relax.call_pure_packed")


def _recomputed(var: relax.Var) -> bool:
    return var.name.endswith(RECOMPUTED_SUFFIX)


def _has_recomputed(func: relax.Function) -> bool:
    body = func.body
    return isinstance(body, relax.SeqExpr) and any(
        _recomputed(b.var) for block in body.blocks for b in block.bindings)


@tvm.transform.module_pass(opt_level=0, name="HoldRecomputed")
class HoldRecomputed:
    """Read the operands of recomputed bindings through opaque calls (see the module
    docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Hold(mod), mod)


@tvm.transform.module_pass(opt_level=0, name="ReleaseRecomputed")
class ReleaseRecomputed:
    """Read the operands of recomputed bindings directly again (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Release(mod), mod)


@mutator
class _Hold(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.held: dict = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not _has_recomputed(func):
            return func
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if not _recomputed(binding.var):
            return super().visit_var_binding_(binding)
        operands = [v for v in relax.analysis.free_vars(binding.value) if not _recomputed(v)]
        if not operands:
            return super().visit_var_binding_(binding)
        remap = {v: self._held(v) for v in operands}  # (this pass remaps no var of its own)
        value = self.builder_.normalize(substitute(binding.value, remap))
        return super().visit_var_binding_(relax.VarBinding(binding.var, value))

    def visit_binding_block_(self, block: relax.BindingBlock) -> relax.BindingBlock:
        self.held = {}  # (a dataflow var bound in a block is read in that block only)
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.held = {}
        return super().visit_dataflow_block_(block)

    def _held(self, var: relax.Var) -> relax.Var:
        """``var`` through the opaque call: one per operand and block, bound before its first
        recomputed reader."""
        if var not in self.held:
            call = relax.call_pure_packed(_HOLD, var, ty_args=var.ty)
            self.held[var] = self.builder_.emit(call, f"{var.name}_held")
        return self.held[var]


@mutator
class _Release(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not _has_recomputed(func):
            return func
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if (is_op(value, _CALL_PURE_PACKED) and isinstance(value.args[0], relax.ExternFunc)
                and value.args[0].global_symbol == _HOLD):  # fmt: skip
            self.set_var_remap(binding.var, self.visit_expr(value.args[1]))
            return None
        return super().visit_var_binding_(binding)
