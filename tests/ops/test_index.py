import numpy as np
import pytest
from tvm.relax import op

from relaxgrad import GradientError

from ._spec import Case, ids, run_case


def _take(x_shape, indices, dtype="float64"):
    """A Case's ``shapes``/``dtype``/``inputs`` for take of fixed integer ``indices``."""
    indices = np.asarray(indices, "int64")

    def inputs(rng):
        return [rng.uniform(-1, 1, x_shape).astype(dtype), indices]

    return {"shapes": [x_shape, indices.shape], "dtype": (dtype, "int64"), "inputs": inputs,
            "wrt": [0]}


# Repeated indices check the accumulation; out-of-range ones the clip/wrap modes.
CASES = [
    Case("take_axis0", lambda x, i: op.take(x, i, 0), **_take((4, 3), [2, 0, 2])),
    Case("take_axis1", lambda x, i: op.take(x, i, 1), **_take((3, 4), [3, 1, 1, 0])),
    Case("take_negative_axis", lambda x, i: op.take(x, i, -1), **_take((2, 3, 4), [1, 1, 3])),
    Case("take_middle_axis", lambda x, i: op.take(x, i, 1), **_take((2, 3, 4), [2, 0])),
    Case("take_axis_none", lambda x, i: op.take(x, i), **_take((5,), [4, 0, 4, 2])),
    Case("take_2d_indices", lambda x, i: op.take(x, i, 0), **_take((4, 3), [[0, 3], [3, 1]])),
    Case("take_2d_indices_last_axis", lambda x, i: op.take(x, i, -1),
         **_take((2, 4), [[0, 3, 3], [1, 2, 0]])),
    Case("take_scalar_index", lambda x, i: op.take(x, i, 1), **_take((3, 4), 2)),
    Case("take_clip", lambda x, i: op.take(x, i, 0, mode="clip"), **_take((4, 3), [-2, 1, 7])),
    Case("take_wrap", lambda x, i: op.take(x, i, 1, mode="wrap"), **_take((3, 4), [-1, 5, 2])),
    Case("take_float32", lambda x, i: op.take(x, i, 0), **_take((4, 3), [1, 1, 0], "float32")),
]


def _ss(axes, begin, end, strides=None):
    return lambda x: op.strided_slice(x, axes, begin, end, strides)


CASES += [
    Case("strided_slice", _ss([1], [1], [3]), [(3, 4)]),
    Case("slice_scatter", lambda x, s: op.slice_scatter(x, s, 1, 4, 1, axis=1), [(3, 5), (3, 3)]),
    Case("slice_scatter_step", lambda x, s: op.slice_scatter(x, s, 0, 6, 2, axis=0),
         [(6, 2), (3, 2)]),
    Case("strided_slice_two_axes", _ss([0, 2], [1, 0], [3, 2]), [(3, 2, 4)]),
    Case("strided_slice_negative_axis_begin", _ss([-1], [-3], [4]), [(2, 5)]),
    Case("strided_slice_end_past_dim", _ss([0], [1], [100]), [(4, 3)]),
    Case("strided_slice_stride", _ss([1], [0], [5], [2]), [(3, 5)]),
    Case("strided_slice_stride_remainder", _ss([1], [1], [6], [3]), [(2, 7)]),
    Case("strided_slice_negative_stride", _ss([0], [3], [0], [-1]), [(5, 2)]),
    Case("strided_slice_reverse_all", _ss([1], [-1], [-100], [-1]), [(2, 4)]),
    Case("strided_slice_negative_stride_2", _ss([1], [5], [0], [-2]), [(2, 7)]),
    Case("strided_slice_mixed", _ss([0, 1, 2], [2, 0, 1], [0, 4, 4], [-1, 3, 2]), [(3, 5, 5)]),
    Case("strided_slice_empty", lambda x: op.sum(x * x) + op.sum(_ss([0], [2], [2])(x)),
         [(3, 2)]),
    Case("strided_slice_float32", _ss([1], [0], [4], [2]), [(3, 4)], dtype="float32"),
    Case("strided_slice_float16", _ss([0, 1], [1, 3], [3, 0], [1, -1]), [(3, 4)],
         dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def test_take_nan_mode_has_no_rule():
    case = Case("take_nan", lambda x, i: op.take(x, i, 0, mode="nan"), **_take((4, 3), [1]))
    with pytest.raises(GradientError, match=r"relax.take .*mode='nan'"):
        run_case(case)
