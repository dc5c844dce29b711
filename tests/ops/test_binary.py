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

# Comparisons have no gradient; they are tested as the condition of a where.
CASES += [
    Case(f"{cmp.__name__}_in_where", lambda x, y, cmp=cmp: op.where(cmp(x, y), x, y),
         [(3, 4), (3, 4)])
    for cmp in (op.equal, op.not_equal, op.greater, op.greater_equal, op.less, op.less_equal)
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
