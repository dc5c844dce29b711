"""DuplicateCheapProducers (relaxgrad/schedules/duplicate.py): a cheap elementwise producer
read by two elementwise kernels (relu's input, read again by relu's gradient) is copied into
each reader's kernel; values unchanged; producers it would cost memory to copy are kept."""

from __future__ import annotations

import re

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import DuplicateCheapProducers


def _module(shapes, body) -> tvm.IRModule:
    params = [relax.Var(f"x{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule, duplicate: bool, rounds: int = 4) -> list[str]:
    copies = [DuplicateCheapProducers(max_rounds=rounds)] if duplicate else []
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), *copies,
              relax.transform.FuseOps()]  # fmt: skip
    main = tvm.transform.Sequential(passes)(mod).script().split("def main")[-1]
    return sorted(re.findall(r"cls\.(\w+)", main))


def _relu_and_its_gradient(bb, x, bias, g):
    t = bb.emit(op.add(x, bias))
    relu = bb.emit(op.nn.relu(t))
    zero = relax.const(0.0, "float32")
    return relax.Tuple([relu, bb.emit(op.where(op.less(t, zero), zero, g))])


def test_relu_input_is_recomputed_in_both_kernels():
    mod = _module([(64, 96), (96,), (64, 96)], _relu_and_its_gradient)
    assert _kernels(mod, False) == ["add", "fused_less_where", "relu"]
    assert _kernels(mod, True) == ["fused_add_less_where", "fused_add_relu"]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in [(64, 96), (96,), (64, 96)]]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    relu, grad = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    t = xs[0] + xs[1]
    np.testing.assert_allclose(relu, np.maximum(t, 0), rtol=1e-6)
    np.testing.assert_allclose(grad, np.where(t < 0, 0, xs[2]), rtol=1e-6)


def test_producers_that_would_cost_memory_or_are_read_elsewhere_are_kept():
    def two_large_operands(bb, x, y, g):  # copying would keep x and y instead of t
        t = bb.emit(op.add(x, y))
        return relax.Tuple([bb.emit(op.nn.relu(t)), bb.emit(op.multiply(t, g))])

    def also_returned(bb, x, bias, g):  # t itself is an output: kept anyway
        t = bb.emit(op.add(x, bias))
        return relax.Tuple([t, bb.emit(op.nn.relu(t)), bb.emit(op.multiply(t, g))])

    for body, shapes in ((two_large_operands, [(8, 16), (8, 16), (8, 16)]),
                         (also_returned, [(8, 16), (16,), (8, 16)])):  # fmt: skip
        mod = _module(shapes, body)
        assert _kernels(mod, True) == _kernels(mod, False)


def test_centered_input_is_recomputed_in_the_reductions_that_read_it():
    """``c = x - mean`` read by ``sum(c * c)`` (one kernel reading ``c`` twice) and by
    ``c * g`` (a normalization's gradient): each reader computes its own ``c``, the sum of
    squares fuses into one kernel; values unchanged."""

    def body(bb, x, m, g):
        c = bb.emit(op.subtract(x, m))
        return relax.Tuple([bb.emit(op.sum(op.multiply(c, c), axis=[0])),
                            bb.emit(op.multiply(c, g))])  # fmt: skip

    shapes = [(32, 48), (1, 48), (32, 48)]
    mod = _module(shapes, body)
    assert "subtract" in _kernels(mod, False)  # c written, then read twice
    fused = _kernels(mod, True)
    assert len(fused) == 2 and all(name.startswith("fused_subtract") for name in fused)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    squares, scaled = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    c = xs[0] - xs[1]
    np.testing.assert_allclose(squares, (c * c).sum(0), rtol=1e-5)
    np.testing.assert_allclose(scaled, c * xs[2], rtol=1e-6)


