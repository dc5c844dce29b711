import numpy as np
import pytest
from tvm import tirx
from tvm.relax import op

from relaxgrad import GradientError

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
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


@pytest.mark.parametrize("pool", [MAX, AVG], ids=["max_pool2d", "avg_pool2d"])
def test_pool_dilation_has_no_rule(pool):
    case = Case("dilated", **_pool(pool, (1, 2, 6, 6), pool_size=2, dilation=2))
    with pytest.raises(GradientError, match=r"relax.nn.\w+_pool2d .*dilation \(2, 2\)"):
        run_case(case)


def test_conv2d_packed_layout_has_no_rule():
    case = Case("packed", **_conv((1, 1, 4, 4, 4), (4, 4, 3, 3), data_layout="NCHW4c"))
    with pytest.raises(GradientError, match="relax.nn.conv2d .*layout NCHW4c"):
        run_case(case)


def test_conv2d_symbolic_shape_has_no_rule():
    shapes = [(tirx.Var("n", "int64"), 2, 5, 5), (3, 2, 3, 3)]
    values = [(1, 2, 5, 5), (3, 2, 3, 3)]
    case = Case("symbolic", lambda x, w: op.sum(op.nn.conv2d(x, w)), shapes,
                inputs=lambda rng: [rng.uniform(-1, 1, v) for v in values])
    with pytest.raises(GradientError, match="relax.nn.conv2d .*symbolic shapes"):
        run_case(case)
