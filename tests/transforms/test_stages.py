"""Before/Expected pins of the pass's stages on programs beyond TVM's (their numerics are checked
in test_programs.py): forward blocks kept, backward in its own block, callee VJPs, If, seeds."""

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad.transforms.checkpoint import strip_markers
from relaxgrad.transforms.stages import _forward_segments


@I.ir_module
class TwoBlocks:
    @R.function
    def main(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            a = R.tanh(x)
            R.output(a)
        b = R.match_cast(a, R.Tensor((3,), "float32"))
        with R.dataflow():
            loss = R.sum(R.multiply(b, x))
            R.output(loss)
        return loss


def test_blocks_and_match_cast():
    @R.function
    def expected(x: R.Tensor((3,), dtype="float32")):
        with R.dataflow():
            a: R.Tensor((3,), dtype="float32") = R.tanh(x)
            R.output(a)
        b: R.Tensor((3,), dtype="float32") = R.match_cast(a, R.Tensor((3,), dtype="float32"))
        with R.dataflow():
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(b, x)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            loss_adjoint: R.Tensor((), dtype="float32") = R.ones(R.shape([]), dtype="float32")
            lv1_adjoint = R.broadcast_to(loss_adjoint, R.shape([3]))
            b_adjoint: R.Tensor((3,), dtype="float32") = R.multiply(lv1_adjoint, x)
            x_adjoint: R.Tensor((3,), dtype="float32") = R.multiply(lv1_adjoint, b)
            a_adjoint: R.Tensor((3,), dtype="float32") = b_adjoint
            lv: R.Tensor((3,), dtype="float32") = R.multiply(a, a)
            lv1_1: R.Tensor((3,), dtype="float32") = R.subtract(R.const(1.0, "float32"), lv)
            lv2: R.Tensor((3,), dtype="float32") = R.multiply(a_adjoint, lv1_1)
            x_adjoint1: R.Tensor((3,), dtype="float32") = R.add(x_adjoint, lv2)
            x_adjoint_out: R.Tensor((3,), dtype="float32") = x_adjoint1
            R.output(lv1, loss, x_adjoint_out)
        return (loss, (x_adjoint_out,))

    after = relaxgrad.Gradient("main", strict=False)(TwoBlocks)["main_adjoint"]
    tvm.ir.assert_structural_equal(after.without_attr("global_symbol"),
                                   expected.without_attr("global_symbol"))


@I.ir_module
class Call:
    @R.function
    def f(x: R.Tensor((3,), "float32")) -> R.Tensor((3,), "float32"):
        with R.dataflow():
            y = R.exp(x)
            R.output(y)
        return y

    @R.function
    def main(x: R.Tensor((3,), "float32")):
        cls = Call
        with R.dataflow():
            a = cls.f(x)
            loss = R.sum(a)
            R.output(loss)
        return loss


def test_call_uses_callee_vjp():
    @I.ir_module
    class Expected:
        @R.function
        def f(x: R.Tensor((3,), "float32")) -> R.Tensor((3,), "float32"):
            with R.dataflow():
                y = R.exp(x)
                R.output(y)
            return y

        @R.function
        def main(x: R.Tensor((3,), "float32")):
            cls = Expected
            with R.dataflow():
                a = cls.f(x)
                loss = R.sum(a)
                R.output(loss)
            return loss

        @R.function
        def f_vjp(x: R.Tensor((3,), "float32"), y_grad: R.Tensor((3,), "float32")):
            with R.dataflow():
                y: R.Tensor((3,), dtype="float32") = R.exp(x)
                y_adjoint: R.Tensor((3,), dtype="float32") = y_grad
                x_adjoint: R.Tensor((3,), dtype="float32") = R.multiply(y_adjoint, y)
                x_adjoint_out: R.Tensor((3,), dtype="float32") = x_adjoint
                R.output(y, x_adjoint_out)
            return (x_adjoint_out,)

        @R.function
        def main_adjoint(x: R.Tensor((3,), "float32")):
            cls = Expected
            with R.dataflow():
                a: R.Tensor((3,), dtype="float32") = cls.f(x)
                loss: R.Tensor((), dtype="float32") = R.sum(a, axis=None, keepdims=False)
                loss_adjoint: R.Tensor((), dtype="float32") = R.ones(R.shape([]), "float32")
                a_adjoint = R.broadcast_to(loss_adjoint, R.shape([3]))
                a_vjp = cls.f_vjp(x, a_adjoint)
                x_adjoint: R.Tensor((3,), dtype="float32") = a_vjp[0]
                x_adjoint_out: R.Tensor((3,), dtype="float32") = x_adjoint
                R.output(loss, x_adjoint_out)
            return (loss, (x_adjoint_out,))

    tvm.ir.assert_structural_equal(relaxgrad.Gradient("main")(Call), Expected)


@I.ir_module
class Branch:
    @R.function
    def main(x: R.Tensor((3,), "float32"), c: R.Tensor((), "bool")):
        if c:
            y = R.exp(x)
        else:
            y = R.negative(x)
        loss = R.sum(y)
        return loss


def test_if_selects_branch_adjoints():
    @R.function
    def expected(x: R.Tensor((3,), dtype="float32"), c: R.Tensor((), dtype="bool")):
        if c:
            y_then: R.Tensor((3,), dtype="float32") = R.exp(x)
            y: R.Tensor((3,), dtype="float32") = y_then
        else:
            y_else: R.Tensor((3,), dtype="float32") = R.negative(x)
            y: R.Tensor((3,), dtype="float32") = y_else
        loss: R.Tensor((), dtype="float32") = R.sum(y, axis=None, keepdims=False)
        loss_adjoint: R.Tensor((), dtype="float32") = R.ones(R.shape([]), dtype="float32")
        y_adjoint: R.Tensor((3,), dtype="float32") = R.broadcast_to(loss_adjoint, R.shape([3]))
        y_then1: R.Tensor((3,), dtype="float32") = R.exp(x)
        y_then_adjoint: R.Tensor((3,), dtype="float32") = y_adjoint
        x_adjoint: R.Tensor((3,), dtype="float32") = R.multiply(y_then_adjoint, y_then1)
        y_else_adjoint: R.Tensor((3,), dtype="float32") = y_adjoint
        x_adjoint1: R.Tensor((3,), dtype="float32") = R.negative(y_else_adjoint)
        x_adjoint2: R.Tensor((3,), dtype="float32") = R.where(c, x_adjoint, x_adjoint1)
        x_adjoint3: R.Tensor((3,), dtype="float32") = x_adjoint2
        return (loss, (x_adjoint3,))

    after = relaxgrad.Gradient("main", strict=False)(Branch)["main_adjoint"]
    tvm.ir.assert_structural_equal(after.without_attr("global_symbol"),
                                   expected.without_attr("global_symbol"))


def test_seed_param_is_the_targets_adjoint():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((3,), "float32")):
            with R.dataflow():
                y = R.exp(x)
                R.output(y)
            return y

    @R.function
    def expected(x: R.Tensor((3,), "float32"), y_grad: R.Tensor((3,), "float32")):
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.exp(x)
            y_adjoint: R.Tensor((3,), dtype="float32") = y_grad
            x_adjoint: R.Tensor((3,), dtype="float32") = R.multiply(y_adjoint, y)
            x_adjoint_out: R.Tensor((3,), dtype="float32") = x_adjoint
            R.output(y, x_adjoint_out)
        return (y, (x_adjoint_out,))

    after = relaxgrad.Gradient("main", seed="param")(Before)["main_adjoint"]
    tvm.ir.assert_structural_equal(after.without_attr("global_symbol"),
                                   expected.without_attr("global_symbol"))


