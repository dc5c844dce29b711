"""Rules for the ops that other rules emit, so that an adjoint can be differentiated again
(Hessian-vector products): TVM's backward ops (relax.op.grad), ``collapse_sum_to``/``_like``
and ``arange``.

The backward ops are linear in their first argument ``output_grad`` (called ``g`` here) and
return a tensor shaped like their second argument ``x``; each rule below returns the transposed
map applied to the incoming adjoint ``G`` (shaped like ``x``). Their partials with respect to the
other arguments are zero: ``x`` only gives a shape (take_backward, avg_pool2d_backward), or is
piecewise constant where it matters (the argmax positions of max_pool2d_backward; exact almost
everywhere), or the result does not depend on it (the predictions of nll_loss_backward).

``relax.grad.start_checkpoint``/``end_checkpoint`` get no rule: the pass strips those markers.
"""

from __future__ import annotations

import functools

import numpy as np
from tvm import relax
from tvm.relax.op import (
    astype,
    broadcast_to,
    equal,
    expand_dims,
    maximum,
    not_equal,
    one_hot,
    reshape,
    strided_slice,
    sum,
    take,
    where,
)
from tvm.relax.op.grad import no_grad
from tvm.relax.op.nn import avg_pool2d, pad

from .. import _ty
from ..errors import GradientError
from ._utils import static_dims
from .registry import register_gradient, register_no_grad

# ``no_grad(x)`` legalizes to ``x``: used in a forward function it stops the gradient.
# ``arange`` has only scalar (PrimValue) arguments: nothing to differentiate.
register_no_grad(["relax.grad.no_grad", "relax.arange"])


@register_gradient("relax.collapse_sum_to")
def collapse_sum_to_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = collapse_sum_to(x, shape)``; backward: ``[broadcast_to(g, x.shape),
    no_grad]``."""
    x, shape = orig_call.args
    return [broadcast_to(output_grad, _ty.shape_of(x)), no_grad(shape)]


@register_gradient("relax.collapse_sum_like")
def collapse_sum_like_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = collapse_sum_like(x, like)``; backward: ``[broadcast_to(g, x.shape),
    no_grad]`` (only the shape of ``like`` matters)."""
    x, like = orig_call.args
    return [broadcast_to(output_grad, _ty.shape_of(x)), no_grad(like)]


@register_gradient("relax.grad.take_backward")
def take_backward_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = take_backward(g, x, indices, axis)``, ``g`` scatter-added into zeros like
    x at ``indices``; backward: ``[take(G, indices, axis), no_grad, no_grad]``."""
    _, x, indices = orig_call.args  # the kernel takes 1-D indices only
    axis = orig_call.attrs.axis
    if axis is None:  # take reads x flattened; relax.take wants it 1-D then
        dg = take(reshape(output_grad, [-1]), indices, 0)
    else:
        dg = take(output_grad, indices, int(axis))
    return [dg, no_grad(x), no_grad(indices)]


def _pool_layout(op_name: str, layout: str) -> tuple[int, int]:
    """The H and W axes of a pooling ``layout`` (a permutation of NCHW)."""
    if sorted(layout) != sorted("NCHW"):
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for layout {layout} (only for "
            "permutations of NCHW, such as NHWC)"
        )
    return layout.index("H"), layout.index("W")


def _windows(t, attrs, ins, out_dims, pad_value: float, op_name: str) -> list:
    """The pooling windows of ``t`` (of dims ``ins``) as one tensor per window offset, in
    row-major order of the offsets: offset (i, j) holds, for each output position, the element
    of its window at (i, j). ``t`` is padded by ``padding`` (and past it as far as ceil_mode
    reaches) with ``pad_value``."""
    axes, ndim = _pool_layout(op_name, str(attrs.layout)), len(ins)
    kernel, strides, dilation = ([int(v) for v in attrs[k]] for k in
                                 ("pool_size", "strides", "dilation"))  # fmt: skip
    padding = [int(v) for v in attrs.padding]  # top, left, bottom, right
    outs = [out_dims[a] for a in axes]
    widths = [0] * (2 * ndim)
    for k, axis in enumerate(axes):
        reach = (outs[k] - 1) * strides[k] + dilation[k] * (kernel[k] - 1) + 1
        before, after = padding[k], padding[k + 2]
        widths[2 * axis] = before
        widths[2 * axis + 1] = max(after, reach - ins[axis] - before)
    if any(widths):
        t = pad(t, widths, "constant", pad_value)
    slices = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            begin = [i * dilation[0], j * dilation[1]]
            end = [b + (n - 1) * s + 1 for b, n, s in zip(begin, outs, strides)]
            slices.append(strided_slice(t, list(axes), begin, end, strides))
    return slices


@register_gradient("relax.grad.max_pool2d_backward")
def max_pool2d_backward_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = max_pool2d_backward(g, x, ...)``, each ``g`` added at the argmax of its
    window of ``x`` (the first one on ties, as TVM's kernel); backward: ``[G at the argmax of
    each window, no_grad]`` (``x`` moves the argmax only at ties: zero almost everywhere).
    The argmax is found by comparing each window offset with the window maximum."""
    op_name = "relax.grad.max_pool2d_backward"
    g, x = orig_call.args
    attrs, dtype = orig_call.attrs, _ty.dtype_of(x)
    ins, out_dims = static_dims(x, op_name), static_dims(g, op_name)
    values = _windows(x, attrs, ins, out_dims, float(np.finfo(dtype).min), op_name)
    grads = _windows(output_grad, attrs, ins, out_dims, 0.0, op_name)
    window_max = functools.reduce(maximum, values)
    # Walk the offsets backwards, so that the first offset holding the maximum wins; when no
    # earlier offset holds it, the last one does.
    dg = grads[-1]
    for value, grad in zip(reversed(values[:-1]), reversed(grads[:-1])):
        dg = where(equal(value, window_max), grad, dg)
    return [dg, no_grad(x)]


