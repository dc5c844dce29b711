"""Losses: values against numpy references, gradients numerically, append_loss plumbing."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from relaxgrad.testing import check_gradients
from relaxgrad.training import CrossEntropyLoss, MSELoss, append_loss

BATCH, FEATURES, CLASSES = 4, 5, 3


def _linear(dtype="float64"):
    """``main(x, w, b) = x @ w.T + b``: a tiny model to append losses to."""
    x = relax.Var("x", relax.TensorType((BATCH, FEATURES), dtype))
    w = relax.Var("w", relax.TensorType((CLASSES, FEATURES), dtype))
    b = relax.Var("b", relax.TensorType((CLASSES,), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            out = bb.emit_output(op.add(op.matmul(x, op.permute_dims(w)), b))
        bb.emit_func_output(out)
    return bb.get()


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _reduce(per_sample, reduction):
    return {"mean": per_sample.mean(), "sum": per_sample.sum(), "none": per_sample}[reduction]


def _targets(kind, rng):
    if kind == "labels":
        return rng.integers(0, CLASSES, BATCH).astype("int64")
    if kind == "one_hot":
        return np.eye(CLASSES)[rng.integers(0, CLASSES, BATCH)]
    return rng.standard_normal((BATCH, CLASSES))


# (loss, target kind, numpy reference of the per-sample loss, the "mean" scale)
CASES = {
    "mse": (MSELoss, "values", lambda z, t: ((z - t) ** 2).mean(axis=1), CLASSES),
    "ce_labels": (CrossEntropyLoss, "labels",
                  lambda z, t: -_log_softmax(z)[np.arange(BATCH), t], 1),
    "ce_one_hot": (CrossEntropyLoss, "one_hot", lambda z, t: -(_log_softmax(z) * t).sum(1), 1),
}


def _target_type(kind):
    if kind == "labels":
        return relax.TensorType((BATCH,), "int64")
    return relax.TensorType((BATCH, CLASSES), "float64")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_standalone_loss_matches_numpy(case, reduction):
    loss_cls, kind, per_sample, scale = CASES[case]
    loss = loss_cls(reduction)
    func = loss(relax.TensorType((BATCH, CLASSES), "float64"), _target_type(kind))
    vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({loss.name: func}), "llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    z, t = rng.standard_normal((BATCH, CLASSES)), _targets(kind, rng)
    got = vm[loss.name](tvm.runtime.tensor(z), tvm.runtime.tensor(t)).numpy()
    expected = _reduce(per_sample(z, t), reduction)
    if reduction == "sum":  # an elementwise loss sums over every element, not per sample
        expected = expected * scale
    np.testing.assert_allclose(got, expected, rtol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_appended_loss_gradients(case, reduction):
    loss_cls, kind, _, _ = CASES[case]
    mod = append_loss(_linear(), loss_cls(reduction), target_type=_target_type(kind))
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((BATCH, FEATURES)), rng.standard_normal((CLASSES, FEATURES)),
              rng.standard_normal(CLASSES), _targets(kind, rng)]
    result = check_gradients(mod, "main_loss", inputs, wrt=[1, 2])
    assert result.ok, str(result)


def test_append_loss_signature_and_default_target():
    mod = _linear()
    out = append_loss(mod, CrossEntropyLoss())
    func = out["main_loss"]
    assert [p.name for p in func.params] == ["x", "w", "b", "target"]
    assert func.params[3].ty.dtype == "int64"
    assert tuple(int(d) for d in func.params[3].ty.shape) == (BATCH,)
    assert func.ret_ty.ndim == 0
    assert func.attrs["global_symbol"] == "main_loss"
    assert "main_loss" not in [gv.name_hint for gv in mod.get_global_vars()]  # input untouched
    renamed = append_loss(mod, MSELoss(), loss_func_name="objective")
    assert tuple(int(d) for d in renamed["objective"].params[3].ty.shape) == (BATCH, CLASSES)


def test_append_loss_rejects_bad_models():
    with pytest.raises(ValueError, match="no Relax function named 'nope'"):
        append_loss(_linear(), MSELoss(), "nope")
    x = relax.Var("x", relax.TensorType((2,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        out = bb.emit(op.exp(x))
        bb.emit_func_output(relax.Tuple([out, out]))
    with pytest.raises(ValueError, match="dataflow block"):
        append_loss(bb.get(), MSELoss())


def test_unknown_reduction():
    with pytest.raises(ValueError, match="unknown reduction 'max'"):
        MSELoss("max")
    with pytest.raises(ValueError, match="unknown reduction"):
        CrossEntropyLoss().with_reduction("avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_ignore_index_matches_torch(reduction, ignore_index):
    """Ignored labels (prompt tokens, padding) add nothing and a mean is over the others:
    loss and gradients of the logits as ``torch.nn.functional.cross_entropy``'s."""
    torch = pytest.importorskip("torch")
    mod = append_loss(_linear(), CrossEntropyLoss(reduction, ignore_index=ignore_index))
    rng = np.random.default_rng(2)
    x, w, b = (rng.standard_normal(s) for s in [(BATCH, FEATURES), (CLASSES, FEATURES),
                                                (CLASSES,)])
    labels = np.array([0, ignore_index, 2, ignore_index], "int64")
    if reduction != "none":
        result = check_gradients(mod, "main_loss", [x, w, b, labels], wrt=[1, 2])
        assert result.ok, str(result)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    got = vm["main_loss"](*(tvm.runtime.tensor(a) for a in (x, w, b, labels))).numpy()
    z = torch.tensor(x @ w.T + b)
    expected = torch.nn.functional.cross_entropy(z, torch.tensor(labels), reduction=reduction,
                                                 ignore_index=ignore_index).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    with pytest.raises(ValueError, match="ignore_index must be an int"):
        CrossEntropyLoss(ignore_index=1.5)
