import numpy as np
import pytest
from tvm import relax
from tvm.relax import op

from relaxgrad import GradientError

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
    Case("squeeze_all", op.squeeze, [(3, 1, 4, 1)]),
    Case("squeeze_axis", lambda x: op.squeeze(x, [1]), [(3, 1, 4, 1)]),
    Case("squeeze_negative_axis", lambda x: op.squeeze(x, -1), [(3, 1, 4, 1)]),
    Case("flatten", op.flatten, [(2, 3, 4)]),
    Case("flip_axis0", lambda x: op.flip(x, 0), [(3, 4)]),
    Case("flip_negative_axis", lambda x: op.flip(x, -1), [(2, 3, 4)]),
    Case("tile", lambda x: op.tile(x, [2, 3]), [(3, 4)]),
    Case("tile_more_repeats", lambda x: op.tile(x, [2, 1, 3]), [(3, 4)]),
    Case("tile_fewer_repeats", lambda x: op.tile(x, 2), [(2, 3, 4)]),
    Case("repeat_axis0", lambda x: op.repeat(x, 2, 0), [(3, 4)]),
    Case("repeat_negative_axis", lambda x: op.repeat(x, 3, -1), [(2, 3, 4)]),
    Case("repeat_flattened", lambda x: op.repeat(x, 2), [(2, 3)]),
    Case("stack", lambda x, y: op.stack([x, y], 0), [(3, 4), (3, 4)]),
    Case("stack_negative_axis", lambda x, y, z: op.stack([x, y, z], -1), [(3, 4)] * 3),
    Case("stack_middle_axis", lambda x, y: op.stack([x, y], 1), [(3, 4), (3, 4)]),
    Case("one_hot_no_grad",
         lambda x, i: x * op.one_hot(i, 2.0, 0.5, 4),
         [(3, 4), (3,)], dtype=("float64", "int64"),
         inputs=lambda rng: [rng.uniform(-1, 1, (3, 4)), np.array([0, 3, 3])], wrt=[0]),
]
CASES += [
    Case(f"{name}_{dtype}", fn, [(3, 4)], dtype=dtype)
    for name, fn in [("tile", lambda x: op.tile(x, [2, 1])),
                     ("repeat", lambda x: op.repeat(x, 2, 1)),
                     ("flip", lambda x: op.flip(x, 1))]
    for dtype in ("float32", "float16")
]


def _indexed(x_shape, indices, *more_shapes, dtype="float64"):
    """A Case's ``shapes``/``dtype``/``inputs``/``wrt`` for ``fn(x, indices, *more)`` with fixed
    integer ``indices`` and random float ``x`` and ``more``."""
    indices = np.asarray(indices, "int64")
    shapes = [x_shape, indices.shape, *more_shapes]

    def inputs(rng):
        floats = [rng.uniform(-1, 1, s).astype(dtype) for s in (x_shape, *more_shapes)]
        return [floats[0], indices, *floats[1:]]

    dtypes = (dtype, "int64") + (dtype,) * len(more_shapes)
    wrt = [0] + [2 + i for i in range(len(more_shapes))]
    return {"shapes": shapes, "dtype": dtypes, "inputs": inputs, "wrt": wrt}


# Indices repeat, so gradients accumulate.
IDX_3x4 = [[0, 2, 2, 1], [1, 1, 0, 0], [2, 0, 1, 2]]
CASES += [
    Case("gather_elements_axis0", lambda x, i: op.gather_elements(x, i, 0),
         **_indexed((3, 4), IDX_3x4)),
    Case("gather_elements_axis1", lambda x, i: op.gather_elements(x, i, 1),
         **_indexed((3, 3), [[0, 2], [1, 1], [2, 0]])),
    Case("gather_elements_negative_axis", lambda x, i: op.gather_elements(x, i, -1),
         **_indexed((2, 2, 3), [[[2, 2], [0, 1]], [[1, 0], [1, 1]]])),
    Case("gather_elements_float32", lambda x, i: op.gather_elements(x, i, 0),
         **_indexed((3, 4), IDX_3x4, dtype="float32")),
    Case("gather_nd", lambda x, i: op.gather_nd(x, i),
         **_indexed((3, 4), [[0, 1], [2, 3], [0, 1]])),
    Case("gather_nd_slices", lambda x, i: op.gather_nd(x, i),
         **_indexed((3, 4, 2), [[[1], [0]], [[1], [2]]])),
    Case("gather_nd_batch_dims", lambda x, i: op.gather_nd(x, i, 1),
         **_indexed((2, 3, 4), [[[0, 1], [2, 3], [0, 1]], [[1, 1], [1, 1], [2, 0]]])),
    Case("gather_nd_batch_dims_slices", lambda x, i: op.gather_nd(x, i, 1),
         **_indexed((2, 3, 4), [[[2], [0]], [[1], [1]]])),
    Case("gather_nd_float32", lambda x, i: op.gather_nd(x, i),
         **_indexed((3, 4), [[0, 1], [2, 3], [0, 1]], dtype="float32")),
]

# scatter_elements: indices (2, 4) into data (3, 4) along axis 0, with collisions in columns 1, 2
SCATTER_IDX = [[0, 2, 1, 1], [2, 2, 1, 0]]
CASES += [
    Case(f"scatter_elements_{reduction}",
         lambda x, i, u, r=reduction: op.scatter_elements(x, i, u, 0, r),
         **_indexed((3, 4), SCATTER_IDX, (2, 4)))
    for reduction in ("update", "add", "max", "min")
]
CASES += [
    Case("scatter_elements_axis1", lambda x, i, u: op.scatter_elements(x, i, u, 1),
         **_indexed((3, 4), [[3, 0], [1, 1], [2, 0]], (3, 2))),
    Case("scatter_elements_negative_axis_add",
         lambda x, i, u: op.scatter_elements(x, i, u, -1, "add"),
         **_indexed((3, 4), [[3, 0], [1, 1], [2, 0]], (3, 2))),
    Case("scatter_elements_float32", lambda x, i, u: op.scatter_elements(x, i, u, 0, "add"),
         **_indexed((3, 4), SCATTER_IDX, (2, 4), dtype="float32")),
]
CASES += [
    Case(f"scatter_nd_{reduction}", lambda x, i, u, r=reduction: op.scatter_nd(x, i, u, r),
         **_indexed((3, 4), [[0, 1], [2, 3], [0, 1]], (3,)))
    for reduction in ("update", "add", "max", "min")
]
CASES += [
    Case("scatter_nd_slices", lambda x, i, u: op.scatter_nd(x, i, u, "update"),
         **_indexed((3, 4), [[2], [0], [2]], (3, 4))),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


@pytest.mark.parametrize("reduction", ["mul", "mean"])
def test_scatter_elements_reduction_has_no_rule(reduction):
    case = Case("scatter", lambda x, i, u: op.scatter_elements(x, i, u, 0, reduction),
                **_indexed((3, 4), SCATTER_IDX, (2, 4)))
    with pytest.raises(GradientError, match=f"relax.scatter_elements .*reduction='{reduction}'"):
        run_case(case)
