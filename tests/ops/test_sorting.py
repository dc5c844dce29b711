import numpy as np
import pytest
from tvm import relax
from tvm.relax import op

from ._spec import Case, ids, run_case


def _distinct(*shape):
    """Values far apart (no ties), so the sorting order is stable under the FD steps."""

    def inputs(rng):
        return [rng.permutation(np.prod(shape)).reshape(shape) * 0.1 + rng.uniform(0, 0.01, shape)]

    return {"shapes": [shape], "inputs": inputs}


CASES = [
    Case("argsort_no_grad", lambda x: x * op.astype(op.argsort(x), "float64"), **_distinct(3, 4)),
    Case("sort", op.sort, **_distinct(3, 4)),
    Case("sort_axis0_descending", lambda x: op.sort(x, 0, True), **_distinct(3, 4)),
    Case("sort_negative_axis", lambda x: op.sort(x, -2), **_distinct(2, 3, 4)),
    Case("topk", lambda x: relax.TupleGetItem(op.topk(x, 2), 0), **_distinct(3, 4)),
    Case("topk_smallest_axis0",
         lambda x: relax.TupleGetItem(op.topk(x, 2, 0, largest=False, dtype="int64"), 0),
         **_distinct(4, 3)),
    Case("topk_values", lambda x: op.topk(x, 3, 0, "values", False), **_distinct(4, 3)),
    Case("topk_indices_no_grad",
         lambda x: x * op.astype(op.topk(x, 4, -1, "indices"), "float64"), **_distinct(3, 4)),
    Case("sort_float32", op.sort, [(3, 4)], dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
