"""``nll_loss_backward`` as a masked broadcast, a Relax rewrite before legalization (CPU), so
that the gradient of a cross-entropy fuses into the log-softmax gradient that reads it.

TVM legalizes ``R.grad.nll_loss_backward(g, log_probs, targets)`` into one opaque kernel that
writes the whole ``(N, C)`` gradient, zero but at each row's target, which the log-softmax
gradient then reads twice (its row sums, then the difference): GPT-2 small's language-model
loss over 50257 classes wrote and read 412 MB three times a step for 2048 nonzero values.
:class:`NllLossGradAsMask` writes it as ``where(arange(C) == targets[:, None], -w * g / W,
0)``, with ``w`` each row's weight (``weights[target]``; 0 where the target is
``ignore_index``, whatever its value: PyTorch's default -100 too) and ``W`` their sum
(``mean``; 1 for ``sum``), from broadcasts that fuse into their readers (each reader computes its
own mask: :class:`~relaxgrad.schedules.DuplicateCheapProducers`).

It is also a fix: TVM 0.27's legalization of ``nll_loss_backward`` leaves ``ignore_index`` out
of the weights (it reads ``weights[target]``, out of bounds for a target of -100, and sums it
into ``W``), so a mean over rows some of which are ignored (padding, a prompt) came out scaled
by the wrong count. The rewrite therefore applies at every size, on CPU and GPU.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import may_change, rewrite_functions, static_shape


@tvm.transform.module_pass(opt_level=0, name="NllLossGradAsMask")
class NllLossGradAsMask:
    """Rewrite ``nll_loss_backward`` of 2-D float predictions with static shapes and 1-D
    targets into a masked broadcast (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


_NLL_BACKWARD = Op.get("relax.grad.nll_loss_backward")


def _is_nll_backward(expr) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(_NLL_BACKWARD)


@mutator
class _Rewriter(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, _is_nll_backward):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is_nll_backward(call):
            return call
        g, predictions, targets, *weights = call.args
        shape, dtype = static_shape(predictions), _ty.dtype_of(predictions)
        target_shape = static_shape(targets)
        reduction, ignore = str(call.attrs.reduction), int(call.attrs.ignore_index)
        if shape is None or len(shape) != 2 or target_shape != shape[:1] or reduction == "none":
            return call
        if not dtype.startswith(("float", "bfloat")) or static_shape(g) != []:
            return call
        emit, op = self.builder_.emit, relax.op
        index_dtype = _ty.dtype_of(targets)
        kept = emit(op.not_equal(targets, relax.const(ignore, index_dtype)))
        if weights:  # an ignored target (e.g. -100) reads class 0's weight, then weighs 0
            safe = emit(op.where(kept, targets, relax.const(0, index_dtype)))
            row_weights = emit(op.take(weights[0], safe, axis=0))
        else:
            row_weights = emit(op.ones((shape[0],), dtype))
        row_weights = emit(op.multiply(row_weights, op.astype(kept, dtype)))
        scale = op.negative(g)
        if reduction == "mean":
            scale = op.divide(scale, emit(op.sum(row_weights)))
        coefficients = emit(op.expand_dims(op.multiply(row_weights, emit(scale)), 1))
        classes = emit(op.reshape(op.arange(0, shape[1], 1, index_dtype), (1, shape[1])))
        hits = emit(op.equal(classes, emit(op.expand_dims(targets, 1))))
        return op.where(hits, coefficients, relax.const(0, dtype))
