"""Rules for relax.op.nn: activations, normalizations, losses, convolution, pooling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.op import (
    astype,
    call_tir_with_grad,
    exp,
    expand_dims,
    flip,
    greater,
    matmul,
    mean,
    one_hot,
    permute_dims,
    reshape,
    rsqrt,
    squeeze,
    strided_slice,
    sum,
    tril,
    where,
)
from tvm.relax.op.grad import (
    avg_pool2d_backward,
    max_pool2d_backward,
    nll_loss_backward,
    no_grad,
)
from tvm.relax.op.nn import conv2d, conv2d_transpose, conv3d, conv3d_transpose, pad, softmax
from tvm.relax.training.utils import register_te_gradient

from .. import _ty
from .._tir import guarded
from ..errors import GradientError
from ._utils import const, count, fit_shape, relayout, scalar, static_dims
from .grad import _pool_layout
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
        output_grad = output_grad / scalar(count(x, [0]), output_grad)
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


def _ints(values) -> list[int]:
    return [int(v) for v in values]


@dataclass(frozen=True)
class _Conv:
    """A convolution's spatial attributes as ints (padding: all befores, then all afters)."""

    strides: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @staticmethod
    def of(attrs) -> _Conv:
        return _Conv(*(tuple(_ints(attrs[k])) for k in ("strides", "padding", "dilation")),
                     int(attrs.groups))  # fmt: skip

    def lifted(self) -> _Conv:
        """The 2-D convolution, over a unit height, that computes this 1-D one."""
        (s,), (before, after), (d,) = self.strides, self.padding, self.dilation
        return _Conv((1, s), (0, before, 0, after), (1, d), self.groups)


# Per number of spatial dims: (conv, conv_transpose, data layout, kernel layout).
_CONV_OPS = {
    2: (conv2d, conv2d_transpose, "NCHW", "OIHW"),
    3: (conv3d, conv3d_transpose, "NCDHW", "OIDHW"),
}


def _spatial_dims(t, op_name: str) -> tuple[int, ...]:
    """The spatial dims (after N and C) of ``t`` as ints: a symbolic batch or channel count is
    fine, symbolic spatial dims are refused (the output padding and crop depend on them)."""
    return static_dims(t, op_name, range(2, _ty.ndim_of(t)))


def _conv_data_grad(x, w, g, conv: _Conv, out_dtype, op_name: str):
    """``dx`` of ``g = conv(x, w)`` (NC.../OI...): the transposed convolution of g by w, with
    output padding for the input rows past the reach of the last output position."""
    (ins, kernel, grads), nd = (_spatial_dims(t, op_name) for t in (x, w, g)), len(conv.strides)
    output_padding = tuple(
        ins[i] - ((grads[i] - 1) * conv.strides[i] - conv.padding[i] - conv.padding[nd + i]
                  + conv.dilation[i] * (kernel[i] - 1) + 1)
        for i in range(nd)
    )  # fmt: skip
    _, transpose, data_layout, kernel_layout = _CONV_OPS[nd]
    return transpose(
        g, w, conv.strides, conv.padding, output_padding, conv.dilation, conv.groups,
        data_layout, "IO" + kernel_layout[2:], data_layout, out_dtype,
    )  # fmt: skip


def _conv_weight_grad(x, w, g, conv: _Conv, out_dtype, op_name: str):
    """``dw`` of ``g = conv(x, w)`` (NC.../OI...): x convolved by g with batch and channels
    swapped (layouts CN.../IO...) and strides and dilation swapped, cropped to the kernel."""
    batch, (out_channels, group_channels) = _ty.shape_values(x)[0], _ty.shape_values(w)[:2]
    ins, kernel, grads = (_spatial_dims(t, op_name) for t in (x, w, g))
    nd = len(ins)
    if conv.groups != 1:  # channels ordered (group, batch); the channel within a group as batch
        x = reshape(x, (batch, conv.groups, group_channels, *ins))
        x = permute_dims(x, [1, 0] + list(range(2, nd + 3)))
        x = reshape(x, (batch * conv.groups, group_channels, *ins))
    op, _, data_layout, kernel_layout = _CONV_OPS[nd]
    swapped = "CN" + data_layout[2:]
    dw = op(
        x, g, strides=conv.dilation, padding=conv.padding, dilation=conv.strides,
        groups=conv.groups, data_layout=swapped, kernel_layout="IO" + kernel_layout[2:],
        out_layout=swapped, out_dtype=out_dtype,
    )  # fmt: skip
    reach = [
        (ins[i] + conv.padding[i] + conv.padding[nd + i] - (grads[i] - 1) * conv.strides[i] - 1)
        // conv.dilation[i] + 1
        for i in range(nd)
    ]  # fmt: skip
    if any(r > k for r, k in zip(reach, kernel)):
        end = [out_channels, group_channels, *kernel]
        dw = strided_slice(dw, axes=list(range(nd + 2)), begin=[0] * (nd + 2), end=end)
    return dw


def _conv_grads(x, w, g, conv: _Conv, out_dtype, transposed: bool, op_name: str):
    """``(dx, dw)`` of a convolution (NC.../OI...) or a transposed one (NC.../IO...). A
    transposed convolution is the adjoint of a convolution from its output to its input, so
    its partials swap roles: ``dx = conv(g, w)``, ``dw`` as for that convolution with data g."""
    if not transposed:
        return (_conv_data_grad(x, w, g, conv, out_dtype, op_name),
                _conv_weight_grad(x, w, g, conv, out_dtype, op_name))  # fmt: skip
    op, _, data_layout, kernel_layout = _CONV_OPS[len(conv.strides)]
    dx = op(g, w, conv.strides, conv.padding, conv.dilation, conv.groups, data_layout,
            kernel_layout, data_layout, out_dtype)  # fmt: skip
    return dx, _conv_weight_grad(g, w, x, conv, out_dtype, op_name)


