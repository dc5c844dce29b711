"""Bad input raises GradientError (a ValueError) naming what is wrong, and mutates nothing."""

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relaxgrad
from relaxgrad import GradientError
from relaxgrad.ops import registry


@I.ir_module(s_tir=True)
class Good:
    @R.function
    def main(x: R.Tensor((3, 3), "float32"), n: R.Tensor((3, 3), "int64")):
        with R.dataflow():
            lv = R.tanh(x)
            gv = R.sum(lv)
            R.output(gv)
        return gv

    @T.prim_func(s_tir=True)
    def twice(a: T.Buffer((3, 3), "float32"), b: T.Buffer((3, 3), "float32")):
        for i, j in T.grid(3, 3):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj] * T.float32(2)


@I.ir_module
class TargetNotScalar:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            gv = R.tanh(x)
            R.output(gv)
        return gv


@I.ir_module
class TargetInt:
    @R.function
    def main(x: R.Tensor((3, 3), "int64")):
        with R.dataflow():
            gv = R.sum(x)
            R.output(gv)
        return gv


@I.ir_module
class TwoOutputs:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            a = R.sum(x)
            b = R.sum(R.tanh(x))
            R.output(a, b)
        return a, (b, b)


@I.ir_module
class TwoOpsWithoutRules:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            a = R.exp(x)
            b = R.tanh(a)
            c = R.exp(b)
            gv = R.sum(c)
            R.output(gv)
        return gv


@I.ir_module(s_tir=True)
class CallTIR:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        cls = CallTIR
        with R.dataflow():
            lv = R.call_tir(cls.twice, (x,), R.Tensor((3, 3), "float32"))
            gv = R.sum(lv)
            R.output(gv)
        return gv

    @T.prim_func(s_tir=True)
    def twice(a: T.Buffer((3, 3), "float32"), b: T.Buffer((3, 3), "float32")):
        for i, j in T.grid(3, 3):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj] * T.float32(2)


# The catalogue of bad inputs, each with the words its message must contain, is
# tests/transforms/test_validation.py; these modules are shared with it.


def test_error_keeps_type_in_sequential():
    seq = tvm.ir.transform.Sequential([relaxgrad.Gradient("main"), relax.transform.LegalizeOps()])
    with pytest.raises(GradientError, match="float scalar"):
        seq(TargetNotScalar)


@pytest.fixture
def without_exp_and_tanh(monkeypatch):
    rules = dict(registry._RULES)
    del rules["relax.exp"], rules["relax.tanh"]
    monkeypatch.setattr(registry, "_RULES", rules)


def test_names_every_op_without_rule(without_exp_and_tanh):
    with pytest.raises(GradientError) as info:
        relaxgrad.Gradient("main")(TwoOpsWithoutRules)
    message = str(info.value)
    assert "relax.exp (bound to c, a)" in message
    assert "relax.tanh (bound to b)" in message


def test_rule_with_wrong_partial_count(monkeypatch):
    rules = dict(registry._RULES)
    rules["relax.tanh"] = lambda var, call, grad, ctx: [grad, grad]
    monkeypatch.setattr(registry, "_RULES", rules)
    with pytest.raises(GradientError, match="relax.tanh returned 2 partials for 1 arguments"):
        relaxgrad.Gradient("main")(Good)


def test_register_gradient_validates():
    with pytest.raises(ValueError, match="already registered"):
        relaxgrad.register_gradient("relax.add", lambda *a: [])
    with pytest.raises(Exception):  # noqa: B017 (TVM's error for an unknown op name)
        relaxgrad.register_gradient("relax.no_such_op", lambda *a: [])


def test_calling_a_local_closure_names_it_and_says_how_to_lift_it():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    y = relax.Var("y", relax.TensorType((3,), "float32"))
    body = relax.SeqExpr([], relax.op.multiply(y, y))
    with bb.function("main", [x]):
        square = bb.emit(relax.Function([y], body, relax.TensorType((3,), "float32")), "square")
        out = bb.emit(relax.op.sum(bb.emit(relax.Call(square, [x]))))
        bb.emit_func_output(out)
    mod = bb.get()
    before = mod.script()
    with pytest.raises(GradientError, match="in function main, square is bound to a local "
                                            "function .*LambdaLift"):
        relaxgrad.Gradient("main", strict=False)(mod)
    assert mod.script() == before
    # the suggested fix works
    lifted = relax.transform.LambdaLift()(mod)
    assert "main_adjoint" in [gv.name_hint for gv in relaxgrad.Gradient(
        "main", strict=False)(lifted).get_global_vars()]
