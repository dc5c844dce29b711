import numpy as np
import pytest
from tvm.relax import op

from ._spec import Case, ids, run_case


def _probs(rng):
    logits = rng.uniform(-1, 1, (3, 5)).astype("float64")
    label = rng.dirichlet(np.ones(5), 3).astype("float64")
    return [logits, label]


CASES = [
    Case("softmax", op.nn.softmax, [(3, 5)]),
    Case("softmax_axis0", lambda x: op.nn.softmax(x, 0), [(3, 5)]),
    Case("log_softmax", op.nn.log_softmax, [(3, 5)]),
    Case("log_softmax_axis0", lambda x: op.nn.log_softmax(x, 0), [(3, 5)]),
    Case("cross_entropy_with_logits", op.nn.cross_entropy_with_logits, [(3, 5), (3, 5)],
         inputs=_probs),
    Case("cross_entropy_with_logits_1d", op.nn.cross_entropy_with_logits, [(5,), (5,)]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)
