"""2-D convolutions as matmuls (im2col / col2im), a Relax rewrite before legalization (CPU and
GPU).

TVM legalizes a convolution to one loop nest whose reduction reads a padded input through
``y * stride + ky`` indices; even tiled (:class:`TiledMatmul`), it runs far below a matmul of
the same size. :class:`ConvToMatmul` rewrites the three convolutions a training step runs
(2-D, ``groups=1``, static shapes) into an unfused gather (im2col) or scatter (col2im) kernel
and a plain ``R.matmul``, which the matmul schedule or BLAS then runs:

- forward ``conv2d`` (``NCHW``, ``OIHW``): ``y[n] = W (O, C*KH*KW) @ cols[n] (C*KH*KW, OH*OW)``;
- the weight gradient, ``conv2d`` with layouts ``CNHW`` / ``IOHW`` / ``CNHW`` (as emitted by
  relaxgrad's rule): ``dw (O, C*KH*KW) = sum_n g[n] (O, OH*OW) @ cols[n]^T`` with the
  forward's im2col where BLAS runs it, else ``g (O, N*OH*OW) @ cols (N*OH*OW, C*KH*KW)``;
- the data gradient, ``conv2d_transpose`` (``NCHW``, ``IOHW``):
  ``cols[n] = W^T (C*KH*KW, O) @ g[n] (O, H*W)``, then col2im sums the ``KH*KW`` taps.

Where images are small (fewer than ``batch_columns_below`` output pixels, with BLAS: the 7x7
stage of a ResNet), each per-image product is a narrow matmul (49 columns) that OpenBLAS runs
at two thirds of its speed; the batch then goes into the columns of one matmul per convolution:
``y^T (O, N*OH*OW) = W @ cols`` with im2col laid out ``(C*KH*KW, N*OH*OW)``,
``dw = g^T @ cols^T`` and ``cols = W^T @ g^T``, ``g^T`` being ``g`` with its batch and channel
axes swapped (one copy, shared by both gradients), and ``y`` swapped back (a 1x1 convolution's
im2col is such a swap of ``x``). A 1x1 convolution with stride 1 and no padding otherwise needs
no im2col or col2im at all (reshapes).

On a GPU target the gather and scatter kernels are left unscheduled for the GPU's schedule
step (dlight binds their threads), col2im gathers its taps plainly, and the matmuls are
dlight's; a weight gradient's product, a small matrix over a long K, is split along K into a
batch of products that are summed (:func:`_k_splits`). TVM legalizes a convolution to a loop
nest that dlight's rules run far below its matmuls: ResNet-50's training step at batch 64 on
an H200 took 720 ms with TVM's convolutions, 371 ms as im2col and matmuls, 155-167 ms with K
split (``bench/gpu_check.py``).

Other convolutions (grouped, 1-D/3-D, other layouts) are left to legalization. The same pass
rewrites the gradient of a max pooling whose windows tile the input (``max_pool2d_backward``
with stride = window, as in a CNN's 2x2 pools): each window's argmax once, then one gather,
instead of TVM's recomputation of every window an input element could be in; where ``relu``'s
gradient, ``where(t < 0, 0, dx)``, is its only reader, the gather applies the mask too.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, s_tir, te, tirx
from tvm.ir import IRModule, Op
from tvm.relax import op
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .. import _ty
from .._tir import guarded, selected
from . import blas
from ._common import (
    OPAQUE,
    bound_values,
    is_gpu,
    is_op,
    may_change,
    read_counts,
    rewrite_functions,
    static_shape,
)
from .cpu import _vector_lanes, _vectorize_unrolled


@tvm.transform.module_pass(opt_level=0, name="ConvToMatmul")
class ConvToMatmul:
    """Rewrite 2-D convolutions into im2col/col2im and matmuls, and tiling max-pool gradients
    into an argmax and a gather (see the module docstring).

    ``summed_batches`` (default: where :mod:`.blas` finds OpenBLAS) picks the weight
    gradient's form: a sum over the batch of ``g[n] @ cols[n]^T`` with the forward's im2col
    layout, which :class:`~.blas.MatmulToBLAS` runs as one accumulating call, instead of one
    matmul over a transposed im2col and a transposed ``g`` (two more copies).

    ``recompute_columns`` (default): the weight gradient computes its im2col again from the
    convolution's input rather than reading the forward's, which would stay alive from the
    forward to the backward at ``KH*KW`` times the input's size (ResNet-50 at batch 8: 432 of
    the step's 1,210 MiB live at its peak; the input is kept anyway). False shares it: an
    im2col less a convolution, for that memory."""

    def __init__(self, summed_batches: bool | None = None, batch_columns_below: int | None = None,
                 recompute_columns: bool = True):
        self.recompute_columns = recompute_columns
        self.summed_batches = blas.available() if summed_batches is None else summed_batches
        self.batch_columns_below = (
            (BATCH_COLUMNS_BELOW if self.summed_batches else 0)
            if batch_columns_below is None
            else batch_columns_below
        )

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        rewriter = _Rewriter(mod, self.summed_batches, self.batch_columns_below,
                             self.recompute_columns)
        # (without the full weight gradients of the cropped ones)
        return relax.transform.DeadCodeElimination()(rewrite_functions(rewriter, mod))


_WIDENED = {("bfloat16", "float32"), ("float16", "float32")}
"""Operand and result dtypes of the mixed-precision convolutions :class:`ConvToMatmul` takes."""
RECOMPUTED = "relaxgrad.recomputed"
"""The attribute of a weight gradient's im2col computed again (:class:`ConvToMatmul`)."""
BATCH_COLUMNS_BELOW = 128
_COLUMNS_MIN_MACS = 1 << 24
"""With BLAS, a convolution whose images have fewer output pixels than this (ResNet-50's 7x7
stage) runs its three matmuls with the batch in the columns (see :class:`ConvToMatmul`)."""


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, summed_batches: bool, batch_columns_below: int,
                 recompute_columns: bool):
        super().__init__(mod)
        self.summed_batches, self.recompute_columns = summed_batches, recompute_columns
        target = Target.current(allow_none=True)
        self.gpu = target is not None and is_gpu(target)
        self.batch_columns_below = batch_columns_below
        self.conv2d = Op.get("relax.nn.conv2d")
        self.conv2d_transpose = Op.get("relax.nn.conv2d_transpose")
        self.max_pool_backward = Op.get("relax.grad.max_pool2d_backward")

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        ops = (self.conv2d, self.conv2d_transpose, self.max_pool_backward)
        if not may_change(func, lambda value: any(is_op(value, op) for op in ops)):
            return func  # (a relu mask goes with a max-pool gradient)
        self.masks, self.masked = _relu_masks(func, self.max_pool_backward), {}
        self.values = bound_values(func)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        """A max-pool gradient read only by ``relu``'s gradient, ``where(t < 0, 0, dx)``, is
        computed with the mask (one kernel, no masked copy); the ``where`` reads it as is."""
        if binding.var in self.masks:
            call, mask = binding.value, self.masks[binding.var]
            args = [self.visit_expr(arg) for arg in call.args]
            value = self._max_pool_backward(relax.Call(call.op, args, call.attrs), mask)
            if value is not None:
                self.masked[binding.var] = self.builder_.emit(value, binding.var.name)
                self.set_var_remap(binding.var, self.masked[binding.var])
                return None
        value = binding.value
        if is_op(value, Op.get("relax.where")) and value.args[2] in self.masked:
            self.set_var_remap(binding.var, self.masked[value.args[2]])
            return None
        return super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        cropped = self._cropped_weight_grad(call)
        if cropped is not None:
            return cropped
        call = super().visit_call_(call)
        if call.op.same_as(self.max_pool_backward):
            result = self._max_pool_backward(call)
            return call if result is None else result
        if not any(call.op.same_as(conv) for conv in (self.conv2d, self.conv2d_transpose)):
            return call
        x, w = call.args
        shapes = [static_shape(t) for t in (x, w, call)]
        attrs = call.attrs
        if (
            any(s is None or len(s) != 4 for s in shapes)
            or int(attrs.groups) != 1
            or not self._dtypes(x, w, call)
        ):
            return call
        layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
        conv = _Params(attrs)
        if call.op.same_as(self.conv2d) and layouts == ("NCHW", "OIHW", "NCHW"):
            return self._forward(x, w, conv, *shapes)
        if call.op.same_as(self.conv2d) and layouts == ("CNHW", "IOHW", "CNHW"):
            return self._weight_grad(x, w, conv, *shapes)
        if call.op.same_as(self.conv2d_transpose) and layouts == ("NCHW", "IOHW", "NCHW"):
            return self._data_grad(x, w, conv, *shapes)
        return call

    def _dtypes(self, x, w, result) -> bool:
        """Whether a convolution of ``x`` and ``w`` giving ``result`` is rewritten: all of one
        dtype, or bfloat16 / float16 operands with a float32 result (mixed precision's
        ``out_dtype``, :class:`~relaxgrad.transforms.MixedPrecision`), whose matmuls then
        read the low dtype and accumulate into float32 (:meth:`_matmul`)."""
        low, out = _ty.dtype_of(x), _ty.dtype_of(result)
        if _ty.dtype_of(w) != low or (low != out and (low, out) not in _WIDENED):
            return False
        self.dtypes = (low, out)
        return True

    def _matmul(self, a, b) -> relax.Expr:
        """``a @ b`` in the dtype of the convolution being rewritten (see :meth:`_dtypes`)."""
        low, out = self.dtypes
        return op.matmul(a, b, out_dtype=out if out != low else None)

    def _cropped_weight_grad(self, call: relax.Call) -> relax.Expr | None:
        """A weight gradient cropped to its kernel, ``strided_slice`` from 0 with stride 1 of
        a ``CNHW`` convolution with more taps than the kernel (a strided convolution's: the
        rule's convolution reaches past the kernel, a 1x1 kernel of stride 2 as a 2x2 one),
        computed for the kernel's taps only (the full one is left unread)."""
        source = call.args[0] if is_op(call, Op.get("relax.strided_slice")) else None
        conv_call = self.values.get(source) if isinstance(source, relax.Var) else None
        if not (is_op(conv_call, self.conv2d) and int(conv_call.attrs.groups) == 1):
            return None
        attrs = conv_call.attrs
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("CNHW", "IOHW", "CNHW"):
            return None
        axes, begin = (_ints(arg) for arg in call.args[1:3])
        strides = _ints(call.args[4]) if len(call.args) > 4 else []
        x, g = (self.visit_expr(arg) for arg in conv_call.args)
        shapes = [static_shape(t) for t in (x, g, source, call)]
        if (
            any(v is None or len(v) != 4 for v in (axes, begin, *shapes))
            or sorted(axes) != [0, 1, 2, 3]
            or any(begin)
            or any(v != 1 for v in strides or [])
            or shapes[3][:2] != shapes[2][:2]
            or not self._dtypes(x, g, call)
        ):
            return None
        return self._weight_grad(x, g, _Params(attrs), shapes[0], shapes[1], shapes[3])

    def _max_pool_backward(self, call: relax.Call, mask=None) -> relax.Expr | None:
        """``dx`` of a max pooling whose windows tile the input (NCHW, stride = window, no
        padding or dilation): ``g`` of the window where ``x`` is the window's first maximum
        in raster order (TVM's tie rule), else 0. TVM's legalization instead sums, per input
        element, over every window that could hold it, recomputing each window's argmax.
        ``mask``: ``t`` of ``where(t < 0, 0, dx)`` (``relu``'s gradient), applied in the same
        kernel where the windows tile the input exactly (None is returned otherwise)."""
        g, x = call.args
        attrs = call.attrs
        (kh, kw), shapes = (int(v) for v in attrs.pool_size), [static_shape(t) for t in (g, x)]
        if (
            attrs.layout != "NCHW"
            or attrs.out_layout != "NCHW"
            or any(s is None or len(s) != 4 for s in shapes)
            or [int(v) for v in attrs.strides] != [kh, kw]
            or any(int(v) != 0 for v in attrs.padding)
            or any(int(v) != 1 for v in attrs.dilation)
            or bool(attrs.ceil_mode)
        ):
            return None
        gh, gw = shapes[0][2:]

        def argmax(data):  # the window's first maximum, as ty * kw + tx
            def value(b, ci, oy, ox):
                best = data[b, ci, oy * kh, ox * kw]
                index = tirx.const(0, "int32")
                for tap in range(1, kh * kw):
                    other = data[b, ci, oy * kh + tap // kw, ox * kw + tap % kw]
                    index = tirx.Select(other > best, tirx.const(tap, "int32"), index)
                    best = tirx.max(best, other)
                return index

            return te.compute(shapes[0], value, name="window_argmax")

        def unpool(grad, index):
            def value(b, ci, y, x):
                oy, ox = tirx.min(y // kh, gh - 1), tirx.min(x // kw, gw - 1)
                tap = tirx.Var("tap", index.dtype)  # read at the clamped window (a Let)
                hit = tirx.all(y < gh * kh, x < gw * kw, tap == (y % kh) * kw + x % kw)
                return tirx.Let(tap, index[b, ci, oy, ox], selected(grad[b, ci, oy, ox], hit))

            return te.compute(shapes[1], value, name="max_unpool")

        def unpool_windows(grad, index, *masks):  # (N, C, GH, KH, GW, KW): x's shape
            def value(b, ci, oy, ty, ox, tx):
                # g where the window's argmax is this tap, else 0, as a bit mask: a select (or
                # a product, wrong for an infinite g) ran 5-10x slower.
                hit = index[b, ci, oy, ox] == ty * kw + tx
                for t in masks:  # relu's gradient: 0 where t < 0
                    hit = tirx.all(hit, tirx.Not(t[b, ci, oy * kh + ty, ox * kw + tx] < 0))
                hit = hit.astype("int32")
                bits = tirx.reinterpret("int32", grad[b, ci, oy, ox])
                return tirx.reinterpret(grad.dtype, bits & (tirx.const(0, "int32") - hit))

            n, c = shapes[0][:2]
            return te.compute((n, c, gh, kh, gw, kw), value, name="max_unpool")

        exact = shapes[1][2:] == [gh * kh, gw * kw] and _ty.dtype_of(g) == "float32"
        if mask is not None and not exact:
            return None
        index = self._emit_te(argmax, [x], "window_argmax", vectorize=False)
        if exact:
            # No rows or columns left out of the windows. Left to LLVM (vectorized by us, it
            # ran 2x slower).
            masks = [] if mask is None else [self.visit_expr(mask)]
            windows = self._emit_te(unpool_windows, [g, index, *masks], "max_unpool",
                                    vectorize=False)  # fmt: skip
            return op.reshape(windows, shapes[1])
        return self._emit_te(unpool, [g, index], "max_unpool")

    def _emit_te(self, compute, args, name: str, vectorize: bool = True, phases: int = 1,
                 recomputed: bool = False):
        """Emit ``compute`` as an unfusable PrimFunc called with ``args`` (its last axis the
        ``phases`` of a strided one, see :func:`_schedule`); ``recomputed``: a PrimFunc of its
        own (an attribute), so that no call of the same computation elsewhere (the forward's)
        is taken for it by ``EliminateCommonSubexpr``."""
        placeholders = [te.placeholder(static_shape(a), _ty.dtype_of(a), f"in{i}")
                        for i, a in enumerate(args)]  # fmt: skip
        out = compute(*placeholders)
        func = te.create_prim_func([*placeholders, out]).without_attr("global_symbol")
        if not self.gpu:  # (a GPU's schedule step binds its threads)
            func = _schedule(func, vectorize, phases)
        func = func.with_attr("op_pattern", OPAQUE)  # FuseOps leaves the gather/scatter unfused
        if recomputed:
            func = func.with_attr(RECOMPUTED, True)
        gvar = self.builder_.add_func(func, name)
        out_type = relax.TensorType([int(d) for d in out.shape], out.dtype)
        return self.builder_.emit(relax.call_tir(gvar, list(args), out_type))

    def _im2col(self, x, conv: _Params, order: str, extents: dict[str, int], name: str,
                recomputed: bool = False):
        """``x[n, c, p * stride + r * dilation - pad, q * stride + s * dilation - pad]`` (0 in
        the padding) as a tensor with axes ``order``, a permutation of ``"ncpqrs"``
        (``recomputed``: see :meth:`_emit_te`)."""

        def im2col(data):
            def value(i0, i1, i2, i3, i4, i5):
                at = dict(zip(order, (i0, i1, i2, i3, i4, i5), strict=True))
                return _padded(data, conv, *(at[axis] for axis in "ncpqrs"))

            return te.compute([extents[axis] for axis in order], value, name=name)

        return self._emit_te(im2col, [x], name, recomputed=recomputed)

    def _in_columns(self, n: int, o: int, taps: int, pixels: int) -> bool:
        """Whether a convolution's matmuls of ``n`` images of ``pixels`` output pixels, ``o``
        channels out and ``taps`` in take the batch in their columns: small images, in
        products large enough for BLAS (below it, TVM's own matmuls run either form alike)."""
        return pixels < self.batch_columns_below and n * o * taps * pixels >= _COLUMNS_MIN_MACS

    def _batch_columns(self, x, conv: _Params, x_shape, kh: int, kw: int, oh: int, ow: int,
                       recomputed: bool = False):
        """The im2col of ``x`` with the batch in its columns: ``(C*KH*KW, N*OH*OW)``."""
        n, c, _, _ = x_shape
        if conv.pointwise(kh, kw):
            cols = op.permute_dims(x, [1, 0, 2, 3])
        else:
            extents = dict(n=n, c=c, r=kh, s=kw, p=oh, q=ow)
            cols = self._im2col(x, conv, "crsnpq", extents, "im2col", recomputed)
        return op.reshape(cols, (c * kh * kw, n * oh * ow))

    @staticmethod
    def _batch_rows(g, g_shape):
        """``g (N, O, OH, OW)`` as ``(O, N*OH*OW)``."""
        n, o, gh, gw = g_shape
        return op.reshape(op.permute_dims(g, [1, 0, 2, 3]), (o, n * gh * gw))

    def _forward(self, x, w, conv: _Params, x_shape, w_shape, y_shape) -> relax.Expr:
        n, c, _, _ = x_shape
        o, _, kh, kw = w_shape
        oh, ow = y_shape[2:]
        taps = c * kh * kw
        if self._in_columns(n, o, taps, oh * ow):  # y^T (O, N*OH*OW) = W @ cols, one matmul
            cols = self._batch_columns(x, conv, x_shape, kh, kw, oh, ow)
            y = op.reshape(self._matmul(op.reshape(w, (o, taps)), cols), (o, n, oh, ow))
            return op.permute_dims(y, [1, 0, 2, 3])
        if conv.pointwise(kh, kw):  # the image is its own im2col
            cols = op.reshape(x, (n, taps, oh * ow))
        else:
            extents = dict(n=n, c=c, r=kh, s=kw, p=oh, q=ow)
            cols = op.reshape(self._im2col(x, conv, "ncrspq", extents, "im2col"),
                              (n, taps, oh * ow))  # fmt: skip
        y = self._matmul(op.reshape(w, (o, taps)), cols)  # (n, o, oh * ow)
        return op.reshape(y, y_shape)

    def _weight_grad(self, x, g, conv: _Params, x_shape, g_shape, dw_shape) -> relax.Expr:
        # x (N, C, H, W) read as CNHW, g (N, O, OH, OW) read as IOHW, dw (O, C, KH, KW) as CNHW:
        # dw[o, c, ky, kx] = sum_{n, oy, ox} xpad[n, c, ky * s + oy * d, kx * s + ox * d] *
        # g[n, o, oy, ox], with s and d this convolution's strides and dilation (the forward
        # convolution's dilation and strides).
        n, c, _, _ = x_shape
        _, o, oh, ow = g_shape
        kh, kw = dw_shape[2:]
        taps = c * kh * kw
        if self._in_columns(n, o, taps, oh * ow):  # the forward's columns: g^T @ cols^T
            cols = self._batch_columns(x, conv.swapped(), x_shape, kh, kw, oh, ow,
                                       self.recompute_columns)
            dw = self._matmul(self._batch_rows(g, g_shape), op.permute_dims(cols))
            return op.reshape(dw, dw_shape)
        # the forward's im2col, and sum_n g[n] @ cols[n]^T (BLAS accumulates it in one call;
        # a mixed-precision product, for oneDNN, is one GEMM over the batch's pixels instead)
        if self.summed_batches and self.dtypes[0] == self.dtypes[1]:
            forward = conv.swapped()
            extents = dict(n=n, c=c, r=kh, s=kw, p=oh, q=ow)
            cols = x if forward.pointwise(kh, kw) else \
                self._im2col(x, forward, "ncrspq", extents, "im2col", self.recompute_columns)
            cols = op.reshape(cols, (n, taps, oh * ow))
            products = self._matmul(op.reshape(g, (n, o, oh * ow)),
                                    op.permute_dims(cols, [0, 2, 1]))
            return op.reshape(op.collapse_sum_to(products, (o, taps)), dw_shape)
        extents = dict(c=c, p=kh, q=kw, n=n, r=oh, s=ow)
        cols = op.reshape(self._im2col(x, conv, "cpqnrs", extents, "im2col_t"), (taps, n * oh * ow))
        g2 = op.reshape(op.permute_dims(g, [1, 0, 2, 3]), (o, n * oh * ow))
        splits = _k_splits(o, taps, n * oh * ow) if self.gpu else 1
        if splits > 1:  # dw = sum_s g2[:, s] @ cols[:, s]^T: one matmul per slice of K
            depth = n * oh * ow // splits
            g3 = op.permute_dims(op.reshape(g2, (o, splits, depth)), [1, 0, 2])
            cols3 = op.permute_dims(op.reshape(cols, (taps, splits, depth)), [1, 2, 0])
            return op.reshape(op.sum(self._matmul(g3, cols3), axis=[0]), dw_shape)
        return op.reshape(self._matmul(g2, op.permute_dims(cols)), dw_shape)

    def _data_grad(self, g, w, conv: _Params, g_shape, w_shape, dx_shape) -> relax.Expr:
        # dx[n, c, y, x] = sum_{o, ky, kx} g[n, o, oy, ox] * w[o, c, ky, kx] where
        # oy * s - pad_top + ky * d == y (and the same for x).
        n, o, gh, gw = g_shape
        _, c, kh, kw = w_shape
        h, wd = dx_shape[2:]
        taps = c * kh * kw
        wt = op.permute_dims(op.reshape(w, (o, taps)), [1, 0])
        stacked = self._in_columns(n, o, taps, gh * gw)  # cols (taps, n * ..), else (n, taps, ..)
        g2 = self._batch_rows(g, g_shape) if stacked else op.reshape(g, (n, o, gh * gw))
        cols = self.builder_.emit(self._matmul(wt, g2))
        if conv.pointwise(kh, kw) and [gh, gw] == [h, wd]:  # each tap is its own pixel
            if stacked:
                return op.permute_dims(op.reshape(cols, (c, n, h, wd)), [1, 0, 2, 3])
            return op.reshape(cols, dx_shape)
        (sh, sw), (dh, dw), (top, left) = conv.strides, conv.dilation, conv.padding[:2]
        # A stride along the rows (dilation 1, dividing them): the row's positions by their
        # phase modulo the stride, x = i * sw + phase, computed as dims (i, phase) reshaped to
        # the row: for a constant phase, the tap and the window are i plus constants, so each
        # phase reads plain rows of the columns instead of a gather (8x128x56x56 at stride 2:
        # 4.8 -> 2.0 ms; 8x256x28x28: 2.9 -> 1.8 ms)
        # (on a GPU, where dlight schedules the kernel: a plain gather of the taps)
        phases = sw if sw > 1 and dw == 1 and wd % sw == 0 and not self.gpu else 1

        def col2im(data):
            # Per axis, the taps that reach a position: with dilation 1, those of its residue
            # modulo the stride, ceil(size / stride) of them (4 of a 3x3 kernel's 9 at stride
            # 2), found by arithmetic; else every tap, checked.
            reach = [(kh, sh, dh, top, gh), (kw, sw, dw, left, gw)]
            axes = [te.reduce_axis((0, -(-k // s) if d == 1 else k), name)
                    for (k, s, d, _, _), name in zip(reach, ("jy", "jx"))]  # fmt: skip

            def tap(j, position, size, stride, dilation, before, extent):
                """(tap, window, conditions) of reduction index ``j`` at ``position``."""
                if dilation == 1:
                    k = tirx.floormod(position + before, stride) + j * stride if stride > 1 else j
                    t = position + before - k
                    window = tirx.floordiv(t, stride) if stride > 1 else t
                    conds = [k < size, t >= 0, window < extent]
                else:
                    k, t = j, position + before - j * dilation
                    window = tirx.floordiv(t, stride)
                    conds = [t >= 0, tirx.floormod(t, stride) == 0, window < extent]
                clamp = lambda v, e: tirx.max(tirx.min(v, e - 1), 0)  # noqa: E731
                return clamp(k, size), clamp(window, extent), conds

            def at(b, tap_index, pixel):
                return (tap_index, b * gh * gw + pixel) if stacked else (b, tap_index, pixel)

            def summed(b, ci, y, x, along=None):
                """The taps' sum at ``(b, ci, y, x)``; ``along``: ``(first, index, length)``
                where the row reads a plain vector of the columns, from column ``first``
                (unclamped) of the tap's window row, ``index`` along it, ``length`` long:
                read so where that is in the buffer, the clamped, checked gather elsewhere."""
                ky, row, inside_y = tap(axes[0], y, *reach[0])
                kx, col, inside_x = tap(axes[1], x, *reach[1])
                inside = tirx.all(*inside_y, *inside_x)
                tap_index = (ci * kh + ky) * kw + kx
                pixel = row * gw + col  # in bounds: a select, not a branch
                read = selected(data[at(b, tap_index, pixel)], inside)
                if along is None:
                    return te.sum(read, axis=axes)
                first, index, length = along
                start = row * gw + first
                flat = _flat(data, at(b, tap_index, start))
                in_buffer = tirx.all(*inside_y, flat >= 0, flat + length - 1 < _size(data))
                fast = tirx.Select(inside, data[at(b, tap_index, start + index)],
                                   tirx.const(0, data.dtype))  # fmt: skip
                return te.sum(tirx.if_then_else(in_buffer, fast, read), axis=axes)

            def value(b, ci, y, x):
                # Stride 1 along the rows: a row of x reads a row of the columns from column
                # x + left - jx, a plain vector read (clamped, a gather) where the columns past
                # either end, which it selects 0 for, are in the buffer: rows in the image but
                # the buffer's first and last (as im2col's, :func:`_padded`).
                along = (left - axes[1], x, wd) if (sw, dw) == (1, 1) and not self.gpu else None
                return summed(b, ci, y, x, along)

            def phase_value(b, ci, y, i, p):
                # A row's positions of one phase: for a tap, its window's column is i plus a
                # constant (the phase's column at i = 0), so the row reads a plain vector of
                # the columns, as for stride 1.
                along = (tirx.floordiv(p + left, sw) - axes[1], i, wd // phases)
                return summed(b, ci, y, i * sw + p, along)

            if phases > 1:
                return te.compute((n, c, h, wd // phases, phases), phase_value,
                                  name="col2im")  # fmt: skip
            return te.compute((n, c, h, wd), value, name="col2im")

        if phases > 1:
            dx = self._emit_te(col2im, [cols], "col2im", phases=phases)
            return op.reshape(dx, dx_shape)
        return self._emit_te(col2im, [cols], "col2im")


def _schedule(func: tirx.PrimFunc, vectorize: bool, phases: int = 1) -> tirx.PrimFunc:
    """Threads over the outer loops, SIMD over the innermost output dim (contiguous reads of
    the image rows for stride 1); a reduction's taps go between them. ``phases`` > 1: the
    last output dim is a row's phase modulo a stride, unrolled inside the loop along the row,
    whose stores LLVM vectorizes as interleaved groups."""
    sch = s_tir.Schedule(func)
    (block,) = sch.get_child_blocks(sch.get_sblock("root"))
    loops = sch.get_loops(block)
    spatial = [v for v in sch.get(block).iter_vars if v.iter_type == tirx.IterVar.DataPar]
    rows = len(spatial) - (2 if phases > 1 else 1)  # the loops over whole rows
    outer, inner, taps = loops[:rows], loops[rows : len(spatial)], loops[len(spatial) :]
    if taps or phases > 1:
        sch.reorder(*outer, *taps, *inner)
    sch.parallel(sch.fuse(*outer))
    target = Target.current(allow_none=True)
    if phases > 1:  # (along the row, phase): LLVM vectorizes the row
        sch.unroll(inner[1])
    elif vectorize and target is not None and target.kind.name == "llvm":
        dtype = sch.get(block).writes[0].source.dtype
        _vectorize_unrolled(sch, inner[0], _vector_lanes(target, dtype))
    elif vectorize:
        sch.vectorize(inner[0])
    if taps:
        sch.decompose_reduction(block, taps[0])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


_GPU_TILE = 64  # rows and columns of a matmul's output a GPU thread block computes, about
_GPU_BLOCKS = 512  # thread blocks that keep a GPU's multiprocessors busy (132 on an H100)
_MIN_DEPTH = 1024  # the shortest slice of a matmul's K worth a launch of its own


def _k_splits(rows: int, cols: int, depth: int) -> int:
    """Slices of a weight gradient's reduction (``depth``, the batch's output pixels) on a GPU:
    its product is a small matrix (``rows x cols``: channels out x taps) over a long K
    (ResNet-50's first convolution at batch 64: 64 x 147 over 802,816), which dlight's matmul
    runs in a few thread blocks, each along all of K. Split, it runs as a batch of products
    over slices of K, summed: enough blocks for the GPU, each slice at least
    :data:`_MIN_DEPTH` long; the largest divisor of ``depth`` within both."""
    blocks = -(-rows // _GPU_TILE) * -(-cols // _GPU_TILE)
    most = min(depth // _MIN_DEPTH, _GPU_BLOCKS // blocks)
    return max((k for k in range(1, most + 1) if depth % k == 0), default=1)


class _Params:
    """Strides, dilation and padding (top, left, bottom, right) of a 2-D convolution."""

    def __init__(self, attrs):
        self.strides = tuple(int(v) for v in attrs.strides)
        self.dilation = tuple(int(v) for v in attrs.dilation)
        pad = [int(v) for v in attrs.padding]
        self.padding = tuple(pad * 4 if len(pad) == 1 else pad * 2 if len(pad) == 2 else pad)

    def pointwise(self, kh: int, kw: int) -> bool:
        """Whether a ``kh`` x ``kw`` kernel with these parameters reads each pixel at its own
        output position (1x1, stride 1, no padding): im2col and col2im are reshapes."""
        return (kh, kw) == (1, 1) and self.strides == (1, 1) and not any(self.padding)

    def swapped(self) -> _Params:
        """These parameters with strides and dilation exchanged: the forward convolution's,
        for its weight gradient's."""
        params = object.__new__(_Params)
        params.strides, params.dilation, params.padding = self.dilation, self.strides, self.padding
        return params


def _ints(expr) -> list[int] | None:
    """The values of a tuple of integer constants (an op's attribute argument), or None."""
    if not isinstance(expr, relax.Tuple):
        return None
    values = [getattr(field, "value", None) for field in expr.fields]
    return values if all(isinstance(v, int) for v in values) else None


def _padded(data, conv: _Params, b, ci, oy, ox, ky, kx):
    """``data[b, ci, oy * stride + ky * dilation - pad, ...]``, zero in the padding.

    Vectorized along a row, the read must be a plain ramp (a clamped index is a gather, 2x
    slower), which reads the padding's columns past either end of the row: within the buffer
    but for the first and the last row of the whole tensor. So a row in the image whose reads
    from ``-left`` to ``w - 1 + right`` stay in the buffer reads them (and selects 0 there);
    any other row reads clamped indices (:func:`relaxgrad._tir.guarded`). The branch is per
    row, not per element: the condition does not depend on the column."""
    (sh, sw), (dh, dw), (top, left) = conv.strides, conv.dilation, conv.padding[:2]
    right = conv.padding[3]
    iy, ix = oy * sh + ky * dh - top, ox * sw + kx * dw - left
    h, w = (int(v) for v in data.shape[2:])
    inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
    zero = tirx.const(0, data.dtype)
    row = _flat(data, (b, ci, iy, 0))  # the row's first element
    row_reads_in_buffer = tirx.all(iy >= 0, iy < h, row - left >= 0,
                                   row + w - 1 + right < _size(data))
    fast = tirx.Select(inside, data[b, ci, iy, ix], zero)
    return tirx.if_then_else(row_reads_in_buffer, fast,
                             guarded(data, [b, ci, iy, ix], inside))


def _flat(data: te.Tensor, indices) -> tirx.PrimExpr:
    """The row-major flat index of ``indices`` (any of them past its dimension) in ``data``."""
    dims = [int(d) for d in data.shape]
    return sum(i * math.prod(dims[d + 1:]) for d, i in enumerate(indices))


def _size(data: te.Tensor) -> int:
    return math.prod(int(d) for d in data.shape)


def _relu_masks(func: relax.Function, max_pool_backward: Op) -> dict:
    """``{p: t}`` for each max-pool gradient ``p`` read only by ``where(less(t, 0), 0, p)``
    (``relu``'s gradient, zeros as scalar constants, bound to a dataflow var), ``t`` a
    parameter or bound before ``p``, in a dataflow block of ``func``."""
    values, reads = bound_values(func), read_counts(func)
    position = {var: i for i, var in enumerate(values)}
    masks = {}
    for var, value in values.items():
        if not (isinstance(var, relax.DataflowVar) and is_op(value, Op.get("relax.where"))):
            continue
        cond, zero, p = value.args
        cond = values.get(cond, cond)
        if not (is_op(cond, Op.get("relax.less")) and _is_zero(cond.args[1]) and _is_zero(zero)):
            continue
        t = cond.args[0]
        if not (reads.get(p) == 1 and is_op(values.get(p), max_pool_backward)):
            continue
        if static_shape(t) == static_shape(p) and position.get(t, -1) < position[p]:
            masks[p] = t
    return masks


def _is_zero(expr) -> bool:
    return (
        isinstance(expr, _ty.Constant)
        and expr.value.numpy().size == 1
        and float(expr.value.numpy().reshape(())) == 0.0
    )
