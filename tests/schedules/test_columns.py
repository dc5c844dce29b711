"""Column sums with the elementwise kernel of their input (relaxgrad/schedules/columns.py):
FuseColumnSums merges a bias gradient's sum over the rows into the fused function that
computes the summed gradient for other readers too, and ColumnLocal computes both in one
parallel pass over the rows; gradients through them checked against PyTorch in float64."""

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
from relaxgrad.schedules import ColumnLocal, FuseColumnSums, blas

from .test_rows import _compiled_gradients, _module, _torch_grads

ROWS, N = (2, 64), 48


def _relu_backward(rows=ROWS, dtype="float32", summed=None):
    """``g = where(x + b < 0, 0, dy)`` read by a matmul and by ``summed(g)`` (default: the
    bias gradient, a sum over the rows)."""
    summed = summed or (lambda g: op.collapse_sum_to(g, relax.ShapeExpr([N])))
    params = [("x", (*rows, N), dtype), ("b", (N,), dtype), ("dy", (*rows, N), dtype),
              ("w", (N, 8), dtype)]  # fmt: skip

    def body(x, b, dy, w):
        mask = op.less(op.add(x, b), relax.const(0, dtype))
        g = op.where(mask, relax.const(0, dtype), dy)
        return relax.Tuple([op.matmul(g, w), summed(g)])

    return _module(params, body)


def _fused(mod: tvm.IRModule, merge: bool = True) -> tvm.IRModule:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), *([FuseColumnSums()] if merge else []),
              relax.transform.FuseTIR()]  # fmt: skip
    return tvm.transform.Sequential(passes)(mod)


def _kernels(mod: tvm.IRModule) -> list[str]:
    return re.findall(r"cls\.(\w+)", mod.script().split("def main")[-1])


def test_bias_gradient_sum_joins_the_kernel_of_its_input():
    mod = _relu_backward()
    unmerged = _fused(mod, merge=False)
    assert _kernels(unmerged) == ["fused_add_less_where", "matmul", "collapse_sum"]
    for name in ["fused_add_less_where", "collapse_sum"]:  # elementwise only; a sum only
        assert ColumnLocal().apply(unmerged[name], host_target(), False) is None
    merged = _fused(mod)
    assert _kernels(merged) == ["fused_add_less_where_collapse_sum", "matmul"]
    (call,) = [b.value for b in merged["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and "collapse_sum" in str(b.value.args[0])]
    assert [[int(d) for d in field.shape.values] for field in call.ty.fields] == [[*ROWS, N], [N]]
    func = merged["fused_add_less_where_collapse_sum"]
    sch = ColumnLocal().apply(func, host_target(), False)
    assert sch is not None
    loops = re.findall(r"for \w+ in (T\.\w+)", sch.mod["main"].script())
    assert loops[0] == "T.parallel" and loops.count("T.parallel") == 1
    assert "T.vectorized" in loops


@pytest.mark.parametrize(
    "summed, rows",
    [
        (lambda g: op.sum(g, axis=[-1]), ROWS),  # along the rows: no column sum
        (lambda g: op.collapse_sum_to(g, relax.ShapeExpr([N])), (2, 16)),  # 32 rows
        (lambda g: op.sum(g, axis=[0, 2]), ROWS),  # the middle axis kept
    ],
    ids=["row-sum", "few-rows", "middle-axis"],
)
def test_other_sums_stay_kernels_of_their_own(summed, rows):
    mod = _relu_backward(rows=rows, summed=summed)
    assert _kernels(_fused(mod)) == _kernels(_fused(mod, merge=False))


def test_input_module_is_left_unchanged():
    fused = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                      relax.transform.AnnotateTIROpPattern(),
                                      relax.transform.FuseOps()])(_relu_backward())  # fmt: skip
    before = fused.script()
    FuseColumnSums()(fused)
    assert fused.script() == before


