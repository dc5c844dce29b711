"""LoRA on any model (:func:`relaxgrad.training.lora`): gradients of the adapters only, against
PEFT's in float64; a backward pass that computes no frozen weight's gradient and stops at the
lowest adapter (counted on the adjoint); adapters saved in PEFT's format load with
``PeftModel.from_pretrained``; merged weights give the adapted model's outputs."""

import copy
import os
import signal

import numpy as np
import pytest

from relaxgrad import GradientError
from relaxgrad.training import (
    SGD,
    AdamW,
    CrossEntropyLoss,
    Trainer,
    from_torch,
    lora,
    merged_state_dict,
    mlp,
    save_adapter,
)
from relaxgrad.training.trainer import training_module

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from .lora_worker import Logits  # noqa: E402

BATCH, SEQ, VOCAB = 2, 8, 48
TARGETS = ["q_proj", "v_proj"]


def _llama():
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=32, use_cache=False)
    config._attn_implementation = "eager"
    return tf.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    base = _llama()
    x = rng.integers(0, VOCAB, (BATCH, SEQ))
    y = rng.integers(0, VOCAB, BATCH * SEQ)
    model = lora(from_torch(Logits(base), (torch.from_numpy(x),)), TARGETS, r=4, alpha=8)
    # B starts at zero, which would leave A without a gradient
    for name, value in model.params.items():
        if "lora_B" in name:
            model.params[name] = rng.normal(0, 0.05, value.shape).astype("float32")
    trainer = Trainer.for_model(model, CrossEntropyLoss(), AdamW(1e-2), progress=False)
    return base, model, trainer, x, y


def _peft(base, trainer, dtype=torch.float32):
    """PEFT's LoRA of a copy of ``base`` holding the trainer's adapters."""
    module = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)).to(dtype)
    params = trainer.params
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                ours = "model." + name.removeprefix("base_model.model.").replace(".default", "")
                p.copy_(torch.from_numpy(params[ours]))
    return module


def test_model_has_adapters_only(case):
    base, model, trainer, _, _ = case
    assert sorted(model.params) == sorted(
        f"model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
        for i in range(2) for p in TARGETS for ab in "AB")
    assert model.params["model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    assert model.params["model.model.layers.0.self_attn.v_proj.lora_B.weight"].shape == (16, 4)
    assert "model.model.layers.0.self_attn.q_proj.weight" in model.buffers
    assert trainer.param_names == list(model.params)


def test_gradients_match_peft_float64(case):
    base, _, trainer, x, y = case
    loss, grads = trainer.gradients(x, y)
    module = _peft(base, trainer, torch.float64)
    logits = module(torch.from_numpy(x)).logits.reshape(-1, VOCAB)
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert len(trainable) == len(grads) == 8
    for name, p in trainable.items():
        ours = grads["model." + name.removeprefix("base_model.model.").replace(".default", "")]
        ref = p.grad.numpy()
        assert np.linalg.norm(ours - ref) <= 1e-5 * np.linalg.norm(ref), name


def test_steps_leave_base_frozen_and_adapter_loads_in_peft(case, tmp_path):
    base, model, trainer, x, y = case
    frozen = copy.deepcopy(trainer.buffers)
    for _ in range(3):
        trainer.step(x, y)
    for name, value in trainer.buffers.items():
        np.testing.assert_array_equal(value, frozen[name])
    save_adapter(trainer, tmp_path / "adapter", prefix="model.")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        out = loaded(torch.from_numpy(x)).logits.reshape(-1, VOCAB).numpy()
    np.testing.assert_allclose(trainer.predict(x), out, rtol=1e-4, atol=1e-5)
    # the merged weights, loaded into the module without adapters, give the same outputs
    merged = copy.deepcopy(Logits(base))
    merged.load_state_dict(merged_state_dict(trainer))
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.from_numpy(x)).numpy(), out, rtol=1e-4,
                                   atol=1e-5)


def _matmuls(func) -> int:
    return sum(1 for block in func.body.blocks for b in block.bindings
               if getattr(getattr(b.value, "op", None), "name", None) == "relax.matmul")


@pytest.mark.parametrize("target, backward", [
    # on the last layer only: dB (with A x^T: TVM's simplifier turns the transpose of the
    # forward's x A^T into that product), d(down) and dA; nothing reaches the layers below
    ("fc2", 4),
    # on the first: those four, plus the inputs' gradients of fc2 and fc1 (no weight's)
    ("fc0", 6),
])
def test_backward_skips_frozen_weights(target, backward):
    model = lora(mlp(8, in_features=12, hidden=(20, 16), num_classes=5), [target], r=2)
    mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1))
    forward = _matmuls(mod["main"])
    assert forward == 3 + 2
    assert _matmuls(mod["main_loss_adjoint"]) - forward == backward


