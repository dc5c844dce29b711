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
class TargetTuple:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            lv = R.sum(x)
            gv = (lv, lv)
            R.output(gv)
        return gv


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
class NoDataflow:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        gv = R.sum(x)
        return gv


@I.ir_module
class TwoBlocks:
    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            lv = R.tanh(x)
            R.output(lv)
        gv = R.sum(lv)
        return gv


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


@I.ir_module
class CallsFunction:
    @R.function
    def helper(x: R.Tensor((3, 3), "float32")) -> R.Tensor((3, 3), "float32"):
        return R.tanh(x)

    @R.function
    def main(x: R.Tensor((3, 3), "float32")):
        cls = CallsFunction
        with R.dataflow():
            lv = cls.helper(x)
            gv = R.sum(lv)
            R.output(gv)
        return gv


@I.ir_module
class MatchCast:
    @R.function
    def main(x: R.Tensor(("n",), "float32")):
        with R.dataflow():
            y = R.match_cast(x, R.Tensor((3,), "float32"))
            gv = R.sum(y)
            R.output(gv)
        return gv


Z = relax.Var("z", relax.TensorType((3, 3), "float32"))

CASES = [
    # (id, module, Gradient kwargs, words the message must contain)
    ("unknown_function", Good, {"func_name": "mian"}, ["'mian'", "main"]),
    ("prim_func", Good, {"func_name": "twice"}, ["'twice'", "not a Relax function"]),
    ("target_not_scalar", TargetNotScalar, {}, ["gv", "float scalar"]),
    ("target_int", TargetInt, {}, ["gv", "float scalar"]),
    ("target_index_single", Good, {"target_index": 1}, ["target_index", "main"]),
    ("target_index_range", TwoOutputs, {"target_index": 2}, ["target_index 2", "2 values"]),
    ("target_not_var", TwoOutputs, {"target_index": 1}, ["must be a Var", "main"]),
    ("var_not_in_function", Good, {"require_grads": [Z]}, ["z", "must be a Var of this"]),
    ("duplicate_require_grads", Good, {"require_grads": "x,x"}, ["x", "more than once"]),
    ("int_require_grads", Good, {"require_grads": "n"}, ["n", "float tensors"]),
    ("call_tir", CallTIR, {}, ["lv", "call_tir", "call_tir_with_grad"]),
]


def _kwargs(mod, kwargs):
    kwargs = dict(kwargs)
    kwargs.setdefault("func_name", "main")
    names = kwargs.get("require_grads")
    if isinstance(names, str):
        params = {p.name: p for p in mod["main"].params}
        kwargs["require_grads"] = [params[n] for n in names.split(",")]
    return kwargs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_error(case):
    _, mod, kwargs, words = case
    before = mod.script()
    with pytest.raises(GradientError) as info:
        relaxgrad.Gradient(**_kwargs(mod, kwargs))(mod)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, ValueError)
    assert mod.script() == before


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
