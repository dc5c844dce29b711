import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.relax import op

import relaxgrad
from relaxgrad import GradientError
from relaxgrad.testing import FAST_LLVM

from ._spec import Case, ids, run_case


def _probs(rng):
    logits = rng.uniform(-1, 1, (3, 5)).astype("float64")
    label = rng.dirichlet(np.ones(5), 3).astype("float64")
    return [logits, label]


CASES = [
    Case("softmax", op.nn.softmax, [(3, 5)]),
    Case("softmax_axis0", lambda x: op.nn.softmax(x, 0), [(3, 5)]),
    Case("log_softmax", op.nn.log_softmax, [(3, 5)]),
    Case("log_softmax_axis0", lambda x: op.nn.log_softmax(x, 0), [(3, 5)]),
    Case("log_softmax_middle_axis", lambda x: op.nn.log_softmax(x, 1), [(2, 3, 4)]),
    Case("log_softmax_negative_axis", lambda x: op.nn.log_softmax(x, -2), [(2, 3, 4)]),
    Case("log_softmax_float32", lambda x: op.nn.log_softmax(x, 0), [(3, 5)], dtype="float32"),
    Case("softmax_negative_axis", lambda x: op.nn.softmax(x, -3), [(2, 3, 4)]),
    Case("cross_entropy_with_logits", op.nn.cross_entropy_with_logits, [(3, 5), (3, 5)],
         inputs=_probs),
    Case("cross_entropy_with_logits_1d", op.nn.cross_entropy_with_logits, [(5,), (5,)]),
]



def _nll(pred_shape, targets, weighted=False, dtype="float64"):
    """A Case's ``shapes``/``dtype``/``inputs``/``wrt`` for nll_loss with fixed ``targets``."""
    targets = np.asarray(targets, "int64")
    num_classes = pred_shape[0 if len(pred_shape) == 1 else 1]
    shapes = [pred_shape, targets.shape] + [(num_classes,)] * weighted

    def inputs(rng):
        pred = rng.uniform(-1, 1, pred_shape).astype(dtype)
        return [pred, targets] + [rng.uniform(0.5, 1.5, num_classes).astype(dtype)] * weighted

    return {"shapes": shapes, "dtype": (dtype, "int64", dtype), "inputs": inputs,
            "wrt": [0, 2] if weighted else [0]}


# Class 1 appears twice; with ignore_index=1 those positions drop out.
TARGETS = [1, 3, 1, 0]
CASES += [
    Case(f"nll_loss_{reduction}", lambda p, t, r=reduction: op.nn.nll_loss(p, t, reduction=r),
         **_nll((4, 5), TARGETS))
    for reduction in ("mean", "sum", "none")
]
CASES += [
    Case(f"nll_loss_weighted_{reduction}",
         lambda p, t, w, r=reduction: op.nn.nll_loss(p, t, w, reduction=r),
         **_nll((4, 5), TARGETS, weighted=True))
    for reduction in ("mean", "sum", "none")
]
CASES += [
    Case(f"nll_loss_ignore_index_{reduction}",
         lambda p, t, w, r=reduction: op.nn.nll_loss(p, t, w, reduction=r, ignore_index=1),
         **_nll((4, 5), TARGETS, weighted=True))
    for reduction in ("mean", "sum", "none")
]
# The default ignore_index -100 is out of the classes: TVM's kernel would read weights[-100].
CASES += [
    Case(f"nll_loss_ignored_target_{reduction}",
         lambda p, t, w, r=reduction: op.nn.nll_loss(p, t, w, reduction=r),
         **_nll((4, 5), [1, -100, 0, 1], weighted=True))
    for reduction in ("mean", "sum", "none")
]
CASES += [
    Case("nll_loss_ignored_target_unweighted", lambda p, t: op.nn.nll_loss(p, t),
         **_nll((4, 5), [1, -100, 0, 1])),
    Case("nll_loss_ignore_index_unweighted",
         lambda p, t: op.nn.nll_loss(p, t, ignore_index=1), **_nll((4, 5), TARGETS)),
    Case("nll_loss_no_batch", lambda p, t, w: op.nn.nll_loss(p, t, w), **_nll((5,), 2, True)),
    Case("nll_loss_no_batch_sum", lambda p, t, w: op.nn.nll_loss(p, t, w, "sum"),
         **_nll((5,), 2, True)),
    Case("nll_loss_spatial", lambda p, t, w: op.nn.nll_loss(p, t, w),
         **_nll((2, 3, 4), [[0, 2, 2, 1], [1, 1, 0, 2]], True)),
    Case("nll_loss_spatial_none", lambda p, t, w: op.nn.nll_loss(p, t, w, "none"),
         **_nll((2, 3, 4), [[0, 2, 2, 1], [1, 1, 0, 2]], True)),
    Case("nll_loss_float32", lambda p, t, w: op.nn.nll_loss(p, t, w),
         **_nll((4, 5), TARGETS, True, "float32")),
]


