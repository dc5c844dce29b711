"""The table format of the op tests: one ``Case`` per op variant, one numeric check for all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tvm import relax

from relaxgrad.testing import check_gradients, loss_module


@dataclass
class Case:
    """``fn(*vars)`` builds the op under test from params of ``shapes`` (and ``dtype``).

    ``inputs(rng)`` overrides the random inputs (e.g. integer indices); ``wrt`` selects the
    params to check (default: every float param).
    """

    id: str
    fn: Callable[..., relax.Expr]
    shapes: Sequence
    dtype: str | Sequence[str] = "float64"
    low: float = -1.0
    high: float = 1.0
    inputs: Callable | None = None
    wrt: Sequence[int] | None = None

    def dtypes(self) -> list[str]:
        return [self.dtype] * len(self.shapes) if isinstance(self.dtype, str) else list(self.dtype)

    def types(self):
        return [relax.TensorType(s, d) for s, d in zip(self.shapes, self.dtypes())]

    def make_inputs(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        if self.inputs is not None:
            return self.inputs(rng)
        return [
            rng.uniform(self.low, self.high, shape).astype(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes())
        ]


def run_case(case: Case, seed: int = 0) -> None:
    mod = loss_module(case.fn, case.types(), seed=seed)
    result = check_gradients(mod, inputs=case.make_inputs(seed), wrt=case.wrt, seed=seed)
    assert result.ok, f"{case.id}\n{result}"


def ids(cases):
    return [c.id for c in cases]
