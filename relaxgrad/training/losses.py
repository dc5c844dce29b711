"""Losses, and :func:`append_loss`, which appends one to a model function.

A :class:`Loss` emits ``loss(prediction, target)`` into a BlockBuilder using only ops that have
relaxgrad rules. Calling it with the types of the prediction and the target also returns a
standalone Relax function, TVM's loss protocol, so it works with
``tvm.relax.training.AppendLoss`` and ``SetupTrainer``.
"""

from __future__ import annotations

import copy
from typing import Literal

from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.relax import op

from .. import _ty
from .._module import with_function

__all__ = ["CrossEntropyLoss", "Loss", "MSELoss", "append_loss"]

Reduction = Literal["mean", "sum", "none"]


class Loss:
    """Base class: a loss of one prediction and one target.

    Parameters
    ----------
    reduction : "mean", "sum" or "none"
        How per-element (or per-sample) losses are reduced to the result; ``"none"`` returns the
        per-sample losses, a tensor of shape ``(batch,)``.
    """

    name: str = "loss"
    num_backbone_outputs: int = 1  # TVM's loss protocol
    classifies: bool = False  # whether argmax of the prediction is a class (for accuracy)

    def __init__(self, reduction: Reduction = "mean"):
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"{type(self).__name__}: unknown reduction {reduction!r}")
        self.reduction = reduction

    def emit(self, bb: relax.BlockBuilder, prediction: relax.Expr, target: relax.Expr):
        """Emit the loss of ``prediction`` against ``target`` into ``bb``; returns its var."""
        raise NotImplementedError

    def target_type(self, prediction: relax.Type) -> relax.Type:
        """The default target type for a prediction of type ``prediction``."""
        raise NotImplementedError

    def with_reduction(self, reduction: Reduction) -> Loss:
        """A copy of this loss with another reduction."""
        other = copy.copy(self)
        Loss.__init__(other, reduction)
        return other

    def __call__(
        self, prediction: relax.Type | relax.Var, target: relax.Type | relax.Var | None = None
    ) -> relax.Function:
        """The standalone function ``<name>(predictions, targets) -> loss``."""
        pred_var = _as_var(prediction, "predictions")
        if target is None:
            target = self.target_type(pred_var.ty)
        target_var = _as_var(target, "targets")
        bb = relax.BlockBuilder()
        with bb.function(self.name, [pred_var, target_var]):
            with bb.dataflow():
                out = bb.emit_output(self.emit(bb, pred_var, target_var))
            bb.emit_func_output(out)
        return bb.get()[self.name]

    def _reduce(self, bb: relax.BlockBuilder, elementwise: relax.Expr, batch_axis_only: bool):
        """Reduce an elementwise loss: mean/sum over everything, or "none": the mean over all
        axes but the first (the sum when ``batch_axis_only`` says they are class axes)."""
        if self.reduction == "mean":
            return bb.emit(op.mean(elementwise))
        if self.reduction == "sum":
            return bb.emit(op.sum(elementwise))
        axes = list(range(1, _ty.ndim_of(elementwise)))
        if not axes:
            return bb.emit(elementwise)
        reduce = op.sum if batch_axis_only else op.mean
        return bb.emit(reduce(elementwise, axes))


class MSELoss(Loss):
    """``reduce((prediction - target) ** 2)``, as ``torch.nn.MSELoss``."""

    name = "mse_loss"

    def emit(self, bb, prediction, target):
        diff = bb.emit(prediction - target)
        return self._reduce(bb, bb.emit(diff * diff), batch_axis_only=False)

    def target_type(self, prediction):
        return prediction


class CrossEntropyLoss(Loss):
    """Cross-entropy of logits ``(batch, classes)`` against integer labels ``(batch,)`` or
    one-hot / probability targets ``(batch, classes)``, as ``torch.nn.CrossEntropyLoss``.

    Integer labels go through ``nll_loss(log_softmax(logits), labels)``; float targets through
    ``cross_entropy_with_logits(log_softmax(logits), targets)`` (mean over the batch).

    Parameters
    ----------
    reduction : "mean", "sum" or "none"
        As :class:`Loss`.
    ignore_index : int
        Labels equal to it add nothing to the loss nor to its gradient, and a mean is over the
        other labels, as PyTorch's (-100 by default: Hugging Face's label for prompt tokens
        and padding).
    """

    name = "cross_entropy_loss"
    classifies = True

    def __init__(self, reduction: Reduction = "mean", ignore_index: int = -100):
        super().__init__(reduction)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"CrossEntropyLoss: ignore_index must be an int, not "
                             f"{ignore_index!r}")
        self.ignore_index = ignore_index

    def emit(self, bb, prediction, target):
        if (not _ty.is_float_tensor(target) and _ty.ndim_of(prediction) == 2
                and all(isinstance(d, tirx.IntImm) for d in _ty.shape_values(prediction))):
            return self._labels(bb, prediction, target)
        log_probs = bb.emit(op.nn.log_softmax(prediction))
        if not _ty.is_float_tensor(target):
            return bb.emit(op.nn.nll_loss(log_probs, target, reduction=self.reduction,
                                          ignore_index=self.ignore_index))
        if self.reduction == "mean":
            return bb.emit(op.nn.cross_entropy_with_logits(log_probs, target))
        return self._reduce(bb, bb.emit(-(log_probs * target)), batch_axis_only=True)

    def target_type(self, prediction):
        return relax.TensorType(_ty.shape_values(prediction)[:1], "int64")

    def _labels(self, bb, logits, labels):
        """The loss of ``(batch, classes)`` logits against integer labels, from the logits
        themselves: a row's loss is ``(m - logits[label]) + log(sum(exp(logits - m)))`` (``m``
        the row's maximum, through which no gradient flows: the gradient is the softmax minus
        the one-hot label for any ``m``). No tensor of the logits' size is kept for the backward
        pass but the logits, and their gradient, ``(softmax - onehot(label)) * g``, is one
        elementwise kernel: a log-softmax over a 150k-token vocabulary would keep a second
        ``tokens x vocabulary`` tensor (``log_softmax`` then ``nll_loss`` hold the same value).
        For static shapes; a symbolic batch goes through ``log_softmax`` and ``nll_loss``."""
        classes = int(_ty.shape_values(logits)[1])
        dtype = _ty.dtype_of(logits)
        top = bb.emit(op.grad.no_grad(op.max(logits, axis=1, keepdims=True)))
        total = bb.emit(op.sum(op.exp(op.subtract(logits, top)), axis=1))
        hit = op.equal(op.expand_dims(labels, 1), op.arange(0, classes, 1, _ty.dtype_of(labels)))
        picked = bb.emit(op.sum(op.where(hit, logits, relax.const(0, dtype)), axis=1))
        scored = bb.emit(op.astype(op.not_equal(labels, relax.const(self.ignore_index,
                                                                    _ty.dtype_of(labels))), dtype))
        # (m - picked) + log(total), in PyTorch's order: exact 0 + log(1 + tiny) when the
        # label's logit is the largest, where lse - picked would lose a small loss's digits
        rows = bb.emit(op.multiply(op.add(op.subtract(op.squeeze(top, [1]), picked),
                                          op.log(total)), scored))
        if self.reduction == "none":
            return rows
        total_loss = bb.emit(op.sum(rows))
        if self.reduction == "sum":
            return total_loss
        return bb.emit(op.divide(total_loss, op.sum(scored)))


