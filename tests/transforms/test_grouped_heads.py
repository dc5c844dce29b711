"""FoldRepeatedHeads: grouped-query attention's products read the key/value heads once; the
function, its gradients (float64 finite differences on compiled code) and products it must not
touch."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad import _ty
from relaxgrad.exprs import is_op
from relaxgrad.testing import assert_gradients_close
from relaxgrad.transforms import FoldRepeatedHeads

B, KV, REP, S, D = 2, 2, 3, 5, 4
H = KV * REP


def _repeat(bb, x, rep=REP, axis=2):
    """Hugging Face's ``repeat_kv``: ``x`` (b, kv, s, d) -> (b, kv * rep, s, d), head ``h``
    reading head ``h // rep``; with ``axis=1`` tiled instead (head ``h`` reads ``h % kv``)."""
    b, kv, s, d = _shape(x)
    shape = [b, kv, s, d]
    shape.insert(axis, rep)
    expanded = bb.emit(op.expand_dims(x, axis))
    repeated = bb.emit(op.broadcast_to(expanded, shape))
    merged = [b, kv * rep, s, d]
    return bb.emit(op.reshape(repeated, merged))


def _attention(rep_axis=2, dtype="float64", flat=True):
    """``main(q, k, v, w) = sum(softmax(q @ k_rep^T) @ v_rep * w)``, its batched products
    on 3-D views as ``from_torch`` imports them (``flat``) or 4-D."""
    q = relax.Var("q", relax.TensorType((B, H, S, D), dtype))
    k = relax.Var("k", relax.TensorType((B, KV, S, D), dtype))
    v = relax.Var("v", relax.TensorType((B, KV, S, D), dtype))
    w = relax.Var("w", relax.TensorType((B, H, S, D), dtype))
    bb = relax.BlockBuilder()

    def product(lhs, rhs):
        if not flat:
            return bb.emit(op.matmul(lhs, rhs))
        ls, rs = _shape(lhs), _shape(rhs)
        lhs = bb.emit(op.reshape(bb.emit(op.broadcast_to(lhs, ls)), [B * H, *ls[2:]]))
        rhs = bb.emit(op.reshape(bb.emit(op.broadcast_to(rhs, rs)), [B * H, *rs[2:]]))
        return bb.emit(op.reshape(bb.emit(op.matmul(lhs, rhs)), [B, H, ls[2], rs[3]]))

    with bb.function("main", [q, k, v, w]):
        with bb.dataflow():
            keys = bb.emit(op.permute_dims(_repeat(bb, k, axis=rep_axis), [0, 1, 3, 2]))
            probs = bb.emit(op.nn.softmax(product(q, keys), axis=-1))
            out = product(probs, _repeat(bb, v, axis=rep_axis))
            loss = bb.emit_output(op.sum(op.multiply(out, w)))
        bb.emit_func_output(loss)
    return bb.get()


def _inputs(dtype="float64"):
    rng = np.random.default_rng(0)
    shapes = [(B, H, S, D), (B, KV, S, D), (B, KV, S, D), (B, H, S, D)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _shape(expr):
    return [int(d) for d in _ty.static_shape(expr)]


def _calls(func, name):
    return [b.value for block in func.body.blocks for b in block.bindings
            if is_op(b.value, name)]


def _run(mod, inputs):
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


@pytest.mark.parametrize("flat", [True, False])
def test_products_read_the_heads_once_with_the_same_value_and_gradients(flat):
    mod = _attention(flat=flat)
    folded = FoldRepeatedHeads()(mod)
    repeats = [c for c in _calls(folded["main"], "relax.broadcast_to")
               if np.prod(_shape(c)) != np.prod(_shape(c.args[0]))]
    assert not repeats  # every repeat is gone (a no-op broadcast of ``flat`` may stay)
    products = _calls(folded["main"], "relax.matmul")
    assert [_shape(p) for p in products] == [
        [B * KV, REP * S, S], [B * KV, REP * S, D]]
    inputs = _inputs()
    np.testing.assert_allclose(_run(folded, inputs), _run(mod, inputs), rtol=1e-12)
    assert_gradients_close(folded, inputs=inputs, compile=lambda m, t: relaxgrad.compile(m, t))


def test_gradients_equal_those_of_the_repeated_program_with_no_sum_over_the_copies():
    mod = _attention(dtype="float32")
    inputs = _inputs("float32")
    grads = relaxgrad.Gradient("main")(mod)
    vm = relax.VirtualMachine(relaxgrad.compile(grads), tvm.cpu())
    _, expected = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    folded = relaxgrad.Gradient("main")(FoldRepeatedHeads()(mod))
    vm = relax.VirtualMachine(relaxgrad.compile(folded), tvm.cpu())
    _, got = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    sums = [c for c in _calls(folded["main_adjoint"], "relax.collapse_sum_to")
            if np.prod(_shape(c)) != np.prod(_shape(c.args[0]))]
    assert not sums
    assert [c for c in _calls(grads["main_adjoint"], "relax.collapse_sum_to")
            if np.prod(_shape(c)) != np.prod(_shape(c.args[0]))]  # (what it would have been)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)


def test_a_repeat_of_another_axis_is_left_as_it_is():
    """Heads tiled (query head h reads key head h % kv), which stacked rows cannot express."""
    mod = _attention(rep_axis=1)
    assert FoldRepeatedHeads()(mod)["main"].same_as(mod["main"])


def test_a_broadcast_left_operand_is_left_as_it_is():
    x = relax.Var("x", relax.TensorType((S, D), "float32"))  # broadcast over the batch
    k = relax.Var("k", relax.TensorType((B, KV, S, D), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, k]):
        with bb.dataflow():
            keys = bb.emit(op.permute_dims(_repeat(bb, k), [0, 1, 3, 2]))
            out = bb.emit_output(op.matmul(x, keys))
        bb.emit_func_output(out)
    mod = bb.get()
    assert FoldRepeatedHeads()(mod)["main"].same_as(mod["main"])


def test_only_the_named_functions():
    mod = _attention()
    assert FoldRepeatedHeads(["other"])(mod)["main"].same_as(mod["main"])