def _conv(x_shape, w_shape, **attrs):
    return {"fn": lambda x, w: op.nn.conv2d(x, w, **attrs), "shapes": [x_shape, w_shape]}


CASES += [
    Case("conv2d", **_conv((2, 3, 5, 5), (4, 3, 3, 3))),
    Case("conv2d_strides", **_conv((1, 2, 7, 7), (3, 2, 3, 3), strides=2)),
    # 6 rows, kernel 3, stride 2: the last row is never read (output_padding 1, crop of dw)
    Case("conv2d_strides_remainder", **_conv((1, 2, 6, 6), (3, 2, 3, 3), strides=2)),
    Case("conv2d_padding", **_conv((1, 2, 4, 4), (3, 2, 3, 3), padding=1)),
    Case("conv2d_asymmetric", **_conv((1, 2, 5, 4), (2, 2, 2, 3), strides=(2, 1),
                                      padding=(1, 0, 2, 1))),
    Case("conv2d_dilation", **_conv((1, 2, 7, 7), (3, 2, 3, 3), dilation=2)),
    Case("conv2d_dilation_strides", **_conv((1, 2, 8, 7), (2, 2, 2, 3), strides=2,
                                            dilation=(2, 1), padding=1)),
    Case("conv2d_groups", **_conv((2, 4, 5, 5), (6, 2, 3, 3), groups=2)),
    Case("conv2d_depthwise", **_conv((1, 3, 5, 5), (3, 1, 3, 3), groups=3, padding=1)),
    Case("conv2d_groups_strides_dilation", **_conv((2, 4, 7, 7), (4, 2, 2, 2), groups=2,
                                                   strides=2, dilation=2)),
    Case("conv2d_nhwc", **_conv((2, 5, 5, 3), (3, 3, 3, 4), data_layout="NHWC",
                                kernel_layout="HWIO")),
    Case("conv2d_nhwc_ohwi_strides", **_conv((1, 6, 6, 2), (3, 3, 3, 2), data_layout="NHWC",
                                             kernel_layout="OHWI", strides=2, padding=1)),
    Case("conv2d_float32", **_conv((1, 2, 5, 5), (3, 2, 3, 3), padding=1), dtype="float32"),
    Case("conv2d_out_dtype", **_conv((1, 2, 5, 5), (3, 2, 3, 3), out_dtype="float64"),
         dtype="float32"),
]


def _conv_nd(conv, x_shape, w_shape, **attrs):
    return {"fn": lambda x, w: conv(x, w, **attrs), "shapes": [x_shape, w_shape]}


