"""The first stage of the pass: check everything it is handed, before any BlockBuilder exists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tvm import relax
from tvm.ir import IRModule
from tvm.relax import Function, Var

from .. import _ty
from ..errors import GradientError
from ..exprs import called_functions, free_vars

__all__ = ["Request", "validate", "validate_arguments"]

SEEDS = ("ones", "param")


@dataclass
class Request:
    """A validated request: the function, and the require_grads as Vars of that function."""

    func_name: str
    func: Function
    require_grads: list | None  # Vars of ``func`` (params or bound vars), or None: all params
    target_index: list | None  # ints
    target_index_arg: object  # as the user gave it, for messages
    seed: str
    checkpoint: object
    strict: bool = True


def validate_arguments(
    func_name, require_grads, target_index, seed, checkpoint, strict=True
) -> dict:
    """Check the pass arguments' kinds (not yet against a module)."""
    if not isinstance(func_name, str):
        raise GradientError(f"Gradient: func_name must be a str, not {func_name!r}")
    where = f"Gradient of function {func_name}"
    if require_grads is not None:
        items = [require_grads] if isinstance(require_grads, Var | str) else require_grads
        if not isinstance(items, Sequence) or isinstance(items, str):
            raise GradientError(
                f"{where}: require_grads must be a Var, a name, or a list of them, not "
                f"{require_grads!r}"
            )
        items = list(items)
        for item in items:
            if not isinstance(item, Var | str):
                raise GradientError(
                    f"{where}: require_grads must hold Vars or names, not {item!r} "
                    f"({type(item).__name__})"
                )
        require_grads = items
    indices = target_index if isinstance(target_index, list | tuple) else [target_index]
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise GradientError(
            f"{where}: target_index must be an int or a non-empty list of ints, not "
            f"{target_index!r}"
        )
    if seed not in SEEDS:
        raise GradientError(f"{where}: seed must be one of {SEEDS}, not {seed!r}")
    if not (isinstance(checkpoint, str | int | list | tuple | dict) or callable(checkpoint)):
        raise GradientError(f"{where}: checkpoint={checkpoint!r} is not a checkpoint policy")
    if not isinstance(strict, bool):
        raise GradientError(f"{where}: strict must be True or False, not {strict!r}")
    return {
        "strict": strict,
        "func_name": func_name,
        "require_grads": require_grads,
        "target_index": target_index if isinstance(target_index, int) else list(indices),
        "seed": seed,
        "checkpoint": checkpoint,
    }


def validate(
    mod: IRModule, func_name: str, require_grads, target_index, seed, checkpoint, strict=True
) -> Request:
    """Check ``mod[func_name]`` and the arguments against it; return the Request."""
    func = _lookup(mod, func_name)
    if strict:
        _check_tvm_shape(func, func_name)
    _check_adjoint_name(mod, func_name)
    _check_well_formed(mod, func, func_name)
    _check_bindings(func, func_name)
    grads = None if require_grads is None else _require_grads(func, func_name, require_grads)
    indices = [target_index] if isinstance(target_index, int) else list(target_index)
    if checkpoint != "markers":
        from .policies import resolve

        resolve(checkpoint)  # raises on a bad policy
    return Request(func_name, func, grads, indices, target_index, seed, checkpoint, strict)


def _check_tvm_shape(func: Function, func_name: str) -> None:
    """With ``strict``: TVM's pass refuses anything but exactly one dataflow block."""
    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        kinds = ", ".join(type(b).__name__ for b in blocks) or "none"
        raise GradientError(
            f"Gradient: function {func_name} must have exactly one binding block, a dataflow "
            f"block (R.dataflow()), as TVM's pass requires; it has: {kinds}. Pass strict=False "
            "to differentiate any blocks, If and match_cast"
        )


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


