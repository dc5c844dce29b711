"""Rules for relax.op.nn: activations, normalizations, losses, convolution, pooling."""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.op import (
    astype,
    exp,
    expand_dims,
    one_hot,
    permute_dims,
    reshape,
    strided_slice,
    sum,
)
from tvm.relax.op.grad import (
    avg_pool2d_backward,
    max_pool2d_backward,
    nll_loss_backward,
    no_grad,
)
from tvm.relax.op.nn import conv2d, conv2d_transpose

from .. import _ty
from ..errors import GradientError
from ._utils import const, static_dims
from .registry import register_gradient


@register_gradient("relax.nn.softmax")
def softmax_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = softmax(x, axis)``; backward: ``[(g - sum(g * y, axis)) * y]``."""
    return [(output_grad - sum(output_grad * orig_var, orig_call.attrs.axis, True)) * orig_var]


@register_gradient("relax.nn.log_softmax")
def log_softmax_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = log_softmax(x, axis)``; backward: ``[g - sum(g, axis) * exp(y)]``."""
    return [output_grad - sum(output_grad, orig_call.attrs.axis, True) * exp(orig_var)]


@register_gradient("relax.nn.cross_entropy_with_logits")
def cross_entropy_with_logits_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``z = -sum(x * y) / N``; backward: ``[-g / N * y, -g / N * x]``."""
    x, y = orig_call.args
    if _ty.ndim_of(x) > 1:
        output_grad = output_grad / const(int(_ty.shape_values(x)[0]), output_grad)
    return [-output_grad * y, -output_grad * x]


def _nll_loss_weighted_grads(loss, pred, targets, weights, output_grad, attrs):
    """``(d pred, d weights)`` of a weighted nll_loss, from one-hot targets: a position p with
    target c adds ``-weights[c] * g[p]`` to ``pred[p, c]`` and ``-pred[p, c] * g[p]`` to
    ``weights[c]``; for ``reduction="mean"`` g is divided by the total weight W and ``weights[c]``
    also gets ``-g * loss * count[c] / W``."""
    dtype, num_classes = _ty.dtype_of(pred), static_dims(weights, "relax.nn.nll_loss")[0]
    class_axis = 0 if _ty.ndim_of(pred) == 1 else 1
    others = [i for i in range(_ty.ndim_of(pred)) if i != class_axis]
    per_class = (num_classes,) + (1,) * (len(others) - class_axis)  # broadcasts over positions
    hit = astype(one_hot(targets, 1, 0, num_classes, class_axis), dtype)  # 0 for out-of-range
    ignore_index = int(attrs.ignore_index)
    if 0 <= ignore_index < num_classes:
        keep = np.ones(per_class, dtype)
        keep[ignore_index] = 0
        hit = hit * relax.const(keep, dtype)
    counts = sum(hit, others) if others else hit
    g = output_grad
    if attrs.reduction == "none" and others:
        g = expand_dims(g, class_axis)
    elif attrs.reduction == "mean":
        g = g / sum(weights * counts)
    pred_grad = -(hit * reshape(weights, per_class)) * g
    weights_grad = -(pred * hit) * g
    if others:
        weights_grad = sum(weights_grad, others)
    if attrs.reduction == "mean":
        weights_grad = weights_grad - g * loss * counts
    return pred_grad, weights_grad


@register_gradient("relax.nn.nll_loss")
def nll_loss_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``z = nll_loss(pred, targets, weights, reduction, ignore_index)``; backward:
    ``[nll_loss_backward(g, pred, targets, weights), no_grad, d weights]``."""
    pred, targets, *weights = orig_call.args
    attrs = orig_call.attrs
    kernel_grad = nll_loss_backward(
        output_grad,
        pred,
        targets,
        weights[0] if weights else None,
        attrs.reduction,
        attrs.ignore_index,
    )
    if not weights:
        return [kernel_grad, no_grad(targets)]
    pred_grad, weights_grad = _nll_loss_weighted_grads(
        orig_var, pred, targets, weights[0], output_grad, attrs
    )
    # The kernel reads weights[ignore_index], out of bounds for a target equal to an
    # ignore_index outside the classes (such as the default -100); only then use pred_grad.
    if 0 <= int(attrs.ignore_index) < _ty.static_shape(weights[0])[0]:
        pred_grad = kernel_grad
    return [pred_grad, no_grad(targets), weights_grad]


def _relayout(expr, src: str, dst: str, op_name: str):
    """``expr`` permuted from layout ``src`` to layout ``dst`` (itself when they are equal)."""
    if src == dst:
        return expr
    if sorted(src) != sorted(dst):
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for layout {src} (only for permutations "
            f"of {dst}, such as NHWC)"
        )
    return permute_dims(expr, [src.index(axis) for axis in dst])


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _conv2d_data_grad(x, w, g, attrs, out_dtype):
    """``dx`` of an NCHW/OIHW ``conv2d``: the transposed convolution of g by w, padded at the
    end by the input rows/columns past the reach of the last output position."""
    (in_h, in_w), (kernel_h, kernel_w), (grad_h, grad_w) = (
        static_dims(t, "relax.nn.conv2d")[2:] for t in (x, w, g)
    )
    (stride_h, stride_w), (dilation_h, dilation_w) = _ints(attrs.strides), _ints(attrs.dilation)
    pad_top, pad_left, pad_bottom, pad_right = _ints(attrs.padding)
    output_padding = (
        in_h - ((grad_h - 1) * stride_h - pad_top - pad_bottom + dilation_h * (kernel_h - 1) + 1),
        in_w - ((grad_w - 1) * stride_w - pad_left - pad_right + dilation_w * (kernel_w - 1) + 1),
    )
    return conv2d_transpose(
        g, w, attrs.strides, attrs.padding, output_padding, attrs.dilation, attrs.groups,
        "NCHW", "IOHW", "NCHW", out_dtype,
    )  # fmt: skip


