import pytest
from tvm.relax import op

from relaxgrad import GradientError

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
    Case("outer", op.outer, [(3,), (4,)]),
    Case("outer_float32", op.outer, [(3,), (4,)], dtype="float32"),
]


def _einsum(subscripts):
    return lambda *xs: op.einsum(list(xs), subscripts)


CASES += [
    Case("einsum_matmul", _einsum("ij,jk->ik"), [(3, 4), (4, 5)]),
    Case("einsum_batched_transposed", _einsum("bij,bkj->bki"), [(2, 3, 4), (2, 5, 4)]),
    Case("einsum_attention_scores", _einsum("bshd,bthd->bhst"), [(1, 3, 2, 4), (1, 5, 2, 4)]),
    Case("einsum_three_operands", _einsum("ij,jk,kl->il"), [(2, 3), (3, 4), (4, 2)]),
    Case("einsum_sum_all", _einsum("ij->"), [(3, 4)]),
    Case("einsum_dot", _einsum("i,i->"), [(4,), (4,)]),
    Case("einsum_private_letter", _einsum("ij,k->i"), [(3, 4), (2,)]),
    Case("einsum_transpose", _einsum("ijk->kij"), [(2, 3, 4)]),
    Case("einsum_implicit", _einsum("ij,jk"), [(3, 4), (4, 2)]),
    Case("einsum_ellipsis", _einsum("...ij,...jk->...ik"), [(2, 3, 4), (2, 4, 5)]),
    Case("einsum_ellipsis_broadcast", _einsum("...j,...j->..."), [(1, 3), (4, 3)]),
    Case("einsum_same_operand_twice", lambda x: op.einsum([x, x], "ij,kj->ik"), [(3, 4)]),
    Case("einsum_float32", _einsum("ij,jk->ik"), [(3, 4), (4, 5)], dtype="float32"),
    Case("einsum_float16", _einsum("bij,bjk->bik"), [(2, 3, 4), (2, 4, 5)], dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def test_einsum_diagonal_has_no_rule():
    with pytest.raises(GradientError, match="relax.einsum .*repeated index"):
        run_case(Case("diagonal", _einsum("ii->i"), [(3, 3)]))