def _conv(op_name: str, nd: int, transposed: bool = False):
    """Register the rule of an ``nd``-D (transposed) convolution, for any layouts that permute
    NC.../OI... (IO... when transposed); 1-D ones are computed as 2-D ones of unit height."""
    data_layout = "NC" + "DHW"[3 - nd :]
    kernel_layout = ("IO" if transposed else "OI") + "DHW"[3 - nd :]

    def rule(orig_var, orig_call, output_grad, ctx):
        x, w = orig_call.args
        attrs = orig_call.attrs
        out_dtype = attrs.out_dtype
        low = _ty.dtype_of(x)
        if _ty.dtype_of(output_grad) != low:  # out_dtype widened the result (mixed precision):
            output_grad = astype(output_grad, low)  # the partials read g in x's dtype and
            out_dtype = _ty.dtype_of(orig_var)  # accumulate in the wide one, then round
        x = relayout(x, attrs.data_layout, data_layout, op_name)
        w = relayout(w, attrs.kernel_layout, kernel_layout, op_name)
        g = relayout(output_grad, attrs.out_layout, data_layout, op_name)
        conv = _Conv.of(attrs)
        if nd == 1:
            x, w, g, conv = expand_dims(x, 2), expand_dims(w, 2), expand_dims(g, 2), conv.lifted()
        x, w, g = ctx.normalize(x), ctx.normalize(w), ctx.normalize(g)
        dx, dw = _conv_grads(x, w, g, conv, out_dtype, transposed, op_name)
        if nd == 1:
            dx, dw = squeeze(dx, [2]), squeeze(dw, [2])
        if _ty.dtype_of(orig_var) != low:
            dx, dw = astype(dx, low), astype(dw, _ty.dtype_of(orig_call.args[1]))
        return [
            relayout(dx, data_layout, attrs.data_layout, op_name),
            relayout(dw, kernel_layout, attrs.kernel_layout, op_name),
        ]

    name = op_name.split(".")[-1]
    forward = "output_padding, dilation, groups" if transposed else "dilation, groups"
    backward = "conv(g, w), conv(g, x)" if transposed else "conv_transpose(g, w), conv(x, g)"
    rule.__doc__ = (
        f"Forward: ``y = {name}(x, w, strides, padding, {forward})``; backward: ``[{backward}]``."
    )
    register_gradient(op_name, rule)
    return rule


conv1d_grad = _conv("relax.nn.conv1d", 1)
conv2d_grad = _conv("relax.nn.conv2d", 2)
conv3d_grad = _conv("relax.nn.conv3d", 3)
conv1d_transpose_grad = _conv("relax.nn.conv1d_transpose", 1, transposed=True)
conv2d_transpose_grad = _conv("relax.nn.conv2d_transpose", 2, transposed=True)
conv3d_transpose_grad = _conv("relax.nn.conv3d_transpose", 3, transposed=True)


_POOL2D_ATTRS = "pool_size strides padding dilation ceil_mode count_include_pad layout".split()


def _pool_extent(attrs, ins, out_dims, op_name: str):
    """Per pooled axis of a 2-D pool (dilation 1): the axis of ``layout``, the pool size, the
    stride, the explicit padding before and after, and the padded length that ``grad._windows``
    gives it (padding, and past it as far as ceil_mode reaches)."""
    axes = _pool_layout(op_name, str(attrs.layout))
    padding = [int(v) for v in attrs.padding]  # top, left, bottom, right
    extents = []
    for k, axis in enumerate(axes):
        size, step = int(attrs.pool_size[k]), int(attrs.strides[k])
        before, after = padding[k], padding[k + 2]
        reach = (out_dims[axis] - 1) * step + size
        padded = before + max(ins[axis] + after, reach - before)
        extents.append((axis, size, step, before, after, padded))
    return extents


def _max_pool2d_overlapping_grad(ctx, grad, x, y, attrs, ins, out_dims, op_name: str):
    """The VJP of max_pool2d for overlapping windows (TVM 0.27's max_pool2d_backward returns
    garbage there): ``g`` to the first argmax of each window (TVM's tie-breaking: the first
    window offset, in raster order, holding the maximum), added at the positions of ``x``.

    The argmax is one kernel (a ``call_tir`` of integers, which no gradient flows into): per
    window, the least offset ``k`` whose value equals the pooled output ``y``, each offset
    compared once (a chain of comparisons, each step reading the running maximum twice, grew
    2**9-fold for a 3x3 window). An ``argmax`` over the stacked offsets wrote nine copies of
    the pooled output (ResNet-50's slowest kernel but the gemms); an elementwise ``minimum``
    over ``where(window_k == y, k, K)`` fused into each of the gather's reads. The sum is a
    gather: each position of ``x`` lies in at most ``ceil(size / stride)`` windows per axis,
    and from window ``(p + before) // stride - j`` it is offset ``(p + before) % stride + j *
    stride``; it adds the ``g`` of those windows whose argmax is its offset (four windows for
    a 3x3 window of stride 2), instead of scattering each of the nine offsets' parts with
    zeros over the whole input."""
    dtype = _ty.dtype_of(x)
    (ay, ky_size, sy, top, _, _), (ax, kx_size, sx, left, _, _) = _pool_extent(
        attrs, ins, out_dims, op_name
    )
    pool = dict(ay=ay, ax=ax, ky_size=ky_size, kx_size=kx_size, sy=sy, sx=sx, top=top,
                left=left)
    operands = [_placeholder(ins, dtype, "x"), _placeholder(out_dims, dtype, "pooled")]
    gv = _opaque_kernel(ctx, operands, _window_argmax(*operands, **pool), "window_argmax")
    first = ctx.emit(relax.call_tir(gv, relax.Tuple([x, ctx.normalize(y)]),
                                    relax.TensorType(out_dims, "int32")))  # fmt: skip
    operands = [_placeholder(out_dims, "int32", "first"), _placeholder(out_dims, dtype, "g")]
    gv = _opaque_kernel(ctx, operands, _window_gather(*operands, ins, **pool), "window_gather",
                        {WINDOW_SCATTER: pool})  # the CPU pipeline's scatter (schedules.scatter)
    return ctx.emit(call_tir_with_grad(gv, relax.Tuple([first, grad]),
                                       relax.TensorType(ins, dtype), WINDOW_GATHER, pool))


WINDOW_GATHER = "relaxgrad.max_pool2d_window_gather"
"""The TE gradient of the overlapping max pool's gather (:func:`_window_gather`)."""

