import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("add", op.add, [(3, 4), (3, 4)]),
    Case("add_broadcast", op.add, [(2, 3, 4), (4,)]),
    Case("add_broadcast_both", op.add, [(3, 1), (1, 4)]),
    Case("subtract", op.subtract, [(3, 4), (3, 4)]),
    Case("subtract_broadcast", op.subtract, [(4,), (3, 4)]),
    Case("multiply", op.multiply, [(3, 4), (3, 4)]),
    Case("multiply_broadcast", op.multiply, [(3, 4), (3, 1)]),
    Case("divide", op.divide, [(3, 4), (3, 4)], low=0.5, high=2.0),
    Case("divide_broadcast", op.divide, [(3, 4), (4,)], low=0.5, high=2.0),
    Case("power", op.power, [(3, 4), (3, 4)], low=0.5, high=2.0),
    Case("maximum", op.maximum, [(3, 4), (3, 4)]),
    Case("maximum_broadcast", op.maximum, [(3, 4), (4,)]),
    Case("minimum", op.minimum, [(3, 4), (3, 4)]),
    Case("float32_add", op.add, [(3, 4), (4,)], dtype="float32"),
]

CASES += [
    Case("floor_mod", op.floor_mod, [(3, 4), (3, 4)], low=0.3, high=2.0),
    Case("floor_mod_broadcast", lambda x, y: op.floor_mod(-x, y), [(3, 4), (4,)], low=0.3,
         high=2.0),
    Case("mod", lambda x, y: op.mod(-x, y), [(3, 4), (3, 4)], low=0.3, high=2.0),
    Case("log_add_exp", op.log_add_exp, [(3, 4), (3, 4)], low=-3.0, high=3.0),
    Case("log_add_exp_broadcast", op.log_add_exp, [(2, 3, 4), (3, 1)], low=-3.0, high=3.0),
    Case("atan2", op.atan2, [(3, 4), (3, 4)], low=0.2, high=2.0),
    Case("atan2_negative", lambda x, y: op.atan2(x, -y), [(3, 4), (4,)], low=0.2, high=2.0),
    Case("floor_divide_no_grad", lambda x, y: x * op.floor_divide(x, y), [(3, 4), (3, 4)],
         low=0.3, high=2.0),
    Case("log_add_exp_float16", op.log_add_exp, [(3, 4), (4,)], dtype="float16"),
    Case("atan2_float32", op.atan2, [(3, 4), (3, 4)], low=0.2, high=2.0, dtype="float32"),
]

# Comparisons have no gradient; they are tested as the condition of a where.
CASES += [
    Case(f"{cmp.__name__}_in_where", lambda x, y, cmp=cmp: op.where(cmp(x, y), x, y),
         [(3, 4), (3, 4)])
    for cmp in (op.equal, op.not_equal, op.greater, op.greater_equal, op.less, op.less_equal)
]
CASES += [
    Case(f"{logic.__name__}_in_where",
         lambda x, y, logic=logic: op.where(logic(op.less(x, y), op.greater(x, 0.0)), x, y),
         [(3, 4), (3, 4)])
    for logic in (op.logical_and, op.logical_or, op.logical_xor)
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
