"""The reverse walk: visit forward bindings backwards and apply gradient rules."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import Op
from tvm.relax import BlockBuilder, Expr, Var

from .. import _ty
from ..errors import GradientError
from ..ops import get_gradient
from .adjoint import AdjointStore, add_in_tuple, is_no_grad, nested_zeros
from .checkpoint import CheckpointInfo, Regenerator, free_vars

TE_GRAD_PREFIX = "tvm.relax.te_grad._register."


class BackwardWalk:
    """Emits the backward bindings of one dataflow block into ``bb``."""

    def __init__(self, bb: BlockBuilder, func_name: str, params, info: CheckpointInfo):
        self.bb = bb
        self.func_name = func_name
        self.info = info
        self.store = AdjointStore(bb)
        self.regen = Regenerator(bb, params, info)
        self.missing: dict[str, list[str]] = {}  # op name -> vars bound to it
        # vars upstream of an op without rule: walked only to find further such ops
        self.blocked: set[int] = set()
        self._call_tir = Op.get("relax.call_tir")
        self._call_tir_with_grad = Op.get("relax.call_tir_with_grad")

    def run(self, target: Var, require_grads, orig_ret: Expr) -> Expr:
        """Seed the target with ones, walk backwards, and return ``(orig_ret, (adjoints...))``."""
        shape, dtype = _ty.shape_of(target), _ty.dtype_of(target)
        self.store.update(target, relax.op.ones(shape, dtype))
        for binding in reversed(self.info.bindings):
            self.visit(binding)
        if self.missing:
            ops = "; ".join(f"{op} (bound to {', '.join(vs)})" for op, vs in self.missing.items())
            raise GradientError(
                f"Gradient: function {self.func_name} uses ops with no gradient rule: {ops}. "
                "Register one with relaxgrad.register_gradient."
            )
        return self.epilogue(require_grads, orig_ret)

    def visit(self, binding) -> None:
        var = binding.var
        if var not in self.store:
            if _ty.key(var) in self.blocked:
                self.find_missing(var, binding.value)
            return  # does not reach the target
        value = binding.value
        if isinstance(value, relax.Call):
            self.visit_call(var, value)
        elif isinstance(value, relax.Tuple):
            self.store.update(value, self.store[var])
        elif isinstance(value, relax.TupleGetItem):
            self.visit_tuple_get_item(var, value)
        elif isinstance(value, relax.Var):
            self.store.update(value, self.store[var])
        elif not isinstance(value, _ty.Constant):
            raise GradientError(
                f"Gradient: in function {self.func_name}, cannot differentiate the binding of "
                f"{var.name}: unsupported value {type(value).__name__} {value}"
            )

    def visit_call(self, var: Var, call: relax.Call) -> None:
        if not isinstance(call.op, Op):
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} is bound to a call of "
                f"{call.op}, which is not an operator; calls of functions are not supported yet"
            )
        adjoint = self.store[var]
        if call.op.same_as(self._call_tir):
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} is bound to call_tir "
                "without a gradient; use call_tir_with_grad (relax.training.utils."
                "register_te_gradient) to give it one"
            )
        cp_var, cp_call = self.regen.update_binding(var, call)
        if call.op.same_as(self._call_tir_with_grad):
            self.visit_call_tir_with_grad(var, call, cp_var, cp_call, adjoint)
            return
        rule = get_gradient(call.op)
        if rule is None:
            self.find_missing(var, call)
            return
        partials = list(rule(cp_var, cp_call, adjoint, self.bb))
        if len(partials) != len(call.args):
            raise GradientError(
                f"Gradient: the rule of {call.op.name} returned {len(partials)} partials for "
                f"{len(call.args)} arguments, at {var.name} = {call}"
            )
        for arg, partial in zip(call.args, partials):
            if not is_no_grad(partial):
                self.store.update(arg, partial)

    def find_missing(self, var: Var, value) -> None:
        """Record ``var = value`` if it calls an op without rule, and keep looking upstream."""
        if isinstance(value, relax.Call) and isinstance(value.op, Op):
            if get_gradient(value.op) is None and not value.op.same_as(self._call_tir_with_grad):
                self.missing.setdefault(str(value.op.name), []).append(var.name)
        self.blocked.update(_ty.key(v) for v in free_vars(value))

    def visit_call_tir_with_grad(self, var, call, cp_var, cp_call, adjoint) -> None:
        name = str(call.attrs.te_grad_name)
        grad_func = tvm.get_global_func(TE_GRAD_PREFIX + name, allow_missing=True)
        if grad_func is None:
            raise GradientError(
                f"Gradient: no TE gradient named {name!r} is registered (for {var.name} in "
                f"function {self.func_name}); register it with register_te_gradient"
            )
        partials = grad_func(cp_var, cp_call, adjoint, self.bb)
        args = call.args[1].fields
        if not _ty.is_tuple(partials):
            if len(args) != 1:
                raise GradientError(
                    f"Gradient: TE gradient {name!r} returned one tensor for {len(args)} inputs"
                )
            self.store.update(args[0], partials)
            return
        for i, arg in enumerate(args):
            self.store.update(arg, relax.TupleGetItem(partials, i))

    def visit_tuple_get_item(self, var: Var, value: relax.TupleGetItem) -> None:
        tup = value.tuple_value
        if not isinstance(tup, relax.Var) or not _ty.is_tuple(tup):
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} indexes {tup}, which "
                "must be a Var of tuple type"
            )
        if tup not in self.store:
            fields = list(nested_zeros(tup.ty, tup.name).fields)
            fields[value.index] = self.store[var]
            self.store.emit(tup, relax.Tuple(fields))
        else:
            updated = add_in_tuple(self.store[tup], value.index, self.store[var])
            self.store.emit(tup, updated)

    def epilogue(self, require_grads, orig_ret: Expr) -> Expr:
        outs = []
        for var in require_grads:
            var = self.info.var_mapping.get(var, var)
            if var not in self.store:
                self.store.update(var, nested_zeros(var.ty, var.name))
            outs.append(self.store.emit(var, self.store[var], is_output=True))
        return relax.Tuple([orig_ret, relax.Tuple(outs)])