C1, C3 = op.nn.conv1d, op.nn.conv3d
CT1, CT2, CT3 = op.nn.conv1d_transpose, op.nn.conv2d_transpose, op.nn.conv3d_transpose
CASES += [
    Case("conv1d", **_conv_nd(C1, (2, 3, 7), (4, 3, 3))),
    Case("conv1d_strides_padding", **_conv_nd(C1, (1, 2, 8), (3, 2, 3), strides=2,
                                              padding=(1, 2))),
    Case("conv1d_dilation_groups", **_conv_nd(C1, (1, 4, 9), (6, 2, 2), dilation=3, groups=2)),
    Case("conv1d_nwc", **_conv_nd(C1, (2, 7, 3), (3, 3, 4), data_layout="NWC",
                                  kernel_layout="WIO")),
    Case("conv1d_float32", **_conv_nd(C1, (1, 2, 6), (3, 2, 3), padding=1), dtype="float32"),
    Case("conv3d", **_conv_nd(C3, (1, 2, 4, 4, 4), (3, 2, 2, 2, 2))),
    Case("conv3d_strides_padding_dilation", **_conv_nd(C3, (1, 2, 5, 5, 4), (2, 2, 2, 2, 2),
                                                       strides=(2, 1, 2), padding=1,
                                                       dilation=(1, 2, 1))),
    Case("conv3d_groups", **_conv_nd(C3, (1, 4, 3, 3, 3), (4, 2, 2, 2, 2), groups=2)),
    Case("conv3d_ndhwc", **_conv_nd(C3, (1, 3, 3, 3, 2), (2, 2, 2, 2, 3), data_layout="NDHWC",
                                    kernel_layout="DHWIO")),
    Case("conv1d_transpose", **_conv_nd(CT1, (1, 3, 5), (3, 2, 3))),
    Case("conv1d_transpose_strides", **_conv_nd(CT1, (2, 2, 4), (2, 3, 3), strides=2,
                                                padding=1, output_padding=1)),
    Case("conv2d_transpose", **_conv_nd(CT2, (2, 3, 4, 4), (3, 2, 3, 3))),
    Case("conv2d_transpose_strides_padding", **_conv_nd(CT2, (1, 2, 4, 3), (2, 3, 3, 2),
                                                        strides=2, padding=(1, 0, 1, 1))),
    Case("conv2d_transpose_output_padding", **_conv_nd(CT2, (1, 2, 3, 3), (2, 2, 3, 3),
                                                       strides=(2, 3), output_padding=(1, 2))),
    Case("conv2d_transpose_dilation", **_conv_nd(CT2, (1, 2, 3, 3), (2, 2, 2, 2), dilation=2)),
    Case("conv2d_transpose_groups", **_conv_nd(CT2, (1, 4, 3, 3), (4, 3, 2, 2), groups=2,
                                               strides=2)),
    Case("conv2d_transpose_float32", **_conv_nd(CT2, (1, 2, 3, 3), (2, 3, 3, 3), strides=2),
         dtype="float32"),
    Case("conv3d_transpose", **_conv_nd(CT3, (1, 2, 2, 3, 2), (2, 2, 2, 2, 2), strides=2)),
    Case("conv2d_float16", **_conv((1, 2, 5, 5), (3, 2, 3, 3), padding=1), dtype="float16"),
]


LN, RMS, GN, IN = op.nn.layer_norm, op.nn.rms_norm, op.nn.group_norm, op.nn.instance_norm
# TVM's norm kernels compute in float32 (layer/group/instance_norm accept no float64): checked in
# float32, and in float64 with a step and tolerance for float32 arithmetic where it is accepted.
F32, F64_IN_F32 = {"dtype": "float32"}, {"eps": 1e-3, "tol": 1e-4}
CASES += [
    Case("layer_norm", lambda x, g, b: LN(x, g, b, -1), [(3, 5), (5,), (5,)], **F32),
    Case("layer_norm_two_axes", lambda x, g, b: LN(x, g, b, [1, 2], 1e-3),
         [(2, 3, 4), (3, 4), (3, 4)], **F32),
    Case("layer_norm_leading_axis", lambda x, g, b: LN(x, g, b, [0]), [(4, 3), (4,), (4,)],
         **F32),
    Case("layer_norm_float16", lambda x, g, b: LN(x, g, b, -1), [(3, 8), (8,), (8,)],
         dtype="float16"),
    Case("rms_norm", lambda x, w: RMS(x, w), [(3, 5), (5,)], **F64_IN_F32),
    Case("rms_norm_axes", lambda x, w: RMS(x, w, [1, -1], 1e-3), [(2, 3, 4), (3, 4)],
         **F64_IN_F32),
    Case("rms_norm_float32", lambda x, w: RMS(x, w), [(3, 5), (5,)], **F32),
    Case("rms_norm_float16", lambda x, w: RMS(x, w), [(3, 8), (8,)], dtype="float16"),
    Case("group_norm", lambda x, g, b: GN(x, g, b, 2, 1, [2, 3]), [(2, 4, 3, 3), (4,), (4,)],
         **F32),
    Case("group_norm_channels_last", lambda x, g, b: GN(x, g, b, 3, -1, [1]),
         [(2, 4, 6), (6,), (6,)], **F32),
    Case("group_norm_one_group", lambda x, g, b: GN(x, g, b, 1, 1, [2], 1e-3),
         [(2, 3, 4), (3,), (3,)], **F32),
    Case("group_norm_float16", lambda x, g, b: GN(x, g, b, 2, 1, [2]), [(2, 4, 4), (4,), (4,)],
         dtype="float16"),
    Case("instance_norm", lambda x, g, b: IN(x, g, b, 1, [2, 3]), [(2, 3, 3, 4), (3,), (3,)],
         **F32),
    Case("instance_norm_channels_last", lambda x, g, b: IN(x, g, b, 2, [1]),
         [(2, 5, 3), (3,), (3,)], **F32),
]


