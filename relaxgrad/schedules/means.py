"""``mean`` as ``sum`` times ``1 / count``, a Relax rewrite before legalization (CPU), so that
the product a mean reduces fuses into it.

TVM legalizes ``R.mean`` to one PrimFunc of two blocks (a sum, then a division), which
``AnnotateTIROpPattern`` does not classify as a plain reduction, so ``FuseOps`` fuses only
elementwise consumers into it: ``mean(c * c)`` runs as two kernels, and the product is
written to memory and read back. ``R.sum`` is a plain reduction, which fuses its elementwise
producers; the division by the count then fuses into the mean's consumers. The normalization
gradients are sums of such products (layer norm's backward went from 11 kernels to 7).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import may_change, rewrite_functions, static_shape


@tvm.transform.module_pass(opt_level=0, name="MeanAsSum")
class MeanAsSum:
    """Rewrite ``mean(x, axes)`` of a floating-point tensor of static shape into
    ``sum(x, axes) * (1 / count)`` (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mean = Op.get("relax.mean")

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, self._is_mean):
            return func
        return super().visit_function_(func)

    def _is_mean(self, expr) -> bool:
        return (
            isinstance(expr, relax.Call) and isinstance(expr.op, Op) and expr.op.same_as(self.mean)
        )

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not self._is_mean(call):
            return call
        (x,) = call.args
        shape, dtype = static_shape(x), _ty.dtype_of(x)
        if shape is None or not dtype.startswith(("float", "bfloat")):
            return call
        axes = call.attrs.axis
        axes = range(len(shape)) if axes is None else [int(a) % len(shape) for a in axes]
        count = math.prod(shape[a] for a in axes)
        if count == 0:
            return call
        total = relax.op.sum(x, call.attrs.axis, call.attrs.keepdims)
        return relax.op.multiply(total, relax.const(1.0 / count, dtype))
