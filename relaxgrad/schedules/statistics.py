"""Training-mode ``batch_norm`` and ``variance`` as means of the same form as the
normalization gradients', a Relax rewrite before legalization (CPU), so that
``EliminateCommonSubexpr`` computes each batch's statistics once.

A training step of a CNN reads each batch-norm input for its statistics several times: TVM's
``batch_norm`` kernel computes the mean and the variance (two passes) before normalizing; an
importer's saved statistics (``from_torch`` returns the batch mean and variance, which the
running statistics update reads) compute them again with ``mean`` and ``variance``; the
gradient (relaxgrad's rule) recomputes them with :func:`relaxgrad.ops.nn.batch_statistics`:
``m = mean(x, keepdims=True)`` and ``v = mean(c * c, keepdims=True)`` with ``c = x - m``,
accumulated in float64 as PyTorch's CPU kernel does. Written alike, they are one computation:

- ``batch_norm(x, gamma, beta, mean, var)`` in training mode, float32 of static shape, becomes
  ``(x - m) * rsqrt(v + eps) * gamma + beta`` (``x - m`` and ``rsqrt`` in float32, per
  element), and the new running statistics ``(1 - momentum) * mean + momentum * m`` (and the
  same for ``v``), as TVM's kernel computes them;
- ``variance(x, axes)`` becomes ``v`` (reshaped where the axes are not kept), the form of TVM's
  kernel (the biased variance).

On ResNet-50's training step (batch 8) each batch norm then reads its input for statistics once
in the forward; the gradient's normalized input is the forward's.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ..ops.nn import batch_statistics
from ._common import is_op, may_change, rewrite_functions, static_shape


@tvm.transform.module_pass(opt_level=0, name="ShareStatistics")
class ShareStatistics:
    """Rewrite training-mode ``batch_norm`` and ``variance`` into means written as the
    normalization gradients write them (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.batch_norm, self.variance = Op.get("relax.nn.batch_norm"), Op.get("relax.variance")

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        ops = (self.batch_norm, self.variance)
        if not may_change(func, lambda value: any(is_op(value, op) for op in ops)):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, Op) or not _float32_static(call.args[0]):
            return call
        if call.op.same_as(self.variance):
            return self._variance(call)
        if call.op.same_as(self.batch_norm) and bool(call.attrs.training):
            return self._batch_norm(call)
        return call

    def _statistics(self, x: relax.Expr, axes: list[int]) -> tuple:
        """``(m, c, v)`` of :func:`relaxgrad.ops.nn.batch_statistics` (float64), each bound to a
        var."""
        return tuple(self.builder_.emit(value) for value in batch_statistics(x, axes))

    def _variance(self, call: relax.Call) -> relax.Expr:
        (x,) = call.args
        shape = static_shape(x)
        axes = call.attrs.axis
        axes = list(range(len(shape))) if axes is None else [int(a) % len(shape) for a in axes]
        _, _, v = self._statistics(x, sorted(set(axes)))
        v = self.builder_.emit(relax.op.astype(v, "float32"))
        if call.attrs.keepdims:
            return v
        return relax.op.reshape(v, static_shape(call))

    def _batch_norm(self, call: relax.Call) -> relax.Expr:
        x, gamma, beta, moving_mean, moving_var = call.args
        attrs, shape = call.attrs, static_shape(x)
        channel = int(attrs.axis) % len(shape)
        axes = [a for a in range(len(shape)) if a != channel]
        emit = self.builder_.emit
        m, _, v = self._statistics(x, axes)
        # as the gradient writes them: (x - m) and rstd per element in float32
        eps = relax.const(float(attrs.epsilon), "float64")
        rstd = emit(relax.op.astype(emit(relax.op.rsqrt(emit(relax.op.add(v, eps)))), "float32"))
        centered = emit(relax.op.subtract(x, emit(relax.op.astype(m, "float32"))))
        out = emit(relax.op.multiply(centered, rstd))
        per_channel = [1] * len(shape)
        per_channel[channel] = shape[channel]
        if attrs.scale:
            out = emit(relax.op.multiply(out, relax.op.reshape(gamma, per_channel)))
        if attrs.center:
            out = emit(relax.op.add(out, relax.op.reshape(beta, per_channel)))
        momentum = float(attrs.momentum)
        keep, step = relax.const(1.0 - momentum, "float32"), relax.const(momentum, "float32")
        running = []
        for old, new in ((moving_mean, m), (moving_var, v)):
            batch = emit(relax.op.astype(emit(relax.op.reshape(new, [shape[channel]])), "float32"))
            running.append(relax.op.add(relax.op.multiply(keep, old),
                                        relax.op.multiply(step, batch)))  # fmt: skip
        return relax.Tuple([out, *(emit(value) for value in running)])


def _float32_static(x: relax.Expr) -> bool:
    return static_shape(x) is not None and _ty.dtype_of(x) == "float32"
