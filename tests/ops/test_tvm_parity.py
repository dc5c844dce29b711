"""relaxgrad's rules against TVM's own, on one simple case of each op TVM differentiates.

Both passes run on the same module and their ``main_adjoint`` functions must be structurally
equal, so relaxgrad is a drop-in replacement for TVM's ``relax.transform.Gradient`` on the ops
TVM covers. ``FIXES`` lists the cases where relaxgrad deliberately differs, each with the reason;
the numeric op tests check that relaxgrad's gradients there are right.
"""

import pytest
import tvm
from tvm import relax, tirx
from tvm.ir import Op
from tvm.relax import op

import relaxgrad
from relaxgrad.testing import loss_module

from ._spec import Case, ids

F32 = "float32"


def _where(cmp):
    return lambda x, y: op.where(cmp(x, y), x, y)


def _two():
    return relax.const(2.0, F32)


# One simple case per op with a TVM gradient; the id is the op name.
CASES = [
    Case("relax.add", op.add, [(3, 4), (4,)], F32),
    Case("relax.subtract", op.subtract, [(3, 4), (3, 4)], F32),
    Case("relax.multiply", op.multiply, [(3, 4), (3, 1)], F32),
    Case("relax.divide", op.divide, [(3, 4), (3, 4)], F32),
    Case("relax.power", op.power, [(3, 4), (3, 4)], F32),
    Case("relax.maximum", op.maximum, [(3, 4), (3, 4)], F32),
    Case("relax.minimum", op.minimum, [(3, 4), (4,)], F32),
    Case("relax.equal", _where(op.equal), [(3, 4), (3, 4)], F32),
    Case("relax.not_equal", _where(op.not_equal), [(3, 4), (3, 4)], F32),
    Case("relax.greater", _where(op.greater), [(3, 4), (3, 4)], F32),
    Case("relax.greater_equal", _where(op.greater_equal), [(3, 4), (3, 4)], F32),
    Case("relax.less", _where(op.less), [(3, 4), (3, 4)], F32),
    Case("relax.less_equal", _where(op.less_equal), [(3, 4), (3, 4)], F32),
    Case("relax.zeros_like", lambda x: x * x + op.zeros_like(x), [(3, 4)], F32),
    Case("relax.ones_like", lambda x: x * op.ones_like(x), [(3, 4)], F32),
    Case("relax.full_like", lambda x: x * op.full_like(x, _two()), [(3, 4)], F32),
    Case("relax.zeros", lambda x: x + op.zeros((3, 4), F32), [(3, 4)], F32),
    Case("relax.ones", lambda x: x * op.ones((3, 4), F32), [(3, 4)], F32),
    Case("relax.full", lambda x: x * op.full((3, 4), _two()), [(3, 4)], F32),
    Case("relax.abs", op.abs, [(3, 4)], F32),
    Case("relax.cos", op.cos, [(3, 4)], F32),
    Case("relax.exp", op.exp, [(3, 4)], F32),
    Case("relax.log", op.log, [(3, 4)], F32),
    Case("relax.negative", op.negative, [(3, 4)], F32),
    Case("relax.sigmoid", op.sigmoid, [(3, 4)], F32),
    Case("relax.sin", op.sin, [(3, 4)], F32),
    Case("relax.sqrt", op.sqrt, [(3, 4)], F32),
    Case("relax.tanh", op.tanh, [(3, 4)], F32),
    Case("relax.sum", lambda x: op.sum(x, 1), [(3, 4)], F32),
    Case("relax.mean", lambda x: op.mean(x, [0, 2], keepdims=True), [(2, 3, 4)], F32),
    Case("relax.variance", lambda x: op.variance(x, 1), [(3, 4)], F32),
    Case("relax.permute_dims", lambda x: op.permute_dims(x, [1, 2, 0]), [(2, 3, 4)], F32),
    Case("relax.concat", lambda x, y: op.concat([x, y], 1), [(2, 3), (2, 4)], F32),
    Case("relax.split", lambda x: op.split(x, 2, 1), [(3, 4)], F32),
    Case("relax.expand_dims", lambda x: op.expand_dims(x, [0, -1]), [(3, 4)], F32),
    Case("relax.reshape", lambda x: op.reshape(x, (2, 6)), [(3, 4)], F32),
    Case("relax.cumsum", lambda x: op.cumsum(x, 1), [(3, 4)], F32),
    Case("relax.broadcast_to", lambda x: op.broadcast_to(x, (2, 3, 4)), [(3, 1)], F32),
    Case("relax.take", lambda x, i: op.take(x, i, 1), [(3, 4), (2,)], (F32, "int64"), wrt=[0]),
    Case("relax.where", op.where, [(3, 4), (3, 4), (3, 4)], ("bool", F32, F32)),
    Case("relax.matmul", op.matmul, [(2, 3, 4), (4, 5)], F32),
    Case("relax.astype", lambda x: op.astype(x, "float64"), [(3, 4)], F32),
    Case("relax.nn.relu", op.nn.relu, [(3, 4)], F32),
    Case("relax.nn.silu", op.nn.silu, [(3, 4)], F32),
    Case("relax.nn.softmax", op.nn.softmax, [(3, 4)], F32),
    Case("relax.nn.log_softmax", lambda x: op.nn.log_softmax(x, 0), [(3, 4)], F32),
    Case("relax.nn.cross_entropy_with_logits", op.nn.cross_entropy_with_logits,
         [(3, 4), (3, 4)], F32),
    Case("relax.nn.nll_loss", lambda p, t, w: op.nn.nll_loss(p, t, w, "sum", ignore_index=1),
         [(3, 5), (3,), (5,)], (F32, "int64", F32), wrt=[0]),
    Case("relax.nn.conv2d", lambda x, w: op.nn.conv2d(x, w, strides=2, padding=1),
         [(2, 3, 6, 6), (4, 3, 3, 3)], F32),
    Case("relax.nn.max_pool2d", lambda x: op.nn.max_pool2d(x, 2, 2), [(1, 2, 4, 4)], F32),
    Case("relax.nn.avg_pool2d", lambda x: op.nn.avg_pool2d(x, 3, 1, 1), [(1, 2, 4, 4)], F32),
]
# More variants of the ops relaxgrad got new rules for, still in TVM's simple domain.
CASES += [
    Case("zeros_like_dtype", lambda x: x * op.zeros_like(x, "float32"), [(3, 4)], F32),
    Case("mean_all", op.mean, [(3, 4)], F32),
    Case("variance_keepdims_negative", lambda x: op.variance(x, [-1], keepdims=True),
         [(2, 3, 4)], F32),
    Case("cumsum_flattened", op.cumsum, [(3, 4)], F32),
    Case("cumsum_dtype", lambda x: op.cumsum(x, 0, "float64"), [(3, 4)], F32),
    Case("take_axis0", lambda x, i: op.take(x, i, 0), [(3, 4), (5,)], (F32, "int64"), wrt=[0]),
    Case("nll_loss_none", lambda p, t: op.nn.nll_loss(p, t, reduction="none"), [(3, 5), (3,)],
         (F32, "int64"), wrt=[0]),
    Case("conv2d_groups_strides", lambda x, w: op.nn.conv2d(x, w, strides=2, groups=2),
         [(2, 4, 6, 6), (6, 2, 3, 3)], F32),
    Case("max_pool2d_nhwc_ceil", lambda x: op.nn.max_pool2d(x, 2, 2, ceil_mode=True,
                                                            layout="NHWC"), [(1, 5, 5, 2)], F32),
    Case("avg_pool2d_count_pad", lambda x: op.nn.avg_pool2d(x, 3, 2, 1, count_include_pad=True),
         [(1, 2, 5, 5)], F32),
]

