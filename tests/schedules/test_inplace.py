"""UpdateInPlace: a Trainer's optimizer step writes its new parameters and state into the tensors
it is given, with the values of the same step compiled without it (bitwise), a non-finite step
leaving them as they were; unsafe aliasing (an old value read after its update) is refused, in
the Relax function and in a kernel."""

import numpy as np
import pytest
import tvm
from tvm import relax, te

import relaxgrad
from relaxgrad.schedules.inplace import IN_PLACE, _safe
from relaxgrad.training import SGD, Adam, AdamW, MomentumSGD

SHAPES = [(6, 5), (5,), (3, 4, 2)]


def _step(optimizer, in_place: bool):
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(SHAPES)]
    optimizer.init(params)
    mod = optimizer.add_to(tvm.IRModule(), "optimizer", in_place=in_place)
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    return vm["optimizer"], [s.numpy() for s in optimizer.state]


def _pointer(tensor) -> int:
    return np.from_dlpack(tensor).__array_interface__["data"][0]


@pytest.mark.parametrize("optimizer", [
    lambda: Adam(1e-2, weight_decay=0.1), lambda: AdamW(1e-2), lambda: SGD(0.1, weight_decay=0.1),
    lambda: MomentumSGD(0.1, dampening=0.2, nesterov=False),
], ids=["adam", "adamw", "sgd", "momentum"])
def test_in_place_equals_out_of_place(optimizer):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype("float32") for s in SHAPES]
    grads = [[rng.standard_normal(s).astype("float32") for s in SHAPES] for _ in range(3)]
    grads.insert(1, [np.full(s, np.nan, "float32") for s in SHAPES])  # a step not applied
    plain, state0 = _step(optimizer(), in_place=False)
    inplace, _ = _step(optimizer(), in_place=True)
    controls = [tvm.runtime.tensor(np.array(v, "float32")) for v in (0.05, 10.0, 0.5)]
    ref_p = [tvm.runtime.tensor(v) for v in values]
    ref_s = [tvm.runtime.tensor(s) for s in state0]
    ours_p = [tvm.runtime.tensor(v) for v in values]
    ours_s = [tvm.runtime.tensor(s) for s in state0]
    pointers = [_pointer(t) for t in ours_p + ours_s[1:]]
    for g in grads:
        gs = [tvm.runtime.tensor(x) for x in g]
        ref_p, ref_s, ref_norm = plain(ref_p, gs, ref_s, controls)
        new_p, new_s, norm = inplace(ours_p, gs, ours_s, controls)
        assert [_pointer(t) for t in list(new_p) + list(new_s)[1:]] == pointers
        ours_p, ours_s = list(new_p), list(new_s)
        for a, b in zip(list(ref_p) + list(ref_s), ours_p + ours_s):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        if not np.isfinite(g[0]).all():  # not applied: as before the step
            assert not np.isfinite(norm[0].numpy())
    for a, b in zip(ours_p, values):
        assert not np.array_equal(a.numpy(), b)  # it did train


def test_old_value_read_later_is_not_overwritten():
    """A function that reads a parameter after computing its update returns the old value
    there: that update keeps its own tensor."""
    p = relax.Var("params", relax.TupleType([relax.TensorType((4,), "float32")]))
    g = relax.Var("gradients", relax.TupleType([relax.TensorType((4,), "float32")]))
    s = relax.Var("optim_states", relax.TupleType([relax.TensorType((), "float32")]))
    bb = relax.BlockBuilder()
    with bb.function("f", [p, g, s]):
        with bb.dataflow():
            w = bb.emit(relax.TupleGetItem(p, 0))
            new = bb.emit(relax.op.subtract(w, relax.TupleGetItem(g, 0)))
            later = bb.emit(relax.op.multiply(w, relax.const(2.0)))
            out = bb.emit_output(relax.Tuple([relax.Tuple([new]),
                                              relax.Tuple([relax.TupleGetItem(s, 0)]),
                                              relax.Tuple([later])]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["f"] = mod["f"].with_attr(IN_PLACE, True)
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    w0 = tvm.runtime.tensor(np.arange(4, dtype="float32"))
    (new,), _, (later,) = vm["f"]((w0,), (tvm.runtime.tensor(np.ones(4, "float32")),),
                                  (tvm.runtime.tensor(np.zeros((), "float32")),))
    np.testing.assert_array_equal(new.numpy(), np.arange(4) - 1)
    np.testing.assert_array_equal(later.numpy(), np.arange(4) * 2)
    np.testing.assert_array_equal(w0.numpy(), np.arange(4))


def test_kernel_reading_an_old_value_after_its_update_is_refused():
    # outputs (new m, new p) in that order: the block of new p, after the one writing new m,
    # reads m again, so new m cannot overwrite m; new p can overwrite p
    p, m, g = (te.placeholder((8,), "float32", n) for n in "pmg")
    new_m, new_p = te.compute((8,), lambda i: [m[i] * 0.9 + g[i], p[i] - m[i]], name="update")
    prim = te.create_prim_func([p, m, g, new_m, new_p])
    assert _safe(prim, 3, 2, {0: 1, 1: 0}) == {1: 0}
    # reading a neighbour of the element being written is refused too
    shifted = te.compute((8,), lambda i: p[(i + 1) % 8] - g[i], name="shifted")
    prim = te.create_prim_func([p, g, shifted])
    assert _safe(prim, 2, 1, {0: 0}) == {}
