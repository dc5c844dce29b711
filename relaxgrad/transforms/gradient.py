"""The ``Gradient`` module pass: validate (:mod:`.validate`), then build the adjoint
(:mod:`.stages`), or the forward and backward pair in split mode (:mod:`.split`)."""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm.ir import IRModule
from tvm.relax import Var

from .._module import with_function
from .._stack import with_deep_stack
from ..errors import GradientError
from .split import SplitGradient
from .stages import Callees, differentiate
from .validate import validate, validate_arguments

__all__ = ["Gradient", "gradient_module"]


def Gradient(  # noqa: N802 (TVM's pass naming)
    func_name: str,
    require_grads: Var | str | Sequence[Var | str] | None = None,
    target_index: int | Sequence[int] = 0,
    *,
    seed: str = "ones",
    checkpoint="markers",
    strict: bool = True,
    split: bool = False,
) -> tvm.ir.transform.Pass:
    """Reverse-mode automatic differentiation of a Relax function.

    Adds ``<func_name>_adjoint`` to the module, returning ``(original_result, (adjoint of each
    require_grad, ...))``; the module's other functions are left as they are.

    Parameters
    ----------
    func_name : str
        Name of the Relax function to differentiate.
    require_grads : Var, str or list of them, optional
        Parameters or bound vars of the function (or their names) to differentiate with
        respect to. Defaults to all parameters.
    target_index : int or list of int
        When the function returns a tuple (or a var bound to one), the field that is the
        target; a list names several targets whose adjoints are summed.
    seed : str
        ``"ones"`` (TVM's behaviour: each target is a float scalar seeded with 1) or
        ``"param"``: one output-gradient parameter per target is appended to the adjoint's
        parameters, so the adjoint is a vector-Jacobian product.
    checkpoint : str, int, list or callable
        Which forward values the backward pass keeps (the rest is recomputed): ``"markers"``
        (TVM's start/end_checkpoint markers; the default), or a policy of
        :mod:`relaxgrad.transforms.policies`.
    strict : bool
        True (the default): refuse what TVM's pass refuses (anything but one dataflow block,
        a return value bound to a tuple), so that this pass is a drop-in replacement for
        TVM's, errors included. False: differentiate any number of blocks (dataflow or not),
        ``If``, ``match_cast``, and look through a returned var bound to a tuple.
    split : bool
        True: add ``<func_name>_fwd`` and ``<func_name>_bwd`` instead of the adjoint (see
        :mod:`relaxgrad.transforms.split`).

    Returns
    -------
    tvm.ir.transform.Pass
        A module pass named "Gradient".
    """
    args = validate_arguments(func_name, require_grads, target_index, seed, checkpoint, strict)
    if not isinstance(split, bool):
        raise GradientError(f"Gradient of function {func_name}: split must be True or False, "
                            f"not {split!r}")
    if split:
        return SplitGradient(args)
    return _GradientPass(args)


@tvm.transform.module_pass(opt_level=0, name="Gradient")
class _GradientPass:
    def __init__(self, args: dict):
        self.args = args

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return with_deep_stack(gradient_module, mod, **self.args)


def gradient_module(
    mod: IRModule,
    func_name: str,
    require_grads: list | None = None,
    target_index: int | list = 0,
    seed: str = "ones",
    checkpoint="markers",
    strict: bool = True,
) -> IRModule:
    """The pass body: a new module with ``<func_name>_adjoint`` added (``mod`` is untouched)."""
    args = validate_arguments(func_name, require_grads, target_index, seed, checkpoint, strict)
    request = validate(mod, **args)
    callees = Callees(mod, args["checkpoint"])
    callees.prepare(request.func, func_name)
    adjoint, new_mod = differentiate(callees.mod, request, callees)
    return with_function(new_mod, func_name + "_adjoint", adjoint)
