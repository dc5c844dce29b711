"""Trainer(precision=...): bfloat16 and float16 training against PyTorch's autocast (first
gradients at least as close to float64 as autocast's, float32 master weights), and float16's
dynamic loss scale: overflow skips and halves, growth, checkpoints, exported artifacts."""

import copy

import numpy as np
import pytest

from relaxgrad.training import SGD, Adam, CrossEntropyLoss, Trainer, from_torch
from relaxgrad.training import trainer as trainer_module
from relaxgrad.training.runtime_runner import Runner

torch = pytest.importorskip("torch")

BATCH = 16


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 10))


def _data(rows=64):
    rng = np.random.default_rng(3)
    return rng.standard_normal((rows, 32)).astype("float32"), rng.integers(0, 10, rows)


def _trainer(precision, optimizer=None, **kwargs):
    net = _net()
    model = from_torch(net, (torch.randn(BATCH, 32),))
    return net, Trainer.for_model(model, CrossEntropyLoss(), optimizer or SGD(0.1),
                                  precision=precision, **kwargs)


def _torch_grads(net, x, y, dtype, autocast=None):
    twin = copy.deepcopy(net).to(dtype)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = twin(torch.from_numpy(x).to(dtype))
    torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(y)).backward()
    return {k: p.grad.double().numpy() for k, p in twin.named_parameters()}


def _distance(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_first_gradients_as_close_as_autocasts(precision, dtype):
    net, trainer = _trainer(precision)
    x, y = _data()
    loss, ours = trainer.gradients(x[:BATCH], y[:BATCH])
    exact = _torch_grads(net, x[:BATCH], y[:BATCH], torch.float64)
    autocast = _torch_grads(net, x[:BATCH], y[:BATCH], torch.float32, dtype)
    _, fp32 = _trainer("fp32")[1].gradients(x[:BATCH], y[:BATCH])
    assert sorted(ours) == sorted(exact)
    for name, g in ours.items():
        assert g.dtype == np.float32 and np.isfinite(g).all(), name
        mine, theirs = _distance(g, exact[name]), _distance(autocast[name], exact[name])
        print(f"{precision} {name}: ours {mine:.2e}, autocast {theirs:.2e}")
        assert mine <= 2 * theirs + 1e-6, name
    assert any(_distance(g, exact[n]) > 10 * _distance(fp32[n], exact[n])
               for n, g in ours.items())  # fmt: skip  (the products are low precision)
    assert all(p.dtype == np.float32 for p in trainer.params.values())  # master weights


def test_bf16_trains_as_autocast_over_steps():
    net, trainer = _trainer("bf16", Adam(1e-2))
    x, y = _data()
    twin = copy.deepcopy(net)
    opt = torch.optim.Adam(twin.parameters(), 1e-2)
    for step in range(8):
        rows = slice(BATCH * (step % 4), BATCH * (step % 4 + 1))
        ours = trainer.step(x[rows], y[rows])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = twin(torch.from_numpy(x[rows]))
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(y[rows]))
        loss.backward()
        opt.step()
        assert ours == pytest.approx(loss.item(), rel=2e-2), step
    assert trainer.history[-1] < trainer.history[0]


def test_fp16_overflow_skips_halves_and_grows(monkeypatch, tmp_path):
    monkeypatch.setattr(trainer_module, "GROWTH_INTERVAL", 3)
    _, trainer = _trainer("fp16")
    assert trainer.loss_scale == 2.0**16
    x, y = _data()
    trainer.loss_scale = 2.0**30  # the scaled gradients overflow float16 (65504)
    before = trainer.params
    trainer.step(x[:BATCH], y[:BATCH])
    assert trainer.skipped_steps == 1 and trainer.steps == 0 and trainer.loss_scale == 2.0**29
    for name, value in before.items():
        np.testing.assert_array_equal(trainer.params[name], value)
    while trainer.steps == 0:
        trainer.step(x[:BATCH], y[:BATCH])
    skipped, scale = trainer.skipped_steps, trainer.loss_scale
    assert 1 < skipped < 30 and scale < 2.0**29
    for _ in range(3):
        trainer.step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
    assert trainer.loss_scale == 2 * scale  # three finite steps in a row (interval 3)
    trainer.save(tmp_path / "ckpt")
    resumed = _trainer("fp16")[1]
    resumed.load(tmp_path / "ckpt")
    assert resumed.loss_scale == trainer.loss_scale and resumed.skipped_steps == skipped


