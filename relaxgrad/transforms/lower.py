"""``call_tir_with_grad`` has no lowering: after differentiation it becomes ``call_tir``."""

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
        if is_op(call, "relax.call_tir_with_grad"):
            return relax.Call(Op.get("relax.call_tir"), call.args, None, call.ty_args)
        return call


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
