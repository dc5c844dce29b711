"""Kernels over the same rows merged into one (relaxgrad/schedules/groups.py): FuseRowGroups
merges a layer norm's five gradient kernels into one PrimFunc, which RowColumnLocal runs in
one pass over the rows; gradients through it checked against PyTorch (float64) and NumPy."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import cpu_pipeline, host_target
from relaxgrad.schedules import FuseRowGroups, FuseRowReductions, RowColumnLocal

from .test_rows import _compiled_gradients, _module, _normalized, _torch_grads

N = 48


def _fused(mod: tvm.IRModule) -> tvm.IRModule:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              FuseRowReductions(), relax.transform.FuseOps(),
              relax.transform.FuseTIR()]  # fmt: skip
    return tvm.transform.Sequential(passes)(mod)


def _grouped(mod: tvm.IRModule, target=None) -> tvm.IRModule:
    with target or host_target():
        return FuseRowGroups()(mod)


def _kernels(mod: tvm.IRModule) -> list[str]:
    return re.findall(r"cls\.(\w+)", mod.script().split("def main")[-1])


def _layer_norm_gradients(rows, dtype, written_out=False):
    """The relaxgrad gradients of sum(norm(x, gamma, beta) * w), compiled for this CPU, with
    the inputs and the schedule rules chosen (by kernel)."""
    params = [("x", (*rows, N), dtype), ("gamma", (N,), dtype), ("beta", (N,), dtype),
              ("w", (*rows, N), dtype)]  # fmt: skip

    def body(x, gamma, beta, w):
        if written_out:
            normed = _normalized(x, gamma, beta, dtype)
        else:
            normed = op.nn.layer_norm(x, gamma, beta, axes=[-1])
        return op.sum(op.multiply(normed, w))

    arrays, grads, choices = _compiled_gradients(params, body, with_names=True)
    return arrays, [g.numpy() for g in grads], choices


def _gradient_kernels(rows, dtype) -> list[str]:
    """The kernels of the layer norm's gradient (those after the loss's) in the adjoint of
    sum(layer_norm(x, gamma, beta) * w) through the CPU pipeline's FuseRowGroups."""
    params = [("x", (*rows, N), dtype), ("gamma", (N,), dtype), ("beta", (N,), dtype),
              ("w", (*rows, N), dtype)]  # fmt: skip

    def body(x, gamma, beta, w):
        return op.sum(op.multiply(op.nn.layer_norm(x, gamma, beta, axes=[-1]), w))

    mod = relaxgrad.Gradient("main")(_module(params, body))
    passes = list(cpu_pipeline(host_target()).passes)
    names = [p.info.name for p in passes]
    with host_target():
        mod = tvm.transform.Sequential(passes[: names.index("FuseRowGroups") + 1])(mod)
    kernels = re.findall(r"R\.call_tir\((\w+)", mod["main_adjoint"].script())
    # layer_norm, the loss's sum, the two products of the loss's gradient, then the norm's
    assert kernels[:4] == ["layer_norm", "fused_multiply_sum", "multiply", "multiply"], kernels
    return kernels[4:]


def _torch_layer_norm(x, gamma, beta, w):
    return (torch.nn.functional.layer_norm(x, (N,), gamma, beta, 1e-5) * w).sum()


@pytest.mark.parametrize("rows", [(2, 64), (127,)], ids=["128-rows", "127-rows"])
def test_layer_norm_gradient_is_one_kernel_matching_pytorch(rows):
    """The mean's and the variance's row sums, the input's gradient and gamma's and beta's sums
    over the rows: one RowColumnLocal kernel (the two sums, accumulated in float64, are cast
    back to float32 after it)."""
    arrays, grads, choices = _layer_norm_gradients(rows, "float32")
    grouped = [name for name, rule in choices.items() if name.startswith("fused_rows")]
    assert [choices[name] for name in grouped] == ["RowColumnLocal"]
    # dx, dgamma and dbeta, then the casts of the two sums
    assert _gradient_kernels(rows, "float32") == ["fused_rows", "cast1", "cast1"]
    wants = _torch_grads(_torch_layer_norm, [a.astype("float64") for a in arrays])
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_written_out_norm_in_float64_matches_pytorch():
    """The same norm written out of means, subtractions and rsqrt, in float64."""
    arrays, grads, choices = _layer_norm_gradients((2, 64), "float64", written_out=True)
    assert "RowColumnLocal" in choices.values()
    wants = _torch_grads(_torch_layer_norm, arrays)
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def _row_and_column_sums():
    """A row sum ``s``, a matmul that reads it, then a sum over the rows ``c`` and an
    elementwise kernel that reads ``c`` back."""
    params = [("x", (128, N), "float32"), ("w", (N, N), "float32")]

    def body(x, w):
        s = op.sum(op.multiply(x, x), axis=[-1], keepdims=True)
        m = op.matmul(op.multiply(x, s), w)
        c = op.sum(x, axis=[0])
        centered = op.subtract(x, c)
        return relax.Tuple([m, c, s, op.multiply(centered, centered)])

    return _module(params, body)


