"""Gradient accumulation: one optimizer step from the gradients of ``k`` micro-batches.

For a loss that is a mean over the batch, the mean of the micro-batch gradients, each weighted
by its share of the rows, is the gradient of the whole batch, so ``Trainer(..., accumulate=k)``
on batches of ``k * m`` rows, with the model compiled for ``m`` rows, takes the same steps as a
Trainer compiled for ``k * m`` rows, while holding the activations of only ``m`` rows at a
time. With a symbolic batch size, a batch of any size is cut into ``k`` parts as equal as can be
(the last, partial batch of an epoch included).
"""

from __future__ import annotations

import numpy as np
import tvm

__all__ = ["accumulate_gradients", "check_accumulate", "split_batch"]


def check_accumulate(accumulate) -> int:
    """``accumulate`` as a positive int (ValueError otherwise)."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"Trainer: accumulate must be a positive int, not {accumulate!r}")
    return accumulate


def split_batch(inputs, target, k: int, equal: bool = True) -> list:
    """``[(inputs_i, target_i)]``: the batch cut into ``k`` micro-batches along axis 0, of equal
    size (``equal``: a model compiled for one batch size) or as equal as can be (a symbolic
    batch; empty ones dropped)."""
    single = isinstance(inputs, np.ndarray | tvm.runtime.Tensor)
    xs = [inputs] if single else list(inputs)
    xs = [np.asarray(x.numpy() if isinstance(x, tvm.runtime.Tensor) else x) for x in xs]
    target = np.asarray(target)
    n = len(target)
    if (equal and n % k) or any(len(x) != n for x in xs):
        raise ValueError(
            f"Trainer: a batch of {n} rows cannot be cut into {k} equal micro-batches"
        )
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    parts = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            micro = [x[start:stop] for x in xs]
            parts.append((micro[0] if single else tuple(micro), target[start:stop]))
    return parts


def accumulate_gradients(trainer, inputs, target, k: int):
    """``(mean loss, mean gradients as device tensors, last result)`` over ``k`` micro-batches
    of ``(inputs, target)``, each weighted by its share of the rows (exact for a mean loss);
    the ``updates`` buffers are replaced after each micro-batch (as in PyTorch, where each
    forward in train mode updates them)."""
    adjoint = trainer.vm[f"{trainer.func_name}_loss_adjoint"]
    total, losses, out = None, [], None
    parts = split_batch(inputs, target, k, equal=trainer.batch_size is not None)
    rows = sum(len(y) for _, y in parts)
    for micro_x, micro_y in parts:
        weight = len(micro_y) / rows
        out, grads = adjoint(*trainer.adjoint_args(micro_x, micro_y))
        if trainer.updates:  # out is (loss, *new buffer values)
            trainer._buffers.update(zip(trainer.updates, list(out)[1:]))
        first = out if isinstance(out, tvm.runtime.Tensor) else out[0]
        losses.append(weight * float(first.numpy()))
        grads = [weight * g.numpy() for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    mean = [tvm.runtime.tensor(g, trainer.device) for g in total]  # keeps the grads' dtype
    return float(sum(losses)), mean, out
