"""``power(x, c)`` with a small whole constant ``c`` as products, a Relax rewrite before
legalization (CPU).

GPT-2's GELU computes ``x ** 3``. Legalized as ``pow``, it builds a libm call per element, and
TVM warns on every ``pow`` whose constant exponent is 3 or more (``Detected pow(x, y) where y
>= 3``): dozens of lines in a GPT-2 compile. :class:`IntegerPowers` writes ``x ** 2``,
``x ** 3`` and ``x ** 4`` of a floating-point ``x`` as ``x * x``, ``x * x * x`` and
``(x * x) * (x * x)``, which fuse and vectorize; other exponents are left as they are. The
exponent may be a constant or arithmetic of constants: the gradient of ``x ** 3`` is
``3 * x ** (3 - 1)``, whose ``pow`` made GPT-2's GELU gradient 11 times its forward.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import is_op, may_change, rewrite_functions

_POWER = Op.get("relax.power")


@tvm.transform.module_pass(opt_level=0, name="IntegerPowers")
class IntegerPowers:
    """Rewrite ``power(x, c)``, ``c`` a scalar constant 1, 2, 3 or 4 (or arithmetic of
    constants of that value) and ``x`` floating-point, into ``x`` or products (see the module
    docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


_ARITHMETIC = {"relax.add": float.__add__, "relax.subtract": float.__sub__,
               "relax.multiply": float.__mul__}  # fmt: skip


def _scalar(expr, lookup, depth: int = 4) -> float | None:
    """The value of a scalar constant, or of sums, differences and products of them (as the
    gradient of ``x ** 3`` writes its exponent: ``x ** (3 - 1)``), looked up through bound
    vars; else None."""
    if isinstance(expr, relax.Var) and depth > 0:
        expr = lookup(expr)
    if isinstance(expr, _ty.Constant):
        value = expr.value.numpy()
        return float(value.reshape(())) if value.size == 1 else None
    if depth > 0 and isinstance(expr, relax.Call) and isinstance(expr.op, Op):
        combine = _ARITHMETIC.get(expr.op.name)
        if combine is not None and len(expr.args) == 2:
            a, b = (_scalar(arg, lookup, depth - 1) for arg in expr.args)
            return None if a is None or b is None else combine(a, b)
    return None


def _exponent(expr, lookup) -> int | None:
    """The whole value 1, 2, 3 or 4 of ``expr`` as :func:`_scalar` reads it, else None."""
    value = _scalar(expr, lookup)
    return int(value) if value in (1.0, 2.0, 3.0, 4.0) else None


@mutator
class _Rewriter(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: is_op(value, _POWER)):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, _POWER):
            return call
        x, exponent = call.args
        n = _exponent(exponent, self.lookup_binding)
        if n is None or not _ty.dtype_of(x).startswith(("float", "bfloat")):
            return call
        shape = _ty.static_shape(x)
        same = _ty.dtype_of(x) == _ty.dtype_of(call) and shape == _ty.static_shape(call)
        if shape is None or not same:
            return call  # (the constant broadcasts x, or casts it: left to legalization)
        if n == 1:
            return x
        square = self.builder_.emit(relax.op.multiply(x, x))
        if n == 2:
            return square
        return relax.op.multiply(square, x if n == 3 else square)
