import pytest
from tvm import relax
from tvm.relax import op

from ._spec import Case, ids, run_case


def _two(dtype="float64"):
    return relax.const(2.0, dtype)


# Creation ops give no gradient to their inputs: each appears inside an expression of x.
CASES = [
    Case("zeros_like", lambda x: x * x + op.zeros_like(x), [(3, 4)]),
    Case("ones_like", lambda x: x * op.ones_like(x), [(3, 4)]),
    Case("ones_like_dtype", lambda x: x * op.ones_like(x, "float32"), [(3, 4)], dtype="float32"),
    Case("full_like", lambda x: x * op.full_like(x, _two()), [(3, 4)]),
    Case("zeros", lambda x: x + op.zeros((3, 4), "float64"), [(4,)]),
    Case("ones", lambda x: x * op.ones((2, 3, 4), "float64"), [(3, 4)]),
    Case("full", lambda x: x * op.full((3, 4), _two()), [(3, 4)]),
    Case("full_float32", lambda x: x * op.full((3, 4), _two("float32")), [(4,)], dtype="float32"),
    # a Var fill value does get a gradient: sum(g) (TVM's rule gives it none)
    Case("full_var_fill", lambda x, v: x * op.full((3, 4), v), [(3, 4), ()]),
    Case("full_var_fill_cast", lambda x, v: x * op.full((3, 4), v, "float64"), [(3, 4), ()],
         dtype=("float64", "float32")),
    Case("full_like_var_fill", lambda x, v: x * op.full_like(x, v), [(3, 4), ()]),
]

CASES += [
    Case(f"{mask.__name__}_k{k}", lambda x, mask=mask, k=k: mask(x, k), [(4, 4)])
    for mask in (op.triu, op.tril)
    for k in (0, 1, -1)
]
CASES += [
    Case("triu_batched_wide", lambda x: op.triu(x, 1), [(2, 3, 5)]),
    Case("tril_float32", lambda x: op.tril(x, -1), [(3, 4)], dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