def test_a_copy_reading_a_cheap_producer_gets_its_own_copy_too():
    """Batch norm's gradient: ``t = c * s``, ``c = x - mean``, with ``t`` read by a sum and an
    elementwise kernel and ``c`` by ``t`` and a sum of squares. The copy of ``t`` would read
    ``c``, one reader more than there was: it reads a copy of ``c`` of its own, in the same
    round, so that no kernel writes ``c`` or ``t``; values unchanged."""

    def body(bb, x, m, s, g):
        c = bb.emit(op.subtract(x, m))
        t = bb.emit(op.multiply(c, s))
        return relax.Tuple([bb.emit(op.sum(op.multiply(c, c), axis=[0])),
                            bb.emit(op.sum(t, axis=[0])), bb.emit(op.multiply(t, g))])  # fmt: skip

    shapes = [(32, 48), (1, 48), (1, 48), (32, 48)]
    mod = _module(shapes, body)
    assert "subtract" in _kernels(mod, False)  # c written, then read by two kernels
    fused = _kernels(mod, True, rounds=1)
    assert len(fused) == 3 and all(name.startswith("fused_subtract") for name in fused)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    squares, total, scaled = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    c = xs[0] - xs[1]
    np.testing.assert_allclose(squares, (c * c).sum(0), rtol=1e-5)
    np.testing.assert_allclose(total, (c * xs[2]).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scaled, c * xs[2] * xs[3], rtol=1e-5)


