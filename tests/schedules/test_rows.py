"""Row-local kernels (relaxgrad/schedules/rows.py): reductions along the innermost axes fused
with the elementwise ops that read them (FuseRowReductions) and computed row by row in one
parallel loop (RowLocal); gradients through them checked against PyTorch in float64."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import host_target
from relaxgrad.schedules import FuseRowReductions, RowColumnLocal, RowLocal, ScheduleCPU

SHAPE = (4, 32, 48)  # 128 rows of 48


def _module(params, body) -> tvm.IRModule:
    args = [relax.Var(name, relax.TensorType(shape, dtype)) for name, shape, dtype in params]
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(body(*args))
        bb.emit_func_output(out)
    return bb.get()


def _legalized(mod: tvm.IRModule) -> tvm.IRModule:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    return tvm.transform.Sequential(passes)(mod)


def _patterns(mod: tvm.IRModule) -> dict[str, int]:
    return {
        gvar.name_hint: int(func.attrs["op_pattern"])
        for gvar, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc)
    }


def _fused(mod: tvm.IRModule) -> tvm.IRModule:
    passes = [FuseRowReductions(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(passes)(_legalized(mod))


def _kernels(mod: tvm.IRModule) -> list[str]:
    return re.findall(r"cls\.(\w+)", mod.script().split("def main")[-1])


def test_only_reductions_along_rows_become_injective():
    params = [("x", SHAPE, "float32"), ("s", (2, 48), "float32")]
    mod = _module(params, lambda x, s: relax.Tuple([
        op.sum(x, axis=[-1], keepdims=True),  # rows: marked
        op.max(x, axis=[2]),  # rows, dims dropped: marked
        op.sum(x, axis=[1, 2]),  # the last two axes of 4 rows: too few rows
        op.sum(x, axis=[0]),  # over the leading axis: a column reduction
        op.sum(s, axis=[-1]),  # 2 rows
    ]))  # fmt: skip
    before = _patterns(_legalized(mod))
    after = _patterns(FuseRowReductions()(_legalized(mod)))
    assert set(before.values()) == {3}  # kCommReduce
    assert after == {"sum": 2, "max": 2, "sum1": 3, "sum2": 3, "sum3": 3}
    assert _patterns(FuseRowReductions(min_rows=2)(_legalized(mod)))["sum3"] == 2


def _softmax_grad(g, y):
    return op.multiply(op.subtract(g, op.sum(op.multiply(g, y), axis=[-1], keepdims=True)), y)


def test_softmax_gradient_is_one_row_local_kernel():
    mod = _module([("g", SHAPE, "float32"), ("y", SHAPE, "float32")], _softmax_grad)
    fused = _fused(mod)
    assert _kernels(fused) == ["fused_multiply_sum_subtract_multiply"]
    func = fused["fused_multiply_sum_subtract_multiply"]
    sch = RowLocal().apply(func, host_target(), False)
    assert sch is not None
    loops = [s for s in re.findall(r"for (\w+) in (T\.\w+)", sch.mod["main"].script())]
    assert loops[0][1] == "T.parallel" and sum(kind == "T.parallel" for _, kind in loops) == 1
    assert any(kind == "T.vectorized" for _, kind in loops)


def test_blocks_on_other_rows_are_left_to_other_rules():
    """Layer norm's dgamma: row sums in one kernel with the sum over the rows that reads them
    (a column reduction), so no rows are shared."""

    def body(x, mean):
        centered = op.subtract(x, mean)
        rstd = op.rsqrt(op.sum(op.multiply(centered, centered), axis=[-1], keepdims=True))
        return op.sum(op.multiply(centered, rstd), axis=[0, 1])

    mod = _module([("x", SHAPE, "float32"), ("mean", SHAPE[:2] + (1,), "float32")], body)
    fused = _fused(mod)
    (name,) = _kernels(fused)
    assert RowLocal().apply(fused[name], host_target(), False) is None


def _compiled_gradients(params, body, with_names=False) -> tuple[list, list, set | dict]:
    """Random inputs of ``params``, the gradients of ``sum(body(...))``'s relaxgrad adjoint at
    them (compiled for this CPU), and the schedule rules chosen for its kernels (by kernel
    name if ``with_names``)."""
    mod = relaxgrad.Gradient("main")(_module(params, body))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(dtype) for _, shape, dtype in params]
    schedule = ScheduleCPU()
    vm = relax.VirtualMachine(relaxgrad.compile(mod, schedule=schedule), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])
    return arrays, grads, dict(schedule.choices) if with_names else set(schedule.choices.values())


def _torch_grads(fn, arrays):
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    fn(*tensors).backward()
    return [t.grad.numpy() for t in tensors]


def _normalized(x, gamma, beta, dtype):
    """Layer norm over the last axis, written out (TVM's kernel is float32 / float16 only)."""
    centered = op.subtract(x, op.mean(x, axis=[-1], keepdims=True))
    var = op.mean(op.multiply(centered, centered), axis=[-1], keepdims=True)
    rstd = op.rsqrt(op.add(var, relax.const(1e-5, dtype)))
    return op.add(op.multiply(op.multiply(centered, rstd), gamma), beta)


@pytest.mark.parametrize("norm, dtype", [("written out", "float64"), ("layer_norm", "float32")])
def test_normalization_and_softmax_gradients_match_pytorch(norm, dtype):
    """sum(softmax(norm(x)^2) * w): the gradient's row sums run in RowLocal kernels."""
    d = SHAPE[-1]
    params = [("x", SHAPE, dtype), ("gamma", (d,), dtype), ("beta", (d,), dtype),
              ("w", SHAPE, dtype)]  # fmt: skip

    def body(x, gamma, beta, w):
        if norm == "layer_norm":
            normed = op.nn.layer_norm(x, gamma, beta, axes=[-1])
        else:
            normed = _normalized(x, gamma, beta, dtype)
        return op.sum(op.multiply(op.nn.softmax(op.multiply(normed, normed), axis=-1), w))

    arrays, grads, choices = _compiled_gradients(params, body)
    assert "RowLocal" in choices

    def reference(x, gamma, beta, w):
        normed = torch.nn.functional.layer_norm(x, (d,), gamma, beta)
        return (torch.softmax(normed * normed, -1) * w).sum()

    rtol = 1e-10 if dtype == "float64" else 2e-4
    for got, want in zip(grads, _torch_grads(reference, arrays)):
        np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("length", [1000, 58, 37])
def test_rows_the_vector_does_not_divide(length):
    """Rows of 1000 (ImageNet's classes) and 58 (2 x 29) sum in partials of a divisor of the
    row's length near the vector's lanes: with AVX-512's 16 float32 lanes 25 and 29, with
    AVX2's 8 lanes 8 (which divides 1000) and none for 58 (no divisor in 5..16); rows of 37
    (prime) stay scalar. log-softmax's values and gradient are PyTorch's either way (compiled
    for this machine's CPU)."""
    params = [("x", (64, length), "float32"), ("w", (64, length), "float32")]

    def body(x, w):
        return op.sum(op.multiply(op.nn.log_softmax(x), w))

    mod = _fused(_module(params, body))
    (name,) = [k for k in _kernels(mod) if "log_softmax" in k]
    expected = {"skylake-avx512": {1000: 25, 58: 29, 37: None},
                "znver3": {1000: 8, 58: None, 37: None}}  # fmt: skip
    for cpu, lanes_by_length in expected.items():
        target = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
        script = RowLocal().apply(mod[name], target, False).mod["main"].script()
        partials = re.findall(r"sblock_alloc_buffer\(\(T\.int64\(64\), T\.int64\((\d+)\)\)",
                              script)
        lanes = lanes_by_length[length]
        assert [int(p) for p in partials] == ([] if lanes is None else [lanes, lanes]), cpu
    arrays, grads, _ = _compiled_gradients(params, body)
    want = _torch_grads(lambda x, w: (torch.log_softmax(x, -1) * w).sum(), arrays)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_a_batch_of_one_is_row_local_and_matches_pytorch():
    """A (1, heads, seq, seq) causal softmax (a language model's fine-tuning step at batch 1):
    TVM drops the unit axis's iterator but indexes its buffers at 0 there, which RowLocal
    reads as the same rows. Half the scores are the most negative float32 (the mask), whose
    exponentials are 0; softmax and its gradient are PyTorch's."""
    shape = (1, 4, 32, 32)
    mask = np.triu(np.full(shape[-2:], np.finfo(np.float32).min, np.float32), 1)
    params = [("x", shape, "float32"), ("m", shape[-2:], "float32"), ("w", shape, "float32")]

    def body(x, m, w):
        return op.sum(op.multiply(op.nn.softmax(op.add(x, m), axis=-1), w))

    mod = _legalized(_module(params, body))
    (name,) = [gvar.name_hint for gvar in mod.get_global_vars() if "softmax" in gvar.name_hint]
    assert RowLocal().apply(mod[name], host_target(), False) is not None
    relaxgrad_mod = relaxgrad.Gradient("main")(_module(params, body))
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(shape).astype("float32") for _ in range(2))
    vm = relax.VirtualMachine(relaxgrad.compile(relaxgrad_mod), tvm.cpu())
    loss, (dx, dm, dw) = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in (x, mask, w)])
    tensors = [torch.tensor(a, requires_grad=True) for a in (x, mask, w)]
    expected = (torch.softmax(tensors[0] + tensors[1], -1) * tensors[2]).sum()
    expected.backward()
    assert float(loss.numpy()) == pytest.approx(expected.item(), rel=1e-5)
    for got, t in zip((dx, dm, dw), tensors):
        want = t.grad.numpy()
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def _exp_calls(script: str) -> int:
    return script.count("T.exp(")


