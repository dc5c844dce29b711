import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case

SHAPE = [(3, 4)]
CASES = [
    Case("negative", op.negative, SHAPE),
    Case("abs", op.abs, SHAPE),
    Case("exp", op.exp, SHAPE),
    Case("log", op.log, SHAPE, low=0.5, high=2.0),
    Case("sqrt", op.sqrt, SHAPE, low=0.5, high=2.0),
    Case("sin", op.sin, SHAPE),
    Case("cos", op.cos, SHAPE),
    Case("tanh", op.tanh, SHAPE),
    Case("sigmoid", op.sigmoid, SHAPE),
    Case("relu", op.nn.relu, SHAPE),
    Case("silu", op.nn.silu, SHAPE),
    Case("exp_float32", op.exp, SHAPE, dtype="float32"),
    Case("erf", op.erf, SHAPE, low=-2.0, high=2.0),
    Case("tan", op.tan, SHAPE),
    Case("sinh", op.sinh, SHAPE),
    Case("cosh", op.cosh, SHAPE),
    Case("asin", op.asin, SHAPE, low=-0.8, high=0.8),
    Case("acos", op.acos, SHAPE, low=-0.8, high=0.8),
    Case("atan", op.atan, SHAPE, low=-2.0, high=2.0),
    Case("asinh", op.asinh, SHAPE, low=-2.0, high=2.0),
    Case("acosh", op.acosh, SHAPE, low=1.5, high=3.0),
    Case("atanh", op.atanh, SHAPE, low=-0.8, high=0.8),
    Case("rsqrt", op.rsqrt, SHAPE, low=0.5, high=2.0),
    Case("square", op.square, SHAPE),
    Case("clip", lambda x: op.clip(x, -0.5, 0.4), SHAPE),
    Case("clip_int_bounds", lambda x: op.clip(x, 0, 1), SHAPE, low=-1.0, high=2.0),
    Case("gelu", op.nn.gelu, SHAPE, low=-3.0, high=3.0),
    Case("gelu_tanh", op.nn.gelu_tanh, SHAPE, low=-3.0, high=3.0),
    Case("leakyrelu", op.nn.leakyrelu, SHAPE),
    Case("leakyrelu_alpha", lambda x: op.nn.leakyrelu(x, 0.3), SHAPE),
    Case("softplus", op.nn.softplus, SHAPE, low=-3.0, high=3.0),
    # beta * x crosses the threshold: there softplus is x itself
    Case("softplus_beta_threshold", lambda x: op.nn.softplus(x, 2.0, 1.5), SHAPE, low=-2.0,
         high=2.0),
    Case("selu", op.nn.selu, SHAPE, low=-2.0, high=2.0),
]
CASES += [
    Case(f"{name}_float32", fn, SHAPE, dtype="float32", low=low, high=high)
    for name, fn, low, high in [
        ("erf", op.erf, -2.0, 2.0),
        ("asin", op.asin, -0.8, 0.8),
        ("rsqrt", op.rsqrt, 0.5, 2.0),
        ("gelu", op.nn.gelu, -3.0, 3.0),
        ("gelu_tanh", op.nn.gelu_tanh, -3.0, 3.0),
        ("softplus", op.nn.softplus, -3.0, 3.0),
    ]
]
CASES += [
    Case(f"{name}_float16", fn, SHAPE, dtype="float16", low=low, high=high)
    for name, fn, low, high in [
        ("tanh", op.tanh, -1.0, 1.0),
        ("square", op.square, -1.0, 1.0),
        ("gelu", op.nn.gelu, -3.0, 3.0),
        ("gelu_tanh", op.nn.gelu_tanh, -3.0, 3.0),
        ("leakyrelu", op.nn.leakyrelu, -1.0, 1.0),
    ]
]
# Piecewise constant ops give no gradient: x * op(x) has gradient op(x).
CASES += [
    Case(f"{fn.__name__}_no_grad", lambda x, fn=fn: x * fn(x * x), SHAPE, low=-2.0, high=2.0)
    for fn in (op.sign, op.floor, op.ceil, op.round, op.trunc)
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