def test_readers_of_the_group_move_after_it():
    """``s`` and ``c`` (and the product that ``s`` feeds the matmul) merge into one kernel; the
    matmul, which reads it, and the kernel that reads ``c`` (a sum the rows would need before
    it is complete) stay out of the group and move after its call."""
    fused = _fused(_row_and_column_sums())
    assert _kernels(fused) == ["fused_multiply_sum", "multiply1", "matmul", "sum1",
                               "fused_subtract_multiply"]  # fmt: skip
    grouped = _grouped(fused)
    assert _kernels(grouped) == ["fused_rows", "matmul", "fused_subtract_multiply"]
    func = grouped[grouped.get_global_var("fused_rows")]
    assert RowColumnLocal().apply(func, host_target(), False) is not None
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((128, N)).astype("float32"), rng.standard_normal((N, N))
    vm = relax.VirtualMachine(relaxgrad.compile(_row_and_column_sums()), tvm.cpu())
    outs = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w.astype("float32")))
    got = [t.numpy() for t in outs]
    s = (x * x).sum(-1, keepdims=True)
    wants = [(x * s) @ w, x.sum(0), s, (x - x.sum(0)) ** 2]
    for g, want in zip(got, wants):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_input_module_is_left_unchanged_and_other_targets_ignored():
    fused = _fused(_row_and_column_sums())
    before = fused.script()
    _grouped(fused)
    assert fused.script() == before
    assert _grouped(fused, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})).same_as(fused)


def _sum_then_scale(middle: bool) -> tvm.tirx.PrimFunc:
    """``out[i, j] = 0.5 * sum_k x[i, k, j]`` (``middle``) or ``sum_k x[i, j, k]``."""
    x = te.placeholder((4, 32, 48) if middle else (4, 48, 32), "float32", "x")
    k = te.reduce_axis((0, 32), "k")
    total = te.compute(
        (4, 48), lambda i, j: te.sum(x[i, k, j] if middle else x[i, j, k], axis=k), "total"
    )
    out = te.compute((4, 48), lambda i, j: total[i, j] * 0.5, "scaled")
    return te.create_prim_func([x, out])


def test_only_reductions_along_the_row():
    """A sum over a middle axis reads its row with a stride: not a row-local function."""
    assert RowColumnLocal().apply(_sum_then_scale(middle=True), host_target(), False) is None
    assert RowColumnLocal().apply(_sum_then_scale(middle=False), host_target(), False) is not None


def test_blocks_without_a_sum_are_left_to_parallel_loops():
    """A split's parts (GPT-2's q, k and v from one projection) share their rows but sum
    nothing: RowColumnLocal leaves them, and each part is its own parallel, vectorized loop
    (RowColumnLocal ran them in one scalar loop, 3x slower); the values are numpy's."""
    x = relax.Var("x", relax.TensorType((256, 96), "float32"))
    b = relax.Var("b", relax.TensorType((96,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, b]):
        with bb.dataflow():
            parts = bb.emit(op.split(op.reshape(op.add(x, b), (4, 64, 96)), 3, axis=2))
            out = bb.emit_output(parts)
        bb.emit_func_output(out)
    mod = bb.get()
    schedule = relaxgrad.schedules.ScheduleCPU()
    vm = relax.VirtualMachine(relaxgrad.compile(mod, schedule=schedule), tvm.cpu())
    assert set(schedule.choices.values()) == {"ParallelLoops"}
    rng = np.random.default_rng(2)
    xv, bv = (rng.standard_normal(s).astype("float32") for s in ((256, 96), (96,)))
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(bv))
    for part, want in zip(got, np.split((xv + bv).reshape(4, 64, 96), 3, axis=2)):
        np.testing.assert_allclose(part.numpy(), want, rtol=1e-6)


def test_too_few_rows_start_no_group(monkeypatch):
    """A kernel reducing along fewer rows than ``min_rows`` (64) starts no group, without a
    merged function being built or tried against the rules (a small model's compile spent
    0.3 s on those trials); from ``min_rows`` rows on, the group is made."""
    from relaxgrad.schedules import groups

    tried = []
    schedules = groups._Grouper._schedules
    monkeypatch.setattr(groups._Grouper, "_schedules",
                        lambda self, prim: tried.append(1) or schedules(self, prim))
    assert "fused_rows" not in _gradient_kernels((63,), "float32") and not tried
    assert "fused_rows" in _gradient_kernels((64,), "float32") and tried


def test_a_reshape_round_trip_leaves_the_row_reductions_one_pass():
    """A log-softmax written out (max, sum of exponentials, log) of logits reshaped to
    ``(1, rows, V)`` and back, as an imported language model's are: the pipeline drops the
    round trip (TVM's ``RemoveRedundantReshape``), so the row reductions of the forward merge
    into one kernel over the rows (the reshapes' blocks kept them apart); the gradients are
    PyTorch's."""
    shape = (128, 1000)
    params = [("x", shape, "float32"), ("w", shape, "float32")]

    def body(x, w):
        y = op.reshape(op.reshape(x, (1, *shape)), shape)
        shifted = op.subtract(y, op.max(y, axis=[-1], keepdims=True))
        total = op.sum(op.exp(shifted), axis=[-1], keepdims=True)
        return op.sum(op.multiply(op.subtract(shifted, op.log(total)), w))

    arrays, grads, choices = _compiled_gradients(params, body, with_names=True)
    assert not [name for name in choices if "reshape" in name]
    assert [name for name in choices if name.startswith("fused_rows")]
    wants = _torch_grads(lambda x, w: (torch.log_softmax(x, -1) * w).sum(),
                         [a.astype("float64") for a in arrays])  # fmt: skip
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
