"""The reverse walk: visit forward bindings backwards and apply gradient rules."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir import Op
from tvm.relax import BlockBuilder, Expr, Var

from .. import _ty
from ..errors import GradientError
from ..exprs import free_vars, is_op, rename_seq
from ..ops import get_gradient
from ..ops.registry import missing_rule_hint
from .adjoint import (
    AdjointStore,
    add_in_tuple,
    combine,
    is_no_grad,
    msg_to_expr,
    nested_zeros,
    to_msg,
)
from .checkpoint import CheckpointInfo, Regenerator

TE_GRAD_PREFIX = "tvm.relax.te_grad._register."

# (callee GlobalVar) -> (GlobalVar of its VJP function, indices of the params it returns grads of)
CalleeVJP = Callable[[relax.GlobalVar, str], tuple[relax.GlobalVar, list[int]]]


class BackwardWalk:
    """Emits the backward bindings of a list of forward bindings into ``bb``.

    Seeds arrive as a mapping ``{target expr: seed expr}`` (or pairs); adjoints that never
    arrive stay absent (a symbolic zero) until an output needs them.
    """

    def __init__(
        self,
        bb: BlockBuilder,
        func_name: str,
        params,
        info: CheckpointInfo,
        callee_vjp: CalleeVJP | None = None,
        regen: Regenerator | None = None,
    ):
        self.bb = bb
        self.func_name = func_name
        self.info = info
        self.store = AdjointStore(bb)
        self.regen = regen if regen is not None else Regenerator(bb, params, info)
        self.callee_vjp = callee_vjp
        self.missing: dict[str, list[str]] = {}  # op name -> vars bound to it
        # vars upstream of an op without rule: walked only to find further such ops
        self.blocked: set[int] = set()

    def walk(self, seeds) -> None:
        """Seed the adjoints (a mapping or ``(target, seed)`` pairs: a target named twice gets
        the sum) and visit the bindings backwards."""
        for target, seed in seeds.items() if isinstance(seeds, dict) else seeds:
            self.store.update(target, seed)
        for binding in reversed(self.info.bindings):
            self.visit(binding)
        if self.missing:
            ops = "; ".join(
                f"{op} (bound to {', '.join(vs)}){missing_rule_hint(op)}"
                for op, vs in self.missing.items()
            )
            raise GradientError(
                f"Gradient: function {self.func_name} uses ops with no gradient rule: {ops}. "
                "Register one with relaxgrad.register_gradient."
            )

    def run(self, seeds, require_grads, orig_ret: Expr | None, dataflow=True) -> Expr:
        """Walk, then return ``(orig_ret, (adjoints...))`` (only the adjoints when
        ``orig_ret`` is None)."""
        self.walk(seeds)
        return self.epilogue(require_grads, orig_ret, dataflow)

    # -- one method per kind of binding ------------------------------------------------------
    def visit(self, binding) -> None:
        var = binding.var
        if var not in self.store:
            if _ty.key(var) in self.blocked:
                self.find_missing(var, binding.value)
            return  # does not reach the target
        value = binding.value
        if isinstance(binding, relax.MatchCast):
            self.visit_match_cast(var, value)
        elif isinstance(value, relax.Call):
            if isinstance(value.op, Op):
                self.visit_call(var, value)
            elif isinstance(value.op, relax.GlobalVar):
                self.visit_call_function(var, value)
            else:
                raise GradientError(
                    f"Gradient: in function {self.func_name}, {var.name} is bound to a call of "
                    f"{value.op}, which is neither an operator nor a function of the module"
                )
        elif isinstance(value, relax.Tuple):
            self.store.update(value, self.store[var])
        elif isinstance(value, relax.TupleGetItem):
            self.visit_tuple_get_item(var, value)
        elif isinstance(value, relax.Var):
            self.store.update(value, self.store[var])
        elif isinstance(value, relax.If):
            self.visit_if(var, value)
        elif not isinstance(value, _ty.Constant | relax.ShapeExpr):
            raise GradientError(
                f"Gradient: in function {self.func_name}, cannot differentiate the binding of "
                f"{var.name}: unsupported value {type(value).__name__} {value}"
            )

    def visit_match_cast(self, var: Var, value: Expr) -> None:
        """``y = match_cast(x, T)``: the adjoint of ``y`` flows to ``x``."""
        self.store.update(value, self.store[var])

    def visit_call(self, var: Var, call: relax.Call) -> None:
        adjoint = self.store[var]
        if is_op(call, "relax.call_tir") and _ty.nested_all(var.ty, _not_float):
            return  # e.g. a random mask: no gradient flows into bool or integer values
        if is_op(call, "relax.call_tir"):
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} is bound to call_tir "
                "without a gradient; use call_tir_with_grad (relax.training.utils."
                "register_te_gradient) to give it one"
            )
        cp_var, cp_call = self.regen.update_binding(var, call)
        if is_op(call, "relax.call_tir_with_grad"):
            self.visit_call_tir_with_grad(var, call, cp_var, cp_call, adjoint)
            return
        rule = get_gradient(call.op)
        if rule is None:
            self.find_missing(var, call)
            return
        name = str(call.op.name)
        try:
            partials = rule(cp_var, cp_call, adjoint, self.bb)
            partials = _check_partials(partials, call.args, f"the rule of {name}", var, call)
            for arg, partial in zip(call.args, partials):
                if not is_no_grad(partial):
                    self._update_checked(arg, partial, f"the rule of {name}", var)
        except GradientError:
            raise
        except Exception as err:  # a rule (ours or a user's) that crashed: name it, never leak
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise GradientError(
                f"Gradient: the rule of {name} failed at {var.name} in function "
                f"{self.func_name} ({type(err).__name__}: {lines[-1]})"
            ) from err

    def _update_checked(self, arg: Expr, partial: Expr, who: str, var: Var) -> None:
        """Add a rule's partial to ``arg``'s adjoint, after checking its type against ``arg``."""
        partial = self.bb.normalize(partial)
        _check_partial_type(partial, arg, who, var, self.func_name)
        self.store.update(arg, partial)

    def visit_call_function(self, var: Var, call: relax.Call) -> None:
        """``y = f(args)`` for a Relax function ``f`` of the module: call its VJP function."""
        if self.callee_vjp is None:
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} calls {call.op.name_hint}, "
                "but calls of functions are not supported here"
            )
        vjp, indices = self.callee_vjp(call.op, self.func_name)
        args = [self.regen.visit(a) for a in call.args]
        if not indices:
            return
        grads = self.bb.emit(relax.Call(vjp, [*args, self.store[var]]), var.name + "_vjp")
        for j, i in enumerate(indices):
            self.store.update(call.args[i], relax.TupleGetItem(grads, j))

    def visit_if(self, var: Var, node: relax.If) -> None:
        """``y = if c then A else B``: the backward of both branches, selected leaf by leaf with
        ``where(c, ...)`` for every outer var the branches read (the condition gets none).

        Both branch backwards are computed (an If over them is not used: TVM 0.27's static
        memory planner miscompiles Ifs whose branches hold temporaries and return tuples).
        """
        outer = []
        seen = set()
        for branch in (node.true_branch, node.false_branch):
            for v in free_vars(branch):
                if _ty.key(v) not in seen and _ty.nested_all(v.ty, _ty.is_float_tensor):
                    seen.add(_ty.key(v))
                    outer.append(v)
        if not outer:
            return
        cond = self.regen.visit(node.cond)
        seed = self.store[var]
        taken = self._branch_backward(node.true_branch, outer, seed)
        other = self._branch_backward(node.false_branch, outer, seed)
        for v, a, b in zip(outer, taken, other):
            if a is None and b is None:
                continue
            a = nested_zeros(v.ty, v.name) if a is None else a
            b = nested_zeros(v.ty, v.name) if b is None else b
            select = combine(to_msg(self.bb.normalize(a)), to_msg(self.bb.normalize(b)),
                             lambda x, y: relax.op.where(cond, x, y))
            self.store.update(v, msg_to_expr(select))

    def _branch_backward(self, branch: relax.SeqExpr, outer: list, seed: Expr) -> list:
        """The backward of one If branch: recompute its bindings (fresh vars), walk them back
        from ``seed``; the adjoints of ``outer`` (None where absent)."""
        bb = self.bb
        remap = {v: self.regen.visit_var(v) for v in free_vars(branch)}
        copy = rename_seq(branch, remap, plain=True)
        bindings = []
        for block in copy.blocks:
            for b in block.bindings:
                value = bb.normalize(b.value)
                if isinstance(b, relax.MatchCast):
                    b = relax.MatchCast(b.var, value, b.ty)
                else:
                    b = relax.VarBinding(b.var, value)
                bb.emit_normalized(b)
                bindings.append(b)
        info = CheckpointInfo([(False, bindings)], copy.body, None)
        walk = BackwardWalk(bb, self.func_name, [], info, self.callee_vjp)
        walk.walk({copy.body: seed})
        out = []
        for v in outer:
            inner = remap.get(v, v)
            out.append(walk.store[inner] if inner in walk.store else None)
        return out

    def find_missing(self, var: Var, value) -> None:
        """Record ``var = value`` if it calls an op without rule, and keep looking upstream."""
        if isinstance(value, relax.Call) and isinstance(value.op, Op):
            if get_gradient(value.op) is None and not is_op(value, "relax.call_tir_with_grad"):
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
        who = f"the TE gradient {name!r}"
        if not _ty.is_tuple(partials):
            if len(args) != 1:
                raise GradientError(
                    f"Gradient: {who} returned one tensor for {len(args)} inputs, at "
                    f"{var.name} in function {self.func_name}"
                )
            self._update_checked(args[0], partials, who, var)
            return
        partials = self.bb.normalize(partials)
        if len(_ty.tuple_fields(partials)) != len(args):
            raise GradientError(
                f"Gradient: {who} returned {len(_ty.tuple_fields(partials))} partials for "
                f"{len(args)} inputs, at {var.name} in function {self.func_name}"
            )
        for i, arg in enumerate(args):
            self._update_checked(arg, relax.TupleGetItem(partials, i), who, var)

    def visit_tuple_get_item(self, var: Var, value: relax.TupleGetItem) -> None:
        tup = value.tuple_value
        if not isinstance(tup, relax.Var) or not _ty.is_tuple(tup):
            raise GradientError(
                f"Gradient: in function {self.func_name}, {var.name} indexes {tup}, which "
                "must be a Var of tuple type"
            )
        if tup not in self.store:
            fields = [
                self.store[var] if i == value.index else nested_zeros(ty, tup.name)
                for i, ty in enumerate(_ty.tuple_fields(tup))
            ]
            self.store.emit(tup, relax.Tuple(fields))
        else:
            updated = add_in_tuple(self.store[tup], value.index, self.store[var])
            self.store.emit(tup, updated)

    def epilogue(self, require_grads, orig_ret: Expr | None, dataflow: bool = True) -> Expr:
        outs = []
        for var in require_grads:
            var = self.info.var_mapping.get(var, var)
            if var not in self.store:
                self.store.update(var, nested_zeros(var.ty, var.name))
            outs.append(self.store.emit(var, self.store[var], is_output=dataflow))
        if orig_ret is None:
            return relax.Tuple(outs)
        return relax.Tuple([orig_ret, relax.Tuple(outs)])


def _not_float(ty) -> bool:
    return not _ty.is_float_tensor(ty)


def _check_partials(partials, args, who: str, var: Var, call: relax.Call) -> list:
    try:
        partials = list(partials)
    except TypeError:
        raise GradientError(
            f"Gradient: {who} must return a list of partials, not {type(partials).__name__}, "
            f"at {var.name} = {call}"
        ) from None
    if len(partials) != len(args):
        raise GradientError(
            f"Gradient: {who} returned {len(partials)} partials for {len(args)} arguments, at "
            f"{var.name} = {call}"
        )
    return partials


def _check_partial_type(partial: Expr, arg: Expr, who: str, var: Var, func_name: str) -> None:
    """A partial must have the structure, dtype and (when provable) shape of its argument."""
    want, got = _ty.type_of(arg), _ty.type_of(partial)
    problem = _type_mismatch(want, got)
    if problem:
        raise GradientError(
            f"Gradient: {who} returned a partial of type {got} for an argument of type {want} "
            f"({problem}), at {var.name} in function {func_name}"
        )


def _type_mismatch(want, got) -> str | None:
    if _ty.is_tuple(want):
        if not _ty.is_tuple(got) or len(want.fields) != len(got.fields):
            return "tuple structure differs"
        for w, g in zip(want.fields, got.fields):
            problem = _type_mismatch(w, g)
            if problem:
                return problem
        return None
    if not _ty.is_tensor(want):
        return None  # shapes, prim values: the store refuses real gradients for them
    if not _ty.is_tensor(got):
        return "not a tensor"
    if _ty.dtype_of(want) != _ty.dtype_of(got) and _ty.dtype_of(got) != "void":
        return f"dtype {_ty.dtype_of(got)} instead of {_ty.dtype_of(want)}"
    wn, gn = _ty.ndim_of(want), _ty.ndim_of(got)
    if wn != -1 and gn != -1 and wn != gn:
        return f"rank {gn} instead of {wn}"
    ws, gs = _ty.shape_of(want), _ty.shape_of(got)
    if isinstance(ws, relax.ShapeExpr) and isinstance(gs, relax.ShapeExpr):
        for a, b in zip(ws.values, gs.values):
            if isinstance(a, tvm.tirx.IntImm) and isinstance(b, tvm.tirx.IntImm):
                if int(a) != int(b):
                    return f"shape {list(gs.values)} instead of {list(ws.values)}"
    return None
