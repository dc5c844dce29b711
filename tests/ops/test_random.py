"""Keyed random masks (relaxgrad.ops.random): Philox 4x32-10 against Random123's known answers,
the keep rate, streams, and dropout's gradient on compiled code (against PyTorch with our masks,
and finite differences), under every checkpoint policy and in split mode."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te

import relaxgrad
from relaxgrad import GradientError
from relaxgrad.ops import random
from relaxgrad.testing import FAST_LLVM, assert_gradients_close
from relaxgrad.transforms import policies

# Random123's kat_vectors: counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def _select(words, j):
    value = words[3]
    for i in (2, 1, 0):
        value = tvm.tirx.Select(j == i, words[i], value)
    return value


def test_philox_matches_the_known_answers():
    n = len(KAT)
    ctr = te.placeholder((n, 4), "uint32", name="ctr")
    key = te.placeholder((n, 2), "uint32", name="key")
    out = te.compute((n, 4), lambda i, j: random.philox4x32(
        [ctr[i, w] for w in range(4)], [key[i, 0], key[i, 1]], lambda ws: _select(ws, j)))
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([ctr, key, out])}), "llvm")
    result = tvm.runtime.tensor(np.zeros((n, 4), "uint32"))
    lib["main"](*(tvm.runtime.tensor(np.array([row[i] for row in KAT], "uint32"))
                  for i in (0, 1)), result)
    np.testing.assert_array_equal(result.numpy(), np.array([row[2] for row in KAT], "uint32"))


SHAPE = (256, 1024)
RATES = (0.1, 0.5, 0.9)


@pytest.fixture(scope="module")
def masks():
    """``masks(key, rate, site)``: the bool mask of SHAPE, from compiled code."""
    key = relax.Var("key", random.KEY_TYPE)
    like = relax.Var("like", relax.TensorType(SHAPE, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [like, key]):
        with bb.dataflow():
            out = [random.bernoulli(bb, like, key, 1.0 - rate, site)
                   for rate in RATES for site in (0, 1)]
            gv = bb.emit_output(relax.Tuple(out))
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(relaxgrad.compile(bb.get(), "llvm"), tvm.cpu())
    dummy = tvm.runtime.tensor(np.zeros(SHAPE, "float32"))

    def run(key, rate, site=0):
        result = vm["main"](dummy, tvm.runtime.tensor(np.array(key, "uint32")))
        return result[RATES.index(rate) * 2 + site].numpy()

    return run


@pytest.mark.parametrize("rate", RATES)
def test_keep_rate_is_within_4_sigma(masks, rate):
    keep = masks([7, 3], rate).reshape(-1)
    for part in (keep, *(keep[lane::4] for lane in range(4))):  # each Philox word too
        sigma = np.sqrt(rate * (1 - rate) / part.size)
        assert abs(part.mean() - (1 - rate)) < 4 * sigma


def test_streams_differ_by_key_and_site_and_repeat_by_key(masks):
    a = masks([1, 0], 0.5)
    np.testing.assert_array_equal(a, masks([1, 0], 0.5))
    for other in (masks([1, 1], 0.5), masks([2, 0], 0.5), masks([1, 0], 0.5, site=1)):
        agree = np.mean(a == other)  # independent halves agree on about half the elements
        assert abs(agree - 0.5) < 4 * np.sqrt(0.25 / a.size)


def _two_dropouts(dtype="float64", rates=(0.5, 0.25)):
    """main(x, w, key) = (sum(tanh(drop(tanh(x @ w)) @ w) dropped), keep0, keep1)."""
    x = relax.Var("x", relax.TensorType((4, 6), dtype))
    w = relax.Var("w", relax.TensorType((6, 6), dtype))
    key = relax.Var("key", random.KEY_TYPE)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, key]):
        with bb.dataflow():
            h = bb.emit(relax.op.tanh(relax.op.matmul(x, w)))
            y, keep0 = random.dropout(bb, h, key, rates[0], site=0)
            h2 = bb.emit(relax.op.matmul(bb.emit(y), w))
            y2, keep1 = random.dropout(bb, h2, key, rates[1], site=1)
            outputs = [relax.op.sum(relax.op.tanh(y2)), keep0, keep1]
            outputs = [bb.emit_output(out) for out in outputs]
        bb.emit_func_output(relax.Tuple(outputs))
    return bb.get(), (x, w)


def _inputs(key=(5, 9)):
    rng = np.random.default_rng(0)
    return [rng.uniform(-1, 1, (4, 6)), rng.uniform(-1, 1, (6, 6)), np.array(key, "uint32")]


def _torch_grads(x, w, keep0, keep1, rates=(0.5, 0.25)):
    x, w = (torch.tensor(a, requires_grad=True) for a in (x, w))
    h = torch.tanh(x @ w) * torch.from_numpy(keep0) / (1 - rates[0])
    y = (h @ w) * torch.from_numpy(keep1) / (1 - rates[1])
    torch.tanh(y).sum().backward()
    return x.grad.numpy(), w.grad.numpy()


def _gradient(mod, wrt, **kwargs):
    return relaxgrad.Gradient("main", list(wrt), target_index=0, **kwargs)(mod)


def _adjoint_grads(mod, inputs):
    vm = relax.VirtualMachine(tvm.compile(mod, FAST_LLVM), tvm.cpu())
    out, grads = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in inputs))
    return [out[1].numpy(), out[2].numpy()], [g.numpy() for g in grads]


@pytest.fixture(scope="module")
def reference():
    """The gradients with no checkpointing, and the masks the forward pass drew."""
    mod, wrt = _two_dropouts()
    return _adjoint_grads(_gradient(mod, wrt, checkpoint="none"),
                          _inputs())


def test_gradient_equals_pytorch_with_our_masks(reference):
    (keep0, keep1), grads = reference
    assert 0 < keep0.mean() < 1 and 0 < keep1.mean() < 1
    for ours, theirs in zip(grads, _torch_grads(*_inputs()[:2], keep0, keep1)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_gradient_matches_finite_differences():
    mod, _ = _two_dropouts()
    assert_gradients_close(mod, inputs=_inputs(), target_index=0)


@pytest.mark.parametrize("checkpoint", [
    "markers", "sqrt", "save_dots", {"save": ["lv1"]}, policies.budget(0),
])
def test_every_checkpoint_policy_gives_the_gradients_of_none(reference, checkpoint):
    mod, wrt = _two_dropouts()
    masks, grads = _adjoint_grads(
        _gradient(mod, wrt, checkpoint=checkpoint), _inputs())
    for ours, expected in zip(masks + grads, reference[0] + reference[1]):
        np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("checkpoint", ["markers", "none", "sqrt"])
def test_split_mode_saves_the_key_not_the_masks(reference, checkpoint):
    mod, wrt = _two_dropouts()
    split = _gradient(mod, wrt, checkpoint=checkpoint, split=True)
    residuals = relaxgrad.split_info(split).residuals
    assert "key" in [r.name for r in residuals]
    assert all(r.dtype != "bool" for r in residuals)
    vm = relax.VirtualMachine(tvm.compile(split, FAST_LLVM), tvm.cpu())
    out, saved = vm["main_fwd"](*(tvm.runtime.tensor(a) for a in _inputs()))
    grads = vm["main_bwd"](*list(saved))
    for ours, expected in zip(grads, reference[1]):
        np.testing.assert_array_equal(ours.numpy(), expected)


def test_rate_zero_and_one():
    mod, wrt = _two_dropouts(rates=(0.0, 1.0))
    (keep0, keep1), (gx, gw) = _adjoint_grads(_gradient(mod, wrt),
                                              _inputs())
    assert keep0.all() and not keep1.any()
    assert not gx.any() and not gw.any()  # everything dropped after the second matmul


def test_bad_keys_and_rates_are_named():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bad_key = relax.Var("key", relax.TensorType((3,), "uint32"))
    key = relax.Var("key", random.KEY_TYPE)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, key, bad_key]):
        with pytest.raises(GradientError, match=r"dropout: the key must be a \(2,\) uint32"):
            random.dropout(bb, x, bad_key, 0.5)
        with pytest.raises(GradientError, match=r"dropout: the rate must be in \[0, 1\]"):
            random.dropout(bb, x, key, 1.5)
        bb.emit_func_output(x)


def test_adjoint_builds_for_cuda():
    mod, wrt = _two_dropouts("float32")
    relaxgrad.compile(_gradient(mod, wrt),
                      {"kind": "cuda", "arch": "sm_90"})


def _relax_dropout(rate=0.4):
    """main(x, w) = (sum(tanh(dropout(x @ w))), mask), with Relax's un-keyed R.nn.dropout."""
    x = relax.Var("x", relax.TensorType((4, 6), "float64"))
    w = relax.Var("w", relax.TensorType((6, 6), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            dropped = bb.emit(relax.op.nn.dropout(relax.op.matmul(x, w), rate))
            loss = bb.emit_output(relax.op.sum(relax.op.tanh(relax.TupleGetItem(dropped, 0))))
            mask = bb.emit_output(relax.TupleGetItem(dropped, 1))
        bb.emit_func_output(relax.Tuple([loss, mask]))
    return bb.get()


def test_unkeyed_relax_dropout_is_refused_by_the_gradient():
    mod = _relax_dropout()
    with pytest.raises(GradientError, match=r"relax\.nn\.dropout \(bound to .*KeyDropout"):
        relaxgrad.Gradient("main", target_index=0)(mod)


def test_key_dropout_lowers_relax_dropout_to_keyed_masks():
    before = _relax_dropout()
    mod = relaxgrad.transforms.KeyDropout("main")(before)
    assert [p.name for p in mod["main"].params] == ["x", "w", "dropout_key"]
    assert len(before.get_global_vars()) == 1 and len(before["main"].params) == 2  # untouched
    grad = relaxgrad.Gradient("main", list(mod["main"].params[:2]), target_index=0)(mod)
    vm = relax.VirtualMachine(tvm.compile(grad, FAST_LLVM), tvm.cpu())
    x, w, key = _inputs()
    (_, mask), (gx, gw) = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in (x, w, key)))
    mask = mask.numpy()
    assert 0.3 < mask.mean() < 0.9 and set(np.unique(mask)) <= {0.0, 1.0}
    xt, wt = (torch.tensor(a, requires_grad=True) for a in (x, w))
    torch.tanh((xt @ wt) * torch.from_numpy(mask) / 0.6).sum().backward()
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gw.numpy(), wt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_key_dropout_names_what_it_cannot_do():
    mod = _relax_dropout()
    with pytest.raises(GradientError, match="KeyDropout: the module has no Relax function nope"):
        relaxgrad.transforms.KeyDropout("nope")(mod)
    with pytest.raises(GradientError, match="already has a parameter x"):
        relaxgrad.transforms.KeyDropout("main", key="x")(mod)
    keyed = relaxgrad.transforms.KeyDropout("main")(mod)
    without = relaxgrad.transforms.KeyDropout("main")(keyed)  # no R.nn.dropout left
    assert without.same_as(keyed)
