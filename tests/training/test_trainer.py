"""Trainer end to end on scikit-learn's digits, plus its bookkeeping and errors."""

import time

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from relaxgrad.training import (
    SGD,
    Adam,
    CrossEntropyLoss,
    MomentumSGD,
    MSELoss,
    Trainer,
    cnn,
    load_digits,
    minibatches,
    mlp,
    training_module,
)

MIN_ACCURACY = 0.95


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def trained_mlp(digits):
    """The digits MLP (64-64-10, batch 32) after 15 epochs of Adam(2e-3)."""
    model = mlp(batch_size=32, seed=0)
    start = time.perf_counter()
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(2e-3))
    compiled = time.perf_counter()
    trainer.fit(digits.x_train, digits.y_train, epochs=15, seed=0, progress=False)
    print(f"MLP: compile {compiled - start:.1f} s, train {time.perf_counter() - compiled:.1f} s")
    return trainer


def test_mlp_reaches_95_percent(trained_mlp, digits):
    result = trained_mlp.evaluate(digits.x_test, digits.y_test)
    print(f"MLP test accuracy {result['accuracy']:.4f}, loss {result['loss']:.4f}")
    assert result["accuracy"] >= MIN_ACCURACY
    assert trained_mlp.history[-1] < trained_mlp.history[0] / 5


def test_cnn_reaches_95_percent():
    digits = load_digits(image=True)
    model = cnn(batch_size=32, seed=0)
    start = time.perf_counter()
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), MomentumSGD(0.02, 0.9))
    compiled = time.perf_counter()
    trainer.fit(digits.x_train, digits.y_train, epochs=12, seed=0, progress=False)
    result = trainer.evaluate(digits.x_test, digits.y_test)
    print(f"CNN: compile {compiled - start:.1f} s, train {time.perf_counter() - compiled:.1f} s, "
          f"test accuracy {result['accuracy']:.4f}")
    assert result["accuracy"] >= MIN_ACCURACY


def test_history_counts_full_batches(trained_mlp, digits):
    steps_per_epoch = len(digits.y_train) // 32
    assert len(trained_mlp.history) == 15 * steps_per_epoch
    assert trained_mlp.batch_size == 32


def test_predict_and_evaluate_agree(trained_mlp, digits):
    x, y = digits.x_test[:50], digits.y_test[:50]  # 50 = 32 + a padded batch of 18
    logits = trained_mlp.predict(x)
    assert logits.shape == (50, 10)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    result = trained_mlp.evaluate(x, y)
    np.testing.assert_allclose(result["loss"], -log_probs[np.arange(50), y].mean(), rtol=1e-5)
    assert result["accuracy"] == np.mean(logits.argmax(axis=1) == y)
    one_hot = np.eye(10, dtype="float32")[y]
    assert trained_mlp.predict(x[:32]).shape == (32, 10)
    with pytest.raises(ValueError, match="target"):  # labels model: one-hot is the wrong type
        trained_mlp.evaluate(x, one_hot)


def test_one_hot_targets(digits):
    model = mlp(batch_size=64, hidden=(32,), seed=1)
    one_hot = np.eye(10, dtype="float32")
    target_type = relax.TensorType((64, 10), "float32")
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(5e-3),
                      target_type=target_type)
    losses = trainer.fit(digits.x_train, one_hot[digits.y_train], epochs=3, progress=False)
    assert losses[-1] < losses[0] / 2
    result = trainer.evaluate(digits.x_test, one_hot[digits.y_test])
    assert result["accuracy"] > 0.8


