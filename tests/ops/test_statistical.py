import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("sum_all", op.sum, [(3, 4)]),
    Case("sum_axis", lambda x: op.sum(x, 1), [(3, 4)]),
    Case("sum_axes_keepdims", lambda x: op.sum(x, [0, 2], keepdims=True), [(2, 3, 4)]),
    Case("sum_negative_axis", lambda x: op.sum(x, -1), [(2, 3, 4)]),
    Case("mean_all", op.mean, [(3, 4)]),
    Case("mean_axis", lambda x: op.mean(x, [0]), [(3, 4)]),
    Case("mean_keepdims", lambda x: op.mean(x, 1, keepdims=True), [(3, 4)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
