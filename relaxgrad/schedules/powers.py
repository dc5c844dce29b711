"""``power(x, c)`` with a small whole constant ``c`` as products, a Relax rewrite before
legalization (CPU).

GPT-2's GELU computes ``x ** 3``. Legalized as ``pow``, it builds a libm call per element, and
TVM warns on every ``pow`` whose constant exponent is 3 or more (``Detected pow(x, y) where y
>= 3``): dozens of lines in a GPT-2 compile. :class:`IntegerPowers` writes ``x ** 2``,
``x ** 3`` and ``x ** 4`` of a floating-point ``x`` as ``x * x``, ``x * x * x`` and
``(x * x) * (x * x)``, which fuse and vectorize; other exponents are left as they are.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import may_change, rewrite_functions
from .blas import _is

_POWER = Op.get("relax.power")


@tvm.transform.module_pass(opt_level=0, name="IntegerPowers")
class IntegerPowers:
    """Rewrite ``power(x, c)``, ``c`` a scalar constant 2, 3 or 4 and ``x`` floating-point,
    into products (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


def _exponent(expr) -> int | None:
    """The whole value 2, 3 or 4 of a scalar constant, else None."""
    if not isinstance(expr, _ty.Constant) or expr.value.numpy().size != 1:
        return None
    value = float(expr.value.numpy().reshape(()))
    return int(value) if value in (2.0, 3.0, 4.0) else None


@mutator
class _Rewriter(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: _is(value, _POWER)):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is(call, _POWER):
            return call
        x, exponent = call.args
        n = _exponent(exponent)
        if n is None or not _ty.dtype_of(x).startswith(("float", "bfloat")):
            return call
        shape = _ty.static_shape(x)
        same = _ty.dtype_of(x) == _ty.dtype_of(call) and shape == _ty.static_shape(call)
        if shape is None or not same:
            return call  # (the constant broadcasts x, or casts it: left to legalization)
        square = self.builder_.emit(relax.op.multiply(x, x))
        if n == 2:
            return square
        return relax.op.multiply(square, x if n == 3 else square)