def test_mlp_lora_gradients_by_finite_differences():
    rng = np.random.default_rng(1)
    model = lora(mlp(4, in_features=6, hidden=(5,), num_classes=3, dtype="float64"), ["fc0"],
                 r=2, alpha=4)
    for name, value in model.params.items():
        model.params[name] = rng.normal(0, 0.5, value.shape)
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), SGD(0.1),
                      buffers=model.buffers, progress=False)
    x, y = rng.normal(size=(4, 6)), rng.integers(0, 3, 4)
    _, grads = trainer.gradients(x, y)

    def loss(params):
        w0 = model.buffers["fc0_weight"] + 2.0 * params["fc0_lora_B"] @ params["fc0_lora_A"]
        h = np.maximum(x @ w0.T + model.buffers["fc0_bias"], 0)
        z = h @ model.buffers["fc1_weight"].T + model.buffers["fc1_bias"]
        z = z - z.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(4), y]))

    for name, value in model.params.items():
        numeric = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            plus, minus = dict(model.params), dict(model.params)
            plus[name] = value.copy()
            minus[name] = value.copy()
            plus[name][i] += 1e-6
            minus[name][i] -= 1e-6
            numeric[i] = (loss(plus) - loss(minus)) / 2e-6
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-9)


def test_bad_targets():
    model = mlp(4, in_features=6, hidden=(5,), num_classes=3)
    with pytest.raises(GradientError, match="no weight parameter"):
        lora(model, ["attention"])
    with pytest.raises(GradientError, match="already has"):
        lora(lora(model, ["fc0"]), ["fc1"])
    from relaxgrad.training import cnn

    with pytest.raises(GradientError, match="no linear layer reads"):
        lora(cnn(4), ["conv0"])
    with pytest.raises(GradientError, match="positive"):
        lora(model, ["fc0"], r=0)


def test_a_weight_frozen_already_is_a_target():
    """A base whose weights are buffers already (requires_grad=False in PyTorch, as PEFT
    leaves a model it wrapped) takes adapters on them too."""
    from dataclasses import replace

    model = mlp(4, in_features=6, hidden=(5,), num_classes=3)
    frozen = replace(model, params={k: v for k, v in model.params.items() if k != "fc0_weight"},
                     buffers={"fc0_weight": model.params["fc0_weight"]})
    adapted = lora(frozen, ["fc0"], r=2)
    assert sorted(adapted.params) == ["fc0_lora_A", "fc0_lora_B"]
    assert adapted.params["fc0_lora_A"].shape == (2, 6)
    assert "fc0_weight" in adapted.buffers


def test_a_killed_lora_fine_tune_resumes_to_the_uninterrupted_run(tmp_path):
    """Killed (SIGKILL) as its step 5 begins, a fine-tune with dropout, a warmup + cosine
    schedule, clipping and AdamW resumes from its last checkpoint to the adapters, optimizer
    state and losses of the run that was not interrupted, bitwise."""
    import subprocess
    import sys

    from . import lora_worker

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, lora_worker.__file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    model = lora_worker.model()
    straight = lora_worker.trainer(model)
    losses = lora_worker.train(straight)
    resumed = lora_worker.trainer(model)
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps == lora_worker.KILLED_AT
    assert lora_worker.train(resumed) == losses[lora_worker.KILLED_AT:]
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value)
    ours, theirs = resumed.state_arrays()[0], straight.state_arrays()[0]
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def test_frozen_weights_are_held_once(case):
    """With ``share_frozen``, the Trainer reads the base's frozen weights (every linear,
    embedding and norm weight) in the PyTorch module's own memory, not a copy, and trains as
    with copies; without, it copies them."""
    base, model, copied, x, y = case
    trainer = Trainer.for_model(model, CrossEntropyLoss(), AdamW(1e-2), progress=False,
                                share_frozen=True)
    reference = Trainer.for_model(model, CrossEntropyLoss(), AdamW(1e-2), progress=False)
    assert [trainer.step(x, y) for _ in range(2)] == [reference.step(x, y) for _ in range(2)]
    frozen = [name for name in trainer._buffers if name not in trainer.updates]
    assert len(frozen) == 2 * 9 + 3  # 9 weights a layer, the embedding, the final norm, lm_head
    for name in frozen:
        assert np.from_dlpack(trainer._buffers[name]).ctypes.data == (
            model.buffers[name].ctypes.data), name
        assert np.from_dlpack(copied._buffers[name]).ctypes.data != (
            model.buffers[name].ctypes.data), name
    weights = {"model." + k: v for k, v in base.state_dict().items()}
    for name in frozen:
        np.testing.assert_array_equal(model.buffers[name], weights[name].numpy())