def _bn(field=0, x_shape=(4, 3), axis=1, dtype="float64", **attrs):
    """A Case's ``fn``/``shapes``/``inputs`` for field ``field`` (all fields: None) of
    batch_norm, with a positive moving variance."""
    channels = x_shape[axis]

    def fn(x, gamma, beta, mean, var):
        out = op.nn.batch_norm(x, gamma, beta, mean, var, axis, **attrs)
        return out if field is None else relax.TupleGetItem(out, field)

    def inputs(rng):
        values = [rng.uniform(-1, 1, x_shape), *rng.uniform(-1, 1, (3, channels)),
                  rng.uniform(0.5, 1.5, channels)]
        return [v.astype(dtype) for v in values]

    return {"fn": fn, "shapes": [x_shape] + [(channels,)] * 4, "inputs": inputs, "dtype": dtype}


CASES += [
    Case("batch_norm", **_bn()),
    Case("batch_norm_nchw", **_bn(x_shape=(2, 3, 2, 2))),
    Case("batch_norm_channels_last", **_bn(x_shape=(2, 2, 3), axis=2, epsilon=1e-3)),
    Case("batch_norm_all_outputs", **_bn(None, momentum=0.3)),
    Case("batch_norm_new_mean_only", **_bn(1)),
    Case("batch_norm_new_var_only", **_bn(2, x_shape=(3, 2, 2))),
    Case("batch_norm_no_center_scale", **_bn(center=False, scale=False)),
    Case("batch_norm_inference", **_bn(training=False)),
    Case("batch_norm_inference_all_outputs", **_bn(None, x_shape=(2, 3, 2), training=False)),
    Case("batch_norm_inference_no_scale", **_bn(x_shape=(2, 3, 2), training=False, scale=False)),
    Case("batch_norm_float32", **_bn(x_shape=(2, 3, 2, 2), dtype="float32")),
]


CASES += [
    Case("prelu", lambda x, a: op.nn.prelu(x, a), [(2, 3, 4), (3,)]),
    Case("prelu_last_axis", lambda x, a: op.nn.prelu(x, a, -1), [(2, 3, 4), (4,)]),
    Case("prelu_shared_alpha", lambda x, a: op.nn.prelu(x, a), [(2, 3, 4), (1,)]),
    Case("prelu_float32", lambda x, a: op.nn.prelu(x, a), [(2, 3, 4), (3,)], dtype="float32"),
    Case("pad", lambda x: op.nn.pad(x, [0, 0, 1, 2]), [(3, 4)]),
    Case("pad_value_all_axes", lambda x: op.nn.pad(x, [2, 1, 0, 3, 1, 1], pad_value=0.5),
         [(2, 3, 2)]),
    Case("pad_float16", lambda x: op.nn.pad(x, [1, 1, 2, 0]), [(3, 4)], dtype="float16"),
]
CASES += [
    Case(f"pad_{mode}", lambda x, m=mode: op.nn.pad(x, [0, 0, 1, 2, 3, 1], m), [(2, 3, 4)])
    for mode in ("reflect", "replicate", "circular")
]
CASES += [
    Case("pad_reflect_widest", lambda x: op.nn.pad(x, [3, 3], "reflect"), [(4,)]),
    Case("pad_circular_whole", lambda x: op.nn.pad(x, [0, 0, 4, 4], "circular"), [(2, 4)]),
    Case("pad_replicate_float32", lambda x: op.nn.pad(x, [2, 0, 0, 3], "replicate"), [(3, 4)],
         dtype="float32"),
]

