"""Reductions over axes of extent 1 (a matmul of k = 1, a sum, max or argmax over an axis of
1) with a fused epilogue: the schedule step writes them as spatial blocks first
(``without_unit_reductions``), since dlight's normalization kept their ``T.init`` and an
inlined epilogue was applied twice (``matmul(a, b) + c`` computed ``a @ b + 2 c``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules._common import without_unit_reductions

from .test_rows import _module, _torch_grads

CASES = {
    "matmul-k1-add": ([(4, 1), (1, 300), (4, 300)],
                      lambda a, b, c: op.add(op.matmul(a, b), c),
                      lambda a, b, c: a @ b + c),
    "sum-axis1-add": ([(64, 1, 300), (64, 300)],
                      lambda x, c: op.add(op.sum(x, axis=[1]), c),
                      lambda x, c: x.sum(1) + c),
    "max-axis1-multiply": ([(64, 1, 300), (64, 300)],
                           lambda x, c: op.multiply(op.max(x, axis=[1]), c),
                           lambda x, c: x.max(1) * c),
    "argmax-axis1-add": ([(64, 1, 300), (64, 300)],
                         lambda x, c: op.add(op.astype(op.argmax(x, axis=1), x.ty.dtype), c),
                         lambda x, c: x.argmax(1) + c),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_unit_reductions_with_an_epilogue_compute_their_values(case, dtype):
    shapes, body, reference = CASES[case]
    mod = _module([(f"x{i}", s, dtype) for i, s in enumerate(shapes)], body)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()
    np.testing.assert_allclose(got, reference(*arrays), rtol=1e-6, atol=1e-6)


def test_linear_layer_of_one_input_feature_gradients_match_pytorch():
    """``sum(tanh(x @ w + b) * t)`` with x of shape (N, 1): the forward is a product of
    k = 1 with an epilogue."""
    params = [("x", (32, 1), "float64"), ("w", (1, 16), "float64"), ("b", (16,), "float64"),
              ("t", (32, 16), "float64")]  # fmt: skip
    mod = relaxgrad.Gradient("main")(_module(
        params, lambda x, w, b, t: op.sum(op.multiply(op.tanh(op.add(op.matmul(x, w), b)), t))))
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(shape) for _, shape, _ in params]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])
    x, w, b, t = arrays
    np.testing.assert_allclose(loss.numpy(), (np.tanh(x @ w + b) * t).sum(), rtol=1e-12)
    wants = _torch_grads(lambda x, w, b, t: (torch.tanh(x @ w + b) * t).sum(), arrays)
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_only_unit_reductions_are_rewritten():
    def legalized(k):
        mod = _module([("a", (4, k), "float32"), ("b", (k, 3), "float32")],
                      lambda a, b: op.matmul(a, b))  # fmt: skip
        return relax.transform.LegalizeOps()(mod)["matmul"]

    proper = legalized(2)
    assert without_unit_reductions(proper).script() == proper.script()
    unit = without_unit_reductions(legalized(1)).script()
    assert "T.init" not in unit and '"SS"' in unit
    assert "matmul[v_i0, v_i1] = T.Add(T.float32(0.0), a[v_i0, T.int64(0)] * b[T.int64(0), v_i1])" \
        in unit


def test_max_pool_of_windows_of_one_gradient_matches_pytorch():
    """A 1x1 max-pool of stride 2 (ceil mode): its gradient's argmax over windows of one
    element keeps two results (index and value) per window, a block that TVM 0.27 builds wrong
    vectorized (the gradient was all zeros)."""
    params = [("x", (1, 2, 3, 2), "float64"), ("w", (1, 2, 2, 1), "float64")]

    def body(x, w):
        pooled = op.nn.max_pool2d(x, pool_size=[1, 1], strides=[2, 2], ceil_mode=True)
        return op.sum(op.multiply(pooled, w))

    mod = relaxgrad.Gradient("main")(_module(params, body))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape) for _, shape, _ in params]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])

    def reference(x, w):
        return (torch.nn.functional.max_pool2d(x, 1, 2, ceil_mode=True) * w).sum()

    for got, want in zip(grads, _torch_grads(reference, arrays)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_argmax_of_one_element_is_rewritten_with_both_results():
    """An argmax keeps an index and a value: both stores read the initial values instead."""
    mod = _module([("x", (4, 1, 3), "float32")], lambda x: op.argmax(x, axis=1))
    func = relax.transform.LegalizeOps()(mod)["argmax"]
    unit = without_unit_reductions(func).script()
    assert "T.init" not in unit and unit.count("T.let") == 2


@pytest.mark.parametrize("shape", [(24, 64, 1, 1), (3, 40, 1), (8, 1, 1)])
def test_sums_over_trailing_dimensions_of_one_are_vector_partials(shape):
    """A full sum of a 1x1 convolution's ``(O, I, 1, 1)`` weight (the gradient norm of
    clipping) reads along ``I``: accumulated in vectors, as a sum over a row is, not one scalar
    chain (which LLVM unrolled into 1,536 dependent adds: 8,000 lines of IR for one kernel);
    the same value as numpy's float64 sum, and the gradient of ``sum(w * w)`` is ``2 w``."""
    mod = relaxgrad.Gradient("main")(_module([("w", shape, "float32")],
                                             lambda w: op.sum(op.multiply(w, w))))
    schedule = relaxgrad.pipeline.ScheduleCPU()
    executable = relaxgrad.compile(mod, schedule=schedule)
    reductions = [name for name in schedule.choices if "sum" in name]
    assert reductions and all(schedule.choices[n] == "ParallelLoops" for n in reductions)
    code = "".join(m.inspect_source("ll") for m in executable.mod.imports if m.kind == "llvm")
    if shape[1] % 8 == 0:
        assert re.search(r"<(4|8|16) x float>", code)  # the vector width is the CPU's
        assert code.count("\n") < 3000, code.count("\n")
    w = np.random.default_rng(2).standard_normal(shape).astype("float32")
    loss, (grad,) = relax.VirtualMachine(executable, tvm.cpu())["main_adjoint"](
        tvm.runtime.tensor(w))
    np.testing.assert_allclose(loss.numpy(), (w.astype("float64") ** 2).sum(), rtol=1e-6)
    np.testing.assert_allclose(grad.numpy(), 2 * w, rtol=1e-6)