N = tirx.Var("n", "int64")
# Where relaxgrad deliberately differs: (case, the error TVM's pass raises or None where it gives
# another adjoint). The comment above each says why relaxgrad's rule is the right one.
FIXES = [
    # TVM's rule returns one partial for triu's two arguments (x, k).
    (Case("relax.triu", lambda x: op.triu(x, 1), [(3, 3)], F32), tvm.error.InternalError),
    # TVM gives a Var fill value no gradient; it gets sum(g).
    (Case("full_var_fill", lambda x, v: x * op.full((3, 4), v), [(3, 4), ()], F32), None),
    # TVM casts the gradient to the integer source and walks on into argmax, which has no rule.
    (Case("astype_from_int", lambda x, y: x * op.astype(op.argmax(y, 1), F32), [(3,), (3, 4)],
          F32, wrt=[0]), tvm.error.InternalError),
    # take_backward's kernel needs a non-negative axis and 1-D indices; TVM passes them as given.
    (Case("take_negative_axis", lambda x, i: op.take(x, i, -1), [(3, 4), (2,)], (F32, "int64"),
          wrt=[0]), None),
    (Case("take_2d_indices", lambda x, i: op.take(x, i, 0), [(3, 4), (2, 2)], (F32, "int64"),
          wrt=[0]), None),
    # TVM ignores exclusive=True: its gradient adds g once too often.
    (Case("cumsum_exclusive", lambda x: op.cumsum(x, 1, exclusive=True), [(3, 4)], F32), None),
    # TVM needs static dims to count the reduced elements.
    (Case("mean_symbolic", lambda x: op.mean(x, 0), [(N, 4)], F32), TypeError),
    # TVM gives the class weights no gradient (zeros).
    (Case("nll_loss_weights", lambda p, t, w: op.nn.nll_loss(p, t, w, ignore_index=1),
          [(3, 5), (3,), (5,)], (F32, "int64", F32), wrt=[0, 2]), None),
    # With weights and an ignore_index outside the classes (the default -100), TVM's kernel
    # reads weights[-100] for a target that is ignored: the gradient comes from one-hot targets.
    (Case("nll_loss_weights_default_ignore", lambda p, t, w: op.nn.nll_loss(p, t, w),
          [(3, 5), (3,), (5,)], (F32, "int64", F32), wrt=[0]), None),
    # TVM's output_padding ignores dilation (it comes out negative here).
    (Case("conv2d_dilation", lambda x, w: op.nn.conv2d(x, w, dilation=2),
          [(1, 2, 7, 7), (3, 2, 3, 3)], F32), ValueError),
    # TVM supports only the NCHW/OIHW layouts.
    (Case("conv2d_nhwc", lambda x, w: op.nn.conv2d(x, w, data_layout="NHWC"),
          [(1, 5, 5, 2), (3, 2, 3, 3)], F32), AssertionError),
]


