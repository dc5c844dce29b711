"""RowSparseGradients (relaxgrad/schedules/sparse_rows.py): a gradient zero but at a few rows
of a sequence (a classifier's first token) is computed on those rows, through layer norms,
linear layers and GELU as ``from_torch`` builds them, and written dense where anything else
reads it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import RowSparseGradients, sparse_rows
from relaxgrad.testing import check_gradients

B, S, H, F = 4, 16, 32, 48


@pytest.fixture(autouse=True)
def _small_gradients_too(monkeypatch):
    """These gradients are smaller than the pass's default threshold (2**16 elements)."""
    monkeypatch.setattr(sparse_rows, "MIN_ELEMENTS", 0)


def _classifier(dtype: str = "float32", token=0, attention: bool = False) -> tvm.IRModule:
    """A post-norm block as ``from_torch`` builds BERT's (linear layers over the flattened
    rows), read at ``token`` (an index or a list of them) of axis 1; ``attention``: the block's
    input first mixes its rows (``softmax(x x^T) x``), whose gradient is dense again."""
    x = relax.Var("x", relax.TensorType((B, S, H), dtype))
    w1 = relax.Var("w1", relax.TensorType((F, H), dtype))
    b1 = relax.Var("b1", relax.TensorType((F,), dtype))
    w2 = relax.Var("w2", relax.TensorType((H, F), dtype))
    gamma = relax.Var("gamma", relax.TensorType((H,), dtype))
    beta = relax.Var("beta", relax.TensorType((H,), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w1, b1, w2, gamma, beta]):
        with bb.dataflow():
            h0 = x
            if attention:
                scores = bb.emit(op.matmul(x, bb.emit(op.permute_dims(x, [0, 2, 1]))))
                h0 = bb.emit(op.matmul(bb.emit(op.nn.softmax(scores)), x))
            rows = bb.emit(op.reshape(h0, (B * S, H)))
            h = bb.emit(op.add(b1, bb.emit(op.matmul(rows, bb.emit(op.permute_dims(w1))))))
            act = bb.emit(op.nn.gelu(bb.emit(op.reshape(h, (B, S, F)))))
            flat = bb.emit(op.reshape(act, (B * S, F)))
            out = bb.emit(op.matmul(flat, bb.emit(op.permute_dims(w2))))
            total = bb.emit(op.add(bb.emit(op.reshape(out, (B, S, H))), h0))
            if dtype == "float32":
                y = bb.emit(op.nn.layer_norm(total, gamma, beta, axes=[-1]))
            else:  # TVM's layer_norm is float32 (and float16) only: the same, op by op
                centered = bb.emit(op.subtract(total, op.mean(total, [-1], keepdims=True)))
                variance = op.mean(op.multiply(centered, centered), [-1], keepdims=True)
                scale = op.rsqrt(op.add(variance, relax.const(1e-5, dtype)))
                y = bb.emit(op.add(op.multiply(op.multiply(centered, scale), gamma), beta))
            y = bb.emit(op.multiply(relax.const(0.5, dtype), y))  # its gradient: one more op
            index = relax.const(np.array(token, "int64"))
            picked = bb.emit(op.take(y, index, axis=1))
            loss = bb.emit_output(op.sum(op.multiply(picked, op.tanh(picked))))
        bb.emit_func_output(loss)
    return bb.get()


def _adjoint(mod: tvm.IRModule) -> tvm.IRModule:
    return relaxgrad.Gradient("main")(mod)


@pytest.mark.parametrize("token", [0, 5, [2, 3], S - 1])
def test_rows_match_the_dense_gradient(token):
    """The first token's (or a middle one's, two rows', the last one's) gradient runs on its
    rows: no
    ``take_backward`` is left, the backward's products have B rows (2 B), and every
    gradient equals TVM's own pipeline's (dense) on the same adjoint."""
    adjoint = _adjoint(_classifier(token=token))
    rewritten = RowSparseGradients()(adjoint)["main_adjoint"]
    script = rewritten.script()
    assert "take_backward" not in script and "R.nn.pad" in script  # the input's gradient
    count = 1 if isinstance(token, int) else len(token)
    values = [b.value for block in rewritten.body.blocks for b in block.bindings]
    products = [v for v in values if isinstance(v, relax.Call) and v.op.name == "relax.matmul"]
    rows = sorted(int(p.args[0].ty.shape[0]) for p in products)
    assert rows.count(B * S) == 2 and rows.count(B * count) == 2  # forward; input gradients
    rng = np.random.default_rng(0)
    params = adjoint["main_adjoint"].params
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in params]
    got = relax.VirtualMachine(relaxgrad.compile(adjoint), tvm.cpu())["main_adjoint"](
        *[tvm.runtime.tensor(a) for a in args]
    )
    want = relax.VirtualMachine(tvm.compile(adjoint, target="llvm"), tvm.cpu())["main_adjoint"](
        *[tvm.runtime.tensor(a) for a in args]
    )
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", [False, True])
def test_gradients_match_finite_differences(attention):
    """float64, compiled with relaxgrad's pipeline (the rows' rewrite in it); with attention
    the gradient mixes the rows again and is written dense before it."""
    result = check_gradients(
        _classifier("float64", attention=attention),
        compile=lambda mod, target: relaxgrad.compile(mod, target),
    )
    assert result.ok, str(result)


def test_gradient_read_whole_is_written_dense_once():
    """A gradient of rows that a dense op reads (here: added to a dense gradient, the
    residual's with attention) is padded back once; the function's results stay dense."""
    adjoint = _adjoint(_classifier(attention=True))
    script = RowSparseGradients()(adjoint)["main_adjoint"].script()
    assert "take_backward" not in script and script.count("R.nn.pad") >= 1
    returned = RowSparseGradients()(adjoint)["main_adjoint"].ret_ty
    assert [int(d) for d in returned.fields[1].fields[0].shape] == [B, S, H]


def test_other_gradients_are_left_alone():
    """More than a quarter of the rows, or a gradient under ``min_elements``: unchanged."""
    many = _adjoint(_classifier(token=list(range(6))))
    assert RowSparseGradients()(many).script() == many.script()
    small = _adjoint(_classifier())
    assert RowSparseGradients(min_elements=B * S * H + 1)(small).script() == small.script()
    assert "take_backward" not in RowSparseGradients(B * S * H)(small).script()
