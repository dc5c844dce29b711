"""Gradient checkpointing: markers decide what is kept; the rest is regenerated as `_cp`."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.testing import FAST_LLVM, check_gradients, random_inputs

LAYERS, WIDTH, BATCH = 4, 6, 3


def mlp(checkpoint: bool, dtype: str = "float32") -> tvm.IRModule:
    """LAYERS x (matmul, add, tanh, multiply); with ``checkpoint`` each layer's input is
    start-marked and its output end-marked, so only layer boundaries are kept."""
    x = relax.Var("x", relax.TensorType((BATCH, WIDTH), dtype))
    ws = [relax.Var(f"w{i}", relax.TensorType((WIDTH, WIDTH), dtype)) for i in range(LAYERS)]
    bs = [relax.Var(f"b{i}", relax.TensorType((WIDTH,), dtype)) for i in range(LAYERS)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for w, b in zip(ws, bs):
                if checkpoint:
                    h = bb.emit(op.grad.start_checkpoint(h))
                z = bb.emit(op.add(bb.emit(op.matmul(h, w)), b))
                a = bb.emit(op.tanh(z))
                h = bb.emit(op.multiply(a, z))
                if checkpoint:
                    h = bb.emit(op.grad.end_checkpoint(h))
            gv = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(gv)
    return bb.get()


def _run_adjoint(mod, inputs):
    vm = relax.VirtualMachine(tvm.compile(relaxgrad.Gradient("main")(mod), "llvm"), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    return loss.numpy(), [g.numpy() for g in grads]


def test_checkpointed_gradients_equal_plain_ones():
    inputs = random_inputs(mlp(False)["main"], seed=3)
    plain_loss, plain = _run_adjoint(mlp(False), inputs)
    cp_loss, cp = _run_adjoint(mlp(True), inputs)
    np.testing.assert_allclose(cp_loss, plain_loss, rtol=1e-6)
    for a, b in zip(cp, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpointed_gradients_numeric():
    result = check_gradients(mlp(True, "float64"))
    assert result.ok, str(result)


def test_regenerates_non_checkpointed_values():
    adjoint = relaxgrad.Gradient("main")(mlp(True))["main_adjoint"]
    bindings = adjoint.body.blocks[0].bindings
    names = [b.var.name for b in bindings]
    regenerated = [n for n in names if n.endswith("_cp")]
    # per layer, z (used by tanh's and multiply's rules) and a are recomputed
    assert len(regenerated) >= 2 * LAYERS, names
    assert not any("checkpoint" in str(b.value) for b in bindings)


def _forward_values_used_by_backward(mod) -> list[str]:
    """Forward (non-parameter) values that the backward part of the adjoint reads."""
    adjoint = relaxgrad.Gradient("main")(mod)["main_adjoint"]
    bindings = list(adjoint.body.blocks[0].bindings)
    seed = next(i for i, b in enumerate(bindings) if b.var.name == "gv_adjoint")
    forward = {b.var.__chandle__(): b.var.name for b in bindings[:seed]}
    used = {}
    for b in bindings[seed:]:
        for v in relax.analysis.free_vars(b.value):
            if v.__chandle__() in forward:
                used[v.__chandle__()] = v.name
    return sorted(used.values())


def test_backward_reads_only_checkpoints():
    plain = _forward_values_used_by_backward(mlp(False))
    checkpointed = _forward_values_used_by_backward(mlp(True))
    assert len(checkpointed) < len(plain)
    # only the layer inputs (the end-marked outputs of the previous layer) are read
    assert len(checkpointed) <= LAYERS, checkpointed


def test_checkpointed_mlp_matches_tvm():
    mod = mlp(True)
    tvm.ir.assert_structural_equal(
        relaxgrad.Gradient("main")(mod)["main_adjoint"],
        relax.transform.Gradient("main")(mod)["main_adjoint"],
    )


@pytest.mark.parametrize("wrapped", ["start", "end"])
def test_require_grads_on_wrapped_var(wrapped):
    """A require_grad that is the result of a marker maps back to the var it wraps."""
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    bb = relax.BlockBuilder()
    marker = op.grad.start_checkpoint if wrapped == "start" else op.grad.end_checkpoint
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(op.tanh(x))
            m = bb.emit(marker(a))
            gv = bb.emit_output(op.sum(op.multiply(m, m)))
        bb.emit_func_output(gv)
    mod = relaxgrad.Gradient("main", [m, x])(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, FAST_LLVM), tvm.cpu())
    xv = np.array([0.1, -0.5, 0.9], "float32")
    _, (g_m, g_x) = vm["main_adjoint"](tvm.runtime.tensor(xv))
    np.testing.assert_allclose(g_m.numpy(), 2 * np.tanh(xv), rtol=1e-5)
    np.testing.assert_allclose(g_x.numpy(), 2 * np.tanh(xv) * (1 - np.tanh(xv) ** 2), rtol=1e-5)


def test_end_checkpoint_on_output():
    """An output var bound to end_checkpoint of a dataflow var stays a valid output."""
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            s = bb.emit(op.sum(op.tanh(x)))
            gv = bb.emit_output(op.grad.end_checkpoint(s))
        bb.emit_func_output(gv)
    mod = bb.get()
    after = relaxgrad.Gradient("main")(mod)
    assert relax.analysis.check_well_formed(after)
    result = check_gradients(mod)
    assert result.ok, str(result)