def test_fp16_steps_equal_unscaled_float16_steps():
    """The loss scale changes nothing but the range: steps at scale 2^16 and at scale 1 take
    the same parameters (powers of two scale exactly), but for the few gradients that are
    subnormal in float16 at scale 1 (what the scale is for)."""
    _, scaled = _trainer("fp16")
    _, unscaled = _trainer("fp16")
    unscaled.loss_scale = 1.0
    x, y = _data()
    for step in range(3):
        rows = slice(BATCH * step, BATCH * (step + 1))
        assert scaled.step(x[rows], y[rows]) == unscaled.step(x[rows], y[rows])
    for name, value in unscaled.params.items():
        close = np.isclose(scaled.params[name], value, rtol=1e-6, atol=1e-7)
        assert close.mean() > 0.99, name
        np.testing.assert_allclose(scaled.params[name], value, rtol=1e-3, atol=1e-5)


def test_exported_fp16_artifacts_scale_as_the_trainer(tmp_path):
    _, trainer = _trainer("fp16", Adam(1e-2))
    trainer.export(tmp_path)
    runner = Runner(tmp_path)
    x, y = _data()
    for step in range(4):
        rows = slice(BATCH * step, BATCH * (step + 1))
        assert runner.step(x[rows], y[rows]) == pytest.approx(trainer.step(x[rows], y[rows]),
                                                              rel=1e-6)
    for name, value in zip(trainer.param_names, runner.params):
        np.testing.assert_allclose(value.numpy(), trainer.params[name], rtol=1e-5, atol=1e-6)
    runner.save()
    resumed = _trainer("fp16", Adam(1e-2))[1]
    resumed.load(runner.state_path)
    assert resumed.loss_scale == 2.0**16 and resumed.steps == 4


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or 'fp16'"):
        _trainer("int8")


