"""The ``Gradient`` module pass: validate, copy, checkpoint, walk backwards, simplify."""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax import Function, Var

from .. import _ty
from .._module import with_function
from ..errors import GradientError
from .backward import BackwardWalk
from .checkpoint import collect_checkpoints
from .lower import lower_call_tir_with_grad
from .simplify import remove_unused, simplify_gradient

__all__ = ["Gradient", "gradient_module"]


def Gradient(  # noqa: N802 (TVM's pass naming)
    func_name: str,
    require_grads: Var | Sequence[Var] | None = None,
    target_index: int = 0,
) -> tvm.ir.transform.Pass:
    """Reverse-mode automatic differentiation of a Relax function.

    Adds ``<func_name>_adjoint`` to the module, returning ``(original_result, (adjoint of each
    require_grad, ...))``; the module's other functions are left as they are.

    Parameters
    ----------
    func_name : str
        Name of the Relax function to differentiate (one dataflow block for now).
    require_grads : Var or list of Var, optional
        Parameters or intermediate vars of the function to differentiate with respect to.
        Defaults to all parameters.
    target_index : int
        When the function returns a tuple, the field that is the target. The target must be a
        float scalar Var.

    Returns
    -------
    tvm.ir.transform.Pass
        A module pass named "Gradient".
    """
    if isinstance(require_grads, Var):
        require_grads = [require_grads]
    elif require_grads is not None:
        require_grads = list(require_grads)
    return _GradientPass(str(func_name), require_grads, int(target_index))


@tvm.transform.module_pass(opt_level=0, name="Gradient")
class _GradientPass:
    def __init__(self, func_name: str, require_grads: list | None, target_index: int):
        self.func_name = func_name
        self.require_grads = require_grads
        self.target_index = target_index

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return gradient_module(mod, self.func_name, self.require_grads, self.target_index)


def gradient_module(
    mod: IRModule, func_name: str, require_grads: list | None = None, target_index: int = 0
) -> IRModule:
    """The pass body: a new module with ``<func_name>_adjoint`` added (``mod`` is untouched)."""
    func = _lookup(mod, func_name)
    copied = relax.utils.copy_with_new_vars(func)
    var_map = _var_map(func, copied)
    block = _single_dataflow_block(copied, func_name)

    bb = relax.BlockBuilder(mod.clone())
    params = list(copied.params)
    bb.begin_scope(params)
    bb._begin_dataflow_block()
    try:
        info = collect_checkpoints(bb, params, block.bindings, copied.body.body)
        if require_grads is None:
            grads = params
        else:
            grads = _map_require_grads(require_grads, var_map, func_name)
        target = _target(info.ret, target_index, func_name)
        has_call_tir_with_grad = _emit_forward(bb, info.bindings)
        ret = BackwardWalk(bb, func_name, params, info).run(target, grads, info.ret)
    finally:
        new_block = bb._end_block()
        bb.end_scope()
    body = bb.normalize(relax.SeqExpr([new_block], ret))
    adjoint = Function(params, body, None, copied.is_pure, copied.attrs)
    if has_call_tir_with_grad:
        adjoint = lower_call_tir_with_grad(adjoint)
    adjoint = remove_unused(adjoint)
    adjoint = simplify_gradient(adjoint)
    return with_function(bb.get(), func_name + "_adjoint", adjoint)


def _emit_forward(bb: relax.BlockBuilder, bindings) -> bool:
    """Re-emit the forward bindings; returns whether any of them calls call_tir_with_grad."""
    with_grad = Op.get("relax.call_tir_with_grad")
    found = False
    for binding in bindings:
        bb.emit_normalized(binding)
        value = binding.value
        found = found or (isinstance(value, relax.Call) and value.op.same_as(with_grad))
    return found


def _lookup(mod: IRModule, func_name: str) -> Function:
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    if func_name not in names:
        raise GradientError(
            f"Gradient: no function named {func_name!r} in the module (it has: "
            f"{', '.join(sorted(names)) or 'nothing'})"
        )
    func = mod[names[func_name]]
    if not isinstance(func, Function):
        raise GradientError(
            f"Gradient: {func_name!r} is a {type(func).__name__}, not a Relax function"
        )
    return func


def _var_map(old: Function, new: Function) -> dict:
    """Map the vars of ``old`` to those of its structural copy ``new``."""
    mapping = dict(zip(old.params, new.params))
    if isinstance(old.body, relax.SeqExpr):
        for old_block, new_block in zip(old.body.blocks, new.body.blocks):
            for ob, nb in zip(old_block.bindings, new_block.bindings):
                mapping[ob.var] = nb.var
    return mapping


def _single_dataflow_block(func: Function, func_name: str) -> relax.DataflowBlock:
    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        kinds = ", ".join(type(b).__name__ for b in blocks) or "none"
        raise GradientError(
            f"Gradient: function {func_name} must have exactly one binding block, a dataflow "
            f"block (R.dataflow()); it has: {kinds}"
        )
    for binding in blocks[0].bindings:
        if not isinstance(binding, relax.VarBinding):
            raise GradientError(
                f"Gradient: in function {func_name}, {binding.var.name} is bound by a "
                f"{type(binding).__name__}; only plain var bindings are supported"
            )
    return blocks[0]


def _target(ret, target_index: int, func_name: str) -> Var:
    if isinstance(ret, relax.Var):
        if target_index != 0:
            raise GradientError(
                f"Gradient: function {func_name} returns a single value, so target_index must "
                f"be 0, not {target_index}"
            )
        target = ret
    elif isinstance(ret, relax.Tuple):
        n = len(ret.fields)
        if not 0 <= target_index < n:
            raise GradientError(
                f"Gradient: target_index {target_index} is out of range: function {func_name} "
                f"returns {n} values"
            )
        target = ret.fields[target_index]
        if not isinstance(target, relax.Var):
            raise GradientError(
                f"Gradient: the target of function {func_name} must be a Var, but return field "
                f"{target_index} is {target}"
            )
    else:
        raise GradientError(
            f"Gradient: function {func_name} must return a Var or a Tuple, not {ret}"
        )
    if not (_ty.is_float_tensor(target) and _ty.is_scalar_tensor(target)):
        raise GradientError(
            f"Gradient: the target {target.name} of function {func_name} must be a float "
            f"scalar (0-dim tensor), but has type {target.ty}"
        )
    return target


def _map_require_grads(require_grads: list, var_map: dict, func_name: str) -> list:
    seen = set()
    mapped = []
    for var in require_grads:
        if not isinstance(var, Var) or var not in var_map:
            name = var.name if isinstance(var, Var) else repr(var)
            raise GradientError(
                f"Gradient: require_grads names {name}, which is not a parameter or a var of "
                f"function {func_name}"
            )
        if var in seen:
            raise GradientError(
                f"Gradient: {var.name} appears more than once in require_grads"
            )
        seen.add(var)
        if not _ty.nested_all(var.ty, _ty.is_float_tensor):
            raise GradientError(
                f"Gradient: only float tensors or tuples of them can require gradients, but "
                f"{var.name} of function {func_name} has type {var.ty}"
            )
        mapped.append(var_map[var])
    return mapped
