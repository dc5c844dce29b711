"""The table format of the op tests: one ``Case`` per op variant, one numeric check for all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax

import relaxgrad
from relaxgrad.testing import FAST_LLVM, check_gradients, loss_module


@dataclass
class Case:
    """``fn(*vars)`` builds the op under test from params of ``shapes`` (and ``dtype``).

    ``inputs(rng)`` overrides the random inputs (e.g. integer indices); ``wrt`` selects the
    params to check (default: every float param); ``eps``/``tol`` override the finite-difference
    step and tolerance of the dtype.
    """

    id: str
    fn: Callable[..., relax.Expr]
    shapes: Sequence
    dtype: str | Sequence[str] = "float64"
    low: float = -1.0
    high: float = 1.0
    inputs: Callable | None = None
    wrt: Sequence[int] | None = None
    eps: float | None = None
    tol: float | None = None

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
    if "float16" in case.dtypes():
        _run_half_case(case, seed)
        return
    mod = loss_module(case.fn, case.types(), seed=seed)
    result = check_gradients(
        mod, inputs=case.make_inputs(seed), wrt=case.wrt, seed=seed, eps=case.eps, tol=case.tol,
        target=FAST_LLVM,
    )
    assert result.ok, f"{case.id}\n{result}"


def _run_half_case(case: Case, seed: int) -> None:
    """float16: finite differences drown in rounding, so the float16 adjoint is compared with
    the float32 adjoint of the same case on the same inputs (tests check that one by finite
    differences; float32, as some TVM kernels, e.g. layer_norm, support no float64)."""
    wide = replace(case, dtype=["float32" if d == "float16" else d for d in case.dtypes()])
    inputs = case.make_inputs(seed)
    wide_inputs = [a.astype("float32") if a.dtype == np.float16 else a for a in inputs]
    half, ref = adjoints(case, inputs, seed), adjoints(wide, wide_inputs, seed)
    for i, (h, r) in enumerate(zip(half, ref)):
        assert h.dtype == np.float16, f"{case.id}: gradient {i} is {h.dtype}, not float16"
        scale = max(1.0, float(np.max(np.abs(r))))
        err = float(np.max(np.abs(h.astype("float64") - r))) / scale
        assert err <= (case.tol or 2e-2), f"{case.id}: gradient {i} off by {err:.3g} (relative)"


def adjoints(case: Case, inputs, seed: int = 0) -> list[np.ndarray]:
    """The gradients relaxgrad computes for the case's loss module on ``inputs`` (llvm)."""
    mod = loss_module(case.fn, case.types(), seed=seed)
    params = list(mod["main"].params)
    wrt = case.wrt
    if wrt is None:
        wrt = [i for i, d in enumerate(case.dtypes()) if d.startswith("float")]
    mod = relaxgrad.Gradient("main", [params[i] for i in wrt])(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=FAST_LLVM), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(np.asarray(a)) for a in inputs])
    return [g.numpy() for g in grads]


def ids(cases):
    return [c.id for c in cases]