AAP1, AAP2, AAP3 = op.nn.adaptive_avg_pool1d, op.nn.adaptive_avg_pool2d, op.nn.adaptive_avg_pool3d
CASES += [
    Case("adaptive_avg_pool2d", lambda x: AAP2(x, (2, 3)), [(2, 3, 5, 7)]),
    Case("adaptive_avg_pool2d_global", lambda x: AAP2(x, 1), [(2, 3, 4, 4)]),
    Case("adaptive_avg_pool2d_upsample", lambda x: AAP2(x, (5, 3)), [(1, 2, 3, 3)]),
    Case("adaptive_avg_pool2d_same", lambda x: AAP2(x), [(1, 2, 3, 4)]),
    Case("adaptive_avg_pool2d_nhwc", lambda x: AAP2(x, (2, 2), "NHWC"), [(1, 5, 4, 3)]),
    Case("adaptive_avg_pool2d_float32", lambda x: AAP2(x, (3, 2)), [(1, 2, 7, 5)],
         dtype="float32"),
    Case("adaptive_avg_pool1d", lambda x: AAP1(x, 3), [(2, 3, 7)]),
    Case("adaptive_avg_pool3d", lambda x: AAP3(x, (2, 1, 3)), [(1, 2, 3, 4, 5)]),
]


def _attention(shape_q, shape_kv, heads_dim_v=None, bias_shape=None, **attrs):
    """A Case's ``fn``/``shapes`` for attention of BSHD q and k/v (and a bias)."""
    b, t, h, d = shape_kv
    shapes = [shape_q, shape_kv, (b, t, h, heads_dim_v or d)] + ([bias_shape] if bias_shape else [])

    def fn(q, k, v, *bias):
        return op.nn.attention(q, k, v, bias[0] if bias else None, **attrs)

    return {"fn": fn, "shapes": shapes}


CASES += [
    Case("attention", **_attention((2, 3, 2, 4), (2, 3, 2, 4))),
    Case("attention_cross_scale", **_attention((1, 2, 2, 3), (1, 4, 2, 3), 5, scale=0.3)),
    Case("attention_causal", **_attention((1, 4, 2, 3), (1, 4, 2, 3), causal_mask="TopLeft")),
    Case("attention_causal_bottom_right", **_attention((1, 2, 1, 3), (1, 4, 1, 3),
                                                       causal_mask="BottomRight")),
    Case("attention_causal_top_left_longer_q", **_attention((1, 4, 1, 3), (1, 2, 1, 3),
                                                            causal_mask="TopLeft")),
    Case("attention_bias", **_attention((2, 3, 2, 4), (2, 5, 2, 4), bias_shape=(2, 2, 3, 5))),
    Case("attention_bias_broadcast", **_attention((2, 3, 2, 4), (2, 5, 2, 4),
                                                  bias_shape=(1, 2, 1, 5))),
    Case("attention_float32", **_attention((1, 3, 2, 4), (1, 3, 2, 4), causal_mask="TopLeft"),
         dtype="float32"),
    Case("attention_float16", **_attention((1, 3, 2, 4), (1, 3, 2, 4)), dtype="float16"),
]


def _pool(pool, x_shape, **attrs):
    return {"fn": lambda x: pool(x, **attrs), "shapes": [x_shape]}