@pytest.mark.parametrize("rule", [RowLocal(), RowColumnLocal()])
def test_a_softmax_exponentiates_each_score_once(rule):
    """softmax's ``exp(x - max)`` is read by the row's sum and by the division: scheduled, it
    is computed once per row into a row's buffer (it was inlined into both readers, computed
    twice), by both row rules; the compiled softmax is PyTorch's."""
    params = [("x", SHAPE, "float32")]
    mod = _legalized(_module(params, lambda x: op.nn.softmax(x, axis=-1)))
    (name,) = [gvar.name_hint for gvar in mod.get_global_vars() if "softmax" in gvar.name_hint]
    func = mod[name]
    assert _exp_calls(func.script()) == 1  # TOPI's T_softmax_exp block, read twice
    script = rule.apply(func, host_target(), False).mod["main"].script()
    assert _exp_calls(script) == 1
    assert 'T.sblock("T_softmax_exp")' in script
    x = np.random.default_rng(0).standard_normal(SHAPE).astype("float32") * 4
    vm = relax.VirtualMachine(relaxgrad.compile(_module(params, lambda x: op.nn.softmax(
        x, axis=-1))), tvm.cpu())  # fmt: skip
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, torch.softmax(torch.from_numpy(x), -1).numpy(), rtol=1e-6,
                               atol=1e-7)  # fmt: skip
