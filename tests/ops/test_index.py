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


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def test_take_nan_mode_has_no_rule():
    case = Case("take_nan", lambda x, i: op.take(x, i, 0, mode="nan"), **_take((4, 3), [1]))
    with pytest.raises(GradientError, match=r"relax.take .*mode='nan'"):
        run_case(case)
