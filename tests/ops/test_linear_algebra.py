import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("matmul_2d", op.matmul, [(3, 4), (4, 5)]),
    Case("matmul_batched", op.matmul, [(2, 3, 4), (2, 4, 5)]),
    Case("matmul_broadcast_batch", op.matmul, [(2, 3, 4), (4, 5)]),
    Case("matmul_broadcast_batch_rhs", op.matmul, [(3, 4), (2, 4, 5)]),
    Case("matmul_vec_mat", op.matmul, [(4,), (4, 5)]),
    Case("matmul_mat_vec", op.matmul, [(3, 4), (4,)]),
    Case("matmul_vec_vec", op.matmul, [(4,), (4,)]),
    Case("matmul_transposed_rhs", lambda a, b: op.matmul(a, op.permute_dims(b)), [(3, 4), (5, 4)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
