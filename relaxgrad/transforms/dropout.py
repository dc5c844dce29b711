"""``KeyDropout``: give Relax's un-keyed ``R.nn.dropout`` a random key.

TVM 0.27 compiles ``R.nn.dropout(x, rate)`` as the identity (it has no random-number op), so
relaxgrad refuses to differentiate it. This pass adds a key parameter to a function and lowers
each of its dropouts to :func:`relaxgrad.ops.random.dropout` (site ``i`` for the ``i``-th), which
drops for real and which the gradient pass differentiates.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from .._module import with_function
from ..errors import GradientError
from ..exprs import is_op
from ..ops import random

__all__ = ["KeyDropout"]


@mutator
class _Lower(PyExprMutator):
    """Rewrites ``R.nn.dropout(x, rate)`` to ``(dropped x, mask as x's dtype)``."""

    def __init__(self, mod: IRModule, key: relax.Var):
        super().__init__(mod)
        self.key, self.sites = key, 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.nn.dropout"):
            return call
        x = call.args[0]
        y, keep = random.dropout(self.builder_, x, self.key, float(call.attrs.rate), self.sites)
        self.sites += 1
        return relax.Tuple([y, relax.op.astype(keep, _ty.dtype_of(x))])


@tvm.transform.module_pass(opt_level=0, name="KeyDropout")
class KeyDropout:
    """Module pass: append a key parameter to ``func_name`` and make its dropouts random.

    Parameters
    ----------
    func_name : str
        The function whose ``R.nn.dropout`` calls are lowered.
    key : str
        Name of the new last parameter, a ``(2,)`` uint32 tensor
        (:data:`relaxgrad.ops.random.KEY_TYPE`): pass a new value at every training step
        (``Trainer(..., key=key, eval_func=...)`` does, with the function as it was before this
        pass, or another without the key, to evaluate).

    Examples
    --------
    >>> mod = relaxgrad.transforms.KeyDropout("main")(mod)
    >>> mod = relaxgrad.Gradient("main")(mod)  # main(..., dropout_key) drops at random
    """

    def __init__(self, func_name: str = "main", key: str = "dropout_key"):
        self.func_name, self.key = func_name, key

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        if self.func_name not in names or not isinstance(mod[self.func_name], relax.Function):
            raise GradientError(f"KeyDropout: the module has no Relax function {self.func_name}")
        func = mod[self.func_name]
        key = relax.Var(self.key, random.KEY_TYPE)
        lower = _Lower(mod, key)
        body = lower.visit_expr(func.body)
        if not lower.sites:
            return mod
        if self.key in {p.name for p in func.params}:
            raise GradientError(
                f"KeyDropout: function {self.func_name} already has a parameter {self.key}")
        new = relax.Function([*func.params, key], body, func.ret_ty, func.is_pure, func.attrs)
        return with_function(lower.builder_.get(), self.func_name, new)