def test_a_bf16_module_trains_with_float32_master_weights():
    net = _net().to(torch.bfloat16)
    model = from_torch(net, (torch.randn(BATCH, 32, dtype=torch.bfloat16),))
    assert model.precision == "bf16"
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())  # the module is untouched
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1))
    assert trainer.precision == "bf16"
    for name, value in model.params.items():  # the bf16 weights, exactly, in float32
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, net.state_dict()[name].float().numpy())
    x, y = _data()
    losses = [trainer.step(x[:BATCH], y[:BATCH]) for _ in range(5)]
    assert losses[-1] < losses[0]
    net.load_state_dict(trainer.state_dict())  # back into the bf16 module
    assert net[0].weight.dtype == torch.bfloat16
    np.testing.assert_allclose(net[0].weight.detach().float().numpy(), trainer.params["0.weight"],
                               rtol=1e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_warning_on_a_cpu_without_low_precision_units(monkeypatch, precision):
    """On a CPU with no bf16 (fp16) arithmetic the Trainer warns once, naming the CPU, and its
    gradients are still those of the products in that precision (float32 products of the same
    values, as autocast's); with the units it says nothing."""
    import warnings

    from relaxgrad.schedules import onednn

    x, y = _data()
    onednn.available()  # whether oneDNN loads is decided (and cached) on the real flags
    monkeypatch.setattr(onednn, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.warns(RuntimeWarning, match=f"precision='{precision}' on a CPU without") as record:
        net, trainer = _trainer(precision)
    assert len([w for w in record if w.category is RuntimeWarning]) == 1
    assert onednn.cpu_model() in str(record[0].message)
    _, ours = trainer.gradients(x[:BATCH], y[:BATCH])
    exact = _torch_grads(net, x[:BATCH], y[:BATCH], torch.float64)
    autocast = _torch_grads(net, x[:BATCH], y[:BATCH], torch.float32,
                            torch.bfloat16 if precision == "bf16" else torch.float16)
    for name, g in ours.items():
        assert _distance(g, exact[name]) <= 2 * _distance(autocast[name], exact[name]) + 1e-6
    monkeypatch.setattr(onednn, "cpu_flags", lambda: set(onednn.UNITS[precision]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _trainer(precision)
    monkeypatch.setattr(onednn, "cpu_flags", lambda: {"avx2", "fma"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _trainer("fp32")


def test_frozen_weights_held_in_bf16_give_the_same_steps(tmp_path):
    """``frozen_dtype="bf16"``: the frozen weights that only products read (a LoRA base's
    linear weights; not its biases or its LayerNorm's) are held in bfloat16, and the steps are
    those of the float32-held weights cast each step, bit for bit (the products read the same
    bf16 values), through a checkpoint too; ``state_dict`` returns them rounded, in float32."""
    from relaxgrad.training import lora

    x, y = _data()
    runs = {}
    for frozen_dtype in (None, "bf16"):
        model = lora(from_torch(_net(), (torch.randn(BATCH, 32),)), ["0", "3"], r=4)
        trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-2), precision="bf16",
                                    frozen_dtype=frozen_dtype)
        losses = [trainer.step(x[:BATCH], y[:BATCH]) for _ in range(3)]
        trainer.save(tmp_path / f"{frozen_dtype}.state")
        runs[frozen_dtype] = trainer, losses
    (wide, wide_losses), (low, low_losses) = runs[None], runs["bf16"]
    assert wide.frozen_low == ()
    weights = {n for n in low.buffer_names if n.endswith("weight") and not n.startswith("2.")}
    assert set(low.frozen_low) == weights and len(weights) == 2
    assert all(low._buffers[n].dtype == "bfloat16" for n in weights)
    assert low_losses == wide_losses
    for name in low.param_names:
        np.testing.assert_array_equal(low.params[name], wide.params[name])
    state, original = low.state_dict(), wide.state_dict()
    for name in weights:
        value = torch.as_tensor(original[name])
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value.to(torch.bfloat16).float())
    resumed = Trainer.for_model(lora(from_torch(_net(), (torch.randn(BATCH, 32),)), ["0", "3"],
                                     r=4),
                                CrossEntropyLoss(), Adam(1e-2), precision="bf16",
                                frozen_dtype="bf16")
    resumed.load(tmp_path / "bf16.state")
    assert resumed.step(x[:BATCH], y[:BATCH]) == wide.step(x[:BATCH], y[:BATCH])


def test_frozen_dtype_needs_the_same_precision():
    with pytest.raises(ValueError, match="frozen_dtype"):
        _trainer("fp32", frozen_dtype="bf16")


class _LM(torch.nn.Module):
    """An embedding looked up, a linear layer, and an output projection: the embedding's
    transpose where ``tied``, else a linear layer of its own."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = None if tied else torch.nn.Linear(16, 50, bias=False)

    def forward(self, ids):
        hidden = torch.nn.functional.gelu(self.proj(self.embed(ids)))
        logits = hidden @ self.embed.weight.T if self.head is None else self.head(hidden)
        return logits.reshape(-1, 50)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "looked_up_only"])
def test_a_frozen_embedding_is_held_in_bf16_and_looked_up_rounded(tmp_path, tied):
    """``frozen_dtype="bf16"`` also takes a frozen embedding that is looked up (and tied to the
    output projection, or not): held in bfloat16, its rows read widened, so the steps are those
    of the float32 model whose embedding was rounded to bfloat16 first, bit for bit; the loss
    is PyTorch's for that rounded model in float64 to bf16's rounding; exported, the step runs
    with TVM's runtime alone as in the Trainer."""
    from relaxgrad.training import lora

    ids = np.random.default_rng(0).integers(0, 50, (4, 8))
    x, y = ids, np.random.default_rng(1).integers(0, 50, 32)
    runs = {}
    for frozen_dtype in (None, "bf16"):
        net = _LM(tied)
        if frozen_dtype is None:  # the float32 model with its embedding rounded to bf16
            with torch.no_grad():
                net.embed.weight.copy_(net.embed.weight.bfloat16().float())
        model = lora(from_torch(net, (torch.from_numpy(ids),)), ["proj"], r=4)
        trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-2), precision="bf16",
                                    frozen_dtype=frozen_dtype)
        runs[frozen_dtype] = trainer, [trainer.step(x, y) for _ in range(3)]
    (wide, wide_losses), (low, low_losses) = runs[None], runs["bf16"]
    embedding = [n for n in low.buffer_names if "embed" in n]
    assert len(embedding) == 1 and embedding[0] in low.frozen_low
    assert low._buffers[embedding[0]].dtype == "bfloat16"
    assert low_losses == wide_losses
    for name in low.param_names:
        np.testing.assert_array_equal(low.params[name], wide.params[name])
    rounded = _LM(tied).double()
    with torch.no_grad():
        rounded.embed.weight.copy_(rounded.embed.weight.bfloat16().double())
    exact = torch.nn.functional.cross_entropy(rounded(torch.from_numpy(ids)),
                                              torch.from_numpy(y)).item()
    assert abs(low_losses[0] - exact) < 2e-2 * abs(exact)
    low.export(tmp_path)
    assert Runner(tmp_path).step(x, y) == pytest.approx(low.step(x, y), rel=1e-6)
