"""HoldRecomputed / ReleaseRecomputed (relaxgrad/schedules/recomputed.py): a checkpoint
policy's recomputations survive the pipelines' common-subexpression elimination, so that a
checkpointed adjoint compiled by ``relaxgrad.compile`` keeps less memory; values unchanged."""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad import pipeline
from relaxgrad.schedules import HoldRecomputed, ReleaseRecomputed
from relaxgrad.testing import check_gradients
from relaxgrad.transforms.plan_memory import PackBlockMemory


def _mlp(layers: int, dtype: str = "float32", width: int = 256) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((128, width), dtype))
    ws = [relax.Var(f"w{i}", relax.TensorType((width, width), dtype)) for i in range(layers)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            h = x
            for w in ws:
                h = bb.emit(op.tanh(op.matmul(h, w)))
            out = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(out)
    return bb.get()


def _tanhs(mod: tvm.IRModule) -> int:
    return mod["main_adjoint"].script().count("R.tanh")


def test_recomputations_are_not_merged_with_the_forward_values():
    grad = relaxgrad.Gradient("main", checkpoint="sqrt")(_mlp(16))
    tanhs = _tanhs(grad)
    assert tanhs > 16 + 8  # 16 forward, the rest recomputed
    cse = relax.transform.EliminateCommonSubexpr()
    assert _tanhs(cse(grad)) == 16  # the elimination alone: checkpointing undone
    held = tvm.transform.Sequential([HoldRecomputed(), cse, ReleaseRecomputed()])(grad)
    assert _tanhs(held) == tanhs
    assert "recomputed_operand" not in held.script()
    none = relaxgrad.Gradient("main", checkpoint="none")(_mlp(16))
    assert _tanhs(tvm.transform.Sequential([HoldRecomputed(), ReleaseRecomputed()])(none)) == 16


def _compiled(grad_mod: tvm.IRModule, monkeypatch) -> tuple[relax.VirtualMachine, int]:
    """The VM of ``relaxgrad.compile(grad_mod)`` and its adjoint's packed workspace."""
    packer = PackBlockMemory()
    monkeypatch.setattr(pipeline, "PackBlockMemory", lambda: packer)
    vm = relax.VirtualMachine(relaxgrad.compile(grad_mod), tvm.cpu())
    return vm, packer.packed["main_adjoint"][0]


def test_a_checkpointed_adjoint_keeps_less_memory_with_the_same_gradients(monkeypatch):
    """A 16-layer MLP's adjoint: ``"sqrt"`` keeps some activations and recomputes the rest,
    in under 0.6 of the workspace; gradients the same bits as without checkpointing."""
    policy = "sqrt"
    plain = _mlp(16)
    rng = np.random.default_rng(0)
    inputs = [tvm.runtime.tensor((rng.standard_normal([int(d) for d in p.ty.shape]) / 16)
                                 .astype("float32")) for p in plain["main"].params]  # fmt: skip
    results, workspace = {}, {}
    for name in (policy, "none"):
        vm, workspace[name] = _compiled(relaxgrad.Gradient("main", checkpoint=name)(plain),
                                        monkeypatch)  # fmt: skip
        loss, grads = vm["main_adjoint"](*inputs)
        results[name] = [loss.numpy(), *(g.numpy() for g in grads)]
    assert workspace["sqrt"] < 0.6 * workspace["none"], workspace
    for a, b in zip(results[policy], results["none"]):
        np.testing.assert_array_equal(a, b)


def test_checkpointed_gradients_match_finite_differences():
    grad_pass = functools.partial(relaxgrad.Gradient, checkpoint="sqrt")
    mod = _mlp(9, "float64", width=16)
    result = check_gradients(mod, "main", grad_pass=lambda f, r, t: grad_pass(f, r, t),
                             compile=relaxgrad.compile)  # fmt: skip
    assert result.ok, result
