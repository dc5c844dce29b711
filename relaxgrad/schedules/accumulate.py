"""Float32 sums over the rows accumulated in float64, a Relax rewrite before legalization.

A bias's gradient is the sum of the output's gradient over every row (``collapse_sum_to`` to
the bias's shape, or ``sum`` over the leading axes): hundreds to thousands of terms whose sum
often cancels to a small fraction of them (an attention's value bias gets the sum of the
output's gradient over the tokens, since each row of the softmax sums to 1). TVM's kernels add
the rows one by one in float32, and the column-sum schedules each thread's rows in turn: the
rounding error grows with the rows, where PyTorch's CPU sum adds them pairwise (a cascade). A
MobileViT's attention biases had 2-3 times PyTorch's float32 error. :class:`WideColumnSums`
casts the rows to float64 inside the reduction and the sum back: the same memory traffic (the
cast fuses into the kernel that reads the rows), and each sum exact to the last bit of
float32. Sums along the innermost axis (a softmax's, a layer norm's) are left as they are, as
PyTorch leaves them.

Sums of 16-bit floats (bfloat16 or float16, in a mixed-precision adjoint: a grouped-query
attention's key gradient summed over the query heads that share it) are accumulated in float32
over any axes and rounded once, as PyTorch's CPU and CUDA sums of them are; TVM's kernel would
round each partial sum to 16 bits (and its bfloat16 legalization cannot build the vectorized
accumulation).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import may_change, rewrite_functions, static_shape

_SUM, _COLLAPSE = Op.get("relax.sum"), Op.get("relax.collapse_sum_to")
_MIN_ROWS = 8  # fewer rows add few roundings


@tvm.transform.module_pass(opt_level=0, name="WideColumnSums")
class WideColumnSums:
    """Rewrite a float32 ``sum`` over axes that do not include the innermost one, and a float32
    ``collapse_sum_to`` that keeps the innermost axis, of at least ``_MIN_ROWS`` rows, into
    ``astype(op(astype(x, "float64")), "float32")``; and every ``sum`` or ``collapse_sum_to`` of
    a 16-bit float into ``astype(op(astype(x, "float32")), dtype)`` (see the module
    docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


def _wide_dtype(call: relax.Call) -> str | None:
    """The dtype ``call`` (a ``sum`` or ``collapse_sum_to``) accumulates in, None to leave it."""
    if not isinstance(call, relax.Call) or not (call.op.same_as(_SUM)
                                                or call.op.same_as(_COLLAPSE)):
        return None
    dtype = _ty.dtype_of(call.args[0])
    if dtype in ("bfloat16", "float16") and _ty.dtype_of(call) == dtype:
        return "float32"
    return "float64" if (_rows(call) or 0) >= _MIN_ROWS else None


def _rows(call: relax.Call) -> int | None:
    """How many rows a column sum adds, None if ``call`` is no float32 column sum."""
    if not isinstance(call, relax.Call) or not isinstance(call.op, Op):
        return None
    x = call.args[0]
    shape = static_shape(x)
    if not shape or _ty.dtype_of(x) != "float32":
        return None
    ndim = len(shape)
    if call.op.same_as(_SUM):
        axes = range(ndim) if call.attrs.axis is None else [int(a) % ndim for a in call.attrs.axis]
        reduced = sorted(set(axes))
    elif call.op.same_as(_COLLAPSE):
        target = static_shape(call)
        if target is None:
            return None
        target = [1] * (ndim - len(target)) + list(target)
        reduced = [a for a in range(ndim) if target[a] != shape[a]]
    else:
        return None
    if not reduced or ndim - 1 in reduced:
        return None
    rows = 1
    for a in reduced:
        rows *= shape[a]
    return rows


@mutator
class _Rewriter(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: _wide_dtype(value) is not None):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        wide_dtype = _wide_dtype(self.builder_.normalize(call))
        if wide_dtype is None:
            return call
        dtype = _ty.dtype_of(call.args[0])
        wide = self.builder_.emit(relax.op.astype(call.args[0], wide_dtype))
        if call.op.same_as(_SUM):
            total = relax.op.sum(wide, call.attrs.axis, call.attrs.keepdims)
        else:
            total = relax.op.collapse_sum_to(wide, call.args[1])
        return relax.op.astype(self.builder_.emit(total), dtype)