def _adjoint(grad_pass, case: Case):
    """``main_adjoint`` of the case's loss module under ``grad_pass`` (relaxgrad's or TVM's)."""
    mod = loss_module(case.fn, case.types())
    params = list(mod["main"].params)
    require = [params[i] for i in case.wrt] if case.wrt is not None else None
    return grad_pass("main", require)(mod)["main_adjoint"]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_matches_tvm(case):
    ours = _adjoint(relaxgrad.Gradient, case)
    tvm.ir.assert_structural_equal(ours, _adjoint(relax.transform.Gradient, case))


@pytest.mark.parametrize("case, tvm_raises", FIXES, ids=ids(c for c, _ in FIXES))
def test_deliberate_fix(case, tvm_raises):
    ours = _adjoint(relaxgrad.Gradient, case)
    if tvm_raises is not None:
        with pytest.raises(tvm_raises):
            _adjoint(relax.transform.Gradient, case)
        return
    theirs = _adjoint(relax.transform.Gradient, case)
    with pytest.raises(ValueError, match="StructuralEqual check failed"):
        tvm.ir.assert_structural_equal(ours, theirs)


def test_every_tvm_gradient_op_is_covered():
    """Each op TVM registers a gradient for has a relaxgrad rule and a case here."""
    tvm_ops = {
        name for name in Op.list_op_names() if Op.get(name).get_attr("FPrimalGradient") is not None
    }
    assert len(tvm_ops) == 52
    assert tvm_ops <= set(relaxgrad.registered_ops())
    checked = {c.id for c in CASES} | {c.id for c, _ in FIXES}
    assert tvm_ops == {name for name in checked if name.startswith("relax.")}