def test_a_reshape_read_twice_is_recomputed_with_its_producer():
    """A feed-forward layer's GELU input: ``t = reshape(h + bias)`` (the gemm's rows back to
    ``(batch, seq, ffn)``) read by GELU and by GELU's gradient. The reshape counts as
    elementwise: both it and the bias sum are copied into each reader's kernel, so ``t`` is
    never written; a transpose (not the same elements in the same order) is kept."""

    def body(bb, h, bias, g, permute=False):
        s = bb.emit(op.add(h, bias))
        t = bb.emit(op.permute_dims(s, [1, 0]) if permute else op.reshape(s, (4, 16, 96)))
        return relax.Tuple([bb.emit(op.nn.gelu(t)), bb.emit(op.multiply(t, g))])

    shapes = [(64, 96), (96,), (4, 16, 96)]
    mod = _module(shapes, body)
    assert "fused_add_reshape" in _kernels(mod, False)  # t written, then read twice
    fused = _kernels(mod, True)
    assert len(fused) == 2 and all(name.startswith("fused_add_reshape") for name in fused)
    transposed = _module([(64, 96), (96,), (96, 64)], lambda *a: body(*a, permute=True))
    assert _kernels(transposed, True) == _kernels(transposed, False)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    gelu, scaled = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    t = torch.from_numpy((xs[0] + xs[1]).reshape(4, 16, 96))
    np.testing.assert_allclose(gelu, torch.nn.functional.gelu(t).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(scaled, t.numpy() * xs[2], rtol=1e-6)


def test_producers_of_two_full_size_operands_expanding_to_one_var_are_copied():
    """GPT-2's GELU, ``0.5 x (1 + tanh(c (x + 0.044715 x ** 3)))``, with its gradient reading
    ``x * x`` (``x ** 3``'s gradient) and ``u = x + 0.044715 x ** 3``: ``x * x`` reads ``x``
    twice and ``u`` reads ``x`` and ``0.044715 x ** 3``, which both expand to ``x``, so copies
    keep only ``x`` alive (``x + y`` of two independent inputs is still kept: see above).
    Every intermediate is computed in the two kernels that read it, none written; values
    against PyTorch's autograd."""

    def body(bb, x, g):
        square = bb.emit(op.multiply(x, x))
        cube = bb.emit(op.multiply(square, x))
        u = bb.emit(op.add(x, bb.emit(op.multiply(cube, relax.const(0.044715, "float32")))))
        t = bb.emit(op.tanh(bb.emit(op.multiply(u, relax.const(0.7978845608, "float32")))))
        half = relax.const(0.5, "float32")
        gelu = bb.emit(op.multiply(op.multiply(half, x), op.add(relax.const(1.0, "float32"), t)))
        dt = bb.emit(op.subtract(relax.const(1.0, "float32"), op.multiply(t, t)))
        du = op.multiply(relax.const(0.7978845608, "float32"),
                         op.add(relax.const(1.0, "float32"),
                                op.multiply(relax.const(3 * 0.044715, "float32"), square)))
        grad = op.add(op.multiply(half, op.add(relax.const(1.0, "float32"), t)),
                      op.multiply(op.multiply(half, x), op.multiply(dt, du)))
        return relax.Tuple([gelu, bb.emit(op.multiply(grad, g))])  # fmt: skip

    shapes = [(64, 96), (64, 96)]
    mod = _module(shapes, body)
    assert len(_kernels(mod, False)) > 2  # x * x, u or tanh written, then read again
    assert len(_kernels(mod, True, rounds=8)) == 2
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    gelu, grad = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    x = torch.from_numpy(xs[0]).double().requires_grad_()
    want = torch.nn.functional.gelu(x, approximate="tanh")
    (want * torch.from_numpy(xs[1]).double()).sum().backward()
    np.testing.assert_allclose(gelu, want.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-4, atol=1e-4)


def _late_reader(bb, x, b, w, y, root_read_last: bool = True):
    """``t = relu(z + b)``, ``z = x @ w``, read by a product at once and by another (a weight
    gradient's) after more than ``_LATE_GAP`` bindings; ``z`` read again at the end (a relu
    gradient's mask) or not."""
    z = bb.emit(op.matmul(x, w))
    t = bb.emit(op.nn.relu(op.add(z, b)))
    h = bb.emit(op.matmul(t, w))
    for _ in range(70):
        h = bb.emit(op.matmul(h, w))
    outs = [bb.emit(op.matmul(op.permute_dims(t, [1, 0]), h))]
    if root_read_last:
        outs.append(bb.emit(op.multiply(op.add(z, b), y)))
    return relax.Tuple(outs)


def test_a_producer_read_again_much_later_is_copied_for_the_late_reader():
    """The late product reads a copy of ``relu(z + b)`` made just before it, so that ``t``
    dies after the first product; not where ``z`` would then live longer for the copy."""
    shapes = [(64, 96), (96,), (96, 96), (64, 96)]
    mod = _module(shapes, _late_reader)
    plain, copied = _kernels(mod, False), _kernels(mod, True)
    relus = [name for name in copied if "relu" in name]
    assert len(relus) == 2 and len([n for n in plain if "relu" in n]) == 1, copied
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    xs[2] = np.linalg.qr(xs[2])[0].astype("float32")  # (orthogonal: h keeps its scale)
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    late, masked = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    z = xs[0] @ xs[2]
    t = np.maximum(z + xs[1], 0)
    h = t @ xs[2]
    for _ in range(70):
        h = h @ xs[2]
    np.testing.assert_allclose(late, t.T @ h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(masked, (z + xs[1]) * xs[3], rtol=1e-5, atol=1e-6)
    shortened = _module(shapes, lambda *a: _late_reader(*a, root_read_last=False))
    assert _kernels(shortened, True) == _kernels(shortened, False)


def _mlp(layers: int, dtype: str = "float32", differentiate: bool = True) -> tvm.IRModule:
    """Linear layers with bias and relu, batch 64, width 256: each relu output is read by the
    next product and, in the backward pass, by that product's weight gradient."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 256), dtype))
    ws = [relax.Var(f"w{i}", relax.TensorType((256, 256), dtype)) for i in range(layers)]
    bs = [relax.Var(f"b{i}", relax.TensorType((256,), dtype)) for i in range(layers)]
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for w, b in zip(ws, bs):
                h = bb.emit(op.nn.relu(op.add(op.matmul(h, w), b)))
            out = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main")(bb.get()) if differentiate else bb.get()


def _with_and_without_late_copies(mod, rng, monkeypatch) -> tuple[dict, dict]:
    """The packed workspace of ``mod``'s adjoint and its results on random inputs, compiled
    with late copies (key True) and without (False)."""
    from relaxgrad import pipeline
    from relaxgrad.schedules import duplicate
    from relaxgrad.transforms.plan_memory import PackBlockMemory

    inputs = [tvm.runtime.tensor((0.1 * rng.standard_normal([int(d) for d in p.ty.shape]))
                                 .astype("float32")) for p in mod["main"].params]  # fmt: skip
    workspace, results = {}, {}
    for late in (True, False):
        if not late:
            monkeypatch.setattr(duplicate, "_LATE_GAP", 10**9)
        packer = PackBlockMemory()
        monkeypatch.setattr(pipeline, "PackBlockMemory", lambda packer=packer: packer)
        vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm", cache=False), tvm.cpu())
        workspace[late] = packer.packed["main_adjoint"][0]
        loss, grads = vm["main_adjoint"](*inputs)
        results[late] = [loss.numpy(), *(g.numpy() for g in grads)]
    return workspace, results


def test_late_copies_shrink_the_adjoints_workspace_and_keep_its_bits(monkeypatch):
    """An MLP's adjoint: with the relu outputs copied for the weight gradients, the packed
    workspace is smaller; the gradients are the same bits, and PyTorch's (float64)."""
    mod = _mlp(8)
    rng = np.random.default_rng(6)
    workspace, results = _with_and_without_late_copies(mod, rng, monkeypatch)
    assert workspace[True] < workspace[False], workspace
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    mod = _mlp(8, "float64")  # against PyTorch's autograd, in float64
    shapes = [[int(d) for d in p.ty.shape] for p in mod["main"].params]
    values = [rng.uniform(-1, 1, s) / (16 if len(s) == 2 and s[0] == 256 else 1) for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(v) for v in values])
    x, *params = [torch.tensor(v, requires_grad=True) for v in values]
    h = x
    for w, b in zip(params[:8], params[8:]):
        h = torch.relu(h @ w + b)
    want = (h * h).sum()
    want.backward()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=1e-12)
    for got, t in zip(grads, [x, *params]):
        np.testing.assert_allclose(got.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_a_value_rounded_to_bf16_is_a_root_its_copies_read():
    """Mixed precision holds a value in bfloat16 and reads it back widened: the copies of the
    widening read the bfloat16 value (held, half the memory), not the float32 chain it was
    rounded from, which would keep that alive (and round again); values unchanged."""
    import ml_dtypes

    def body(bb, x, bias, g):
        t = bb.emit(op.add(x, bias))
        wide = bb.emit(op.astype(bb.emit(op.astype(t, "bfloat16")), "float32"))
        zero = relax.const(0.0, "float32")
        return relax.Tuple([bb.emit(op.nn.relu(wide)),
                            bb.emit(op.where(op.less(wide, zero), zero, g))])

    shapes = [(64, 96), (96,), (64, 96)]
    mod = _module(shapes, body)
    assert _kernels(mod, True) == ["fused_add_cast", "fused_cast1_less_where",
                                   "fused_cast1_relu"]  # fmt: skip
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm", cache=False), tvm.cpu())
    relu, grad = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    t = (xs[0] + xs[1]).astype(ml_dtypes.bfloat16).astype("float32")
    np.testing.assert_array_equal(relu, np.maximum(t, 0))
    np.testing.assert_array_equal(grad, np.where(t < 0, 0, xs[2]))


def test_operands_held_in_bf16_are_copied_for_late_readers_too(monkeypatch):
    """Mixed precision: each relu output is held in bf16 (a root: the float32 value it was
    rounded from dies) and read by the next product and, in the backward pass, by its weight
    gradient. The late reader reads a copy computed from the held product result, which the
    backward pass keeps anyway, so the packed workspace is smaller (ResNet-50 in bf16 at batch
    8: 560 -> 371 MiB, float32's 566), with the same gradient bits."""
    from relaxgrad.transforms import MixedPrecision

    mod = relaxgrad.Gradient("main")(MixedPrecision("bf16")(_mlp(8, differentiate=False)))
    workspace, results = _with_and_without_late_copies(mod, np.random.default_rng(7),
                                                       monkeypatch)
    assert workspace[True] < 0.8 * workspace[False], workspace
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)


def test_a_producer_is_not_copied_into_readers_that_broadcast_it():
    """A rotary embedding's ``cos(freqs)`` (positions x head size), read by the queries' 14
    heads and the keys' 2 (broadcast over the heads): a copy in each reader would compute each
    cosine once per head. It is computed once, in a kernel of its own, which both read (cheap
    arithmetic broadcast so, as a mean, is still copied: the other tests); values unchanged."""

    def body(bb, freqs, q, k):
        c = bb.emit(op.cos(freqs))
        return relax.Tuple([bb.emit(op.multiply(q, c)), bb.emit(op.multiply(k, c))])

    shapes = [(1, 32, 16), (14, 32, 16), (2, 32, 16)]
    mod = _module(shapes, body)
    assert _kernels(mod, True) == _kernels(mod, False) == ["multiply", "multiply1", "tir_cos"]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    vm = relax.VirtualMachine(relaxgrad.compile(mod, "llvm"), tvm.cpu())
    queries, keys = (t.numpy() for t in vm["main"](*[tvm.runtime.tensor(x) for x in xs]))
    np.testing.assert_allclose(queries, xs[1] * np.cos(xs[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(keys, xs[2] * np.cos(xs[0]), rtol=1e-5, atol=1e-6)
