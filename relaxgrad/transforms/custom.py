"""Custom gradients of module functions, and a stop-gradient helper.

:func:`custom_gradient` gives a Relax function ``f`` of a module its own backward: another
function of the module, ``f_bwd(params of f..., output_grad) -> (one gradient per parameter of
f)`` (the contract of TVM's ``FPrimalGradient``, for a function). The ``Gradient`` pass then
calls ``f_bwd`` wherever a differentiated function calls ``f``, instead of differentiating
``f``'s body (in split mode too, and inside ``If`` branches). Gradients returned for non-float
parameters are ignored. ``Gradient("f")`` itself still differentiates ``f``'s body: the custom
backward serves the callers of ``f``.

:func:`stop_gradient` wraps an expression in ``R.grad.no_grad``: its value is unchanged (TVM
lowers ``no_grad`` to an identity) and no gradient flows through it.
"""

from __future__ import annotations

from tvm import relax
from tvm.ir import IRModule
from tvm.relax import Function

from .. import _ty
from .._module import with_function
from ..errors import GradientError

__all__ = ["CUSTOM_GRADIENT_ATTR", "custom_gradient", "stop_gradient"]

CUSTOM_GRADIENT_ATTR = "relaxgrad.custom_gradient"


def stop_gradient(expr: relax.Expr) -> relax.Expr:
    """``R.grad.no_grad(expr)``: the value of ``expr``, through which no gradient flows."""
    return relax.op.grad.no_grad(expr)


def custom_gradient(mod: IRModule, func_name: str, bwd_name: str) -> IRModule:
    """A copy of ``mod`` where ``func_name`` uses ``bwd_name`` as its backward.

    Parameters
    ----------
    mod : IRModule
        Module holding both functions.
    func_name : str
        The Relax function ``f`` (its result: a float tensor or a tuple of them).
    bwd_name : str
        The backward ``f_bwd(params of f..., output_grad) -> (grad of each param of f, ...)``:
        it takes ``f``'s parameters and a gradient shaped like ``f``'s result, and returns a
        tuple with one gradient per parameter of ``f``, each shaped like its parameter.

    Returns
    -------
    IRModule
        ``mod`` with ``f`` carrying the attribute ``"relaxgrad.custom_gradient": bwd_name``.
    """
    names = {gv.name_hint for gv in mod.get_global_vars()}
    for name in (func_name, bwd_name):
        if name not in names or not isinstance(mod[name], Function):
            raise GradientError(f"custom_gradient: the module has no Relax function {name}")
    func, bwd = mod[func_name], mod[bwd_name]
    _check_contract(func, bwd, func_name, bwd_name)
    return with_function(mod, func_name, func.with_attr(CUSTOM_GRADIENT_ATTR, bwd_name))


def _check_contract(func: Function, bwd: Function, name: str, bwd_name: str) -> None:
    where = f"custom_gradient: the backward {bwd_name} of {name}"
    n = len(func.params)
    if len(bwd.params) != n + 1:
        raise GradientError(
            f"{where} must take the {n} parameters of {name} and one output gradient, but "
            f"takes {len(bwd.params)} parameters"
        )
    ret_ty = bwd.ret_ty if bwd.ret_ty is not None else _ty.type_of(bwd.body)
    if not _ty.is_tuple(ret_ty) or len(ret_ty.fields) != n:
        raise GradientError(
            f"{where} must return a tuple of {n} gradients (one per parameter of {name}), "
            f"not {ret_ty}"
        )


def custom_vjp(mod: IRModule, gv: relax.GlobalVar, func: Function, float_indices: list):
    """``(module, vjp GlobalVar, indices)`` for the Callees table: the backward named by the
    attribute, wrapped to return only the gradients of the float parameters when ``func`` has
    others."""
    bwd_name = str(func.attrs[CUSTOM_GRADIENT_ATTR])
    names = {g.name_hint: g for g in mod.get_global_vars()}
    if bwd_name not in names:
        raise GradientError(
            f"Gradient: the custom backward {bwd_name} of {gv.name_hint} is not in the module"
        )
    bwd_gv = names[bwd_name]
    _check_contract(func, mod[bwd_gv], gv.name_hint, bwd_name)
    if len(float_indices) == len(func.params):
        return mod, bwd_gv, float_indices
    # an adapter keeping the float parameters' gradients
    params = [relax.Var(p.name, p.ty) for p in mod[bwd_gv].params]
    bb = relax.BlockBuilder(mod)
    adapter = bwd_name + "_float"
    with bb.function(adapter, params):
        with bb.dataflow():
            grads = bb.emit(relax.Call(bwd_gv, params))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(grads, i) for i in float_indices]))
        bb.emit_func_output(out)
    new = bb.get()
    adapter_gv = new.get_global_var(adapter)
    return new, adapter_gv, float_indices
