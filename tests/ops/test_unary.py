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
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
