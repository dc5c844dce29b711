"""Vectorized loops TVM 0.27 cannot build (relaxgrad/schedules/serial.py): loops over
``sinh`` and ``cosh`` run serially, so programs with them compile, with tvm.compile's values,
and their gradients match PyTorch. (Blocks of several results: test_unit_reductions.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import host_target
from relaxgrad.schedules import ScheduleCPU, SerialVectorLoops

from .test_rows import _module, _torch_grads


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(5,), (64, 256)], ids=["5", "64x256"])
def test_sinh_and_cosh_compile_with_tvm_compile_values(dtype, shape):
    mod = _module([("x", shape, dtype)], lambda x: relax.Tuple([op.sinh(x), op.cosh(x)]))
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype) * 3
    x.flat[0] = 1e-6  # sinh's cancellation, were it e^x - e^-x
    results = []
    for build in (relaxgrad.compile, lambda m: tvm.compile(m, "llvm")):
        vm = relax.VirtualMachine(build(mod), tvm.cpu())
        results.append([t.numpy() for t in vm["main"](tvm.runtime.tensor(x))])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    rtol = 1e-6 if dtype == "float32" else 1e-14
    np.testing.assert_allclose(results[0][0], np.sinh(x), rtol=rtol)


def test_only_loops_over_them_become_serial():
    mod = _module([("x", (256, 256), "float32")],
                  lambda x: relax.Tuple([op.cosh(x), op.exp(x)]))  # fmt: skip
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), relax.transform.FuseTIR(), ScheduleCPU()]  # fmt: skip
    with host_target():
        scheduled = tvm.transform.Sequential(passes)(mod)
    after = SerialVectorLoops()(scheduled)

    def loops(module, name):
        return re.findall(r"for \w+ in (T\.\w+)", module[name].script())

    assert "T.vectorized" in loops(scheduled, "tir_cosh")
    assert "T.vectorized" not in loops(after, "tir_cosh")
    assert "T.parallel" in loops(after, "tir_cosh")
    assert loops(after, "tir_exp") == loops(scheduled, "tir_exp")
    assert "T.vectorized" in loops(after, "tir_exp")


def test_sinh_gradient_matches_pytorch():
    """``sum(sinh(x @ w) * t)``: the gradient reads ``cosh``."""
    params = [("x", (128, 64), "float64"), ("w", (64, 32), "float64"),
              ("t", (128, 32), "float64")]  # fmt: skip
    mod = relaxgrad.Gradient("main")(
        _module(params, lambda x, w, t: op.sum(op.multiply(op.sinh(op.matmul(x, w)), t)))
    )
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape) * 0.3 for _, shape, _ in params]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])
    wants = _torch_grads(lambda x, w, t: (torch.sinh(x @ w) * t).sum(), arrays)
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
