import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case


def _cond_and_values(cond_shape, *shapes):
    """A Case's ``shapes``/``dtype``/``inputs``/``wrt`` for ``where(cond, a, b)``."""

    def inputs(rng):
        cond = rng.integers(0, 2, cond_shape).astype(bool)
        return [cond] + [rng.uniform(-1, 1, s) for s in shapes]

    return {"shapes": [cond_shape, *shapes], "dtype": ("bool",) + ("float64",) * len(shapes),
            "inputs": inputs, "wrt": list(range(1, len(shapes) + 1))}


CASES = [
    Case("where", op.where, **_cond_and_values((3, 4), (3, 4), (3, 4))),
    Case("where_broadcast", op.where, **_cond_and_values((3, 4), (4,), (3, 1))),
    # Integer results: no gradient; each appears inside an expression of x.
    Case("argmax_no_grad", lambda x: x * op.astype(op.argmax(x, 1, True), "float64"), [(3, 4)]),
    Case("argmin_no_grad", lambda x: x * op.astype(op.argmin(x), "float64"), [(3, 4)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
