"""UpdateInPlace: a Trainer's optimizer step writes its new parameters and state into the tensors
it is given, with the values of the same step compiled without it (bitwise), a non-finite step
leaving them as they were; unsafe aliasing (an old value read after its update) is refused, in
the Relax function and in a kernel."""

import numpy as np
import pytest
import tvm
import tvm_ffi
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


def _cross_entropy(n: int, classes: int):
    """``mean(-log_softmax(x @ w)[y])`` and its gradient of ``w``: a loss adjoint whose
    log-softmax and loss gradient (n x classes, 1 MiB or more) may overwrite their inputs."""
    from relaxgrad.training import CrossEntropyLoss
    from relaxgrad.training.trainer import training_module

    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, classes), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x, w)))
        bb.emit_func_output(out)
    return training_module(bb.get(), ["w"], CrossEntropyLoss(), SGD(0.1))


def _bytes(prim) -> int:
    """The bytes of the kernel's largest float32 parameter."""
    return max(int(np.prod([int(d) for d in p.ty.shape])) * 4 for p in prim.params
               if hasattr(p.ty, "shape"))


def _kernels(mod) -> list[str]:
    return [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


def test_large_temporaries_are_overwritten_with_the_same_gradients(monkeypatch):
    """The gradient of a 256 x 2048 cross-entropy (2 MiB) overwrites the logits, scheduled as
    out of place (vectorized, parallel); gradients bitwise as without, the function's own
    arguments untouched, and PyTorch's in float64."""
    from relaxgrad import pipeline
    from relaxgrad.schedules.inplace import UpdateInPlace

    mod = _cross_entropy(256, 2048)
    target = pipeline.host_target()
    with target:
        lowered = pipeline.cpu_pipeline(target)(mod)
    inplace = [lowered[k] for k in _kernels(lowered) if "_inplace" in k]
    assert any(_bytes(f) == 256 * 2048 * 4 and "T.parallel" in f.script() for f in inplace)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype("float32")
    w = rng.standard_normal((16, 2048)).astype("float32")
    y = rng.integers(0, 2048, 256)
    results = []
    for temporaries in (True, False):
        if not temporaries:
            monkeypatch.setattr(pipeline, "UpdateInPlace", lambda: UpdateInPlace(None))
        vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
        args = [tvm.runtime.tensor(a) for a in (x, w, y)]
        loss, (grad,) = vm["main_loss_adjoint"](*args)
        np.testing.assert_array_equal(args[0].numpy(), x)
        np.testing.assert_array_equal(args[1].numpy(), w)
        results.append((loss.numpy(), grad.numpy()))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    import torch

    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(torch.tensor(x, dtype=torch.float64) @ tw,
                                            torch.tensor(y))
    ref.backward()
    np.testing.assert_allclose(results[0][1], tw.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_temporary_read_later_through_a_view_is_not_overwritten():
    """``b = exp(a)`` may not overwrite ``a`` when a reshape of ``a`` (a view) is read after
    it, nor overwrite a parameter."""
    from relaxgrad.schedules.inplace import UpdateInPlace

    x = relax.Var("x", relax.TensorType((512, 512), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, relax.const(1.0)))
            view = bb.emit(relax.op.reshape(a, (512 * 512,)))
            b = bb.emit(relax.op.exp(a))
            c = bb.emit(relax.op.exp(x))
            out = bb.emit_output(relax.Tuple([b, c, bb.emit(relax.op.sum(view))]))
        bb.emit_func_output(out)
    mod = relax.transform.FuseTIR()(relax.transform.LegalizeOps()(bb.get()))
    assert not [k for k in _kernels(UpdateInPlace(1 << 10)(mod)) if "inplace" in k]
    vm = relax.VirtualMachine(relaxgrad.compile(bb.get()), tvm.cpu())
    value = np.random.default_rng(0).standard_normal((512, 512)).astype("float32") * 0.1
    b, c, total = vm["main"](tvm.runtime.tensor(value))
    np.testing.assert_allclose(total.numpy(), (value + 1).sum(), rtol=1e-4)
    np.testing.assert_allclose(b.numpy(), np.exp(value + 1), rtol=1e-6)


def test_out_of_place_kernels_are_not_kept_for_the_build():
    """The out-of-place originals of the kernels UpdateInPlace rewrites are dropped with it
    (nothing calls them: scheduling and building them would be wasted), and no other PrimFunc
    goes; the module still runs (the values: test_in_place_equals_out_of_place)."""
    from relaxgrad.schedules import UpdateInPlace

    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(SHAPES)]
    optimizer = Adam(1e-2)
    optimizer.init(params)
    mod = optimizer.add_to(tvm.IRModule(), "optimizer", in_place=True)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    fused = tvm.transform.Sequential(passes)(mod)
    rewritten = UpdateInPlace()(fused)
    before = {gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    after = {gv.name_hint for gv, f in rewritten.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    added = after - before
    assert added and all(name.endswith("_inplace") for name in added)
    assert before - after == {name.removesuffix("_inplace") for name in added}
    called = set()
    for _, func in rewritten.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(tvm.ir.GlobalVar, lambda gv: called.add(gv.name_hint))])
    assert after <= called