WINDOW_SCATTER = "relaxgrad.window_scatter"
"""The PrimFunc attribute of the gather (:func:`_window_gather`): its window geometry, from
which the CPU pipeline writes it as a scatter (:class:`relaxgrad.schedules.WindowScatter`)."""


def _placeholder(dims, dtype: str, name: str) -> te.Tensor:
    return te.placeholder([tirx.IntImm("int64", d) for d in dims], dtype, name)  # as Relax's


def _opaque_kernel(ctx, operands: list[te.Tensor], result: te.Tensor, name: str,
                   attrs: dict | None = None):  # fmt: skip
    """Add the PrimFunc computing ``result`` from the placeholders ``operands``, kept out of
    fusion (kOpaque): fused with its readers or producers, a gather runs them once per read.
    ``attrs``: more attributes of the PrimFunc."""
    func = te.create_prim_func([*operands, result]).without_attr("global_symbol")
    for key, value in {"op_pattern": 8, **(attrs or {})}.items():
        func = func.with_attr(key, value)
    return ctx.add_func(func, name)


def _window_tap(index, k, ins, ay, ax, ky_size, kx_size, sy, sx, top, left, **_):
    """``(position, inside)``: the position in ``x`` (dims ``ins``) of offset ``k`` (``ky *
    kx_size + kx``) of the window at ``index``, and whether it lies in ``x`` (not the padding)."""
    at = list(index)
    at[ay] = index[ay] * sy + tirx.floordiv(k, kx_size) - top
    at[ax] = index[ax] * sx + tirx.floormod(k, kx_size) - left
    return at, tirx.all(at[ay] >= 0, at[ay] < ins[ay], at[ax] >= 0, at[ax] < ins[ax])


def _window_argmax(x, pooled, **pool) -> te.Tensor:
    """Per window, the least offset whose value equals the pooled output (``ky_size *
    kx_size`` where none does), the padding reading as the dtype's least value (as
    ``_windows`` pads)."""
    ins, size = [int(d) for d in x.shape], pool["ky_size"] * pool["kx_size"]
    fill = float(np.finfo(str(x.dtype)).min)

    def value(*index):
        first = tirx.const(size, "int32")
        for k in reversed(range(size)):  # the least offset wins
            at, inside = _window_tap(index, tirx.const(k, "int32"), ins, **pool)
            first = tirx.Select(guarded(x, at, inside, fill) == pooled[index],
                                tirx.const(k, "int32"), first)  # fmt: skip
        return first

    return te.compute(pooled.shape, value, name="window_argmax")


