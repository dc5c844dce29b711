"""``StaticPlanBlockMemory`` made safe for functions with ``If``.

TVM 0.27's planner walks a function's bindings in textual order (true branch, false branch,
then what follows the ``If``) with one pool of free storage tokens for the whole function, and
creates each token's ``alloc_storage`` lazily, at the first tensor that gets the token. A
temporary that lives and dies inside a branch therefore gets a token whose ``alloc_storage`` is
bound inside that branch, and once it dies the token goes back to the pool, where a tensor
allocated in the other branch or after the ``If`` picks it up. That tensor's ``alloc_tensor``
then reads a storage variable that is not defined on every path to it: when the branch that
binds it did not run, the VM register is null and ``StorageObj::AllocTensor`` dereferences it
(segfault). Even when it did run, ``KillAfterLastUse`` (which sees only the branch's own block)
kills the storage right after its last use inside the branch, so the register is null again.

:class:`PlanBlockMemory` runs ``StaticPlanBlockMemory`` and then, in each function with an
``If``, hoists every ``alloc_storage`` that is bound inside a branch but used outside it to
the start of the function (its size is a constant, or a shape of the function's own
parameters). The planner's reuse is otherwise sound for branches: its textual order is a
linearization in which every value is live at least as long as on any path. A function in
which a storage cannot be hoisted is left unplanned (every tensor its own allocation).
"""

from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule, Op

from .._module import with_functions

__all__ = ["PlanBlockMemory", "escaping_storages"]

_ALLOC_STORAGE = "relax.memory.alloc_storage"
_STOCK_PLAN = relax.transform.StaticPlanBlockMemory  # kept should someone patch it with ours


def _is_alloc_storage(value: relax.Expr) -> bool:
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, Op)
        and value.op.same_as(Op.get(_ALLOC_STORAGE))
    )


def _has_if(func: relax.Function) -> bool:
    found = []  # (a walk that calls back on If nodes only: a Python call per node took 0.1 s)
    tvm_ffi.structural_walk(func.body, [(relax.If, found.append)])
    return bool(found)


def _scan(func: relax.Function):
    """``(defs, uses)``: for each ``alloc_storage`` var, its binding and the scope path
    (a tuple of ``(if number, branch)``) where it is bound; for each var, the paths of its uses."""
    defs: dict = {}
    uses: dict = {}
    counter = itertools.count()

    def use(expr: relax.Expr, path: tuple) -> None:
        for var in relax.analysis.free_vars(expr):
            uses.setdefault(var, []).append(path)

    def value(expr: relax.Expr, path: tuple) -> None:
        if isinstance(expr, relax.If):
            use(expr.cond, path)
            number = next(counter)
            value(expr.true_branch, path + ((number, 0),))
            value(expr.false_branch, path + ((number, 1),))
        elif isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    if isinstance(binding, relax.VarBinding) and _is_alloc_storage(binding.value):
                        defs[binding.var] = (path, binding)
                    value(binding.value, path)
            value(expr.body, path)
        else:
            use(expr, path)

    value(func.body, ())
    return defs, uses


def escaping_storages(func: relax.Function) -> list[relax.VarBinding]:
    """The ``alloc_storage`` bindings of ``func`` that sit inside an ``If`` branch and whose
    var is used outside that branch, in textual order."""
    defs, uses = _scan(func)
    out = []
    for var, (path, binding) in defs.items():
        if path and any(p[: len(path)] != path for p in uses.get(var, [])):
            out.append(binding)
    return out


def _hoistable(func: relax.Function, binding: relax.VarBinding) -> bool:
    if relax.analysis.free_vars(binding.value):
        return False
    params = set()
    for param in func.params:
        params.update(relax.analysis.definable_tir_vars_in_type(param.ty))
    return all(v in params for v in relax.analysis.free_symbolic_vars(binding.value))


def _without(expr: relax.Expr, drop: set) -> relax.Expr:
    """``expr`` with the bindings of the vars in ``drop`` removed (inside ``If`` branches)."""
    if isinstance(expr, relax.If):
        return relax.If(
            expr.cond,
            _without(expr.true_branch, drop),
            _without(expr.false_branch, drop),
            expr.span,
        )
    if isinstance(expr, relax.SeqExpr):
        blocks = []
        for block in expr.blocks:
            bindings = []
            for binding in block.bindings:
                if binding.var in drop:
                    continue
                if isinstance(binding, relax.VarBinding) and isinstance(
                    binding.value, (relax.If, relax.SeqExpr)
                ):
                    binding = relax.VarBinding(binding.var, _without(binding.value, drop))
                bindings.append(binding)
            if isinstance(block, relax.DataflowBlock):
                blocks.append(relax.DataflowBlock(bindings, block.span))
            else:
                blocks.append(relax.BindingBlock(bindings, block.span))
        return relax.SeqExpr(blocks, _without(expr.body, drop), expr.span)
    return expr


def hoist_escaping_storages(func: relax.Function) -> relax.Function | None:
    """``func`` (planned) with its escaping ``alloc_storage`` bindings moved to the start, or
    ``None`` when one of them cannot be moved."""
    escaping = escaping_storages(func)
    if not escaping:
        return func
    if not all(_hoistable(func, b) for b in escaping):
        return None
    body = _without(func.body, {b.var for b in escaping})
    hoisted = [relax.VarBinding(b.var, b.value) for b in escaping]
    if not isinstance(body, relax.SeqExpr):
        body = relax.SeqExpr([], body)
    body = relax.SeqExpr([relax.BindingBlock(hoisted), *body.blocks], body.body, body.span)
    body = relax.BlockBuilder().normalize(body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="relaxgrad.PlanBlockMemory")
class PlanBlockMemory:
    """``relax.transform.StaticPlanBlockMemory`` with its ``If`` bug worked around (see the
    module docstring); use it in its place, after ``CallTIRRewrite``."""

    def __init__(self):
        self.unplanned: list[str] = []
        """Names of the functions of the last module left unplanned."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        planned = _STOCK_PLAN()(mod)
        self.unplanned = []
        fixes = {}
        for gvar, func in planned.functions_items():
            if not isinstance(func, relax.Function) or not _has_if(func):
                continue
            fixed = hoist_escaping_storages(func)
            if fixed is None:
                self.unplanned.append(gvar.name_hint)
                fixed = mod[gvar.name_hint]
            if not fixed.same_as(func):
                fixes[gvar] = fixed
        return with_functions(planned, fixes)
