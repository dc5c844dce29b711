import pytest
from tvm import tirx
from tvm.relax import op

from ._spec import Case, ids, run_case

CASES = [
    Case("sum_all", op.sum, [(3, 4)]),
    Case("sum_axis", lambda x: op.sum(x, 1), [(3, 4)]),
    Case("sum_axes_keepdims", lambda x: op.sum(x, [0, 2], keepdims=True), [(2, 3, 4)]),
    Case("sum_negative_axis", lambda x: op.sum(x, -1), [(2, 3, 4)]),
    Case("mean_all", op.mean, [(3, 4)]),
    Case("mean_axis", lambda x: op.mean(x, [0]), [(3, 4)]),
    Case("mean_keepdims", lambda x: op.mean(x, 1, keepdims=True), [(3, 4)]),
    Case("mean_negative_axes", lambda x: op.mean(x, [-1, 0]), [(2, 3, 4)]),
    Case("mean_float32", lambda x: op.mean(x, 0), [(3, 4)], dtype="float32"),
    Case("variance_all", op.variance, [(3, 4)]),
    Case("variance_axis", lambda x: op.variance(x, 1), [(3, 4)]),
    Case("variance_keepdims", lambda x: op.variance(x, 0, keepdims=True), [(3, 4)]),
    Case("variance_negative_axes", lambda x: op.variance(x, [-1, 0]), [(2, 3, 4)]),
    Case("variance_all_keepdims", lambda x: op.variance(x, keepdims=True), [(2, 3)]),
    Case("variance_float32", lambda x: op.variance(x, 1), [(3, 4)], dtype="float32"),
    Case("cumsum_axis0", lambda x: op.cumsum(x, 0), [(3, 4)]),
    Case("cumsum_axis1", lambda x: op.cumsum(x, 1), [(3, 4)]),
    Case("cumsum_negative_axis", lambda x: op.cumsum(x, -2), [(2, 3, 4)]),
    Case("cumsum_flattened", op.cumsum, [(3, 4)]),
    Case("cumsum_exclusive", lambda x: op.cumsum(x, 1, exclusive=True), [(3, 4)]),
    Case("cumsum_flattened_exclusive", lambda x: op.cumsum(x, exclusive=True), [(2, 3)]),
    Case("cumsum_dtype", lambda x: op.cumsum(x, 0, "float64"), [(3, 4)], dtype="float32"),
    Case("cumsum_float32", lambda x: op.cumsum(x, 1), [(3, 4)], dtype="float32"),
]



def _with_zeros(shape, zeros):
    """Random inputs of ``shape`` with exact zeros at the flat positions ``zeros``."""

    def inputs(rng):
        x = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)
        x.flat[list(zeros)] = 0.0
        return [x]

    return inputs


CASES += [
    Case("max_all", op.max, [(3, 4)]),
    Case("max_axis", lambda x: op.max(x, 1), [(3, 4)]),
    Case("max_axes_keepdims", lambda x: op.max(x, [0, 2], keepdims=True), [(2, 3, 4)]),
    Case("max_negative_axis", lambda x: op.max(x, -1), [(2, 3, 4)]),
    Case("min_all", op.min, [(3, 4)]),
    Case("min_axis_keepdims", lambda x: op.min(x, 0, keepdims=True), [(3, 4)]),
    Case("min_negative_axes", lambda x: op.min(x, [-1, 0]), [(2, 3, 4)]),
    Case("max_float32", lambda x: op.max(x, 1), [(3, 4)], dtype="float32"),
    Case("min_float16", lambda x: op.min(x, 1), [(3, 4)], dtype="float16"),
    Case("prod_all", op.prod, [(3, 4)], low=0.5, high=1.5),
    Case("prod_axis", lambda x: op.prod(x, 1), [(3, 4)]),
    Case("prod_axes_keepdims", lambda x: op.prod(x, [0, 2], keepdims=True), [(2, 3, 4)]),
    Case("prod_negative_axis", lambda x: op.prod(x, -2), [(2, 3, 4)]),
    # one zero in a group: only it gets a gradient there; two zeros: none does
    Case("prod_zeros", lambda x: op.prod(x, 1), [(3, 4)], inputs=_with_zeros((3, 4), [1, 4, 5])),
    Case("prod_all_one_zero", op.prod, [(2, 3)], inputs=_with_zeros((2, 3), [4])),
    Case("prod_float32", lambda x: op.prod(x, 0), [(3, 4)], dtype="float32"),
    Case("std_all", op.std, [(3, 4)]),
    Case("std_axis", lambda x: op.std(x, 1), [(3, 4)]),
    Case("std_keepdims_negative", lambda x: op.std(x, [-1, 0], keepdims=True), [(2, 3, 4)]),
    Case("std_float32", lambda x: op.std(x, 0), [(3, 4)], dtype="float32"),
    Case("cumprod_axis0", lambda x: op.cumprod(x, 0), [(3, 4)]),
    Case("cumprod_axis1", lambda x: op.cumprod(x, 1), [(3, 4)]),
    Case("cumprod_negative_axis", lambda x: op.cumprod(x, -2), [(2, 3, 4)]),
    Case("cumprod_flattened", op.cumprod, [(2, 3)]),
    Case("cumprod_exclusive", lambda x: op.cumprod(x, 1, exclusive=True), [(3, 4)]),
    Case("cumprod_flattened_exclusive", lambda x: op.cumprod(x, exclusive=True), [(2, 3)]),
    Case("cumprod_zeros", lambda x: op.cumprod(x, 1), [(3, 4)],
         inputs=_with_zeros((3, 4), [1, 4, 5, 11])),
    Case("cumprod_dtype", lambda x: op.cumprod(x, 0, "float64"), [(3, 4)], dtype="float32"),
    Case("cumprod_float16", lambda x: op.cumprod(x, 1), [(3, 4)], dtype="float16"),
]

# Symbolic dims: the count of reduced elements is computed at run time.
N = tirx.Var("n", "int64")


def _symbolic(rng):
    return [rng.uniform(-1, 1, (5, 4))]


CASES += [
    Case("mean_symbolic_all", op.mean, [(N, 4)], inputs=_symbolic),
    Case("mean_symbolic_axis", lambda x: op.mean(x, 0), [(N, 4)], inputs=_symbolic),
    Case("variance_symbolic_axis", lambda x: op.variance(x, [0]), [(N, 4)], inputs=_symbolic),
    Case("max_symbolic_axis", lambda x: op.max(x, 0), [(N, 4)], inputs=_symbolic),
    Case("std_symbolic_axis", lambda x: op.std(x, [0]), [(N, 4)], inputs=_symbolic),
    Case("variance_symbolic_float32", lambda x: op.variance(x, 0), [(N, 4)], dtype="float32",
         inputs=lambda rng: [a.astype("float32") for a in _symbolic(rng)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