def _window_gather(first, g, ins, ay, ax, ky_size, kx_size, sy, sx, top, left):
    """``dx`` of the overlapping max pool: each position of ``x`` (dims ``ins``) adds the ``g``
    of the windows whose first argmax (``first``: the offset ``ky * kx_size + kx``) it is. A
    position lies in at most ``ceil(size / stride)`` windows per axis: from window
    ``(p + before) // stride - j`` it is offset ``(p + before) % stride + j * stride`` (four
    windows of a 3x3 window of stride 2). Reads are guarded, at clamped indices."""
    windows = [int(d) for d in g.shape]

    def value(*index):
        total = tirx.const(0, g.dtype)
        for jy in range(-(-ky_size // sy)):
            for jx in range(-(-kx_size // sx)):
                at, offsets, inside = list(index), [], []
                for axis, size, stride, before, j in ((ay, ky_size, sy, top, jy),
                                                      (ax, kx_size, sx, left, jx)):
                    at[axis] = tirx.floordiv(index[axis] + before, stride) - j
                    offsets.append(tirx.floormod(index[axis] + before, stride) + j * stride)
                    inside += [offsets[-1] < size, at[axis] >= 0, at[axis] < windows[axis]]
                hit = tirx.all(*inside, guarded(first, at, tirx.all(*inside), -1)
                               == offsets[0] * kx_size + offsets[1])  # fmt: skip
                total = total + guarded(g, at, hit)
        return total

    return te.compute([tirx.IntImm("int64", d) for d in ins], value, name="window_gather")


@register_te_gradient(WINDOW_GATHER)
def _window_gather_grad(dx, first, g, **pool):
    """The gather's VJP: ``g`` of a window reads ``dx`` at its argmax (0 where there is none);
    the integer ``first`` gets zeros. ``pool``: the gather's ``te_grad_kwargs``."""
    ins, size = [int(d) for d in dx.shape], pool["ky_size"] * pool["kx_size"]

    def value(*index):
        k = first[index]
        at, inside = _window_tap(index, k, ins, **pool)
        return guarded(dx, at, tirx.all(k >= 0, k < size, inside))

    none = te.compute(first.shape, lambda *i: tirx.const(0, first.dtype), name="no_grad")
    return [none, te.compute(g.shape, value, name="window_gather_grad")]


def _avg_pool2d_ceil_include_pad_grad(grad, x, attrs, op_name: str):
    """The VJP of avg_pool2d with ceil_mode and count_include_pad (TVM 0.27's
    avg_pool2d_backward disagrees with the forward when the last window hangs past the
    padding): the forward divides each window sum by the number of its positions inside the
    padded input (explicit padding counted, ceil_mode's overhang not), so ``g`` over that
    divisor goes to every position of its window. Windows are boxes and the divisor is a
    product over the axes, so this is ``A^T g`` per axis with ``A[o, i] = [i in window o] /
    count[o]``: two matmuls, however large the window (a global pool's window of 128x128 as
    one offset per element would be 16,384 pads)."""
    layout = str(attrs.layout)
    ins = _layout_dims(x, layout, "NCHW", op_name)
    outs = _layout_dims(grad, layout, "NCHW", op_name)
    matrices = {}
    for k, axis in enumerate((2, 3)):
        size, step = int(attrs.pool_size[k]), int(attrs.strides[k])
        before, after = int(attrs.padding[k]), int(attrs.padding[k + 2])
        start = np.arange(outs[axis]) * step - before
        counts = np.minimum(start + size, ins[axis] + after) - start
        positions = np.arange(ins[axis])
        inside = (positions >= start[:, None]) & (positions < start[:, None] + size)
        matrices[axis] = inside / counts[:, None]
    grad = relayout(grad, layout, "NCHW", op_name)
    grad = _pooling_matrices_grad(grad, matrices, outs, _ty.dtype_of(x))
    return relayout(grad, "NCHW", layout, op_name)


def _pool2d(op_name: str, backward):
    """Register the rule of a 2-D pooling op whose input gradient is the TVM op ``backward``
    (computed here where TVM 0.27's kernel is wrong: max_pool2d with overlapping windows,
    avg_pool2d with ceil_mode and count_include_pad)."""

    def rule(orig_var, orig_call, output_grad, ctx):
        attrs = orig_call.attrs
        if any(int(d) != 1 for d in attrs.dilation):
            raise GradientError(
                f"Gradient: {op_name} has no gradient rule for dilation {tuple(attrs.dilation)} "
                "(TVM's pooling gradient kernels support dilation 1 only)"
            )
        grad = relayout(output_grad, attrs.out_layout, attrs.layout, op_name)
        x = orig_call.args[0]
        overlapping = any(int(s) < int(k) for s, k in zip(attrs.strides, attrs.pool_size))
        if op_name == "relax.nn.max_pool2d" and overlapping:
            ins, out_dims = static_dims(x, op_name), static_dims(ctx.normalize(grad), op_name)
            y = relayout(orig_var, attrs.out_layout, attrs.layout, op_name)
            return [_max_pool2d_overlapping_grad(ctx, grad, x, y, attrs, ins, out_dims, op_name)]
        if op_name == "relax.nn.avg_pool2d" and attrs.ceil_mode and attrs.count_include_pad:
            return [_avg_pool2d_ceil_include_pad_grad(ctx.normalize(grad), x, attrs, op_name)]
        kwargs = {key: attrs[key] for key in _POOL2D_ATTRS}
        return [backward(grad, x, **kwargs, out_layout=attrs.layout)]

    rule.__doc__ = (
        f"Forward: ``y = {op_name}(x, pool_size, strides, padding, ceil_mode, layout)``; "
        f"backward: ``[{backward.__name__}(g, x, ...)]``."
    )
    register_gradient(op_name, rule)
    return rule


max_pool2d_grad = _pool2d("relax.nn.max_pool2d", max_pool2d_backward)
avg_pool2d_grad = _pool2d("relax.nn.avg_pool2d", avg_pool2d_backward)


# Normalizations. The backward pass recomputes the statistics (in :func:`_compute_dtype`) and
# uses, for xhat = (x - mean(x)) * rstd over ``axes``,
#     dx = rstd * (gx - mean(gx) - xhat * mean(gx * xhat)),  gx = d loss / d xhat.


#: Fewer elements per statistic than this, a float32 normalization's gradient is computed in
#: float64: its projections cancel (over 2 elements, ``g`` lies in the span of 1 and ``xhat``,
#: and only eps's share of it is left: a batch norm over a batch of 2, LeViT's classifier), and
#: so few are cheap.
FEW_ELEMENTS = 4


def _compute_dtype(dtype: str, elements=None) -> str:
    """The dtype a normalization's gradient of ``dtype`` is computed in: float32 for float16 and
    bfloat16 (as TVM's kernels compute them), float64 for float32 over fewer than
    :data:`FEW_ELEMENTS` static ``elements`` per statistic, else ``dtype``."""
    if dtype in ("float16", "bfloat16"):
        return "float32"
    if dtype == "float32" and isinstance(elements, int) and elements < FEW_ELEMENTS:
        return "float64"
    return dtype


def _wide(expr, dtype: str, wide: str):
    """``expr``, of ``dtype``, in the compute dtype ``wide``."""
    return expr if wide == dtype else astype(expr, wide)


def _narrow(expr, dtype: str, wide: str):
    """A partial computed in ``wide`` (by :func:`_wide` math), back in ``dtype``."""
    return expr if wide == dtype else astype(expr, dtype)


def _narrow_all(expr, dtype: str, wide: str):
    """:func:`_narrow`, None for None (no gradient)."""
    return None if expr is None else _narrow(expr, dtype, wide)


def _standardized(x, axes: list[int], epsilon: float, dtype: str):
    """``(xhat, rstd)`` of ``x`` over ``axes``, in ``dtype``, with the reduced axes kept."""
    centered = x - mean(x, axes, keepdims=True)
    rstd = rsqrt(mean(centered * centered, axes, keepdims=True) + const(epsilon, dtype))
    return centered * rstd, rstd


def _standardized_grad(xhat, rstd, gx, axes: list[int]):
    """``dx`` of ``xhat = (x - mean(x)) * rstd`` over ``axes``, for ``gx = d loss / d xhat``."""
    centered_gx = gx - mean(gx, axes, keepdims=True)
    return rstd * (centered_gx - xhat * mean(gx * xhat, axes, keepdims=True))


def _sum_except(expr, keep: list[int], ndim: int):
    """``expr`` summed over every axis not in ``keep``."""
    others = [a for a in range(ndim) if a not in keep]
    return sum(expr, others) if others else expr


def _norm_axes(op_name: str, attrs, ndim: int, affine: bool = True) -> list[int]:
    """The normalized axes, non-negative. Refused: axes out of order (TVM 0.27's kernels do not
    compute the op's documented result for them) and, for ``affine`` ops, ``center``/``scale``
    off (the kernels ignore them: gamma and beta are always applied)."""
    axes = [int(a) % ndim for a in attrs.axes]
    if axes != sorted(axes):
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for axes out of order ({list(attrs.axes)})"
        )
    if affine and not (bool(attrs.center) and bool(attrs.scale)):
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for center=False or scale=False (TVM "
            "0.27 legalizes the op ignoring them: gamma and beta are always applied)"
        )
    return axes


def _per_axes(param, axes: list[int], dims: list, dtype: str, wide: str):
    """``param`` (of ``dtype``) of shape ``dims[axes]`` in ``wide``, shaped to broadcast against
    a tensor of shape ``dims``."""
    return reshape(_wide(param, dtype, wide), [d if a in axes else 1 for a, d in enumerate(dims)])


@register_gradient("relax.nn.layer_norm")
def layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = xhat * gamma + beta``, ``xhat = c * rstd``, ``c = x - mean(x)``,
    ``rstd = rsqrt(mean(c * c) + eps)`` over ``axes``; backward, with ``gx = g * gamma``:
    ``dx = rstd * (gx - mean(gx) - c * rstd^2 * mean(gx * c))``, ``dgamma = sum(g * c * rstd)``
    and ``dbeta = sum(g)``, sums over the other axes. Written on ``c`` and per-row scalars, so
    that each mean is one pass fused with the product it reduces and ``dx`` one more pass."""
    x, gamma, beta = orig_call.args
    attrs, dtype, dims = orig_call.attrs, _ty.dtype_of(x), _ty.shape_values(x)
    axes = _norm_axes("relax.nn.layer_norm", attrs, len(dims))
    wide = _compute_dtype(dtype, count(x, axes))
    g, xw = _wide(output_grad, dtype, wide), _wide(x, dtype, wide)
    centered = xw - mean(xw, axes, keepdims=True)
    rstd = rsqrt(mean(centered * centered, axes, keepdims=True) + const(float(attrs.epsilon), wide))
    gx = g * _per_axes(gamma, axes, dims, dtype, wide)
    slope = rstd * rstd * mean(gx * centered, axes, keepdims=True)
    dx = rstd * (gx - mean(gx, axes, keepdims=True) - centered * slope)
    dgamma = _sum_except(g * centered * rstd, axes, len(dims))
    dbeta = _sum_except(g, axes, len(dims))
    return [_narrow(dx, dtype, wide), _narrow(dgamma, dtype, wide), _narrow(dbeta, dtype, wide)]


@register_gradient("relax.nn.rms_norm")
def rms_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = x * r * w``, ``r = rsqrt(mean(x * x, axes) + eps)``; backward:
    ``[r * g * w - x * r^3 * mean(g * w * x, axes), sum(g * x * r)]``."""
    x, weight = orig_call.args
    attrs, dtype, dims = orig_call.attrs, _ty.dtype_of(x), _ty.shape_values(x)
    axes = _norm_axes("relax.nn.rms_norm", attrs, len(dims), affine=False)
    wide = _compute_dtype(dtype, count(x, axes))
    xw, g = _wide(x, dtype, wide), _wide(output_grad, dtype, wide)
    eps = const(float(attrs.epsilon), wide)
    r = rsqrt(mean(xw * xw, axes, keepdims=True) + eps)
    gw = g * _per_axes(weight, axes, dims, dtype, wide)
    dx = r * gw - xw * (r * r * r) * mean(gw * xw, axes, keepdims=True)
    dweight = _sum_except(g * xw * r, axes, len(dims))
    return [_narrow(dx, dtype, wide), _narrow(dweight, dtype, wide)]


def _channel_affine_grads(x, gamma, g, xhat, channel: int, ndim: int, wide: str):
    """``(gx, dgamma, dbeta)`` of ``y = xhat * gamma + beta`` with gamma and beta per channel."""
    per_channel = [1] * ndim
    per_channel[channel] = _ty.shape_values(x)[channel]
    gx = g * reshape(_wide(gamma, _ty.dtype_of(x), wide), per_channel)
    return gx, _sum_except(g * xhat, [channel], ndim), _sum_except(g, [channel], ndim)


@register_gradient("relax.nn.group_norm")
def group_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = xhat * gamma + beta``, xhat standardized per group of channels over
    ``axes``, gamma and beta per channel; backward: ``[dx(g * gamma), sum(g * xhat), sum(g)]``."""
    x, gamma, beta = orig_call.args
    attrs, dtype, dims = orig_call.attrs, _ty.dtype_of(x), _ty.shape_values(x)
    ndim, groups = len(dims), int(attrs.num_groups)
    axes = _norm_axes("relax.nn.group_norm", attrs, ndim)
    channel = int(attrs.channel_axis) % ndim
    grouped = dims[:channel] + [groups, dims[channel] // groups] + dims[channel + 1 :]
    group_axes = [channel + 1] + [a + 1 if a > channel else a for a in axes]
    spatial = count(x, axes)  # times the channels of a group: the elements of a statistic
    per_group = dims[channel]
    elements = (spatial * int(per_group) // groups
                if isinstance(spatial, int) and isinstance(per_group, tirx.IntImm) else None)
    wide = _compute_dtype(dtype, elements)
    xw, g = reshape(_wide(x, dtype, wide), grouped), _wide(output_grad, dtype, wide)
    xhat, rstd = _standardized(xw, group_axes, float(attrs.epsilon), wide)
    xhat_flat = reshape(xhat, dims)
    gx, dgamma, dbeta = _channel_affine_grads(x, gamma, g, xhat_flat, channel, ndim, wide)
    dx = reshape(_standardized_grad(xhat, rstd, reshape(gx, grouped), group_axes), dims)
    return [_narrow(dx, dtype, wide), _narrow(dgamma, dtype, wide), _narrow(dbeta, dtype, wide)]


@register_gradient("relax.nn.instance_norm")
def instance_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = xhat * gamma + beta``, xhat standardized over ``axes``, gamma and beta per
    channel; backward: ``[dx(g * gamma), sum(g * xhat), sum(g)]``."""
    x, gamma, beta = orig_call.args
    attrs, dtype, dims = orig_call.attrs, _ty.dtype_of(x), _ty.shape_values(x)
    axes = _norm_axes("relax.nn.instance_norm", attrs, len(dims))
    channel = int(attrs.channel_axis) % len(dims)
    wide = _compute_dtype(dtype, count(x, axes))
    g = _wide(output_grad, dtype, wide)
    xhat, rstd = _standardized(_wide(x, dtype, wide), axes, float(attrs.epsilon), wide)
    gx, dgamma, dbeta = _channel_affine_grads(x, gamma, g, xhat, channel, len(dims), wide)
    dx = _standardized_grad(xhat, rstd, gx, axes)
    return [_narrow(dx, dtype, wide), _narrow(dgamma, dtype, wide), _narrow(dbeta, dtype, wide)]


_ZEROS = tvm.ir.Op.get("relax.zeros")


def _tuple_field_grads(ctx, output_grad, count: int) -> list:
    """The adjoints of the fields of a tuple-valued op, None for the ones that are known zeros
    (fields the loss does not use get ``zeros`` from the pass)."""
    bound = ctx.lookup_binding(output_grad) if isinstance(output_grad, relax.Var) else None
    fields = list(bound.fields) if isinstance(bound, relax.Tuple) else None
    grads = []
    for i in range(count):
        field = fields[i] if fields is not None else relax.TupleGetItem(output_grad, i)
        value = ctx.lookup_binding(field) if isinstance(field, relax.Var) else field
        is_zeros = isinstance(value, relax.Call) and value.op.same_as(_ZEROS)
        grads.append(None if is_zeros else field)
    return grads


def batch_statistics(x, axes: list[int]):
    """``(m, c, v)`` of a training-mode batch norm of ``x`` over ``axes`` (kept): the mean,
    ``x - m`` and the mean of ``c * c``, accumulated in :func:`_accumulator`'s dtype (float64
    for float32 ``x``, as PyTorch's CPU kernel accumulates a batch norm's sums in double).
    ``relaxgrad.compile``'s :class:`~relaxgrad.schedules.ShareStatistics` writes the forward
    pass's statistics with it, so that the gradient's are the same computation."""
    dtype = _ty.dtype_of(x)
    xa = _wide(x, dtype, _accumulator(dtype))
    m = mean(xa, axes, keepdims=True)
    c = xa - m
    return m, c, mean(c * c, axes, keepdims=True)


def _accumulator(dtype: str) -> str:
    """The dtype a batch norm of ``dtype`` accumulates its sums in."""
    return "float64" if dtype == "float32" else _compute_dtype(dtype)


def _batch_norm_train_grads(x, gamma, grads, attrs, channel: int):
    """``[dx, dgamma, dbeta, dmoving_mean, dmoving_var]`` of a training-mode batch_norm (None
    for no gradient), from the adjoints ``grads`` of ``(y, new_mean, new_var)``.

    As PyTorch's CPU kernel: the statistics and the sums ``sum(g)`` and ``sum(g * (x - m))``
    accumulated in float64 (for float32), then per element, in the compute dtype,
    ``dx = (g - sum(g) / n - (x - m) * rstd^2 * sum(g * (x - m)) / n) * rstd * gamma``."""
    g, g_mean, g_var = grads
    dims, dtype = _ty.shape_values(x), _ty.dtype_of(x)
    axes = [a for a in range(len(dims)) if a != channel]
    acc, wide = _accumulator(dtype), _compute_dtype(dtype, count(x, axes))
    per_channel = [1] * len(dims)
    per_channel[channel] = dims[channel]
    m, c, v = batch_statistics(x, axes)
    rstd = rsqrt(v + const(float(attrs.epsilon), acc))
    n = scalar(count(x, axes), acc)
    centered = _wide(x, dtype, wide) - _wide(m, acc, wide)  # (x - m) per element, in wide
    dx = dgamma = dbeta = None
    if g is not None:
        ga = _wide(g, dtype, acc)
        sum_g = _sum_except(ga, [channel], len(dims))
        dot = _sum_except(ga * c, [channel], len(dims))
        dgamma, dbeta = dot * reshape(rstd, [dims[channel]]), sum_g
        scale = _wide(rstd, acc, wide)
        if attrs.scale:
            scale = scale * reshape(_wide(gamma, dtype, wide), per_channel)
        grad_mean = _wide(reshape(sum_g, per_channel) / n, acc, wide)
        projection = _wide(reshape(dot, per_channel) * rstd * rstd / n, acc, wide)
        dx = (_wide(g, dtype, wide) - grad_mean - centered * projection) * scale
    momentum = float(attrs.momentum)
    per_element = const(momentum, wide) / scalar(count(x, axes), wide)  # m / n
    stat_grads = []
    for stat_grad, of_x in ((g_mean, None), (g_var, centered)):
        if stat_grad is None:  # new_mean = (1 - m) mean + m batch_mean, same for the var
            stat_grads.append(None)
            continue
        stat_grads.append(const(1 - momentum, dtype) * stat_grad)
        per_x = _per_axes(stat_grad, [channel], dims, dtype, wide) * per_element
        if of_x is None:  # the same for every element: broadcast to x's own shape
            per_x = relax.op.broadcast_to(per_x, _ty.shape_of(x))
        else:
            per_x = const(2, wide) * per_x * of_x
        dx = per_x if dx is None else dx + per_x
    return [_narrow_all(dx, dtype, wide), _narrow_all(dgamma, dtype, acc),
            _narrow_all(dbeta, dtype, acc), *stat_grads]


def _batch_norm_eval_grads(x, gamma, moving_mean, moving_var, grads, attrs, channel: int):
    """``[dx, dgamma, dbeta, dmoving_mean, dmoving_var]`` of an inference-mode batch_norm, which
    normalizes with the moving statistics and returns them unchanged."""
    g, g_mean, g_var = grads
    dims, dtype = _ty.shape_values(x), _ty.dtype_of(x)
    dx = dgamma = dbeta = None
    d_mean, d_var = g_mean, g_var
    wide = _compute_dtype(dtype)
    if g is not None:
        g = _wide(g, dtype, wide)
        r = rsqrt(_wide(moving_var, dtype, wide) + const(float(attrs.epsilon), wide))
        centered = _wide(x, dtype, wide) - _per_axes(moving_mean, [channel], dims, dtype, wide)
        xhat = centered * _per_axes(r, [channel], dims, wide, wide)
        gx, dgamma, dbeta = _channel_affine_grads(x, gamma, g, xhat, channel, len(dims), wide)
        gx = gx if attrs.scale else g
        dx = gx * _per_axes(r, [channel], dims, wide, wide)
        mean_grad = -_sum_except(dx, [channel], len(dims))
        var_grad = _sum_except(gx * centered, [channel], len(dims)) * (r * r * r)
        var_grad = const(-0.5, wide) * var_grad
        d_mean = mean_grad if d_mean is None else _wide(d_mean, dtype, wide) + mean_grad
        d_var = var_grad if d_var is None else _wide(d_var, dtype, wide) + var_grad
        d_mean, d_var = _narrow(d_mean, dtype, wide), _narrow(d_var, dtype, wide)
    return [_narrow_all(dx, dtype, wide), _narrow_all(dgamma, dtype, wide),
            _narrow_all(dbeta, dtype, wide), d_mean, d_var]


@register_gradient("relax.nn.batch_norm")
def batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``(y, new_mean, new_var) = batch_norm(x, gamma, beta, mean, var, axis)``;
    backward (training): ``[dx(g * gamma) + momentum terms, sum(g * xhat), sum(g),
    (1 - momentum) * g_new_mean, (1 - momentum) * g_new_var]``; (inference) the partials of
    ``(x - mean) * rsqrt(var + eps) * gamma + beta``."""
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    attrs = orig_call.attrs
    channel = int(attrs.axis) % _ty.ndim_of(x)
    grads = _tuple_field_grads(ctx, output_grad, 3)
    if attrs.training:
        partials = _batch_norm_train_grads(x, gamma, grads, attrs, channel)
    else:
        partials = _batch_norm_eval_grads(x, gamma, moving_mean, moving_var, grads, attrs, channel)
    if not attrs.scale:
        partials[1] = None
    if not attrs.center:
        partials[2] = None
    return [no_grad(arg) if partial is None else partial
            for arg, partial in zip(orig_call.args, partials)]


@register_gradient("relax.nn.prelu")
def prelu_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = where(x > 0, x, alpha * x)``, alpha per channel on ``axis``; backward:
    ``[where(x > 0, g, alpha * g), sum(where(x > 0, 0, g * x))]``."""
    x, alpha = orig_call.args
    ndim, dims = _ty.ndim_of(x), _ty.shape_values(x)
    axis = int(orig_call.attrs.axis) % ndim
    per_channel = [_ty.shape_values(alpha)[0] if a == axis else 1 for a in range(ndim)]
    positive = greater(x, const(0, x))
    dx = where(positive, output_grad, reshape(alpha, per_channel) * output_grad)
    dalpha = _sum_except(where(positive, const(0, x), output_grad * x), [axis], ndim)
    if dims[axis] != _ty.shape_values(alpha)[0]:  # one alpha for every channel
        dalpha = sum(dalpha, [0], keepdims=True)
    return [dx, dalpha]


def _pad_blocks(mode: str, before: int, after: int, n: int):
    """The blocks of an axis padded in ``mode``: ``(out_begin, size, in_begin, how)``, the
    outputs ``out_begin + i`` copy the inputs ``in_begin + i`` ("flip": in reverse order; "sum":
    all the same input)."""
    blocks = [(before, n, 0, None)]
    if mode == "reflect":  # without the edge: output before - 1 - i copies input i + 1
        blocks += [(0, before, 1, "flip"), (before + n, after, n - 1 - after, "flip")]
    elif mode == "replicate":
        blocks += [(0, before, 0, "sum"), (before + n, after, n - 1, "sum")]
    elif mode == "circular":
        blocks += [(0, before, n - before, None), (before + n, after, 0, None)]
    return [block for block in blocks if block[1] > 0]


def _unpad_axis(g, axis: int, before: int, after: int, dims: list[int], mode: str):
    """``g`` of an axis padded by ``before``/``after`` in ``mode`` folded back to the input:
    each input position sums the gradients of the outputs that copy it."""
    ndim, n = len(dims), dims[axis]
    grad = None
    for out_begin, size, in_begin, how in _pad_blocks(mode, before, after, n):
        block = strided_slice(g, [axis], [out_begin], [out_begin + size])
        if how == "flip":
            block = flip(block, axis)
        elif how == "sum":
            block, size = sum(block, [axis], keepdims=True), 1
        if (in_begin, size) != (0, n):
            widths = [0] * (2 * ndim)
            widths[2 * axis], widths[2 * axis + 1] = in_begin, n - in_begin - size
            block = pad(block, widths)
        grad = block if grad is None else grad + block
    return grad


def _pad_widths(attrs, dims: list) -> list[tuple[int, int]]:
    """``(before, after)`` per axis of a ``pad``, refusing the widths its mode cannot copy from
    (negative ones; reflect: more than n - 1; circular: more than n)."""
    mode, widths = str(attrs.pad_mode), _ints(attrs.pad_width)
    limit = {"constant": None, "reflect": 1, "replicate": None, "circular": 0}
    if mode not in limit:
        raise GradientError(f"Gradient: relax.nn.pad has no gradient rule for pad_mode={mode!r}")
    pairs = list(zip(widths[::2], widths[1::2]))
    for (before, after), n in zip(pairs, dims):
        if not (before or after):  # n may be symbolic
            continue
        too_wide = limit[mode] is not None and max(before, after) > n - limit[mode]
        if min(before, after) < 0 or too_wide:
            raise GradientError(
                f"Gradient: relax.nn.pad has no gradient rule for pad_width ({before}, {after}) "
                f"on an axis of {n} in pad_mode={mode!r}"
            )
    return pairs


@register_gradient("relax.nn.pad")
def pad_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = pad(x, pad_width, pad_mode)``; backward: ``[g of the x positions, plus for
    reflect/replicate/circular the g of the pads folded onto the inputs they copy]``. Only the
    padded axes need static dims."""
    x, widths = orig_call.args[0], _ints(orig_call.attrs.pad_width)
    padded = [a for a in range(_ty.ndim_of(x)) if widths[2 * a] or widths[2 * a + 1]]
    dims = list(_ty.shape_values(x))
    for axis, n in zip(padded, static_dims(x, "relax.nn.pad", padded)):
        dims[axis] = n
    grad = output_grad
    for axis, (before, after) in enumerate(_pad_widths(orig_call.attrs, dims)):
        if before or after:
            grad = _unpad_axis(grad, axis, before, after, dims, str(orig_call.attrs.pad_mode))
    return [grad]


def _adaptive_pool_matrix(n_in: int, n_out: int, dtype: str) -> np.ndarray:
    """``(n_out, n_in)``: row i averages the inputs of output bin i, ``[floor(i n_in / n_out),
    ceil((i + 1) n_in / n_out))``."""
    matrix = np.zeros((n_out, n_in))
    for i in range(n_out):
        start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix.astype(dtype)


def _pooling_matrices_grad(g, matrices: dict[int, np.ndarray], outs: list, dtype: str):
    """``A^T g`` along each spatial axis of ``g`` (NC..., of dims ``outs``) that has a matrix
    ``A = matrices[axis]`` of shape ``(out, in)``, as matmuls: the last axis on the right, the
    others on the left of ``g`` reshaped to ``(.., out, rest)``. One matmul per axis, whatever
    the window sizes."""
    dims, last = list(outs), len(outs) - 1
    for axis in sorted(matrices, reverse=True):
        matrix = matrices[axis].astype(dtype)
        if axis == last:
            g = matmul(g, relax.const(matrix, dtype))
        else:
            rest = int(np.prod(dims[axis + 1 :]))
            merged = reshape(g, dims[: axis + 1] + [rest]) if axis < last - 1 else g
            g = matmul(relax.const(np.ascontiguousarray(matrix.T), dtype), merged)
        dims[axis] = matrix.shape[1]
        g = reshape(g, dims) if axis < last - 1 else g
    return g


def _adaptive_pool_input_grad(g, ins: list[int], outs: list[int], dtype: str):
    """``A^T g`` over each spatial axis of ``g`` (NC..., of shape ``outs``) whose size changes."""
    matrices = {axis: _adaptive_pool_matrix(ins[axis], outs[axis], dtype)
                for axis in range(2, len(outs)) if ins[axis] != outs[axis]}
    return _pooling_matrices_grad(g, matrices, outs, dtype)


def _layout_dims(t, src: str, dst: str, op_name: str) -> list:
    """The dims of ``t`` (in layout ``src``) in the order of layout ``dst`` (NC...): N and C as
    they are (possibly symbolic), the spatial ones as ints."""
    order, dims = [src.index(c) for c in dst], _ty.shape_values(t)
    return [dims[a] for a in order[:2]] + list(static_dims(t, op_name, order[2:]))


def _adaptive_avg_pool(op_name: str, nd: int):
    """Register the rule of an ``nd``-D adaptive average pool. It is linear in x, one static
    averaging matrix ``A`` per spatial axis, so ``dx = A^T g`` axis by axis."""
    layout = "NC" + "DHW"[3 - nd :]

    def rule(orig_var, orig_call, output_grad, ctx):
        x, attrs = orig_call.args[0], orig_call.attrs
        ins = _layout_dims(x, str(attrs.layout), layout, op_name)
        outs = _layout_dims(orig_var, str(attrs.out_layout), layout, op_name)
        grad = relayout(output_grad, attrs.out_layout, layout, op_name)
        grad = _adaptive_pool_input_grad(grad, ins, outs, _ty.dtype_of(x))
        return [relayout(grad, layout, attrs.layout, op_name)]

    rule.__doc__ = (
        f"Forward: ``y = {op_name.split('.')[-1]}(x, output_size)``; backward: ``[A^T g]`` per "
        "spatial axis, ``A`` the static matrix averaging each output bin."
    )
    register_gradient(op_name, rule)
    return rule


adaptive_avg_pool1d_grad = _adaptive_avg_pool("relax.nn.adaptive_avg_pool1d", 1)
adaptive_avg_pool2d_grad = _adaptive_avg_pool("relax.nn.adaptive_avg_pool2d", 2)
adaptive_avg_pool3d_grad = _adaptive_avg_pool("relax.nn.adaptive_avg_pool3d", 3)


def _attention_probs(q, k, bias, scale, offset: int | None):
    """The probabilities of ``attention`` (q, k in BHSD layout), as TVM's kernel computes them:
    ``softmax(q k^T * scale + bias)``, with probability 0 above diagonal ``offset`` if given."""
    scores = matmul(q, permute_dims(k, [0, 1, 3, 2])) * scale
    if bias is not None:
        scores = scores + bias
    if offset is None:
        return softmax(scores, -1)
    masked = tril(scores, offset)
    e = tril(exp(masked - relax.op.max(masked, -1, keepdims=True)), offset)
    return e / sum(e, -1, keepdims=True)


def _attention_offset(attrs, q, k) -> int | None:
    """The diagonal of the causal mask of ``attention`` (None without one)."""
    mask = attrs.causal_mask
    if attrs.window_size is not None or mask not in (None, "TopLeft", "BottomRight"):
        raise GradientError(
            f"Gradient: relax.nn.attention has no gradient rule for causal_mask={mask!r}, "
            f"window_size={attrs.window_size} (TVM 0.27 cannot lower sliding windows either)"
        )
    if mask is None:
        return None
    if mask == "TopLeft":
        return 0
    seq_len, seq_len_kv = (static_dims(t, "relax.nn.attention", [1])[0] for t in (q, k))
    return abs(seq_len - seq_len_kv)


@register_gradient("relax.nn.attention")
@register_gradient("relax.nn.attention_bias")
def attention_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``o = p v``, ``p = softmax(q k^T * scale + bias)`` (causally masked), BSHD
    layouts; backward: ``ds = p * (g v^T - sum(g v^T * p)) * scale``, ``[ds k, ds^T q, p^T g,
    ds / scale]``."""
    q, k, v, *bias = orig_call.args
    attrs = orig_call.attrs
    offset = _attention_offset(attrs, q, k)
    if attrs.scale is not None:
        scale = float(attrs.scale)
    else:
        scale = 1.0 / np.sqrt(static_dims(q, "relax.nn.attention", [3])[0])
    scale = const(scale, q)
    to_bhsd = [0, 2, 1, 3]  # its own inverse
    qt, kt, vt, g = (permute_dims(t, to_bhsd) for t in (q, k, v, output_grad))
    p = _attention_probs(qt, kt, bias[0] if bias else None, scale, offset)
    dp = matmul(g, permute_dims(vt, [0, 1, 3, 2]))
    dscores = p * (dp - sum(dp * p, -1, keepdims=True))
    ds = dscores * scale
    dq = permute_dims(matmul(ds, kt), to_bhsd)
    dk = permute_dims(matmul(permute_dims(ds, [0, 1, 3, 2]), qt), to_bhsd)
    dv = permute_dims(matmul(permute_dims(p, [0, 1, 3, 2]), g), to_bhsd)
    return [dq, dk, dv] + [fit_shape(ctx, dscores, b) for b in bias]