@pytest.mark.skipif(not blas.available(), reason="no OpenBLAS found")
@pytest.mark.parametrize("rows", [(3, 50), (127,)], ids=["150-rows", "127-rows"])
def test_mlp_gradients_match_pytorch(rows):
    """sum(relu(x @ w1 + b1) @ w2 * t) in float32, whose matmuls are OpenBLAS calls: the
    relu's gradient and b1's gradient in one ColumnLocal kernel. (Without the calls, the relu's
    gradient is the epilogue of a matmul.)"""
    dtype, hidden, out = "float32", 256, 64  # products of over 2^20 multiply-adds
    params = [("x", (*rows, N), dtype), ("w1", (N, hidden), dtype), ("b1", (hidden,), dtype),
              ("w2", (hidden, out), dtype), ("t", (*rows, out), dtype)]  # fmt: skip

    def body(x, w1, b1, w2, t):
        h = op.nn.relu(op.add(op.matmul(x, w1), b1))
        return op.sum(op.multiply(op.matmul(h, w2), t))

    arrays, grads, choices = _compiled_gradients(params, body)
    assert "ColumnLocal" in choices

    def reference(x, w1, b1, w2, t):
        return ((torch.relu(x @ w1 + b1) @ w2) * t).sum()

    wants = _torch_grads(reference, [a.astype("float64") for a in arrays])
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_summed_tensor_returned_too():
    """``g`` is an output of the function as well as the sum's and the matmul's input: the
    merged kernel's first result is bound to it."""
    dtype = "float32"
    params = [("x", (*ROWS, N), dtype), ("b", (N,), dtype), ("dy", (*ROWS, N), dtype),
              ("w", (N, 8), dtype)]  # fmt: skip
    args = [relax.Var(name, relax.TensorType(shape, dtype)) for name, shape, dtype in params]
    x, b, dy, w = args
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            mask = bb.emit(op.less(op.add(x, b), relax.const(0, dtype)))
            g = bb.emit_output(op.where(mask, relax.const(0, dtype), dy))
            product = bb.emit_output(op.matmul(g, w))
            total = bb.emit_output(op.collapse_sum_to(g, relax.ShapeExpr([N])))
        bb.emit_func_output(relax.Tuple([g, product, total]))
    mod = bb.get()
    assert _kernels(_fused(mod)) == ["fused_add_less_where_collapse_sum", "matmul"]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(dtype) for _, shape, _ in params]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]
    want = np.where(arrays[0] + arrays[1] < 0, 0, arrays[2])
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_allclose(got[1], want @ arrays[3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_sum_of_an_alias_joins_the_kernel_of_its_input():
    """sum(mean(x @ w + b + x, axis=1) * t): the gradient binds ``b``'s sum to an alias of
    the mean's broadcast gradient (``lv1_adjoint = lv2_adjoint``), which the pipeline drops
    before fusing, so the sum still joins the broadcast's kernel; gradients against PyTorch."""
    dtype, rows, seq = "float32", 2, 64
    params = [("x", (rows, seq, N), dtype), ("w", (N, N), dtype), ("b", (N,), dtype),
              ("t", (rows, N), dtype)]  # fmt: skip

    def body(x, w, b, t):
        h = op.add(op.add(op.matmul(x, w), b), x)
        return op.sum(op.multiply(op.mean(h, axis=[1]), t))

    adjoint = relaxgrad.Gradient("main")(_module(params, body))["main_adjoint"]
    assert any(isinstance(b.value, relax.Var) for b in adjoint.body.blocks[0].bindings)
    arrays, grads, choices = _compiled_gradients(params, body, with_names=True)
    assert any("broadcast_to" in name and "collapse_sum" in name and rule == "ColumnLocal"
               for name, rule in choices.items())  # fmt: skip

    def reference(x, w, b, t):
        return (((x @ w + b + x).mean(1)) * t).sum()

    wants = _torch_grads(reference, [a.astype("float64") for a in arrays])
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
