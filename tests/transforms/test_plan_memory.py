"""PackBlockMemory (relaxgrad/transforms/plan_memory.py): a function's temporaries of static
shape at offsets in one storage, packed by lifetime. The placement never overlaps two tensors
alive at once (random lifetimes); a compiled adjoint computes the bits it computes with TVM's
planner alone, and its gradients match finite differences (float64); a temporary read through
a reshape long after its kernel keeps its bytes; the function's results stay out of the
storage; a transformer-like adjoint plans less storage than TVM's planner."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad import _ty, pipeline
from relaxgrad.testing import check_gradients
from relaxgrad.transforms import plan_memory
from relaxgrad.transforms.plan_memory import PackBlockMemory


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12), st.integers(1, 9)),
                min_size=2, max_size=40))  # fmt: skip
def test_placement_overlaps_no_tensor_alive_at_the_same_time(specs):
    temps = list(range(len(specs)))
    starts = {t: s for t, (s, _, _) in zip(temps, specs)}
    # (the placement takes binding indices as starts: shift them apart, keep the order)
    sizes = {t * 100 + starts[t]: 64 * z for t, (_, _, z) in zip(temps, specs)}
    last = {t * 100 + starts[t]: t * 100 + starts[t] + 100 * n
            for t, (_, n, _) in zip(temps, specs)}  # fmt: skip
    keys = list(sizes)
    offsets, total = plan_memory._place(keys, sizes, last)
    peak = 0
    for a in keys:
        assert offsets[a] % 64 == 0 and offsets[a] + sizes[a] <= total
        alive = [b for b in keys if b <= last[a] and last[b] >= a]
        peak = max(peak, sum(sizes[b] for b in alive if b <= a <= last[b]))
        for b in alive:
            if b != a:  # alive together: apart in memory
                apart = offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a]
                assert apart, (a, b, offsets, sizes)
    assert total >= peak


@I.ir_module
class LongReshape:
    @R.function
    def main(x: R.Tensor((16, 64), "float64"), w: R.Tensor((64, 64), "float64")):
        with R.dataflow():
            a = R.tanh(R.matmul(x, w))  # read through a reshape at the very end
            keep = R.reshape(a, R.shape([64, 16]))
            b = R.sigmoid(R.matmul(a, w))  # large temporaries born and dead in between
            c = R.sin(R.matmul(b, w))
            d = R.cos(R.matmul(c, w))
            e = R.sum(R.multiply(d, d))
            loss = R.add(e, R.sum(R.multiply(keep, R.reshape(x, R.shape([64, 16])))))
            R.output(loss)
        return loss


def _compiled(mod: tvm.IRModule, pack: bool, monkeypatch) -> relax.VirtualMachine:
    with monkeypatch.context() as patch:
        if not pack:  # the pipeline without the packing: TVM's planner plans everything
            patch.setattr(pipeline, "PackBlockMemory", lambda: tvm.transform.Sequential([]))
        return relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())


def test_adjoint_computes_the_same_bits_as_with_tvms_planner(monkeypatch):
    mod = relaxgrad.Gradient("main")(LongReshape)
    rng = np.random.default_rng(0)
    inputs = [tvm.runtime.tensor(rng.standard_normal(s)) for s in [(16, 64), (64, 64)]]
    results = []
    for pack in (True, False):
        loss, grads = _compiled(mod, pack, monkeypatch)["main_adjoint"](*inputs)
        results.append([loss.numpy(), *(g.numpy() for g in grads)])
    for packed, planned in zip(*results):
        np.testing.assert_array_equal(packed, planned)


def test_gradients_through_the_packed_storage_match_finite_differences():
    result = check_gradients(LongReshape, "main", compile=relaxgrad.compile)
    assert result.ok, result


def _packed(mod: tvm.IRModule, name: str) -> tuple[relax.Function, PackBlockMemory]:
    """``mod[name]`` as the CPU pipeline hands it to the packing, and packed."""
    captured = {}
    original = pipeline.PlanBlockMemory

    @tvm.transform.module_pass(opt_level=0, name="Capture")
    def capture(module, ctx):
        captured["mod"] = module
        return original()(module)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "PackBlockMemory", lambda: tvm.transform.Sequential([]))
        patch.setattr(pipeline, "PlanBlockMemory", lambda: capture)
        relaxgrad.compile(mod)
    packer = PackBlockMemory()
    return packer(captured["mod"])[name], packer, captured["mod"]


def test_results_stay_out_of_the_storage():
    func, packer, _ = _packed(relaxgrad.Gradient("main")(LongReshape), "main_adjoint")
    storage, count = packer.packed["main_adjoint"]
    assert count >= 5 and storage > 0
    returned = relax.analysis.free_vars(func.body.body)
    allocs = {b.var.name: b.value for block in func.body.blocks for b in block.bindings}
    bound = {b.var.name: b.value for block in func.body.blocks for b in block.bindings}
    for var in returned:  # the loss and the gradients: each TVM's own allocation
        value = bound[var.name]
        while isinstance(value, relax.Var):
            value = allocs[value.name]
        if isinstance(value, relax.Tuple):
            continue
        assert value.op.name == "relax.builtin.alloc_tensor", value


def _gradients_in_workspace(mod: tvm.IRModule) -> tvm.IRModule:
    adjoint = mod["main_adjoint"].with_attr(plan_memory.RESULTS_IN_WORKSPACE, [1])
    mod = mod.clone()
    mod[mod.get_global_var("main_adjoint")] = adjoint
    return mod


def _shape(expr) -> list[int]:
    return [int(d) for d in _ty.shape_values(expr)]


def _source(func: relax.Function, var: relax.Var) -> relax.Expr:
    """The value ``var`` is bound to, through aliases and zero-offset views."""
    bound = {b.var.name: b.value for block in func.body.blocks for b in block.bindings}
    value = bound[var.name]
    while True:
        if isinstance(value, relax.Var):
            value = bound[value.name]
        elif value.op.name == "relax.memory.ensure_zero_offset":
            value = bound[value.args[0].name]
        else:
            return value


def test_named_results_share_the_workspace():
    """With RESULTS_IN_WORKSPACE naming the gradients, they are placed in the storage, in the
    room of temporaries that died before them, the loss is not; the storage is less than the
    temporaries' plus the gradients'; the results are the same bits as TVM's planner's, and a
    result held while the function runs again keeps its values."""
    grad_mod = _stack(6)
    plain, plain_packer, _ = _packed(grad_mod, "main_adjoint")
    func, packer, _ = _packed(_gradients_in_workspace(grad_mod), "main_adjoint")
    loss, grads = func.body.body.fields
    assert _source(func, loss).op.name == "relax.builtin.alloc_tensor"
    workspace = func.body.blocks[0].bindings[0].var
    for grad in grads.fields:
        source = _source(func, grad)
        assert source.op.name == "relax.memory.alloc_tensor" and source.args[0].same_as(workspace)
    grad_bytes = sum(int(np.prod(_shape(g))) * 4 for g in grads.fields)
    storage, _ = packer.packed["main_adjoint"]
    assert storage < plain_packer.packed["main_adjoint"][0] + grad_bytes

    rng = np.random.default_rng(0)
    params = grad_mod["main"].params
    inputs = [tvm.runtime.tensor((0.05 * rng.standard_normal(_shape(p))).astype("float32"))
              for p in params]  # fmt: skip
    shared = relax.VirtualMachine(relaxgrad.compile(_gradients_in_workspace(grad_mod)),
                                  tvm.cpu())["main_adjoint"]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "PackBlockMemory", lambda: tvm.transform.Sequential([]))
        planned = relax.VirtualMachine(relaxgrad.compile(grad_mod), tvm.cpu())["main_adjoint"]
    expected = planned(*inputs)
    first = shared(*inputs)
    second = shared(*[tvm.runtime.tensor(2 * t.numpy()) for t in inputs])  # first one held
    np.testing.assert_array_equal(first[0].numpy(), expected[0].numpy())
    for got, want, other in zip(first[1], expected[1], second[1]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert np.abs(want.numpy()).max() > 0 and not np.array_equal(other.numpy(), want.numpy())


def test_trainer_steps_the_same_with_the_gradients_in_the_workspace(monkeypatch):
    """The Trainer places its adjoint's gradients in the workspace; its steps are the same bits
    as with every gradient allocated on its own."""
    from relaxgrad.training import SGD, MSELoss, Trainer
    from relaxgrad.training import trainer as trainer_module

    model = _stack(3, differentiate=False)
    params = {p.name: (0.1 * np.random.default_rng(2).standard_normal(_shape(p)))
              .astype("float32") for p in model["main"].params[1:]}  # fmt: skip
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((64, 128)).astype("float32") for _ in range(2))
    histories = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(trainer_module, "RESULTS_IN_WORKSPACE", "relaxgrad.unused")
        trainer = Trainer(model, params, MSELoss(), SGD(0.01), cache=False, progress=False)
        adjoint = trainer.mod["main_loss_adjoint"]
        assert (plan_memory.RESULTS_IN_WORKSPACE in adjoint.attrs) == shared
        histories.append([trainer.step(x, y) for _ in range(3)])
        histories.append(trainer.params)
    assert histories[0] == histories[2]
    for name, value in histories[1].items():
        np.testing.assert_array_equal(value, histories[3][name])


def _stack(blocks: int, differentiate: bool = True) -> tvm.IRModule:
    """Layers whose wide product (64 x 1024) lives only until it is summed, and whose narrow
    result (64 x 128, an eighth of it) lives until the backward pass reads it: TVM's planner
    gives each narrow result the storage of a dead wide product, which it then pins."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((128, 1024), "float32")) for i in range(blocks)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            h = x
            for w in ws:
                wide = bb.emit(relax.op.matmul(h, w))
                scale = bb.emit(relax.op.sum(wide, axis=[1], keepdims=True))
                h = bb.emit(relax.op.tanh(relax.op.multiply(h, scale)))
            if differentiate:
                h = relax.op.sum(relax.op.multiply(h, h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main")(bb.get()) if differentiate else bb.get()


def test_packed_storage_is_less_than_tvms_plan():
    _, packer, before = _packed(_stack(6), "main_adjoint")
    packed, _ = packer.packed["main_adjoint"]
    planned = pipeline.PlanBlockMemory()(before)["main_adjoint"]
    tvm_bytes = sum(int(np.prod([int(d) for d in b.value.args[0].values]))
                    for block in planned.body.blocks for b in block.bindings
                    if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
                    and b.value.op.name == "relax.memory.alloc_storage")  # fmt: skip
    assert packed < tvm_bytes, (packed, tvm_bytes)
