"""MergeSiblingKernels (relaxgrad/schedules/siblings.py): independent scheduled kernels that
read a common tensor run under one parallel loop; the values are unchanged, and kernels that
depend on each other, or run loops of different extents, are left apart."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import cpu_pipeline, host_target
from relaxgrad.schedules import MergeSiblingKernels
from relaxgrad.testing import tvm_compile_quietly

SHAPE = (8, 64, 32, 32)  # 2 MB: over the pass's 1 MB threshold


def _batch_norms(shortcut: bool) -> tvm.IRModule:
    """The gradient of ``sum(w * relu(bn(x)))`` (with ``shortcut``: ``relu(bn(x) + bn2(x))``,
    two batch norms reading one gradient, as ResNet's downsampling blocks): the bias's and the
    scale's gradients of each batch norm are reductions of that gradient."""
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    params = [relax.Var(f"{n}{i}", relax.TensorType((SHAPE[1],), "float32"))
              for i in range(2 if shortcut else 1)
              for n in ("gamma", "beta", "mean", "var")]  # fmt: skip
    weights = np.random.default_rng(0).standard_normal(SHAPE).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            y = bb.emit(relax.TupleGetItem(op.nn.batch_norm(x, *params[:4], axis=1), 0))
            if shortcut:
                z = bb.emit(op.multiply(x, relax.const(np.float32(0.5))))
                y2 = bb.emit(relax.TupleGetItem(op.nn.batch_norm(z, *params[4:], axis=1), 0))
                y = bb.emit(op.add(y, y2))
            loss = bb.emit_output(op.sum(op.multiply(op.nn.relu(y), relax.const(weights))))
        bb.emit_func_output(loss)
    mod = bb.get()
    wrt = [p for p in mod["main"].params if p.name.startswith(("x", "gamma", "beta"))]
    return relaxgrad.Gradient("main", require_grads=wrt)(mod)


def _inputs(mod) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for p in mod["main_adjoint"].params:
        shape = [int(d) for d in p.ty.shape.values]
        value = rng.standard_normal(shape).astype("float32")
        out.append(np.abs(value) + 0.5 if p.name.startswith("var") else value)
    return out


def _grads(executable, inputs) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    return [g.numpy() for g in grads]


def _scheduled(mod) -> tvm.IRModule:
    """``mod`` through the CPU pipeline up to (not including) MergeSiblingKernels."""
    seen = {}

    @tvm.instrument.pass_instrument
    class Grab:
        def run_before_pass(self, module, info):
            if info.name == "MergeSiblingKernels":
                seen["mod"] = module

    with host_target() as target, tvm.transform.PassContext(instruments=[Grab()]):
        cpu_pipeline(target)(mod)
    return seen["mod"]


@pytest.mark.parametrize("shortcut", [False, True], ids=["one", "shortcut"])
def test_batch_norm_reductions_merge_and_keep_their_values(shortcut):
    mod = _batch_norms(shortcut)
    step = MergeSiblingKernels()
    merged = step(_scheduled(mod))
    assert step.merged >= (3 if shortcut else 1)  # (the shortcut: two pairs and the dx kernels)
    assert "siblings" in merged["main_adjoint"].script()
    inputs = _inputs(mod)
    want = _grads(tvm_compile_quietly(mod, "llvm"), inputs)
    got = _grads(relaxgrad.compile(mod, "llvm"), inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4 * np.abs(w).max())


def _pair(second_reads_first: bool, extents=(64, 64)) -> tvm.IRModule:
    """Two row sums of ``x`` (64 x 8192, 2 MB), each a parallel loop over its rows, the second
    of ``x`` times the first's result where ``second_reads_first``; ``extents``: the rows each
    kernel's loop runs (64, or 32 for a loop over pairs of rows)."""
    x = relax.Var("x", relax.TensorType((64, 8192), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(op.sum(x, axis=[1]))
            b_in = bb.emit(op.multiply(x, op.expand_dims(a, 1))) if second_reads_first else x
            b = bb.emit(op.max(op.reshape(b_in, (extents[1], -1)), axis=[1]))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("case", ["independent", "dependent", "other_extent"])
def test_only_independent_loops_of_one_extent_merge(case):
    mod = _pair(case == "dependent", (64, 32) if case == "other_extent" else (64, 64))
    step = MergeSiblingKernels()
    step(_scheduled(mod))
    assert step.merged == (1 if case == "independent" else 0)
    x = np.random.default_rng(2).standard_normal((64, 8192)).astype("float32")
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    a, b = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
    np.testing.assert_allclose(a, x.sum(1), rtol=1e-4, atol=1e-3)
    b_in = x * x.sum(1, keepdims=True) if case == "dependent" else x
    np.testing.assert_allclose(b, b_in.reshape(b.shape[0], -1).max(1), rtol=1e-4)


def test_a_kernel_joins_another_call_of_its_own_function():
    """Two calls of one PrimFunc (each batch norm's scale gradient of the shortcut test reads
    the same gradient) merge with fresh buffers each; the module builds and runs."""
    mod = _batch_norms(shortcut=True)
    merged = MergeSiblingKernels()(_scheduled(mod))
    calls = [b.value for block in merged["main_adjoint"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and "siblings" in str(b.value.args[0])]
    assert calls
    for call in calls:
        prim = merged[call.args[0]]
        assert len({p.name for p in prim.params}) <= len(prim.params)
        tvm.tirx.build(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}),
                       target="llvm")