def append_loss(
    mod: IRModule,
    loss: Loss,
    func_name: str = "main",
    target_type: relax.Type | None = None,
    loss_func_name: str | None = None,
) -> IRModule:
    """A copy of ``mod`` with ``<func_name>_loss(*params of func_name, target) -> loss`` added.

    The new function runs ``func_name``'s bindings, then ``loss`` on its result, in one dataflow
    block, so :func:`relaxgrad.Gradient` can differentiate it. A model returning a tuple (as
    TVM's PyTorch importer does: ``gv = (out,)``) is scored on field 0; when the tuple has
    more fields (e.g. updated BatchNorm statistics) the loss function returns
    ``(loss, field 1, field 2, ...)``, the loss at index 0.

    Parameters
    ----------
    mod : IRModule
        Module holding the model function.
    loss : Loss
        The loss to append.
    func_name : str
        The model function: one dataflow block returning one tensor, or a tuple whose field 0
        is a tensor.
    target_type : relax.Type, optional
        Type of the target parameter; ``loss.target_type(<result type>)`` by default.
    loss_func_name : str, optional
        Name of the new function; ``<func_name>_loss`` by default.
    """
    func = _model_function(mod, func_name)
    copied = relax.utils.copy_with_new_vars(func)
    block, result = copied.body.blocks[0], copied.body.body
    target = relax.Var("target", target_type or loss.target_type(prediction_type(func)))
    name = loss_func_name or f"{func_name}_loss"
    bb = relax.BlockBuilder()
    with bb.function(name, [*copied.params, target]):
        with bb.dataflow():
            for binding in block.bindings:
                bb.emit_normalized(binding)
            fields = [result]
            if _ty.is_tuple(result):
                count = _num_fields(result)
                fields = [bb.emit(relax.TupleGetItem(result, i)) for i in range(count)]
            outs = [bb.emit_output(v) for v in [loss.emit(bb, fields[0], target), *fields[1:]]]
        bb.emit_func_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
    return with_function(mod, name, _without_tuple_detours(bb.get())[name])


def _without_tuple_detours(mod: IRModule) -> IRModule:
    """``mod`` with fields read from tuples built in the same function read directly, and what
    is then unused removed (``CanonicalizeBindings``, ``DeadCodeElimination``). The gradient
    of a field read from a tuple is the tuple's gradient with zeros in every other field, and
    those zeros are carried back through whatever computed the other fields: TVM's importer
    returns a train-mode BatchNorm as a tuple of five (two of them unused), and the model's
    result as a tuple of the prediction and the new buffer values."""
    return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))


def prediction_type(func: relax.Function) -> relax.Type:
    """The type of a model function's prediction: its result, or field 0 of a tuple result."""
    ty = func.body.body.ty
    return ty.fields[0] if _ty.is_tuple(ty) else ty


def _num_fields(expr: relax.Expr) -> int:
    return len(_ty.type_of(expr).fields)


def _model_function(mod: IRModule, func_name: str) -> relax.Function:
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    func = mod[names[func_name]] if func_name in names else None
    if not isinstance(func, relax.Function):
        raise ValueError(f"append_loss: the module has no Relax function named {func_name!r}")
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError(
            f"append_loss: function {func_name} must have exactly one binding block, a dataflow "
            f"block; it has {len(blocks)}"
        )
    result = func.body.body
    if not (_ty.is_tensor(result) or (_ty.is_tuple(result) and _num_fields(result) > 0
                                      and _ty.is_tensor(result.ty.fields[0]))):
        raise ValueError(
            f"append_loss: function {func_name} must return a tensor or a tuple whose field 0 "
            f"is a tensor, not {result}"
        )
    return func


def _as_var(value: relax.Type | relax.Var, name: str) -> relax.Var:
    if isinstance(value, relax.Var):
        return relax.Var(value.name, value.ty)
    return relax.Var(name, value)
