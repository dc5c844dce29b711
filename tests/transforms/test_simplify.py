"""The clean-ups of the adjoint: ``remove_unused`` and ``simplify_gradient`` (TVM's
gradient_simplifier), as Before/Expected pairs, plus the numeric regressions of the
transpose-of-matmul rule on vector operands.
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad.exprs import is_op
from relaxgrad.testing import check_gradients
from relaxgrad.transforms.simplify import RemoveUnused, remove_unused, simplify_gradient

# --- regressions: permute_dims(matmul(a, b)) with a vector operand ---------------------------
# matmul drops the vector's axis, so matmul(T(b), T(a)) is not the transpose: TVM leaves these
# bindings alone, and so must we (it used to give an ill-typed adjoint, or a wrong loss).


@I.ir_module
class VectorTimesBatch:
    @R.function
    def main(p2: R.Tensor((4,), "float64"), p1: R.Tensor((2, 4, 1), "float64")):
        with R.dataflow():
            lv = R.matmul(p2, p1)  # (2, 1)
            lv1 = R.permute_dims(lv, [1, 0])  # (1, 2)
            lv2 = R.multiply(lv1, R.const(np.array([[1.5, -2.0]]), "float64"))
            gv = R.sum(lv2)
            R.output(gv)
        return gv


@I.ir_module
class BatchTimesVector:
    @R.function
    def main(p0: R.Tensor((2,), "float64"), p1: R.Tensor((3, 3, 2), "float64")):
        with R.dataflow():
            lv = R.matmul(p1, p0)  # (3, 3)
            lv1 = R.permute_dims(lv, [1, 0])  # (3, 3), other values than matmul(p0, T(p1))
            lv2 = R.multiply(lv1, R.const(np.arange(9.0).reshape(3, 3), "float64"))
            gv = R.sum(lv2)
            R.output(gv)
        return gv


@I.ir_module
class MatrixChain:
    """Both operands matrices: TVM rewrites the forward binding too (exact), so do we."""

    @R.function
    def main(a: R.Tensor((3, 4), "float64"), b: R.Tensor((2, 4, 5), "float64")):
        with R.dataflow():
            lv = R.matmul(a, b)
            lv1 = R.permute_dims(lv, [0, 2, 1])
            lv2 = R.permute_dims(lv1, [0, 2, 1])
            lv3 = R.multiply(lv2, lv2)
            gv = R.sum(lv3)
            R.output(gv)
        return gv


def _numpy_loss(mod, inputs):
    p = inputs
    if mod is VectorTimesBatch:
        return float(np.sum(np.matmul(p[0], p[1]).T * np.array([[1.5, -2.0]])))
    if mod is BatchTimesVector:
        return float(np.sum(np.matmul(p[1], p[0]).T * np.arange(9.0).reshape(3, 3)))
    return float(np.sum(np.matmul(p[0], p[1]) ** 2))


@pytest.mark.parametrize("mod", [VectorTimesBatch, BatchTimesVector, MatrixChain])
def test_transpose_of_matmul_numeric(mod):
    rng = np.random.default_rng(0)
    inputs = [rng.uniform(-1, 1, [int(d) for d in p.ty.shape.values]) for p in mod["main"].params]
    grad_mod = relaxgrad.Gradient("main")(mod)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.compile(grad_mod, target="llvm"), dev)
    loss, _ = vm["main_adjoint"](*[tvm.runtime.tensor(x, dev) for x in inputs])
    np.testing.assert_allclose(float(loss.numpy()), _numpy_loss(mod, inputs), rtol=1e-12)
    result = check_gradients(mod, inputs=inputs)
    assert result.ok, str(result)


@pytest.mark.parametrize("mod", [VectorTimesBatch, BatchTimesVector, MatrixChain])
def test_transpose_of_matmul_matches_tvm(mod):
    ours = relaxgrad.Gradient("main")(mod)["main_adjoint"]
    theirs = relax.transform.Gradient("main")(mod)["main_adjoint"]
    tvm.ir.assert_structural_equal(ours, theirs)


@I.ir_module
class SeveralBlocks:
    @R.function
    def main(a: R.Tensor((3, 4), "float64"), b: R.Tensor((4, 5), "float64")):
        with R.dataflow():
            lv = R.matmul(a, b)
            t = R.permute_dims(lv, [1, 0])  # rule 2
            R.output(t)
        u = R.exp(t)
        with R.dataflow():
            lv2 = R.permute_dims(u, [1, 0])
            lv3 = R.permute_dims(lv2, [1, 0])  # rule 1
            lv4 = R.matmul(lv3, a)
            gv = R.sum(lv4)
            R.output(gv)
        return gv


def test_several_blocks_numeric():
    def grad_pass(func_name, require_grads, target_index):
        return relaxgrad.Gradient(func_name, require_grads, target_index, strict=False)

    adjoint = grad_pass("main", None, 0)(SeveralBlocks)["main_adjoint"]
    bindings = [b for block in adjoint.body.blocks for b in block.bindings]
    u = next(b.var for b in bindings if b.var.name == "u")
    # rule 1 in the second block: lv4 = matmul(u, a)
    assert any(is_op(b.value, "relax.matmul") and b.value.args[0].same_as(u) for b in bindings)
    result = check_gradients(SeveralBlocks, grad_pass=grad_pass)
    assert result.ok, str(result)


# --- simplify_gradient: Before / Expected ----------------------------------------------------


def test_rule1_transpose_of_transpose():
    @R.function(private=True)
    def before(x: R.Tensor((3, 4), "float32"), y: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            lv = R.permute_dims(x, [1, 0])
            lv1 = R.permute_dims(lv, [1, 0])
            gv = R.multiply(lv1, y)
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(x: R.Tensor((3, 4), "float32"), y: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            gv = R.multiply(x, y)
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


def test_rule1_needs_a_var_inside():
    """As in TVM, ``T(T(constant))`` stays."""

    @R.function(private=True)
    def before(x: R.Tensor((2, 2), "float32")):
        with R.dataflow():
            lv = R.permute_dims(R.const(np.ones((2, 2), "float32")), [1, 0])
            lv1 = R.permute_dims(lv, [1, 0])
            gv = R.multiply(lv1, x)
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(simplify_gradient(before), before)


def test_rule1_output_var_onto_dataflow_var_keeps_an_alias():
    """TVM would put the dataflow var ``lv`` in the result (ill-formed); we bind ``gv`` to it."""

    @R.function(private=True)
    def before(x: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            lv = R.exp(x)
            lv1 = R.permute_dims(lv, [1, 0])
            gv = R.permute_dims(lv1, [1, 0])
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(x: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            lv = R.exp(x)
            gv = lv
            R.output(gv)
        return gv

    after = simplify_gradient(before)
    tvm.ir.assert_structural_equal(after, expected)
    relax.analysis.well_formed(after)  # raises when ill-formed


def test_rule2_transpose_of_matmul():
    @R.function(private=True)
    def before(
        a: R.Tensor((3, 4), "float32"),
        c: R.Tensor((5, 4), "float32"),
        d: R.Tensor((5, 3), "float32"),
    ):
        with R.dataflow():
            b = R.permute_dims(c, [1, 0])
            lv = R.matmul(a, b)
            lv1 = R.permute_dims(lv, [1, 0])
            gv = R.add(lv1, d)
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(
        a: R.Tensor((3, 4), "float32"),
        c: R.Tensor((5, 4), "float32"),
        d: R.Tensor((5, 3), "float32"),
    ):
        with R.dataflow():
            ta = R.permute_dims(a, [1, 0])
            lv1 = R.matmul(c, ta)  # T(b) is c: b is bound to T(c)
            gv = R.add(lv1, d)
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


def test_rule2_batched_keeps_out_dtype():
    @R.function(private=True)
    def before(a: R.Tensor((2, 3, 4), "float16"), b: R.Tensor((4, 5), "float16")):
        with R.dataflow():
            lv = R.matmul(a, b, out_dtype="float32")
            gv = R.permute_dims(lv, [0, 2, 1])
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(a: R.Tensor((2, 3, 4), "float16"), b: R.Tensor((4, 5), "float16")):
        with R.dataflow():
            tb = R.permute_dims(b, [1, 0])
            ta = R.permute_dims(a, [0, 2, 1])
            gv = R.matmul(tb, ta, out_dtype="float32")
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


@pytest.mark.parametrize(
    "shape_a, shape_b", [((4,), (2, 4, 1)), ((3, 3, 2), (2,)), ((5,), (3, 4, 5, 6))]
)
def test_rule2_leaves_vector_operands(shape_a, shape_b):
    """The forward bindings of the regressions above are not touched."""
    a = relax.Var("a", relax.TensorType(shape_a, "float32"))
    b = relax.Var("b", relax.TensorType(shape_b, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            lv = bb.emit(relax.op.matmul(a, b))
            ndim = len(lv.ty.shape)
            lv1 = bb.emit(relax.op.permute_dims(lv, list(range(ndim - 2)) + [ndim - 1, ndim - 2]))
            gv = bb.emit_output(relax.op.sum(lv1))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    tvm.ir.assert_structural_equal(simplify_gradient(func), func)


def test_rule2_then_rule1_on_forward_bindings():
    """``T(T(matmul(a, b)))``: rule 2 twice gives back ``matmul(a, b)``, as in TVM."""

    @R.function(private=True)
    def before(a: R.Tensor((3, 4), "float32"), b: R.Tensor((4, 5), "float32")):
        with R.dataflow():
            lv = R.matmul(a, b)
            lv1 = R.permute_dims(lv, [1, 0])
            gv = R.permute_dims(lv1, [1, 0])
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(a: R.Tensor((3, 4), "float32"), b: R.Tensor((4, 5), "float32")):
        with R.dataflow():
            gv = R.matmul(a, b)
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


def test_simplify_several_blocks():
    """Rules apply within each dataflow block; rule 1's remap reaches later blocks and the
    result; nothing looks across blocks; non-dataflow blocks are only remapped."""

    @R.function(private=True)
    def before(x: R.Tensor((3, 4), "float32"), y: R.Tensor((4, 3), "float32")):
        with R.dataflow():
            lv = R.permute_dims(x, [1, 0])
            t1 = R.permute_dims(lv, [1, 0])  # output var replaced by x
            t2 = R.permute_dims(y, [1, 0])  # used by the next block
            R.output(t1, t2)
        s = R.add(t1, t2)
        with R.dataflow():
            lv2 = R.permute_dims(t2, [1, 0])  # t2 = T(y) is in another block: kept
            lv3 = R.permute_dims(lv2, [1, 0])  # T(T(t2)) -> t2
            gv = R.add(lv3, s)
            R.output(gv)
        return (gv, t1)

    @R.function(private=True)
    def expected(x: R.Tensor((3, 4), "float32"), y: R.Tensor((4, 3), "float32")):
        with R.dataflow():
            t2 = R.permute_dims(y, [1, 0])
            R.output(t2)
        s = R.add(x, t2)
        with R.dataflow():
            gv = R.add(t2, s)
            R.output(gv)
        return (gv, x)

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


def test_simplify_remap_reaches_a_later_if():
    @R.function(private=True)
    def before(x: R.Tensor((3, 4), "float32"), cond: R.Tensor((), "bool")):
        with R.dataflow():
            lv = R.permute_dims(x, [1, 0])
            t1 = R.permute_dims(lv, [1, 0])
            R.output(t1)
        if cond:
            r = R.exp(t1)
        else:
            r = R.add(t1, t1)
        return r

    @R.function(private=True)
    def expected(x: R.Tensor((3, 4), "float32"), cond: R.Tensor((), "bool")):
        if cond:
            r = R.exp(x)
        else:
            r = R.add(x, x)
        return r

    tvm.ir.assert_structural_equal(simplify_gradient(before), expected)


def test_simplify_without_pattern_returns_func():
    @R.function(private=True)
    def before(x: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            lv = R.permute_dims(x, [1, 0])
            gv = R.exp(lv)
            R.output(gv)
        return gv

    assert simplify_gradient(before).same_as(before)


# --- remove_unused: Before / Expected --------------------------------------------------------


def test_remove_unused_single_block():
    @R.function(private=True)
    def before(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            lv = R.exp(x)
            dead = R.exp(lv)  # noqa: F841 (TVMScript binding)
            gv = R.add(lv, x)
            R.output(gv)
        return gv

    @R.function(private=True)
    def expected(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            lv = R.exp(x)
            gv = R.add(lv, x)
            R.output(gv)
        return gv

    tvm.ir.assert_structural_equal(remove_unused(before), expected)
    assert remove_unused(expected).same_as(expected)


@R.function(pure=False, private=True)
def _several_blocks(x: R.Tensor((3,), "float32"), y: R.Tensor(ndim=1, dtype="float32")):
    with R.dataflow():
        a = R.exp(x)  # non-dataflow var used two blocks later: kept
        b = R.exp(a)  # unused output: dropped
        R.output(a, b)
    c = R.add(a, a)
    unused = R.exp(c)  # noqa: F841 (pure, unused: dropped)
    y1 = R.match_cast(y, R.Tensor((3,), "float32"))  # noqa: F841 (a runtime check: kept)
    R.print(c, format="{}")  # impure: kept (and so is c)
    with R.dataflow():
        d = R.exp(x)  # the whole block is unused: dropped
        R.output(d)
    with R.dataflow():
        e = R.add(a, x)
        f = R.multiply(e, e)  # noqa: F841 (unused: dropped)
        R.output(e)
    return e


@R.function(pure=False, private=True)
def _several_blocks_expected(x: R.Tensor((3,), "float32"), y: R.Tensor(ndim=1, dtype="float32")):
    with R.dataflow():
        a = R.exp(x)
        R.output(a)
    c = R.add(a, a)
    y1 = R.match_cast(y, R.Tensor((3,), "float32"))  # noqa: F841
    R.print(c, format="{}")
    with R.dataflow():
        e = R.add(a, x)
        R.output(e)
    return e


def test_remove_unused_several_blocks():
    tvm.ir.assert_structural_equal(remove_unused(_several_blocks), _several_blocks_expected)


def test_remove_unused_agrees_with_relax():
    expected = relax.analysis.remove_all_unused(_several_blocks)
    tvm.ir.assert_structural_equal(remove_unused(_several_blocks), expected)


def test_remove_unused_sees_uses_inside_if():
    @R.function(private=True)
    def before(x: R.Tensor((3,), "float32"), cond: R.Tensor((), "bool")):
        with R.dataflow():
            a = R.exp(x)
            b = R.exp(a)  # used only inside a branch: kept
            dead = R.log(x)
            R.output(a, b, dead)
        if cond:
            r = R.add(b, a)
        else:
            r = R.multiply(a, a)
        return r

    @R.function(private=True)
    def expected(x: R.Tensor((3,), "float32"), cond: R.Tensor((), "bool")):
        with R.dataflow():
            a = R.exp(x)
            b = R.exp(a)
            R.output(a, b)
        if cond:
            r = R.add(b, a)
        else:
            r = R.multiply(a, a)
        return r

    tvm.ir.assert_structural_equal(remove_unused(before), expected)
    tvm.ir.assert_structural_equal(remove_unused(before), relax.analysis.remove_all_unused(before))


def _chain_module(dead: int) -> tvm.IRModule:
    """``main(x) = exp(x) + x`` with a chain of ``dead`` unused bindings from ``exp(x)``."""
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            lv = bb.emit(relax.op.exp(x))
            v = lv
            for _ in range(dead):
                v = bb.emit(relax.op.multiply(v, v))
            gv = bb.emit_output(relax.op.add(lv, x))
        bb.emit_func_output(gv)
    return bb.get()


def test_remove_unused_pass_drops_a_dead_chain_as_relax_does():
    """The module pass gives DeadCodeElimination's function (which removes a chain one link
    per sweep), and the module itself when nothing is unused."""
    mod = _chain_module(300)
    got = RemoveUnused()(mod)
    tvm.ir.assert_structural_equal(got, relax.transform.DeadCodeElimination()(mod))
    assert len(got["main"].body.blocks[0].bindings) == 2
    assert RemoveUnused()(got).same_as(got)
    assert len(mod["main"].body.blocks[0].bindings) == 302  # the caller's module as it was
