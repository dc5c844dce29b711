import pytest
from tvm import relax
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("permute_dims_default", op.permute_dims, [(3, 4)]),
    Case("permute_dims_axes", lambda x: op.permute_dims(x, [2, 0, 1]), [(2, 3, 4)]),
    Case("concat", lambda x, y: op.concat([x, y], 1), [(2, 3), (2, 4)]),
    Case("concat_three", lambda x, y, z: op.concat([x, y, z], 0), [(1, 3), (2, 3), (3, 3)]),
    Case("split_sections", lambda x: op.split(x, 2, 1), [(3, 4)]),
    Case("split_indices", lambda x: op.split(x, [1, 3], 0), [(5, 2)]),
    Case("reshape", lambda x: op.reshape(x, (6, 2)), [(3, 4)]),
    Case("reshape_shape_expr", lambda x: op.reshape(x, relax.ShapeExpr([2, 2, 3])), [(3, 4)]),
    Case("broadcast_to", lambda x: op.broadcast_to(x, (2, 3, 4)), [(3, 1)]),
    Case("expand_dims_front", lambda x: op.expand_dims(x, 0), [(3, 4)]),
    Case("expand_dims_negative", lambda x: op.expand_dims(x, -1), [(3, 4)]),
    Case("expand_dims_axes", lambda x: op.expand_dims(x, [0, 2]), [(3, 4)]),
    Case("expand_dims_mixed_axes", lambda x: op.expand_dims(x, [-1, 1]), [(3, 4)]),
    Case("expand_dims_float32", lambda x: op.expand_dims(x, 1), [(3,)], dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