def _check_adjoint_name(mod: IRModule, func_name: str) -> None:
    """An existing ``<f>_adjoint`` is replaced: refuse when other functions call it."""
    adjoint = func_name + "_adjoint"
    callers = []
    for gv, func in mod.functions_items():
        if gv.name_hint == adjoint or not isinstance(func, Function):
            continue
        if any(gv.name_hint == adjoint for gv in called_functions(func)):
            callers.append(gv.name_hint)
    if callers:
        raise GradientError(
            f"Gradient: the module already has a function {adjoint}, called by "
            f"{', '.join(sorted(callers))}; replacing it would break those callers. Rename or "
            "remove it first"
        )


def _check_well_formed(mod: IRModule, func: Function, func_name: str) -> None:
    for p in func.params:
        if _ty.is_float_tensor(p) and _ty.shape_of(p) is None:
            raise GradientError(
                f"Gradient: parameter {p.name} of function {func_name} is a float tensor of "
                f"unknown shape ({p.ty}); give it a shape (symbolic dims are fine)"
            )
    if not isinstance(func.body, relax.SeqExpr):
        raise GradientError(f"Gradient: the body of function {func_name} is not normalized")
    # the function on its own (the rest of the module is not ours to judge): a DataflowVar used
    # outside its block, a var used before it is defined, ...
    try:
        relax.analysis.well_formed(func, check_ty=False)
    except Exception as err:  # TVM raises its own error kinds here
        detail = str(err).strip().splitlines()
        raise GradientError(
            f"Gradient: function {func_name} is not well formed: "
            f"{detail[-1] if detail else err}"
        ) from None


def _check_bindings(func: Function, func_name: str) -> None:
    for block in func.body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding | relax.MatchCast):
                raise GradientError(
                    f"Gradient: in function {func_name}, {b.var.name} is bound by a "
                    f"{type(b).__name__}; only var bindings and match_cast are supported"
                )
            if isinstance(b.value, relax.Function):
                raise GradientError(
                    f"Gradient: in function {func_name}, {b.var.name} is bound to a local "
                    "function (a closure); relaxgrad differentiates calls of the module's global "
                    "functions only: lift it into the module first (relax.transform.LambdaLift())"
                )
            try:
                free_vars(b.value)  # raises on node kinds the pass does not know
            except GradientError as err:
                raise GradientError(f"Gradient: in function {func_name}, the value of "
                                    f"{b.var.name}: {err}") from None


def _require_grads(func: Function, func_name: str, require_grads: list) -> list:
    by_name: dict[str, list] = {}
    own = set()
    for v in [*func.params, *(b.var for blk in func.body.blocks for b in blk.bindings)]:
        by_name.setdefault(v.name, []).append(v)
        own.add(_ty.key(v))
    seen = set()
    out = []
    for item in require_grads:
        if isinstance(item, str):
            found = by_name.get(item, [])
            if not found:
                raise GradientError(
                    f"Gradient: require_grads names {item!r}, but function {func_name} has no "
                    f"parameter or var of that name (it has: {', '.join(by_name)})"
                )
            if len(found) > 1:
                raise GradientError(
                    f"Gradient: require_grads names {item!r}, but function {func_name} has "
                    f"{len(found)} vars of that name; pass the Var itself"
                )
            var = found[0]
        else:
            var = item
            if _ty.key(var) not in own:
                raise GradientError(
                    f"Gradient: require_grads names {var.name}, which is not a parameter or a "
                    f"var of function {func_name}: it must be a Var of this function (e.g. "
                    f"{func_name}.params[i]), or its name as a string"
                )
        if _ty.key(var) in seen:
            raise GradientError(f"Gradient: {var.name} appears more than once in require_grads")
        seen.add(_ty.key(var))
        if not _ty.nested_all(var.ty, _ty.is_float_tensor):
            raise GradientError(
                f"Gradient: only float tensors or tuples of them can require gradients, but "
                f"{var.name} of function {func_name} has type {var.ty}"
            )
        out.append(var)
    return out
