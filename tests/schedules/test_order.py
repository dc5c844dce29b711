"""FuseOpsInOrder (relaxgrad/schedules/order.py): FuseOps with each fused kernel where its last
operation was, not ahead of the bindings between its first and its last."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import FuseOpsInOrder, order
from relaxgrad.transforms import MixedPrecision


def _tied_mlp(layers: int = 6, width: int = 256, dtype: str = "float32") -> tvm.IRModule:
    """An MLP whose first and last products read one weight (a tied embedding's pattern)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((128, width), dtype))
    w = relax.Var("w", relax.TensorType((width, width), dtype))
    ws = [relax.Var(f"w{i}", relax.TensorType((width, width), dtype)) for i in range(layers)]
    with bb.function("main", [x, w, *ws]):
        with bb.dataflow():
            h = bb.emit(op.nn.relu(op.matmul(x, w)))
            for wi in ws:
                h = bb.emit(op.nn.relu(op.matmul(h, wi)))
            out = bb.emit(op.matmul(h, op.permute_dims(w)))
            loss = bb.emit_output(op.sum(op.multiply(out, out)))
        bb.emit_func_output(loss)
    return bb.get()


def test_a_kernel_fused_across_the_backward_pass_keeps_the_weight_gradients_in_place(
        monkeypatch):  # fmt: skip
    """In bf16, the tied weight's gradient is its last product's weight gradient, rounded and
    widened early in the backward pass, added to the first product's at its end; the casts
    and the add fuse. FuseOps alone then emitted the whole backward pass before every other
    weight gradient, each keeping the gradient it reads alive (GPT-2 small's bf16 step: 504
    MiB). In order, the packed workspace is smaller, the results are the same bits, and the
    gradients as far from PyTorch's float64 ones as autocast's are. The products run as sgemm of
    their operands' float32 conversions, as on a CPU without bf16 units, whatever this one has
    (oneDNN reads the bf16 gradients themselves: no conversion to keep alive)."""
    from relaxgrad import pipeline
    from relaxgrad.transforms.plan_memory import PackBlockMemory

    monkeypatch.setenv("RELAXGRAD_BF16_GEMM", "float32")
    mod = relaxgrad.Gradient("main")(MixedPrecision("bf16")(_tied_mlp()))
    rng = np.random.default_rng(0)
    values = [0.06 * rng.standard_normal([int(d) for d in p.ty.shape])
              for p in mod["main"].params]  # fmt: skip
    inputs = [tvm.runtime.tensor(v.astype("float32")) for v in values]
    workspace, results, moved = {}, {}, {}
    sunk_order = order.sunk_order
    for in_order in (True, False):
        monkeypatch.setattr(order, "sunk_order", sunk_order if in_order else lambda *_: None)
        packer, fuser = PackBlockMemory(), FuseOpsInOrder()
        monkeypatch.setattr(pipeline, "PackBlockMemory", lambda packer=packer: packer)
        monkeypatch.setattr(pipeline, "FuseOpsInOrder", lambda fuser=fuser: fuser)
        vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm", cache=False), tvm.cpu())
        workspace[in_order], moved[in_order] = packer.packed["main_adjoint"][0], fuser.moved
        loss, grads = vm["main_adjoint"](*inputs)
        results[in_order] = [loss.numpy(), *(g.numpy() for g in grads)]
    assert moved[True] > 0 and moved[False] == 0
    assert workspace[True] < 0.8 * workspace[False], workspace
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    want, autocast = (_torch_gradients(values, bf16) for bf16 in (False, True))
    for got, exact, rounded in zip(results[True], want, autocast):
        error, autocast_error = (np.linalg.norm(v - exact) / np.linalg.norm(exact)
                                 for v in (got, rounded))  # fmt: skip
        assert error <= 1.1 * autocast_error + 1e-3, (error, autocast_error)


def _torch_gradients(values, bf16: bool) -> list[np.ndarray]:
    """The loss and gradients of :func:`_tied_mlp` in PyTorch: float64, or float32 under bf16
    autocast."""
    dtype = torch.float32 if bf16 else torch.float64
    x, w, *ws = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in values]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        h = torch.relu(x @ w)
        for wi in ws:
            h = torch.relu(h @ wi)
        out = h @ w.T
    loss = (out.float() ** 2).sum()
    loss.backward()
    return [loss.detach().double().numpy(), *(t.grad.double().numpy() for t in [x, w, *ws])]


def test_producers_move_to_their_one_fusing_reader_and_nothing_else_moves():
    """A chain of elementwise producers read far later moves, whole, to just before its
    reader; a producer read twice, or read by a kernel that does not fuse it, stays."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 64), "float32"))
    y = relax.Var("y", relax.TensorType((64, 64), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            early = bb.emit(op.exp(x), "early")  # read once, by chain: both move to late
            chain = bb.emit(op.negative(early), "chain")
            twice = bb.emit(op.sin(y), "twice")  # read by two kernels: stays
            product = bb.emit(op.matmul(twice, y), "product")  # a matmul: not moved
            other = bb.emit(op.cos(twice), "other")
            inner = bb.emit(op.add(product, other), "inner")
            late = bb.emit(op.add(chain, inner), "late")
            out = bb.emit_output(op.sum(late), "out")
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                    relax.transform.AnnotateTIROpPattern()])(bb.get())
    func = mod["main"]
    bindings = list(func.body.blocks[0].bindings)
    from relaxgrad.schedules.order import op_patterns

    got = order.sunk_order(bindings, op_patterns(mod))
    assert [bindings[i].var.name for i in got] == [
        "twice", "product", "early", "chain", "other", "inner", "late", "out"]
    fused = FuseOpsInOrder()(mod)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((64, 64)).astype("float32") for _ in range(2)]
    vm = relax.VirtualMachine(relaxgrad.compile(fused, "llvm", cache=False), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v) for v in xs]).numpy()
    a, b = (v.astype("float64") for v in xs)
    want = (-np.exp(a) + np.sin(b) @ b + np.cos(np.sin(b))).sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)