@register_gradient("relax.grad.avg_pool2d_backward")
def avg_pool2d_backward_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = avg_pool2d_backward(g, x, ...)``, the transpose of ``avg_pool2d``;
    backward: ``[avg_pool2d(G, ...), no_grad]`` (``x`` only gives the shape)."""
    attrs = orig_call.attrs
    layout = str(attrs.layout)
    _pool_layout("relax.grad.avg_pool2d_backward", layout)
    dg = avg_pool2d(
        output_grad, attrs.pool_size, attrs.strides, attrs.padding, attrs.dilation,
        attrs.ceil_mode, attrs.count_include_pad, layout, layout,
    )  # fmt: skip
    return [dg, no_grad(orig_call.args[1])]


def _nll_position_weights(pred, targets, weights, hit, ignore_index: int):
    """``(w_t, keep)``: the weight of each position, ``w[t_p]`` (1 without weights), 0 where the
    target is ``ignore_index``, as nll_loss counts them; and the per-class 0/1 mask of
    ``ignore_index`` (None unless it is a class)."""
    dtype, class_axis = _ty.dtype_of(pred), 0 if _ty.ndim_of(pred) == 1 else 1
    num_classes = static_dims(pred, "relax.grad.nll_loss_backward")[class_axis]
    if weights is None:
        counted = not_equal(targets, relax.const(ignore_index, _ty.dtype_of(targets)))
        return astype(counted, dtype), None
    keep = None
    if 0 <= ignore_index < num_classes:
        keep = np.ones(num_classes, dtype)
        keep[ignore_index] = 0
        keep = relax.const(keep, dtype)
        weights = weights * keep
    per_class = (num_classes,) + (1,) * (_ty.ndim_of(pred) - class_axis - 1)
    return sum(hit * reshape(weights, per_class), class_axis), keep


@register_gradient("relax.grad.nll_loss_backward")
def nll_loss_backward_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y[p, c] = -[c == t_p] * w_t[p] * g'_p``, ``w_t[p] = w[t_p]`` (0 for
    ``ignore_index``), ``g' = g`` ("sum"/"none") or ``g / W``, ``W = sum(w_t)`` ("mean");
    backward, with ``Gt[p] = G[p, t_p]`` and ``S = sum(w_t * Gt)``: ``[-S (sum), -w_t * Gt
    (none), -S / W (mean); no_grad; no_grad; sum_p [c == t_p] * d w_t[p]]``,
    ``d w_t = -g' * Gt`` (``-g' * (Gt - S / W)`` for "mean")."""
    g, pred, targets, *weights = orig_call.args
    attrs = orig_call.attrs
    reduction, ignore_index = str(attrs.reduction), int(attrs.ignore_index)
    dtype, ndim = _ty.dtype_of(pred), _ty.ndim_of(pred)
    class_axis = 0 if ndim == 1 else 1
    num_classes = static_dims(pred, "relax.grad.nll_loss_backward")[class_axis]
    hit = astype(one_hot(targets, 1, 0, num_classes, class_axis), dtype)
    w_t, keep = _nll_position_weights(
        pred, targets, weights[0] if weights else None, hit, ignore_index
    )
    g_t = sum(output_grad * hit, class_axis)  # G at each position's target, shape of targets
    a = w_t * g_t
    partials = [None, no_grad(pred), no_grad(targets)]
    if reduction == "none":
        partials[0] = -a
        d_w_t = -g * g_t
    elif reduction == "sum":
        partials[0] = -sum(a)
        d_w_t = -g * g_t
    elif reduction == "mean":
        total = sum(w_t)
        mean_a = sum(a) / total
        partials[0] = -mean_a
        d_w_t = -(g / total) * (g_t - mean_a)
    else:
        raise GradientError(
            f"Gradient: relax.grad.nll_loss_backward has no gradient rule for reduction="
            f"{reduction!r}"
        )
    if weights:
        per_position = expand_dims(d_w_t, class_axis) if ndim > 1 else d_w_t
        dw = hit * per_position
        others = [i for i in range(ndim) if i != class_axis]
        dw = sum(dw, others) if others else dw
        partials.append(dw if keep is None else dw * keep)
    return partials
