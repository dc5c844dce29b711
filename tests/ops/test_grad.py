"""Rules of the ops that first-order rules emit (relax.grad.*, collapse_sum_to, ...), checked in
isolation by the table harness, and end to end: a Hessian-vector product (the gradient of
``sum(v * grad)``, the adjoint differentiated again) against finite differences of the gradient.
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op
from tvm.relax.op import grad as G

import relaxgrad
from relaxgrad import GradientError
from relaxgrad.testing import FAST_LLVM, check_gradients

from ._spec import Case, ids, run_case

F64, I64 = "float64", "int64"


def _take_backward(g_shape, x_shape, indices, axis, dtype=F64):
    indices = np.asarray(indices, I64)

    def inputs(rng):
        values = [rng.uniform(-1, 1, shape).astype(dtype) for shape in (g_shape, x_shape)]
        return values + [indices]

    return {"fn": lambda g, x, i: G.take_backward(g, x, i, axis),
            "shapes": [g_shape, x_shape, indices.shape], "dtype": (dtype, dtype, I64),
            "inputs": inputs}  # fmt: skip


CASES = [
    # Index 1 is taken twice: its gradient sums two rows.
    Case("take_backward", **_take_backward((4, 3), (5, 3), [1, 3, 1, 0], 0)),
    Case("take_backward_axis1", **_take_backward((2, 4), (2, 5), [4, 0, 0, 2], 1)),
    Case("take_backward_flat", **_take_backward((4,), (2, 3), [5, 0, 5, 2], None)),
    Case("take_backward_float32", **_take_backward((3, 2), (4, 2), [3, 3, 1], 0, "float32")),
]


def _pool_backward(kind, x_shape, ties=False, dtype=F64, **attrs):
    """``{kind}_pool2d_backward(g, x)`` with the attributes and the g shape of ``{kind}_pool2d``
    of x; with ``ties``, x holds few distinct values, so windows tie (checked wrt g only: x
    moves no gradient)."""
    pool, backward = {"max": (op.nn.max_pool2d, G.max_pool2d_backward),
                      "avg": (op.nn.avg_pool2d, G.avg_pool2d_backward)}[kind]  # fmt: skip
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    forward = relax.BlockBuilder().normalize(pool(x, **attrs))
    g_shape = tuple(int(d) for d in forward.ty.shape)
    keys = "pool_size strides padding dilation ceil_mode count_include_pad layout out_layout"
    values = [forward.attrs[key] for key in keys.split()]
    case = {"fn": lambda g, x: backward(g, x, *values), "shapes": [g_shape, x_shape]}
    if ties:
        case["inputs"] = lambda rng: [rng.uniform(-1, 1, g_shape).astype(dtype),
                                      rng.integers(0, 2, x_shape).astype(dtype)]  # fmt: skip
        case["wrt"] = [0]
    return case


MAX_ATTRS = {
    "": {"pool_size": 2, "strides": 2},
    "_overlapping": {"pool_size": 3, "strides": 1},
    "_padding": {"pool_size": 3, "strides": 2, "padding": 1},
    "_ceil_mode": {"pool_size": 2, "strides": 2, "ceil_mode": True},
    "_asymmetric": {"pool_size": (2, 3), "strides": (1, 2), "padding": (1, 0, 0, 2)},
}
CASES += [
    Case(f"{kind}_pool2d_backward{name}", **_pool_backward(kind, (2, 2, 5, 5), **attrs))
    for kind in ("max", "avg")
    for name, attrs in MAX_ATTRS.items()
]
CASES += [
    Case("max_pool2d_backward_nhwc", **_pool_backward("max", (1, 4, 4, 3), pool_size=2,
                                                      strides=2, layout="NHWC")),
    Case("max_pool2d_backward_ties", **_pool_backward("max", (1, 2, 5, 5), ties=True,
                                                      pool_size=3, strides=1)),
    Case("max_pool2d_backward_ties_padding", **_pool_backward("max", (1, 1, 4, 4), ties=True,
                                                              pool_size=2, strides=2,
                                                              padding=1)),
    Case("max_pool2d_backward_float32", **_pool_backward("max", (1, 2, 4, 4), pool_size=2,
                                                         strides=2, dtype="float32"),
         dtype="float32"),
    Case("avg_pool2d_backward_count_include_pad",
         **_pool_backward("avg", (1, 2, 5, 5), pool_size=3, strides=2, padding=1,
                          count_include_pad=True)),
    Case("avg_pool2d_backward_nhwc", **_pool_backward("avg", (1, 4, 4, 3), pool_size=2,
                                                      strides=2, layout="NHWC")),
    Case("avg_pool2d_backward_float32", **_pool_backward("avg", (1, 2, 4, 4), pool_size=2,
                                                         strides=2, dtype="float32"),
         dtype="float32"),
]


def _nll_backward(pred_shape, targets, reduction="mean", weighted=False, ignore_index=-100):
    """``nll_loss_backward(g, pred, targets[, weights])``; weights in [0.5, 1.5)."""
    targets = np.asarray(targets, I64)
    num_classes = pred_shape[0 if len(pred_shape) == 1 else 1]
    g_shape = targets.shape if reduction == "none" else ()
    shapes = [g_shape, pred_shape, targets.shape] + [(num_classes,)] * weighted

    def fn(g, pred, t, *w):
        return G.nll_loss_backward(g, pred, t, w[0] if w else None, reduction, ignore_index)

    def inputs(rng):
        values = [rng.uniform(-1, 1, g_shape), rng.uniform(-1, 1, pred_shape), targets]
        return values + [rng.uniform(0.5, 1.5, num_classes)] * weighted

    return {"fn": fn, "shapes": shapes, "dtype": (F64, F64, I64, F64), "inputs": inputs,
            "wrt": [0, 1, 3] if weighted else [0, 1]}  # fmt: skip


TARGETS = [1, 3, 1, 0]  # class 1 twice; ignore_index=1 drops both
CASES += [
    Case(f"nll_loss_backward_{reduction}{'_weighted' * weighted}",
         **_nll_backward((4, 5), TARGETS, reduction, weighted))
    for reduction in ("mean", "sum", "none")
    for weighted in (False, True)
]
CASES += [
    Case(f"nll_loss_backward_ignore_index_{reduction}",
         **_nll_backward((4, 5), TARGETS, reduction, True, ignore_index=1))
    for reduction in ("mean", "sum", "none")
]
CASES += [
    Case("nll_loss_backward_ignore_index_unweighted",
         **_nll_backward((4, 5), TARGETS, ignore_index=1)),
    # An ignored target out of the classes (the default -100) counts in no total.
    Case("nll_loss_backward_ignored_target_unweighted",
         **_nll_backward((4, 5), [1, -100, 0, 1])),
    Case("nll_loss_backward_spatial", **_nll_backward((2, 3, 4), [[0, 2, 2, 1], [1, 1, 0, 2]],
                                                      weighted=True)),
    Case("nll_loss_backward_spatial_none",
         **_nll_backward((2, 3, 4), [[0, 2, 2, 1], [1, 1, 0, 2]], "none", True)),
    Case("nll_loss_backward_no_batch", **_nll_backward((5,), 2, weighted=True)),
    Case("nll_loss_backward_no_batch_sum", **_nll_backward((5,), 2, "sum", True)),
]


CASES += [
    Case("collapse_sum_to", lambda x: op.collapse_sum_to(x, (3, 1)), [(2, 3, 4)]),
    Case("collapse_sum_to_same", lambda x: op.collapse_sum_to(x, (2, 3)), [(2, 3)]),
    Case("collapse_sum_like", op.collapse_sum_like, [(2, 3, 4), (3, 1)]),
    Case("collapse_sum_to_float32", lambda x: op.collapse_sum_to(x, (4,)), [(2, 3, 4)],
         dtype="float32"),
    Case("arange", lambda x: x * op.arange(0, 4, 1, F64), [(4,)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def _compile(mod):
    return relax.VirtualMachine(tvm.compile(mod, target=FAST_LLVM), tvm.cpu())


def test_no_grad_stops_the_gradient():
    """``no_grad(x)`` is ``x`` in value, a constant to the gradient: d sum(x * no_grad(x)) = x."""
    x = relax.Var("x", relax.TensorType((2, 3), F64))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op.sum(x * bb.emit(G.no_grad(x))))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main", [x])(bb.get())
    value = np.random.default_rng(0).uniform(-1, 1, (2, 3))
    loss, (grad,) = _compile(mod)["main_adjoint"](tvm.runtime.tensor(value))
    np.testing.assert_allclose(loss.numpy(), np.sum(value * value))
    np.testing.assert_allclose(grad.numpy(), value)


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_pool_backward_packed_layout_has_no_rule(pool):
    backward = {"max": G.max_pool2d_backward, "avg": G.avg_pool2d_backward}[pool]
    case = Case("packed", lambda g, x: backward(g, x, (2, 2), (2, 2), layout="NCHW4c"),
                [(1, 1, 2, 2, 4), (1, 1, 4, 4, 4)], wrt=[0])
    with pytest.raises(GradientError, match=rf"relax.grad.{pool}_pool2d_backward .*NCHW4c"):
        run_case(case)


# End to end: Hessian-vector products.


def _hvp_module(mod, wrt: list[int]) -> tvm.IRModule:
    """A module whose ``main(*params, *v)`` returns ``sum_i sum(v_i * grad_i)``, the gradients
    of ``mod["main"]`` wrt the params ``wrt`` computed by the inlined bindings of relaxgrad's
    adjoint; its gradient is the Hessian of ``main`` times ``v``."""
    params = list(mod["main"].params)
    adjoint = relaxgrad.Gradient("main", [params[i] for i in wrt])(mod)["main_adjoint"]
    (block,) = adjoint.body.blocks
    grads = adjoint.body.body.fields[1].fields
    vs = [relax.Var(f"v_{params[i].name}", params[i].ty) for i in wrt]
    bb = relax.BlockBuilder()
    with bb.function("main", list(adjoint.params) + vs):
        with bb.dataflow():
            for binding in block.bindings:
                bb.emit_normalized(binding)
            terms = [bb.emit(op.sum(grad * v)) for grad, v in zip(grads, vs)]
            total = terms[0]
            for term in terms[1:]:
                total = bb.emit(total + term)
            out = bb.emit_output(total)
        bb.emit_func_output(out)
    return bb.get()


def _ops_of(func) -> set[str]:
    return {str(b.value.op.name) for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}  # fmt: skip


def _embedding_pool_model(pool, weighted: bool):
    """Embedding (take) -> 2x2 pooling over (tokens, features) -> dense (+ bias) -> tanh ->
    log_softmax -> nll_loss (class-weighted with ignore_index 2 when ``weighted``)."""
    emb = relax.Var("emb", relax.TensorType((6, 4), F64))
    w = relax.Var("w", relax.TensorType((4, 3), F64))
    b = relax.Var("b", relax.TensorType((3,), F64))
    tokens = relax.Var("tokens", relax.TensorType((2, 4), I64))
    labels = relax.Var("labels", relax.TensorType((3,), I64))
    class_weights = [relax.Var("class_weights", relax.TensorType((3,), F64))] * weighted
    bb = relax.BlockBuilder()
    with bb.function("main", [emb, w, b, *class_weights, tokens, labels]):
        with bb.dataflow():
            x = bb.emit(op.reshape(op.take(emb, tokens, axis=0), (1, 2, 4, 4)))
            h = bb.emit(op.reshape(pool(x, pool_size=2, strides=2), (2, 4)))
            # rows: the two pooled sequences and their sum, so that labels has three entries
            h = bb.emit(op.concat([h, op.sum(h, 0, keepdims=True)], 0))
            z = bb.emit(op.nn.log_softmax(op.tanh(op.matmul(h, w) + b)))
            loss = op.nn.nll_loss(z, labels, *class_weights, ignore_index=2 if weighted else -100)
            out = bb.emit_output(loss)
        bb.emit_func_output(out)
    return bb.get()


# Each window of two tokens holds two different ones: no ties in max_pool2d.
TOKENS = np.array([[0, 3, 5, 1], [2, 4, 0, 5]], I64)


@pytest.mark.parametrize(
    "pool, weighted, emitted",
    [(op.nn.max_pool2d, False, "relax.grad.max_pool2d_backward"),
     (op.nn.avg_pool2d, True, "relax.grad.avg_pool2d_backward")],
    ids=["max_pool2d", "avg_pool2d_weighted"],
)  # fmt: skip
def test_hessian_vector_product(pool, weighted, emitted):
    mod = _embedding_pool_model(pool, weighted)
    n_float = 3 + weighted
    hvp = _hvp_module(mod, list(range(n_float)))
    backward_ops = {"relax.grad.take_backward", "relax.grad.nll_loss_backward",
                    "relax.collapse_sum_to", emitted}  # fmt: skip
    assert backward_ops <= _ops_of(hvp["main"])
    rng = np.random.default_rng(0)
    params = [rng.uniform(-1, 1, [int(d) for d in p.ty.shape]) for p in mod["main"].params[:3]]
    params += [rng.uniform(0.5, 1.5, 3)] * weighted
    labels = np.array([0, 2, 1], I64)  # with ignore_index 2, the second row is ignored
    vs = [rng.uniform(-1, 1, p.shape) for p in params]
    result = check_gradients(hvp, inputs=params + [TOKENS, labels] + vs,
                             wrt=list(range(n_float)), target=FAST_LLVM, directions=3)
    assert result.ok, str(result)