MAX, AVG = op.nn.max_pool2d, op.nn.avg_pool2d
CASES += [
    Case("max_pool2d", **_pool(MAX, (2, 3, 4, 4), pool_size=2, strides=2)),
    Case("max_pool2d_overlapping", **_pool(MAX, (1, 2, 5, 5), pool_size=3, strides=1)),
    Case("max_pool2d_padding", **_pool(MAX, (1, 2, 5, 5), pool_size=3, strides=2, padding=1)),
    Case("max_pool2d_ceil_mode", **_pool(MAX, (1, 2, 5, 5), pool_size=2, strides=2,
                                         ceil_mode=True)),
    Case("max_pool2d_nhwc", **_pool(MAX, (1, 4, 4, 3), pool_size=2, strides=2, layout="NHWC")),
    Case("max_pool2d_float32", **_pool(MAX, (1, 2, 4, 4), pool_size=2, strides=2),
         dtype="float32"),
    # Overlapping windows: computed by relaxgrad (TVM 0.27's max_pool2d_backward returns
    # garbage there, e.g. for a (1, 1, 4, 2) input, pool 2, stride 1).
    Case("max_pool2d_overlapping_4x2", **_pool(MAX, (1, 1, 4, 2), pool_size=2, strides=1)),
    Case("max_pool2d_overlapping_3x2", **_pool(MAX, (1, 1, 3, 2), pool_size=2, strides=1)),
    Case("max_pool2d_overlapping_4x4", **_pool(MAX, (2, 2, 4, 4), pool_size=2, strides=1)),
    Case("max_pool2d_overlapping_rect", **_pool(MAX, (1, 2, 5, 4), pool_size=(3, 2),
                                                strides=(1, 2))),
    Case("max_pool2d_overlapping_padding_ceil", **_pool(MAX, (1, 2, 6, 6), pool_size=3,
                                                        strides=2, padding=1, ceil_mode=True)),
    Case("max_pool2d_overlapping_asym_padding", **_pool(MAX, (1, 1, 5, 6), pool_size=3,
                                                        strides=2, padding=(1, 0, 0, 1))),
    Case("max_pool2d_overlapping_nhwc", **_pool(MAX, (1, 5, 5, 2), pool_size=3, strides=2,
                                                layout="NHWC")),
    Case("max_pool2d_overlapping_float32", **_pool(MAX, (1, 2, 5, 5), pool_size=3, strides=1),
         dtype="float32"),
    Case("avg_pool2d", **_pool(AVG, (2, 3, 4, 4), pool_size=2, strides=2)),
    Case("avg_pool2d_overlapping", **_pool(AVG, (1, 2, 5, 5), pool_size=3, strides=1)),
    Case("avg_pool2d_padding", **_pool(AVG, (1, 2, 5, 5), pool_size=3, strides=2, padding=1)),
    Case("avg_pool2d_count_include_pad", **_pool(AVG, (1, 2, 5, 5), pool_size=3, strides=2,
                                                 padding=1, count_include_pad=True)),
    Case("avg_pool2d_ceil_mode", **_pool(AVG, (1, 2, 5, 5), pool_size=2, strides=2,
                                         ceil_mode=True)),
    Case("avg_pool2d_nhwc", **_pool(AVG, (1, 4, 4, 3), pool_size=2, strides=2, layout="NHWC")),
    Case("avg_pool2d_float32", **_pool(AVG, (1, 2, 4, 4), pool_size=2, strides=2),
         dtype="float32"),
    # ceil_mode with count_include_pad: computed by relaxgrad (TVM 0.27's avg_pool2d_backward
    # disagrees with the forward when the last window hangs past the padding; the forward
    # divides by the window's positions inside the padded input).
    Case("avg_pool2d_ceil_include_pad", **_pool(AVG, (1, 1, 3, 3), pool_size=2, strides=2,
                                                ceil_mode=True, count_include_pad=True)),
    Case("avg_pool2d_ceil_include_pad_overlapping", **_pool(AVG, (1, 2, 4, 3), pool_size=3,
                                                            strides=2, ceil_mode=True,
                                                            count_include_pad=True)),
    Case("avg_pool2d_ceil_include_pad_padding", **_pool(AVG, (1, 2, 6, 6), pool_size=3,
                                                        strides=2, padding=1, ceil_mode=True,
                                                        count_include_pad=True)),
    Case("avg_pool2d_ceil_include_pad_rect", **_pool(AVG, (1, 1, 5, 6), pool_size=(3, 2),
                                                     strides=(2, 3), padding=(1, 0, 0, 1),
                                                     ceil_mode=True, count_include_pad=True)),
    Case("avg_pool2d_ceil_include_pad_nhwc", **_pool(AVG, (1, 5, 5, 2), pool_size=2, strides=2,
                                                     ceil_mode=True, count_include_pad=True,
                                                     layout="NHWC")),
    # a window larger than the input (EfficientNet's last pool: kernel = channels, input 1x1 or
    # 2x2), one matmul per axis rather than one pad per window offset
    Case("avg_pool2d_ceil_include_pad_window_past_input",
         **_pool(AVG, (2, 3, 2, 3), pool_size=16, strides=16, ceil_mode=True,
                 count_include_pad=True)),
    Case("avg_pool2d_ceil_include_pad_float32", **_pool(AVG, (1, 2, 5, 5), pool_size=2,
                                                        strides=2, ceil_mode=True,
                                                        count_include_pad=True),
         dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def test_max_pool2d_overlapping_ties_go_to_the_first_argmax():
    # Equal values: each window's gradient goes to its first position (row-major), as TVM's
    # kernels break ties. Overlapping windows (pool 2, stride 1) take relaxgrad's own VJP.
    x = relax.Var("x", relax.TensorType((1, 1, 3, 4), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op.sum(MAX(x, pool_size=2, strides=1)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target=FAST_LLVM), tvm.cpu())
    _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(np.ones((1, 1, 3, 4))))
    expected = np.zeros((3, 4))
    expected[:2, :3] = 1  # the top-left corners of the 2 x 3 windows
    np.testing.assert_array_equal(grad.numpy()[0, 0], expected)


@pytest.mark.parametrize("pool", [MAX, AVG], ids=["max_pool2d", "avg_pool2d"])
def test_pool_dilation_has_no_rule(pool):
    case = Case("dilated", **_pool(pool, (1, 2, 6, 6), pool_size=2, dilation=2))
    with pytest.raises(GradientError, match=r"relax.nn.\w+_pool2d .*dilation \(2, 2\)"):
        run_case(case)


@pytest.mark.parametrize("flag", ["center", "scale"])
def test_layer_norm_center_scale_off_has_no_rule(flag):
    case = Case("off", lambda x, g, b: LN(x, g, b, -1, **{flag: False}), [(3, 5), (5,), (5,)])
    with pytest.raises(GradientError, match="relax.nn.layer_norm .*center=False or scale=False"):
        run_case(case)


def test_layer_norm_axes_out_of_order_have_no_rule():
    case = Case("unsorted", lambda x, g, b: LN(x, g, b, [2, 1]), [(2, 3, 4), (4, 3), (4, 3)],
                dtype="float32")
    with pytest.raises(GradientError, match="relax.nn.layer_norm .*axes out of order"):
        run_case(case)


def test_attention_sliding_window_has_no_rule():
    case = Case("window", **_attention((1, 4, 1, 2), (1, 4, 1, 2), window_size=2))
    with pytest.raises(GradientError, match="relax.nn.attention .*window_size=2"):
        run_case(case)


@pytest.mark.parametrize("mode, widths", [("constant", [-1, 0]), ("reflect", [0, 4]),
                                          ("circular", [5, 0])])
def test_pad_out_of_range_has_no_rule(mode, widths):
    case = Case("pad", lambda x: op.nn.pad(x, widths, mode), [(4,)])
    with pytest.raises(GradientError, match=f"relax.nn.pad .*pad_mode='{mode}'"):
        run_case(case)


def test_conv2d_packed_layout_has_no_rule():
    case = Case("packed", **_conv((1, 1, 4, 4, 4), (4, 4, 3, 3), data_layout="NCHW4c"))
    with pytest.raises(GradientError, match="relax.nn.conv2d .*layout NCHW4c"):
        run_case(case)


def test_conv2d_symbolic_spatial_dim_has_no_rule():
    # a symbolic batch is fine (tests/ops/test_symbolic.py); a symbolic height is not
    shapes = [(1, 2, tirx.Var("h", "int64"), 5), (3, 2, 3, 3)]
    values = [(1, 2, 5, 5), (3, 2, 3, 3)]
    case = Case("symbolic", lambda x, w: op.sum(op.nn.conv2d(x, w)), shapes,
                inputs=lambda rng: [rng.uniform(-1, 1, v) for v in values])
    with pytest.raises(GradientError, match=r"relax.nn.conv2d .*symbolic dims on axes \[2\]"):
        run_case(case)
