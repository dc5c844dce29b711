"""Regression tests of gradient rules, one per bug found by random-program fuzzing.

Each compiles the adjoint and checks it numerically (finite differences in float64), or, where
TVM's forward is itself wrong, against the adjoint of an equivalent well-defined program.
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.ops._utils import fit_shape
from relaxgrad.testing import FAST_LLVM, assert_gradients_close, check_gradients, loss_module

from ._spec import Case, adjoints, ids, run_case


def _with_indices(x_shape, indices, *, high=None):
    """A Case's ``shapes``/``dtype``/``inputs``/``wrt`` for an op of x and fixed int64
    ``indices`` (an array, or a shape filled with random indices in ``[0, high)``)."""
    if high is not None:
        indices = np.random.default_rng(1).integers(0, high, indices)
    indices = np.asarray(indices, "int64")

    def inputs(rng):
        return [rng.uniform(-1, 1, x_shape), indices]

    return {"shapes": [x_shape, indices.shape], "dtype": ("float64", "int64"), "inputs": inputs,
            "wrt": [0]}  # fmt: skip


def _gather(axis):
    return lambda x, i: op.gather_elements(x, i, axis)


# TVM's scatter_elements kernels assume indices and data agree on the non-gather axes.
GATHER_CASES = [
    Case("leading_axis", _gather(0), **_with_indices((2, 3, 4), [[[1, 0, 1], [0, 1, 1]]])),
    Case("smaller_last_axes", _gather(0), **_with_indices((3, 4, 5), (2, 3, 5), high=3)),
    Case("last_axis", _gather(2), **_with_indices((2, 2, 4), (1, 1, 3), high=4)),
    Case("middle_axis", _gather(-2), **_with_indices((3, 4, 2, 3), (2, 3, 5, 2), high=2)),
]


@pytest.mark.parametrize("case", GATHER_CASES, ids=ids(GATHER_CASES))
def test_gather_elements_indices_smaller_than_data(case):
    run_case(case)


def _take(axis, mode):
    return lambda x, i: op.take(x, i, axis, mode=mode)


# clip/wrap of a 0-d or 2-D+ index tensor used to raise "The type is not populated".
TAKE_CASES = [
    Case(f"{mode}_{name}", _take(axis, mode), **_with_indices(x_shape, indices))
    for mode in ("clip", "wrap")
    for name, axis, x_shape, indices in [
        ("0d", 0, (4, 3), 7),
        ("0d_negative", 1, (3, 4), -2),
        ("2d", 1, (3, 4), [[-1, 5], [2, 9]]),
        ("3d", 0, (4, 2), [[[0, -5]], [[3, 3]]]),
    ]
]


@pytest.mark.parametrize("case", TAKE_CASES, ids=ids(TAKE_CASES))
def test_take_clip_wrap_with_0d_or_nd_indices(case):
    run_case(case)


@pytest.mark.parametrize("axis", [None, []], ids=["0d", "no_axes"])
def test_prod_of_0d_tensor(axis):
    """prod of a 0-d tensor (and over no axes) reduces nothing: it used to raise a TypeError."""
    run_case(Case("prod", lambda x: op.prod(x, axis), [() if axis is None else (2, 3)]))


@tvm.ir.transform.module_pass(opt_level=0)
def _inline_shape_vars(mod, _ctx):
    """Shape vars of a known shape replaced by their ShapeExpr: TVM cannot compile
    ``zeros(lv)`` for ``lv = shape_of(x)`` (it can ``zeros(R.shape([2, 3]))``)."""

    @relax.expr_functor.mutator
    class Inline(relax.PyExprMutator):
        def visit_var_(self, var):
            values = getattr(var.ty, "values", None)
            if isinstance(var.ty, relax.ShapeType) and values is not None:
                return relax.ShapeExpr(values)
            return super().visit_var_(var)

        def visit_dataflow_var_(self, var):
            return self.visit_var_(var)

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = Inline().visit_expr(func)
    return mod


def test_binary_operand_shaped_by_shape_var():
    """``x + zeros(shape_of(x))``: the operand's shape is a var, not a ShapeExpr (fit_shape used
    to raise an AttributeError)."""

    def grad_pass(*args):
        return tvm.ir.transform.Sequential([relaxgrad.Gradient(*args), _inline_shape_vars])

    shape = relax.TensorType((2, 3), "float64")
    for fn in (
        lambda x: op.add(x, op.zeros(op.shape_of(x), "float64")),
        lambda x, y: op.multiply(op.broadcast_to(y, op.shape_of(x)), x),
    ):
        types = [shape, relax.TensorType((1, 3), "float64")][: fn.__code__.co_argcount]
        result = check_gradients(loss_module(fn, types), grad_pass=grad_pass, target=FAST_LLVM)
        assert result.ok, str(result)


def test_binary_operand_of_unknown_shape_names_the_op():
    """An operand whose type gives no shape at all: a GradientError naming the op."""
    grad = relax.Var("g", relax.TensorType((2, 3), "float64"))
    like = relax.Var("y", relax.TensorType(None, "float64", ndim=2))
    with pytest.raises(relaxgrad.GradientError, match="relax.multiply .*unknown shape"):
        fit_shape(relax.BlockBuilder(), grad, like, "relax.multiply")


def _prim(value=2.0):
    return relax.prim_value(tvm.tirx.FloatImm("float64", value))


PRIM_CASES = [
    Case(f"{name}_{side}", (lambda x, f=f: f(x, _prim())) if side == "rhs" else
         (lambda x, f=f: f(_prim(), x)), [shape], low=0.5, high=1.5)
    for name, f in [("multiply", op.multiply), ("add", op.add), ("divide", op.divide),
                    ("power", op.power), ("maximum", op.maximum)]
    for side, shape in [("rhs", (2, 3)), ("lhs", ())]
]  # fmt: skip


@pytest.mark.parametrize("case", PRIM_CASES, ids=ids(PRIM_CASES))
def test_binary_prim_value_operand(case):
    """``multiply(x, R.prim_value(2.0))``: the prim value gets no gradient (the rule used to read
    its shape: AttributeError on PrimType)."""
    run_case(case)


def test_concat_single_input():
    """concat of one tensor (PyTorch's nn.LSTM through TVM's importer): ``split(g, [])`` is a
    tensor, not the 1-tuple the adjoint of the tuple needs."""
    run_case(Case("concat_single", lambda x: op.concat([x], 1), [(2, 3)]))
    run_case(Case("concat_single_then_more", lambda x, y: op.concat([op.concat([x], 0), y], 0),
                  [(2, 3), (1, 3)]))  # fmt: skip


def test_concat_empty_input():
    """concat with a (0, n) operand: the split offsets repeat ("split_indices must be sorted")."""
    run_case(Case("concat_empty_first", lambda x, y: op.concat([x, y], 0), [(0, 3), (2, 3)]))
    run_case(Case("concat_empty_middle", lambda x, y, z: op.concat([x, y, z], 1),
                  [(2, 2), (2, 0), (2, 3)]))  # fmt: skip


@pytest.mark.parametrize("index", [-1, [[-1, 0], [-3, 2]]], ids=["scalar", "2d"])
def test_take_negative_constant_index_fast_mode(index):
    """``x[:, -1]`` through TVM's PyTorch importer: ``take(x, -1, axis=1, mode="fast")``, whose
    backward wrote out of bounds (the process aborted). Negative constant indices count from the
    end; TVM's fast forward reads out of bounds there, so the adjoint is compared with that of
    "wrap" mode, which is checked numerically."""
    indices = relax.const(np.asarray(index, "int64"))
    fast, wrap = (
        Case(mode, lambda x, mode=mode: op.take(x, indices, 1, mode=mode), [(2, 3)])
        for mode in ("fast", "wrap")
    )
    run_case(wrap)
    inputs = wrap.make_inputs()
    np.testing.assert_allclose(adjoints(fast, inputs)[0], adjoints(wrap, inputs)[0])


def test_cumprod_of_an_empty_slice():
    """Found by the long fuzz run: cumprod (axis None) of a (0, 4, 1) slice crashed the rule with
    a TVM InternalError; nothing flows through an empty tensor."""

    def fn(x):
        empty = relax.op.strided_slice(x, [0], [0], [-2], [2])
        return relax.op.add(relax.op.sum(relax.op.cumprod(empty)), relax.op.sum(x))

    x = relax.Var("x", relax.TensorType((4, 4, 1), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(fn(x))
        bb.emit_func_output(gv)
    assert_gradients_close(bb.get())