def test_forward_stage_promotes_dataflow_vars_across_blocks():
    segments, ret, remap = _forward_segments(TwoBlocks["main"], general=True)
    assert [df for df, _ in segments] == [True, False, True]
    names = [(b.var.name, type(b.var).__name__) for _, bs in segments for b in bs]
    assert names == [("a", "Var"), ("b", "Var"), ("lv1", "Var"), ("loss", "Var")]
    assert ret.name == "loss"
    assert all(not isinstance(v, relax.DataflowVar) for v in remap.values())


def test_checkpoint_stage_strips_markers_and_keeps_tvm_rule():
    @I.ir_module
    class Marked:
        @R.function
        def main(x: R.Tensor((3,), "float32")):
            with R.dataflow():
                s = R.grad.start_checkpoint(x)
                a = R.exp(s)
                b = R.tanh(a)
                e = R.grad.end_checkpoint(b)
                c = R.multiply(e, e)
                loss = R.sum(c)
                R.output(loss)
            return loss

    func = Marked["main"]
    bb = relax.BlockBuilder()
    bb.begin_scope(list(func.params))
    segments = [(True, list(func.body.blocks[0].bindings))]
    info = strip_markers(bb, list(func.params), segments, func.body.body)
    bb.end_scope()
    assert [b.var.name for b in info.bindings] == ["a", "b", "c", "loss"]
    assert {v.name for v in info.checkpoints} == {"x", "c", "loss"}
    assert [v.name for v in info.start_marked] == ["x"]
    assert [v.name for v in info.end_marked] == ["b"]
