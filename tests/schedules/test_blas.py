"""MatmulToBLAS (relaxgrad/schedules/blas.py): large float32 matmuls as OpenBLAS calls, with
transposes folded into sgemm's flags, batches looped or stacked, and a shared weight's gradient
summed over a batch in one gemm."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import _common, blas

pytestmark = pytest.mark.skipif(not blas.available(), reason="no OpenBLAS sgemm found")

# (a shape, b shape, transpose a, transpose b): every operand either batched like the result
# or 2-D.
CASES = [
    ((128, 96), (96, 160), False, False),
    ((96, 128), (96, 160), True, False),
    ((128, 96), (160, 96), False, True),
    ((96, 128), (160, 96), True, True),
    ((4, 64, 96), (96, 80), False, False),  # stacked rows of a
    ((64, 96), (4, 96, 80), False, False),  # a broadcast over b's batch
    ((4, 96, 64), (96, 80), True, False),
    ((2, 3, 64, 96), (2, 3, 80, 96), False, True),  # attention's q @ k^T
]


def _module(a_shape, b_shape, trans_a, trans_b) -> tvm.IRModule:
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))

    def swap(t, ndim):
        return op.permute_dims(t, [*range(ndim - 2), ndim - 1, ndim - 2])

    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            lhs = bb.emit(swap(a, len(a_shape))) if trans_a else a
            rhs = bb.emit(swap(b, len(b_shape))) if trans_b else b
            out = bb.emit_output(op.matmul(lhs, rhs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", CASES)
def test_matmul_matches_numpy(a_shape, b_shape, trans_a, trans_b):
    mod = _module(a_shape, b_shape, trans_a, trans_b)
    rewritten = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert _calls_sgemm(rewritten) and "permute_dims" not in rewritten
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
    executable = relaxgrad.compile(mod)
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](
        tvm.runtime.tensor(a), tvm.runtime.tensor(b)
    ).numpy()
    lhs = np.swapaxes(a, -1, -2) if trans_a else a
    rhs = np.swapaxes(b, -1, -2) if trans_b else b
    np.testing.assert_allclose(got, lhs @ rhs, rtol=1e-4, atol=1e-4)


def test_a_gemm_of_one_kind_is_parsed_once(monkeypatch):
    # every layer of a model multiplies the same shapes: one parse of the script per kind
    parses = []
    real = _common.parse
    monkeypatch.setattr(_common, "parse", lambda *a, **k: parses.append(1) or real(*a, **k))
    monkeypatch.setattr(_common, "_PARSED", type(_common._PARSED)())
    first = blas.gemm_func([512, 896], [896, 896], [512, 896], False, True, threads=2)
    again = blas.gemm_func([512, 896], [896, 896], [512, 896], False, True, threads=2)
    assert len(parses) == 1 and tvm_ffi.structural_equal(again, first)
    other = blas.gemm_func([512, 896], [896, 896], [512, 896], False, False, threads=2)
    assert len(parses) == 2 and not tvm_ffi.structural_equal(other, first)
    # values equal in Python but not in a script are other kinds
    assert len({_common._frozen(v) for v in ([1, 2], (1, 2), [True, 2], [1.0, 2])}) == 3


def test_default_permutation_is_a_transpose():
    """``permute_dims(w)`` without axes (a dense layer's ``x @ w.T``) reverses the axes."""
    x = relax.Var("x", relax.TensorType((128, 96), "float32"))
    w = relax.Var("w", relax.TensorType((160, 96), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(op.matmul(x, op.permute_dims(w)))
        bb.emit_func_output(out)
    rewritten = blas.MatmulToBLAS()(bb.get()).script()
    assert _calls_sgemm(rewritten) and "permute_dims" not in rewritten


def test_small_and_broadcast_batch_matmuls_stay_in_tvm():
    small = _module((8, 16), (16, 8), False, False)
    assert not _calls_sgemm(blas.MatmulToBLAS()(small).script())
    broadcast = _module((1, 64, 96), (4, 96, 80), False, False)
    assert not _calls_sgemm(blas.MatmulToBLAS(min_macs=0)(broadcast).script())



@pytest.mark.skipif(blas.library_path() is None, reason="no OpenBLAS wheel")
def test_a_module_without_products_is_returned_as_it_is():
    """No matmul: none of the rewrites walks the functions (or eliminates dead code after
    them): the module is returned as it is (a 10,000-binding chain's compile spent 6 s here)."""
    x = relax.Var("x", relax.TensorType((64, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op.sum(op.multiply(op.tanh(x), x)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    assert blas.MatmulToBLAS(min_macs=0)(mod).same_as(mod)
    products = _module((64, 64), (64, 64), False, False)
    assert _calls_sgemm(blas.MatmulToBLAS(min_macs=0)(products).script())

@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_over_threads(monkeypatch, threads):
    """Rows, columns (a result wider than tall), batches or, for a small result of a long k
    (tall or wide), k split over the tasks of a parallel loop give the same result, with
    either operand transposed."""
    monkeypatch.setattr(blas, "_SPLIT_MACS", 0)
    monkeypatch.setattr(blas, "_CACHE_BYTES", 0)  # k in slices of 1024: several per task
    rng = np.random.default_rng(1)
    cases = [((97, 33), (33, 41)), ((29, 33), (33, 97)), ((5, 17, 33), (5, 33, 41)),
             ((24, 5000), (5000, 20)), ((20, 5000), (5000, 24))]  # fmt: skip
    for (a_shape, b_shape), trans_a, trans_b in itertools.product(cases, (0, 1), (0, 1)):
        lhs, rhs = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
        a = np.ascontiguousarray(np.swapaxes(lhs, -1, -2)) if trans_a else lhs
        b = np.ascontiguousarray(np.swapaxes(rhs, -1, -2)) if trans_b else rhs
        out_shape = (*a_shape[:-1], b_shape[-1])
        func = blas.gemm_func(a.shape, b.shape, out_shape, trans_a, trans_b, threads)
        assert ("T.parallel" in func.script()) == (threads > 1 or len(a_shape) > 2)
        lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
        out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
        lib(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
        np.testing.assert_allclose(out.numpy(), lhs @ rhs, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("x_first", [True, False])
def test_weight_gradient_over_a_batch_is_one_gemm(x_first):
    """``collapse_sum_to(matmul(permute(x), g), (K, N))`` over a (B, S) batch (a dense layer's
    weight gradient) is one gemm of k = B * S, equal to the sum of the batch's products."""
    x = relax.Var("x", relax.TensorType((4, 32, 48), "float32"))
    g = relax.Var("g", relax.TensorType((4, 32, 40), "float32"))
    lhs, rhs = (x, g) if x_first else (g, x)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            product = bb.emit(op.matmul(bb.emit(op.permute_dims(lhs, [0, 2, 1])), rhs))
            target = (lhs.ty.shape[-1], rhs.ty.shape[-1])
            out = bb.emit_output(op.collapse_sum_to(product, target))
        bb.emit_func_output(out)
    mod = bb.get()
    rewritten = blas.MatmulToBLAS(min_macs=0)(mod)
    script = rewritten.script()
    assert _calls_sgemm(script) and "collapse_sum_to" not in script
    (sgemm,) = [f for gv, f in rewritten.functions_items() if gv.name_hint.startswith("sgemm")]
    assert [int(d) for d in sgemm.params[0].ty.shape] == [128, int(target[0])]  # stacked rows
    rng = np.random.default_rng(2)
    xv, gv = (rng.standard_normal(s).astype("float32") for s in ((4, 32, 48), (4, 32, 40)))
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(gv)).numpy()
    lv, rv = (xv, gv) if x_first else (gv, xv)
    want = sum(lv[i].T @ rv[i] for i in range(4))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _calls_sgemm(script: str) -> bool:
    return "R.call_tir(cls.sgemm" in script and blas.SGEMM in script


@pytest.mark.parametrize("short_k, large", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("trans_a, trans_b", list(itertools.product((False, True), repeat=2)))
def test_summed_batch_of_products_is_one_call(trans_a, trans_b, short_k, large, monkeypatch):
    """``collapse_sum_to(matmul(a, b), (M, N))`` over 3-D operands whose ``k`` is not
    contiguous across the batch (a convolution's weight gradient, ``g[n] @ cols[n]^T``) is one
    call that accumulates the batch's products, transposes folded into its flags; where it is
    contiguous (``a`` transposed, ``b`` not), one gemm over the stacked rows. With ``short_k``
    (a ``k`` per batch under the threshold, a result over it), one gemm over ``k`` stacked
    across the batch, the operands copied into that layout where needed. ``large``: a result
    over the split-k bound, summed by rows or columns of it."""
    if short_k:  # thresholds scaled down to this test's sizes
        monkeypatch.setattr(blas, "_STACK_K_BELOW", 41)
        monkeypatch.setattr(blas, "_STACK_OUT_FROM", 24 * 36)
    if large:
        monkeypatch.setattr(blas, "_SPLIT_K_MAX_OUT", 24 * 36 - 1)
        monkeypatch.setattr(blas, "_SPLIT_MACS", 0)
    batch, m, k, n = 5, 24, 40, 36
    a_shape = (batch, k, m) if trans_a else (batch, m, k)
    b_shape = (batch, n, k) if trans_b else (batch, k, n)
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            lhs = bb.emit(op.permute_dims(a, [0, 2, 1])) if trans_a else a
            rhs = bb.emit(op.permute_dims(b, [0, 2, 1])) if trans_b else b
            out = bb.emit_output(op.collapse_sum_to(bb.emit(op.matmul(lhs, rhs)), (m, n)))
        bb.emit_func_output(out)
    mod = bb.get()
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    stacked = short_k or (trans_a and not trans_b)
    assert ("cls.sgemm_sum" in script) != stacked and "collapse_sum_to" not in script
    assert ("partial" in script) == (not stacked and not large)  # split k: partial results
    copies = script.count("R.permute_dims")  # an operand whose k is last: batch axis moved
    assert copies == (short_k * ((not trans_a) + trans_b)) and "R.matmul" not in script
    rng = np.random.default_rng(3)
    av, bv = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(av), tvm.runtime.tensor(bv)).numpy()
    lhs_v = np.swapaxes(av, 1, 2) if trans_a else av
    rhs_v = np.swapaxes(bv, 1, 2) if trans_b else bv
    np.testing.assert_allclose(got, (lhs_v @ rhs_v).sum(0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m, n", [(24, 36), (36, 24)])
def test_summed_batch_over_threads(threads, m, n):
    """Batches split over 1-3 tasks, the result tall or wide (computed transposed), sum to the
    products' total."""
    batch, k = 7, 33
    rng = np.random.default_rng(threads)
    a = rng.standard_normal((batch, m, k)).astype("float32")
    b = rng.standard_normal((batch, n, k)).astype("float32")
    func = blas._split_k_func(a.shape, b.shape, (m, n), False, True, threads, batched=True)
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    want = sum(a[i] @ b[i].T for i in range(batch))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("trans_a, trans_b", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("m, n", [(24, 37), (37, 24)])
def test_summed_batch_by_rows_or_columns(threads, trans_a, trans_b, m, n, monkeypatch):
    """A batch sum whose result is large (a 1x1 convolution's weight gradient, (256, 1024)):
    each of 1-3 tasks takes rows of the result (columns where it is wider than tall) and
    accumulates the batch's products into them; every transpose, uneven splits."""
    monkeypatch.setattr(blas, "_SPLIT_MACS", 0)  # split this test's small product
    batch, k = 5, 33
    rng = np.random.default_rng(threads)
    a = rng.standard_normal((batch, k, m) if trans_a else (batch, m, k)).astype("float32")
    b = rng.standard_normal((batch, n, k) if trans_b else (batch, k, n)).astype("float32")
    func = blas.gemm_func(a.shape, b.shape, (m, n), trans_a, trans_b, threads, summed=True)
    assert "T.parallel" in func.script() or threads == 1
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.full((m, n), np.nan, "float32"))  # written, not accumulated
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    lhs = np.swapaxes(a, 1, 2) if trans_a else a
    rhs = np.swapaxes(b, 1, 2) if trans_b else b
    np.testing.assert_allclose(out.numpy(), (lhs @ rhs).sum(0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("summed", [True, False])
def test_transposed_product_is_computed_in_place(summed):
    """``permute_dims`` of a product read only there (a linear layer's ``(out, in)`` weight
    gradient, ``(x^T g)^T`` over a batch, or a plain ``(a b)^T``) is folded into the gemm's
    operands: no transpose is left; a product read twice keeps its transpose."""
    shapes = [(4, 32, 48), (4, 32, 40)] if summed else [(64, 48), (48, 40)]
    x, g = (relax.Var(n, relax.TensorType(s, "float32")) for n, s in zip("xg", shapes))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            if summed:
                product = bb.emit(op.matmul(bb.emit(op.permute_dims(x, [0, 2, 1])), g))
                product = bb.emit(op.collapse_sum_to(product, (48, 40)))
            else:
                product = bb.emit(op.matmul(x, g))
            out = bb.emit_output(op.permute_dims(product))
        bb.emit_func_output(out)
    mod = bb.get()
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert _calls_sgemm(script) and "permute_dims" not in script and "transpose" not in script
    rng = np.random.default_rng(4)
    xv, gv = (rng.standard_normal(s).astype("float32") for s in shapes)
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(gv)).numpy()
    want = sum(xv[i].T @ gv[i] for i in range(4)).T if summed else (xv @ gv).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _attention_scores(b: int, h: int, s: int, d: int) -> tvm.IRModule:
    """``scores = q @ k^T`` per head as PyTorch's importer writes it (``k`` transposed per head,
    an identity ``broadcast_to``, then reshaped to one batch axis), and its gradient."""
    q, k = (relax.Var(n, relax.TensorType((b, h, s, d), "float32")) for n in "qk")
    r = relax.Var("r", relax.TensorType((b, h, s, s), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, r]):
        with bb.dataflow():
            keys = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
            keys = bb.emit(op.broadcast_to(keys, (b, h, d, s)))
            keys = bb.emit(op.reshape(keys, (b * h, d, s)))
            scores = bb.emit(op.matmul(bb.emit(op.reshape(q, (b * h, s, d))), keys))
            scores = bb.emit(op.reshape(scores, (b, h, s, s)))
            out = bb.emit_output(op.sum(op.multiply(scores, r)))
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main")(bb.get())


def test_keys_transposed_per_head_are_a_transpose_flag():
    """Attention's keys transposed per head and reshaped (forward), and transposed back in the
    gradient of ``q`` or computed transposed for ``k``'s (``dk^T`` through reshapes and an
    identity ``collapse_sum_to``), leave no transpose: each is an operand's flag or the
    product's swapped operands. The values are ``tvm.compile``'s."""
    mod = _attention_scores(2, 3, 64, 48)
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert _calls_sgemm(script) and "permute_dims" not in script
    rng = np.random.default_rng(5)
    shapes = [[int(v) for v in p.ty.shape] for p in mod["main"].params]
    inputs = [rng.standard_normal(shape).astype("float32") for shape in shapes]
    args = [tvm.runtime.tensor(v) for v in inputs]
    got = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main_adjoint"](*args)
    want = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main_adjoint"](*args)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-4)
    for ours, theirs in zip(got[1], want[1]):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-3)
    q, k, r = inputs
    np.testing.assert_allclose(got[1][0].numpy(), r @ k, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got[1][1].numpy(), np.swapaxes(r, 2, 3) @ q, rtol=1e-4,
                               atol=1e-3)  # fmt: skip


def test_transposed_product_read_twice_keeps_its_transpose():
    a = relax.Var("a", relax.TensorType((64, 48), "float32"))
    b = relax.Var("b", relax.TensorType((48, 40), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            product = bb.emit(op.matmul(a, b))
            out = bb.emit_output(op.add(op.permute_dims(product), op.sum(product)))
        bb.emit_func_output(out)
    script = blas.MatmulToBLAS(min_macs=0)(bb.get()).script()
    assert script.count("R.call_tir(cls.sgemm") == 1 and "permute_dims" in script


WIDTHS = (24, 40, 16)  # of the gradients of three linear layers reading one (4, 32, 28) input


def _layers_backward(x_first: bool, residual: bool, leak: bool) -> tvm.IRModule:
    """The backward of three linear layers ``x @ w_i`` (an attention's q, k and v projections),
    given their output gradients ``d_i``: the input's gradient ``sum_i d_i @ w_i^T`` (plus a
    ``residual`` one), each weight's, ``d_i^T x`` (or ``x^T d_i`` when ``x_first``), and bias's.
    ``leak``: ``d_2`` is also returned, so it is read elsewhere."""
    x = relax.Var("x", relax.TensorType((4, 32, 28), "float32"))
    r = relax.Var("r", relax.TensorType((4, 32, 20), "float32"))
    ds = [relax.Var(f"d{i}", relax.TensorType((4, 32, k), "float32")) for i, k in enumerate(WIDTHS)]
    ws = [relax.Var(f"w{i}", relax.TensorType((k, 20), "float32")) for i, k in enumerate(WIDTHS)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r, *ds, *ws]):
        with bb.dataflow():
            total = r if residual else None
            for d, w in zip(ds, ws):
                product = bb.emit(op.matmul(d, w))
                total = product if total is None else bb.emit(op.add(total, product))
            grads = []
            for d, k in zip(ds, WIDTHS):
                if x_first:
                    product = op.matmul(bb.emit(op.permute_dims(x, [0, 2, 1])), d)
                    grads.append(bb.emit(op.collapse_sum_to(bb.emit(product), (28, k))))
                else:
                    product = op.matmul(bb.emit(op.permute_dims(d, [0, 2, 1])), x)
                    grads.append(bb.emit(op.collapse_sum_to(bb.emit(product), (k, 28))))
                grads.append(bb.emit(op.collapse_sum_to(d, (k,))))
            outputs = [total, *grads, *([ds[1]] if leak else [])]
            out = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("x_first", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_linear_layers_over_one_input_share_their_backward_gemms(x_first, residual):
    """The products of the three gradients become products of their concatenation: one gemm
    for the input's gradient (no add left but the residual's; the weights are read where they
    are, not concatenated), one for the weights', one sum for the biases', sliced; the values
    are numpy's."""
    mod = _layers_backward(x_first, residual, leak=False)
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert script.count("R.concat(") == 1 and script.count("R.strided_slice(") == 6
    parts = [line for line in script.splitlines() if "R.call_tir(cls.sgemm_parts" in line]
    assert len(parts) == 1 and all(f"w{i}" in parts[0] for i in range(3))
    assert script.count("R.call_tir(cls.sgemm") == 2 and script.count("R.add(") == int(residual)
    _check_layers_backward(mod, x_first, residual, leak=False)


def test_gradient_read_elsewhere_stays_out_of_the_concatenation():
    """A gradient read by anything else (here returned) keeps its own products: its producer
    would be computed, then copied into the concatenation. The other two are concatenated."""
    mod = _layers_backward(False, False, leak=True)
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    concats = [line for line in script.splitlines() if "R.concat(" in line]
    assert len(concats) == 1 and "d1" not in concats[0]  # the weights: read where they are
    parts = [line for line in script.splitlines() if "R.call_tir(cls.sgemm_parts" in line]
    assert len(parts) == 1 and "w1" not in parts[0]
    assert script.count("R.call_tir(cls.sgemm") == 4  # 2 of the concatenation, 2 of d1's
    _check_layers_backward(mod, False, False, leak=True)


def test_flattened_linear_layers_share_their_backward_gemms():
    """As ``from_torch`` builds BERT's attention: each layer flattens the (4, 32, 28) input's
    batch with a reshape of its own, its input gradient is its 2-D product reshaped back, and
    its weight gradient a 2-D product with no sum over a batch. The reshapes of one input are
    one input, the products are concatenated as in the 3-D case; the values are numpy's."""
    x = relax.Var("x", relax.TensorType((4, 32, 28), "float32"))
    r = relax.Var("r", relax.TensorType((4, 32, 20), "float32"))
    ds = [relax.Var(f"d{i}", relax.TensorType((128, k), "float32")) for i, k in enumerate(WIDTHS)]
    ws = [relax.Var(f"w{i}", relax.TensorType((k, 20), "float32")) for i, k in enumerate(WIDTHS)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r, *ds, *ws]):
        with bb.dataflow():
            total, grads = r, []
            for d, w, k in zip(ds, ws, WIDTHS):
                product = bb.emit(op.reshape(bb.emit(op.matmul(d, w)), (4, 32, 20)))
                total = bb.emit(op.add(total, product))
                rows = bb.emit(op.reshape(x, (128, 28)))
                grads.append(bb.emit(op.matmul(bb.emit(op.permute_dims(d)), rows)))
                grads.append(bb.emit(op.collapse_sum_to(d, (k,))))
            out = bb.emit_output(relax.Tuple([total, *grads]))
        bb.emit_func_output(out)
    mod = bb.get()
    script = blas.MatmulToBLAS(min_macs=0)(mod).script()
    assert script.count("R.concat(") == 1 and script.count("R.call_tir(cls.sgemm") == 2
    rng = np.random.default_rng(6)
    inputs = [rng.standard_normal(_shape(p)).astype("float32") for p in mod["main"].params]
    x, r, ds, ws = inputs[0], inputs[1], inputs[2:5], inputs[5:]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(v) for v in inputs])]
    want = [r + sum(d @ w for d, w in zip(ds, ws)).reshape(4, 32, 20)]
    for d in ds:
        want += [d.T @ x.reshape(128, 28), d.sum(0)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


def _check_layers_backward(mod, x_first: bool, residual: bool, leak: bool) -> None:
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(_shape(p)).astype("float32") for p in mod["main"].params]
    x, r, ds, ws = inputs[0], inputs[1], inputs[2:5], inputs[5:]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(v) for v in inputs])]
    want = [sum(d @ w for d, w in zip(ds, ws)) + (r if residual else 0)]
    for d in ds:
        weight = np.einsum("bsi,bsj->ij", x, d) if x_first else np.einsum("bsi,bsj->ij", d, x)
        want += [weight, d.sum((0, 1))]
    want += [ds[1]] if leak else []
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


HEADS = (2, 4, 64, 32)  # batch, heads, rows, head width: 1.2M multiply-adds per product


def _heads_module(transposes, leak: bool = False, flat: bool = False) -> tvm.IRModule:
    """``concat([merge(op(a_i) @ op(b_i))], -1)`` and, with one part, the merge alone; merge:
    ``reshape(permute_dims(p, [0, 2, 1, 3]), (B, S, H * D))``, as attention's output and, in
    its backward, the q, k and v gradients. ``leak``: the first product is returned too.
    ``flat``: as ``from_torch`` builds BERT's, the products are 3-D, ``(B * H, S, D)``,
    reshaped to ``(B, H, S, D)``, and the merges reshaped on to ``(B * S, H * D)``."""
    batch, heads, rows, width = HEADS
    params, merged = [], []
    bb = relax.BlockBuilder()
    lead = (batch * heads,) if flat else (batch, heads)
    for i, (trans_a, trans_b) in enumerate(transposes):
        a_shape = (*lead, 72, rows) if trans_a else (*lead, rows, 72)
        b_shape = (*lead, width, 72) if trans_b else (*lead, 72, width)
        params += [relax.Var(f"a{i}", relax.TensorType(a_shape, "float32")),
                   relax.Var(f"b{i}", relax.TensorType(b_shape, "float32"))]  # fmt: skip
    with bb.function("main", params):
        with bb.dataflow():
            products = []
            for i, (trans_a, trans_b) in enumerate(transposes):
                a, b = params[2 * i : 2 * i + 2]
                swap = [0, 2, 1] if flat else [0, 1, 3, 2]
                lhs = bb.emit(op.permute_dims(a, swap)) if trans_a else a
                rhs = bb.emit(op.permute_dims(b, swap)) if trans_b else b
                products.append(bb.emit(op.matmul(lhs, rhs)))
                product = products[-1]
                if flat:
                    product = bb.emit(op.reshape(product, (batch, heads, rows, width)))
                permuted = bb.emit(op.permute_dims(product, [0, 2, 1, 3]))
                merged.append(bb.emit(op.reshape(permuted, (batch, rows, heads * width))))
                if flat:
                    merged[-1] = bb.emit(op.reshape(merged[-1], (batch * rows, heads * width)))
            out = merged[0] if len(merged) == 1 else bb.emit(op.concat(merged, axis=-1))
            outs = [out, products[0]] if leak else [out]
            result = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(result)
    return bb.get()


@pytest.mark.parametrize(
    "transposes",
    [[(False, False)], [(True, False)], [(False, False), (True, False), (False, True)]],
)
@pytest.mark.parametrize("flat", [False, True])
def test_merged_heads_are_written_in_place(transposes, flat):
    mod = _heads_module(transposes, flat=flat)
    script = blas.MatmulToBLAS()(mod).script()
    assert script.count("R.call_tir(cls.sgemm_heads") == 1
    assert "R.concat" not in script and "permute_dims" not in script and "reshape" not in script
    _check_heads(mod, transposes, leak=False, flat=flat)


@pytest.mark.parametrize("trans_a", [False, True])
def test_products_in_unpacked_pieces(trans_a, monkeypatch):
    """On a core whose OpenBLAS kernels multiply small products unpacked, each matrix of a
    batch, or each head, is cut into calls of fewer rows (the last one shorter), except
    where ``op(b)`` is a transpose and ``a`` is not; the results stay the same."""
    monkeypatch.setattr(blas, "CORE", "SkylakeX")
    monkeypatch.setattr(blas, "_UNPACKED_MACS", 40_000)
    monkeypatch.setattr(blas, "_SPLIT_MACS", 0)
    batch, heads, rows, width = HEADS
    assert blas.unpacked_rows(rows, width, 72, trans_b=False) == 16
    assert blas.unpacked_rows(rows, width, 72, trans_b=True) == rows
    assert blas.unpacked_rows(40, 24, 64, trans_b=False) == 16  # pieces of 16, 16 and 8
    transposes = [(trans_a, False), (False, False)]
    mod = _heads_module(transposes, flat=True)
    script = blas.MatmulToBLAS()(mod).script()
    assert script.count("R.call_tir(cls.sgemm_heads") == 1
    _check_heads(mod, transposes, leak=False, flat=True)
    rng = np.random.default_rng(7)
    a_shape, b_shape = ((3, 64, 40) if trans_a else (3, 40, 64)), (3, 64, 24)
    lhs, rhs = rng.standard_normal((3, 40, 64)), rng.standard_normal(b_shape)
    a = np.ascontiguousarray(np.swapaxes(lhs, -1, -2)) if trans_a else lhs
    func = blas.gemm_func(a_shape, b_shape, (3, 40, 24), trans_a, False, threads=2)
    assert "T.parallel(9)" in func.script()  # three pieces per matrix
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.zeros((3, 40, 24), "float32"))
    lib(tvm.runtime.tensor(a.astype("float32")), tvm.runtime.tensor(rhs.astype("float32")), out)
    np.testing.assert_allclose(out.numpy(), lhs @ rhs, rtol=1e-4, atol=1e-3)


def test_product_read_elsewhere_keeps_its_heads_apart():
    """The first product is also returned: it is computed on its own and merged by a transpose,
    the second one's heads are written in place, and the two are concatenated."""
    transposes = [(False, False), (True, False)]
    mod = _heads_module(transposes, leak=True)
    script = blas.MatmulToBLAS()(mod).script()
    assert "R.concat" in script and script.count("R.call_tir(cls.sgemm_heads") == 1
    _check_heads(mod, transposes, leak=True)


def _check_heads(mod, transposes, leak: bool, flat: bool = False) -> None:
    batch, heads, rows, width = HEADS
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(_shape(p)).astype("float32") for p in mod["main"].params]
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    got = [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(v) for v in inputs])]
    products = []
    for i, (trans_a, trans_b) in enumerate(transposes):
        a, b = inputs[2 * i : 2 * i + 2]
        lhs, rhs = (np.swapaxes(x, -1, -2) if t else x for x, t in ((a, trans_a), (b, trans_b)))
        products.append(lhs @ rhs)
    out = (batch * rows, heads * width) if flat else (batch, rows, heads * width)
    merged = [p.reshape(batch, heads, rows, width).transpose(0, 2, 1, 3).reshape(out)
              for p in products]  # fmt: skip
    want = [np.concatenate(merged, -1)] + ([products[0]] if leak else [])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def _shape(var) -> list[int]:
    return [int(d) for d in var.ty.shape]


@pytest.mark.skipif(not blas.FLUSH_DENORMALS, reason="not x86")
@pytest.mark.parametrize("split_k", [False, True])
def test_gemm_flushes_denormals_and_restores_the_thread(split_k):
    """Denormal operands count as zero in the sgemm calls (OpenBLAS is 10-20x slower on them;
    gradients reach them when a model fits its data), and each thread's mode is restored: the
    caller's own float math keeps its denormals."""
    m, k, n = (8, 65536, 8) if split_k else (64, 32, 48)
    a = np.full((m, k), 1e-39, "float32")  # denormal
    a[0, 0] = 1.0
    b = np.ones((k, n), "float32")
    func = blas.gemm_func(a.shape, b.shape, (m, n), False, False, threads=2)
    assert ("partial" in func.script()) == split_k
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    want = np.zeros((m, n), "float32")
    want[0] = 1.0
    np.testing.assert_array_equal(out.numpy(), want)  # without the flush: k * 1e-39 each
    assert np.float32(1e-39) * np.float32(0.5) > 0  # this thread's mode was restored


# A fresh process with TVM's runtime alone: load the library, run main, compare with numpy.
_RUNTIME_ONLY = """
import sys
import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine
vm = VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
a, b = np.load(sys.argv[2]).values()
out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
np.testing.assert_allclose(out, a @ b.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
maps = open("/proc/self/maps").read()
print("COMPILER", "libtvm_compiler" in maps, "OPENBLAS", "scipy_openblas32" in maps)
"""


def test_exported_library_runs_with_the_runtime_alone(tmp_path):
    import os
    import subprocess
    import sys

    shapes = ((4, 64, 96), (4, 80, 96), False, True)
    executable = relaxgrad.compile(_module(*shapes))
    assert "scipy_cblas_sgemm" in executable.mod.imports[0].inspect_source("ll")
    executable.export_library(str(tmp_path / "lib.so"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "ab.npz", *(rng.standard_normal(s).astype("float32") for s in shapes[:2]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TVM_USE_RUNTIME_LIB"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _RUNTIME_ONLY, str(tmp_path / "lib.so"), str(tmp_path / "ab.npz")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "COMPILER False OPENBLAS True" in done.stdout


def test_only_executables_calling_openblas_link_it():
    small = relaxgrad.compile(_module((8, 8), (8, 8), False, False))
    large = relaxgrad.compile(_module(*CASES[0]))
    assert not small.blas_linked and large.blas_linked


@pytest.mark.parametrize("name", ["small", "gemm", "heads", "cnn_step"])
def test_an_executable_links_openblas_exactly_when_its_machine_code_calls_it(name):
    """``blas_linked`` comes from the marks of the PrimFuncs the pipeline leaves
    (``relaxgrad.calls``); the machine code is the truth: an sgemm call left unmarked would
    make an exported library that cannot load, a mark left on no call a needless link."""
    if name == "cnn_step":
        from relaxgrad.training import SGD, CrossEntropyLoss, cnn
        from relaxgrad.training.trainer import training_module

        model = cnn(batch_size=64, image=(3, 16, 16), seed=0)  # convolutions through sgemm
        mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1))
    else:
        mod = {"small": lambda: _module((8, 8), (8, 8), False, False),
               "gemm": lambda: _module(*CASES[0]),
               "heads": lambda: _heads_module([(False, False), (True, False)], flat=True)}[name]()
    executable = relaxgrad.compile(mod)
    code = "".join(m.inspect_source("ll") for m in executable.mod.imports if m.kind == "llvm")
    assert executable.blas_linked == (blas.SGEMM in code)
    assert executable.blas_linked == (name != "small")