def _linear_model(batch=16, features=4, outputs=2):
    x = relax.Var("x", relax.TensorType((batch, features), "float32"))
    w = relax.Var("w", relax.TensorType((features, outputs), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [w, x]):  # parameters need not come last
        with bb.dataflow():
            out = bb.emit_output(op.matmul(x, w))
        bb.emit_func_output(out)
    return bb.get()


def test_mse_regression_recovers_weights(capsys):
    rng = np.random.default_rng(0)
    true_w = rng.standard_normal((4, 2)).astype("float32")
    x = rng.standard_normal((160, 4)).astype("float32")
    trainer = Trainer(_linear_model(), {"w": np.zeros((4, 2), "float32")}, MSELoss(), SGD(0.1))
    trainer.fit(x, x @ true_w, epochs=30, progress=True)
    assert "epoch 30/30" in capsys.readouterr().err  # the tqdm bar
    np.testing.assert_allclose(trainer.params["w"], true_w, atol=1e-3)
    assert trainer.evaluate(x, x @ true_w)["loss"] < 1e-6
    assert "accuracy" not in trainer.evaluate(x, x @ true_w)


def test_fit_uses_minibatches_order():
    """``fit`` visits exactly ``minibatches(n, batch, default_rng(seed))``: same steps as
    calling ``step`` by hand."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype("float32")
    y = x @ rng.standard_normal((4, 2)).astype("float32")
    init = {"w": np.zeros((4, 2), "float32")}
    by_fit = Trainer(_linear_model(), init, MSELoss(), MomentumSGD(0.05))
    by_hand = Trainer(_linear_model(), init, MSELoss(), MomentumSGD(0.05))
    fit_losses = by_fit.fit(x, y, epochs=2, seed=3, progress=False)
    order = np.random.default_rng(3)
    hand_losses = [by_hand.step(x[idx], y[idx])
                   for _ in range(2) for idx in minibatches(40, 16, order)]
    assert fit_losses == hand_losses


def test_training_module_functions():
    mod = training_module(_linear_model(), ["w"], MSELoss(), SGD(0.1))
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert names == {"main", "main_loss", "main_loss_adjoint", "main_optimizer", "main_sample_loss"}
    assert [p.name for p in mod["main_loss"].params] == ["w", "x", "target"]
    assert len(mod["main_loss_adjoint"].ret_ty.fields[1].fields) == 1  # the gradient of w
    with pytest.raises(ValueError, match="already has a function named 'main_optimizer'"):
        training_module(mod, ["w"], MSELoss(), SGD(0.1))


def test_errors():
    model = _linear_model()
    with pytest.raises(ValueError, match=r"no parameters named \['v'\]"):
        Trainer(model, {"v": np.zeros(3)}, MSELoss(), SGD(0.1))
    trainer = Trainer(model, {"w": np.zeros((4, 2), "float32")}, MSELoss(), SGD(0.1))
    x, y = np.zeros((32, 4), "float32"), np.zeros((32, 2), "float32")
    with pytest.raises(ValueError, match="compiled for batches of 16, not 8"):
        trainer.fit(x, y, batch_size=8)
    with pytest.raises(ValueError, match=r"input x must have shape \(16, 4\)"):
        trainer.step(x, y[:16])
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        trainer.step((x[:16], x[:16]), y[:16])


def test_shared_buffers_are_cpu_aligned_contiguous_arrays_only():
    from relaxgrad.training.trainer import _shared

    aligned = np.zeros(1024 + 16, "float32")
    start = (-aligned.ctypes.data % 64) // 4
    array = aligned[start:start + 1024].reshape(32, 32)
    array.flags.writeable = False  # from_torch's views are read-only
    tensor = _shared(array, tvm.cpu())
    assert np.from_dlpack(tensor).ctypes.data == array.ctypes.data
    assert _shared(aligned[start + 1:start + 1001], tvm.cpu()) is None  # 4 bytes off
    assert _shared(array.T, tvm.cpu()) is None  # not C-contiguous
    assert _shared(array, tvm.cuda()) is None


@pytest.mark.parametrize("large", [True, False])
def test_first_step_gives_back_what_the_caller_let_go(monkeypatch, large):
    """With large weights, the first step returns freed memory to the system once (a source
    model the caller deleted after making the Trainer), later steps do not; the losses are
    those of a Trainer that never does (the peak RSS it saves is measured in
    bench/real_models.py). With small weights (a model, and so garbage, under
    ``_LARGE_WEIGHTS``), no step does."""
    from relaxgrad.training import trainer as trainer_module

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype("float32")
    y = x @ rng.standard_normal((4, 2)).astype("float32")
    init = {"w": np.ones((4, 2), "float32")}
    plain = Trainer(_linear_model(), init, MSELoss(), SGD(0.1))
    expected = [plain.step(x, y) for _ in range(3)]
    calls = []
    trainer = Trainer(_linear_model(), init, MSELoss(), SGD(0.1))
    monkeypatch.setattr(trainer_module, "_release_free_memory", lambda: calls.append(1))
    if large:  # these 32 bytes of weights counted as large
        monkeypatch.setattr(trainer_module, "_LARGE_WEIGHTS", 32)
    else:
        assert trainer_module._weight_bytes(trainer) == 32 < trainer_module._LARGE_WEIGHTS
    assert [trainer.step(x, y) for _ in range(3)] == expected
    assert calls == ([1] if large else [])


def _tanh_stack(layers: int) -> tuple[tvm.IRModule, dict]:
    """A 64-wide tanh MLP of ``layers`` layers, batch 512 (activations larger than the
    weights, as in a CNN or a long sequence), and its weights."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((512, 64), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((64, 64), "float32")) for i in range(layers)]
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            h = x
            for w in ws:
                h = bb.emit(op.tanh(op.matmul(h, w)))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    rng = np.random.default_rng(3)
    params = {w.name: (rng.standard_normal((64, 64)) / 8).astype("float32") for w in ws}
    return bb.get(), params


def test_gradient_checkpointing_keeps_less_memory_for_the_same_steps(monkeypatch):
    """``gradient_checkpointing=True`` (``"sqrt"``): the compiled adjoint's workspace is smaller
    and the steps the same bits as without; a value that is no policy is a ValueError."""
    from relaxgrad import pipeline
    from relaxgrad.transforms.plan_memory import PackBlockMemory

    model, params = _tanh_stack(16)
    rng = np.random.default_rng(4)
    x, y = (rng.standard_normal((512, 64)).astype("float32") for _ in range(2))
    workspace, runs = {}, {}
    for checkpointing in (True, False):
        packer = PackBlockMemory()
        monkeypatch.setattr(pipeline, "PackBlockMemory", lambda packer=packer: packer)
        trainer = Trainer(model, params, MSELoss(), Adam(1e-3), cache=False, progress=False,
                          gradient_checkpointing=checkpointing)  # fmt: skip
        workspace[checkpointing] = packer.packed["main_loss_adjoint"][0]
        runs[checkpointing] = [trainer.step(x, y) for _ in range(3)], trainer.params
    assert workspace[True] < 0.7 * workspace[False], workspace
    assert runs[True][0] == runs[False][0]
    for name, value in runs[True][1].items():
        np.testing.assert_array_equal(value, runs[False][1][name])
    with pytest.raises(ValueError, match="gradient_checkpointing must be"):
        Trainer(model, params, MSELoss(), Adam(1e-3), gradient_checkpointing="often")
