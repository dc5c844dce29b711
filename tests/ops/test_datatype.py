import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("astype_f32_to_f64", lambda x: op.astype(x, "float64"), [(3, 4)], dtype="float32"),
    Case("astype_roundtrip", lambda x: op.astype(op.astype(x, "float64"), "float32"), [(3, 4)],
         dtype="float32"),
    Case("astype_f16_to_f32", lambda x: op.astype(x, "float32") * op.astype(x, "float32"),
         [(3, 4)], dtype="float16"),
    Case("astype_same_dtype", lambda x: op.astype(x, "float64") * x, [(3, 4)]),
    # An integer source gets no gradient, so the walk stops there: argmax has no rule.
    Case("astype_from_int", lambda x, y: x * op.astype(op.argmax(y, 1, keepdims=True), "float64"),
         [(3, 4), (3, 4)], wrt=[0]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)