def _conv2d_weight_grad(x, w, g, attrs, out_dtype):
    """``dw`` of an NCHW/OIHW ``conv2d``: x convolved by g with batch and channels swapped
    (layouts CNHW/IOHW) and strides and dilation swapped, cropped to the kernel size."""
    batch, _, in_h, in_w = static_dims(x, "relax.nn.conv2d")
    out_channels, group_channels, kernel_h, kernel_w = static_dims(w, "relax.nn.conv2d")
    grad_h, grad_w = static_dims(g, "relax.nn.conv2d")[2:]
    (stride_h, stride_w), (dilation_h, dilation_w) = _ints(attrs.strides), _ints(attrs.dilation)
    pad_top, pad_left, pad_bottom, pad_right = _ints(attrs.padding)
    groups = int(attrs.groups)
    if groups != 1:  # channels ordered (group, batch); the channel within a group as batch
        x = reshape(x, (batch, groups, group_channels, in_h, in_w))
        x = permute_dims(x, [1, 0, 2, 3, 4])
        x = reshape(x, (batch * groups, group_channels, in_h, in_w))
    dw = conv2d(
        x, g, strides=attrs.dilation, padding=attrs.padding, dilation=attrs.strides,
        groups=groups, data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW",
        out_dtype=out_dtype,
    )  # fmt: skip
    dw_h = (in_h + pad_top + pad_bottom - (grad_h - 1) * stride_h - 1) // dilation_h + 1
    dw_w = (in_w + pad_left + pad_right - (grad_w - 1) * stride_w - 1) // dilation_w + 1
    if dw_h > kernel_h or dw_w > kernel_w:
        end = [out_channels, group_channels, kernel_h, kernel_w]
        dw = strided_slice(dw, axes=[0, 1, 2, 3], begin=[0, 0, 0, 0], end=end)
    return dw


@register_gradient("relax.nn.conv2d")
def conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = conv2d(x, w, strides, padding, dilation, groups)``; backward:
    ``[conv2d_transpose(g, w), conv2d(x, g)]``, computed in NCHW/OIHW for any 4-D layouts."""
    x, w = orig_call.args
    attrs = orig_call.attrs
    name = "relax.nn.conv2d"
    out_dtype = attrs.out_dtype
    if _ty.dtype_of(output_grad) != _ty.dtype_of(x):  # out_dtype widened the result
        output_grad, out_dtype = astype(output_grad, _ty.dtype_of(x)), _ty.dtype_of(x)
    x = ctx.normalize(_relayout(x, attrs.data_layout, "NCHW", name))
    w = ctx.normalize(_relayout(w, attrs.kernel_layout, "OIHW", name))
    g = ctx.normalize(_relayout(output_grad, attrs.out_layout, "NCHW", name))
    dx = _conv2d_data_grad(x, w, g, attrs, out_dtype)
    dw = _conv2d_weight_grad(x, w, g, attrs, out_dtype)
    return [
        _relayout(dx, "NCHW", attrs.data_layout, name),
        _relayout(dw, "OIHW", attrs.kernel_layout, name),
    ]


_POOL2D_ATTRS = "pool_size strides padding dilation ceil_mode count_include_pad layout".split()


def _pool2d(op_name: str, backward):
    """Register the rule of a 2-D pooling op whose input gradient is the TVM op ``backward``."""

    def rule(orig_var, orig_call, output_grad, ctx):
        attrs = orig_call.attrs
        if any(int(d) != 1 for d in attrs.dilation):
            raise GradientError(
                f"Gradient: {op_name} has no gradient rule for dilation {tuple(attrs.dilation)} "
                "(TVM's pooling gradient kernels support dilation 1 only)"
            )
        grad = _relayout(output_grad, attrs.out_layout, attrs.layout, op_name)
        kwargs = {key: attrs[key] for key in _POOL2D_ATTRS}
        return [backward(grad, orig_call.args[0], **kwargs, out_layout=attrs.layout)]

    rule.__doc__ = (
        f"Forward: ``y = {op_name}(x, pool_size, strides, padding, ceil_mode, layout)``; "
        f"backward: ``[{backward.__name__}(g, x, ...)]``."
    )
    register_gradient(op_name, rule)
    return rule


max_pool2d_grad = _pool2d("relax.nn.max_pool2d", max_pool2d_backward)
avg_pool2d_grad = _pool2d("relax.nn.avg_pool2d", avg_pool2d_backward)
