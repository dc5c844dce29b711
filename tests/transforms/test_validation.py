"""A catalogue of bad inputs: each raises GradientError naming the function and the var or op
at fault, before anything is built; the input module is never changed; outputs are well formed
and deterministic."""

import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad import GradientError
from relaxgrad.ops import registry

from .test_errors import CallTIR, Good, TargetInt, TargetNotScalar, TwoOutputs
from .test_programs import Blocks, Branches, Calls, Recursive, TupleReturn, Vector


def _loose(**kw):
    return {"strict": False, **kw}


def _dataflow_var_outside_block():
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    lv = relax.DataflowVar("lv", relax.TensorType((3,), "float32"))
    gv = relax.Var("gv", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    blocks = [
        relax.DataflowBlock([relax.VarBinding(lv, bb.normalize(relax.op.tanh(x)))]),
        relax.BindingBlock([relax.VarBinding(gv, bb.normalize(relax.op.sum(lv)))]),
    ]
    func = relax.Function([x], relax.SeqExpr(blocks, gv), relax.TensorType((), "float32"))
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def _duplicate_names():
    a = relax.Var("h", relax.TensorType((3,), "float32"))
    b = relax.Var("h", relax.TensorType((3,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.sum(relax.op.multiply(a, b)))
        bb.emit_func_output(gv)
    return bb.get()


@I.ir_module
class UnknownShape:
    @R.function
    def main(x: R.Tensor(dtype="float32", ndim=2)):
        with R.dataflow():
            gv = R.sum(x)
            R.output(gv)
        return gv


@I.ir_module
class AdjointInUse:
    @R.function
    def main(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            gv = R.sum(R.tanh(x))
            R.output(gv)
        return gv

    @R.function
    def main_adjoint(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            gv = R.sum(x)
            R.output(gv)
        return gv

    @R.function
    def user(x: R.Tensor((3,), "float32")) -> R.Tensor((), "float32"):
        cls = AdjointInUse
        with R.dataflow():
            y = cls.main_adjoint(x)
            R.output(y)
        return y


@I.ir_module
class IntTarget:
    @R.function
    def main(x: R.Tensor((3,), "float32")):
        with R.dataflow():
            gv = R.astype(x, "int32")
            R.output(gv)
        return gv


Z = relax.Var("z", relax.TensorType((3, 3), "float32"))

CASES = [
    # (id, module, Gradient kwargs, words the message must contain)
    ("unknown_function", Good, {"func_name": "mian"}, ["'mian'", "main"]),
    ("prim_func", Good, {"func_name": "twice"}, ["'twice'", "not a Relax function"]),
    ("func_name_not_str", Good, {"func_name": 3}, ["func_name", "3"]),
    ("target_not_scalar", TargetNotScalar, {}, ["main", "gv", "float scalar", "seed"]),
    ("target_int", TargetInt, {}, ["main", "gv", "float scalar"]),
    ("target_int_vjp", IntTarget, {"seed": "param"}, ["main", "gv", "float tensor"]),
    ("target_index_single", Good, {"target_index": 1}, ["main", "target_index"]),
    ("target_index_range", TwoOutputs, {"target_index": 2}, ["main", "target_index 2"]),
    ("target_index_list_range", TwoOutputs, {"target_index": [0, 5]}, ["main", "5"]),
    ("target_not_var", TwoOutputs, {"target_index": 1}, ["main", "must be a Var"]),
    ("target_index_float", Good, {"target_index": 1.5}, ["main", "target_index", "1.5"]),
    ("target_index_none", Good, {"target_index": None}, ["main", "target_index", "None"]),
    ("target_index_bool", Good, {"target_index": True}, ["main", "target_index", "True"]),
    ("target_index_empty", Good, {"target_index": []}, ["main", "target_index"]),
    ("require_grads_int", Good, {"require_grads": 5}, ["main", "require_grads", "5"]),
    ("require_grads_mixed", Good, {"require_grads": ["x", 2.0]}, ["main", "2.0"]),
    ("require_grads_foreign", Good, {"require_grads": [Z]}, ["main", "z", "Var of this"]),
    ("require_grads_unknown_name", Good, {"require_grads": "q"}, ["main", "'q'", "x, n"]),
    ("require_grads_duplicate", Good, {"require_grads": ["x", "x"]}, ["x", "more than once"]),
    ("require_grads_int_param", Good, {"require_grads": ["n"]}, ["main", "n", "float"]),
    ("require_grads_ambiguous", _duplicate_names(), {"require_grads": "h"}, ["main", "'h'"]),
    ("seed_unknown", Good, {"seed": "zeros"}, ["main", "seed", "zeros"]),
    ("checkpoint_unknown", Good, {"checkpoint": "bogus"}, ["bogus"]),
    ("strict_not_bool", Good, {"strict": 1}, ["main", "strict"]),
    ("strict_blocks", Blocks, {}, ["main", "exactly one", "strict=False"]),
    ("strict_if", Branches, {}, ["main", "exactly one", "strict=False"]),
    ("strict_tuple_return", TupleReturn, {}, ["main", "gv", "float scalar"]),
    ("dataflow_var_outside", _dataflow_var_outside_block(), _loose(), ["main", "well formed"]),
    ("unknown_shape_param", UnknownShape, {}, ["main", "x", "unknown shape"]),
    ("adjoint_in_use", AdjointInUse, {}, ["main_adjoint", "user"]),
    ("recursion", Recursive, {}, ["main -> f -> g -> f", "recursive"]),
    ("call_tir", CallTIR, {}, ["main", "lv", "call_tir_with_grad"]),
    ("vjp_needs_float", Vector, {"seed": "param", "require_grads": "x", "target_index": 3},
     ["main", "target_index 3"]),
]


def _kwargs(kwargs):
    kwargs = dict(kwargs)
    kwargs.setdefault("func_name", "main")
    return kwargs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case):
    _, mod, kwargs, words = case
    before_hash, before_text = tvm_ffi.structural_hash(mod), mod.script()
    with pytest.raises(GradientError) as info:
        relaxgrad.Gradient(**_kwargs(kwargs))(mod)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, ValueError)
    assert tvm_ffi.structural_hash(mod) == before_hash
    assert mod.script() == before_text


def test_catalogue_size():
    assert len(CASES) >= 30


def _with_rule(monkeypatch, op, rule):
    rules = dict(registry._RULES)
    rules[op] = rule
    monkeypatch.setattr(registry, "_RULES", rules)


@pytest.mark.parametrize(
    "rule, words",
    [
        (lambda var, call, grad, ctx: [grad, grad], ["relax.tanh", "2 partials", "lv"]),
        (lambda var, call, grad, ctx: None, ["relax.tanh", "list of partials", "lv"]),
        (
            lambda var, call, grad, ctx: [relax.op.sum(grad, axis=[0])],
            ["relax.tanh", "rank 1 instead of 2", "lv", "main"],
        ),
        (
            lambda var, call, grad, ctx: [relax.op.astype(grad, "float64")],
            ["relax.tanh", "dtype float64 instead of float32", "lv", "main"],
        ),
        (
            lambda var, call, grad, ctx: [relax.op.concat([grad, grad], axis=0)],
            ["relax.tanh", "shape", "lv", "main"],
        ),
        (
            lambda var, call, grad, ctx: [grad.no_such_attribute],
            ["the rule of relax.tanh failed at lv in function main", "AttributeError"],
        ),
    ],
    ids=["count", "not_a_list", "rank", "dtype", "shape", "crashes"],
)
def test_bad_rule_output(monkeypatch, rule, words):
    _with_rule(monkeypatch, "relax.tanh", rule)
    with pytest.raises(GradientError) as info:
        relaxgrad.Gradient("main")(Good)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "mod, kwargs",
    [
        (Good, {"require_grads": ["x"]}),
        (Blocks, {"strict": False}),
        (Branches, {"strict": False}),
        (Calls, {}),
        (TupleReturn, {"strict": False, "seed": "param", "target_index": [0, 1]}),
    ],
    ids=["one_block", "blocks", "if", "calls", "vjp"],
)
def test_outputs_well_formed_and_deterministic(mod, kwargs):
    first = relaxgrad.Gradient("main", **kwargs)(mod)
    second = relaxgrad.Gradient("main", **kwargs)(mod)
    relax.analysis.well_formed(first)
    assert first.script() == second.script()
