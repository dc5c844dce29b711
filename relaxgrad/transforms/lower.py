"""``call_tir_with_grad`` has no lowering in TVM 0.27: after differentiation it becomes
``call_tir``.

Gradient rules emit it too (the overlapping max pool's gather, whose TE gradient makes second
derivatives possible), so an adjoint can hold one: importing relaxgrad registers the same
lowering as the operator's ``FLegalize`` (where TVM has none), so that ``tvm.compile``'s
``LegalizeOps`` turns it into ``call_tir`` as it legalizes every other operator (and marks the
operator as not needing its operands' shapes, which ``LegalizeOps`` otherwise requires)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._module import with_functions
from ..exprs import is_op

__all__ = ["LowerCallTIRWithGrad", "lower_call_tir_with_grad"]


@mutator
class _Lower(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        return _as_call_tir(call) if is_op(call, "relax.call_tir_with_grad") else call


def _as_call_tir(call: relax.Call) -> relax.Call:
    """A ``call_tir_with_grad`` as the plain ``call_tir`` of the same PrimFunc and operands."""
    return relax.Call(Op.get("relax.call_tir"), call.args, None, call.ty_args)


if Op.get("relax.call_tir_with_grad").get_attr("FLegalize") is None:
    tvm.ir.register_op_attr("relax.call_tir_with_grad", "FLegalize",
                            lambda bb, call: _as_call_tir(call))  # fmt: skip
    # LegalizeOps skips a call whose operands' shapes are not all known, and the PrimFunc's
    # GlobalVar has none
    tvm.ir.register_op_attr("relax.call_tir_with_grad", "RequiresArgumentShapes", False)


def _uses_call_tir_with_grad(func: relax.Function) -> bool:
    found = []

    def visit_call(call: relax.Call) -> None:
        if is_op(call, "relax.call_tir_with_grad"):
            found.append(call)

    tvm_ffi.structural_walk(func, [(relax.Call, visit_call)])
    return bool(found)


def lower_call_tir_with_grad(func: relax.Function) -> relax.Function:
    """``func`` with every ``call_tir_with_grad`` turned into a plain ``call_tir``."""
    return _Lower().visit_expr(func)


@tvm.transform.module_pass(opt_level=0, name="LowerCallTIRWithGrad")
class LowerCallTIRWithGrad:
    """Module pass: lower ``call_tir_with_grad`` in every Relax function (needed to compile
    a module whose forward function uses it)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {
            gv: lower_call_tir_with_grad(func)
            for gv, func in mod.functions_items()
            if isinstance(func, relax.Function) and _uses_call_tir_with_grad(func)
        }
        return with_functions(mod, updates)
