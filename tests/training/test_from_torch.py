"""PyTorch modules -> relaxgrad training -> ``load_state_dict``.

Each tiny architecture is imported with :func:`from_torch`, and one step of relaxgrad's
training is compared with PyTorch's own: the first-step gradients, the weights after the
optimizer step (and the BatchNorm running statistics), then the trained state is loaded back
into the module, whose eval-mode output must equal the Trainer's ``predict``.
"""

import numpy as np
import pytest

from relaxgrad.training import (
    SGD,
    Adam,
    CrossEntropyLoss,
    MomentumSGD,
    MSELoss,
    Trainer,
    from_torch,
)

torch = pytest.importorskip("torch")
nn = torch.nn

from .lora_worker import Logits  # noqa: E402 (a causal LM's logits, one row per token)
from .test_precision import _distance  # noqa: E402 (relative distance of two gradients)

BATCH = 8
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
WEIGHT_ATOL = 1e-5


def mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))


def lenet():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5),
    )  # fmt: skip


def batchnorm():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 8 * 8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5),
    )  # fmt: skip


class EmbeddingBag(nn.Module):
    """Token embeddings averaged over the sequence, then a linear classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


class AttentionBlock(nn.Module):
    """A pre-norm self-attention block (``nn.MultiheadAttention``, two heads) with a residual
    and a GELU, pooled to class logits."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.head(torch.nn.functional.gelu(x).mean(dim=1))


class TiedEmbeddings(nn.Module):
    """An output layer tied to the input embedding (one parameter, two names), a second
    embedding with a padding row, and positions from the cumsum of a bool mask."""

    def __init__(self, vocab=12, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pad_embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, 5, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        positions = (tokens != 0).cumsum(-1)
        h = self.embed(tokens) + self.pad_embed(tokens) * positions.unsqueeze(-1).float()
        h = h + self.out(h)[..., :6]
        return self.head(h).mean(1)


def _tokens(rng):
    tokens = rng.integers(0, 12, (BATCH, 5))
    tokens[:, -1] = 0
    return tokens


def _images(rng):
    return rng.standard_normal((BATCH, 1, 8, 8)).astype("float32")


# id -> (module factory, input maker, our optimizer, torch optimizer)
CASES = {
    "mlp-sgd": (mlp, lambda rng: rng.standard_normal((BATCH, 12)).astype("float32"),
                lambda: SGD(0.1), lambda p: torch.optim.SGD(p, 0.1)),
    "lenet-adam": (lenet, _images, lambda: Adam(1e-2), lambda p: torch.optim.Adam(p, 1e-2)),
    "batchnorm-momentum": (batchnorm, _images, lambda: MomentumSGD(0.1, 0.9),
                           lambda p: torch.optim.SGD(p, 0.1, momentum=0.9)),
    "embedding-adam": (EmbeddingBag, lambda rng: rng.integers(0, 20, (BATCH, 6)),
                       lambda: Adam(1e-2), lambda p: torch.optim.Adam(p, 1e-2)),
    "tied-embeddings-sgd": (TiedEmbeddings, _tokens, lambda: SGD(0.1),
                            lambda p: torch.optim.SGD(p, 0.1)),
    "attention-sgd": (AttentionBlock, lambda rng: rng.standard_normal((BATCH, 4, 8))
                      .astype("float32"), lambda: SGD(0.5), lambda p: torch.optim.SGD(p, 0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_step_matches_torch(case):
    factory, make_input, ours, theirs = CASES[case]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    net = factory()
    x, y = make_input(rng), rng.integers(0, 5, BATCH)
    model = from_torch(net, (torch.from_numpy(x),))
    assert set(model.params) == {name for name, _ in net.named_parameters()}
    trainer = Trainer.for_model(model, CrossEntropyLoss(), ours())

    loss, grads = trainer.gradients(x, y)
    net.train()
    optimizer = theirs(net.parameters())
    torch_loss = nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
    torch_loss.backward()
    np.testing.assert_allclose(loss, torch_loss.item(), rtol=1e-5)
    for name, param in net.named_parameters():
        np.testing.assert_allclose(grads[name], param.grad.numpy(), rtol=GRAD_RTOL,
                                   atol=GRAD_ATOL, err_msg=name)

    assert trainer.step(x, y) == pytest.approx(loss)
    optimizer.step()
    state = trainer.state_dict()
    assert list(state) == list(net.state_dict())
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), atol=WEIGHT_ATOL,
                                   err_msg=name)

    # the way back: a fresh module loads the trained state and predicts as the Trainer does
    fresh = factory()
    fresh.load_state_dict(state)
    with torch.no_grad():
        expected = fresh.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(trainer.predict(x), expected, rtol=1e-4, atol=1e-5)


def test_batchnorm_running_stats_follow_torch():
    """Train mode normalizes with the batch statistics and updates the running ones as PyTorch
    does (unbiased variance, momentum, ``num_batches_tracked``), step after step; eval mode
    uses the running statistics."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4, momentum=0.3), nn.Linear(4, 2))
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((3, 16, 6)).astype("float32") * 3 + 1
    ys = rng.standard_normal((3, 16, 2)).astype("float32")
    trainer = Trainer.for_model(from_torch(net, (torch.from_numpy(xs[0]),)), MSELoss(), SGD(0.05))
    optimizer = torch.optim.SGD(net.parameters(), 0.05)
    net.train()
    for x, y in zip(xs, ys):
        trainer.step(x, y)
        optimizer.zero_grad()
        nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    buffers = trainer.buffers
    assert buffers["1.num_batches_tracked"] == 3
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_allclose(buffers[name], net.state_dict()[name].numpy(), rtol=1e-5)
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(xs[0])).numpy()
    np.testing.assert_allclose(trainer.predict(xs[0]), expected, rtol=1e-4, atol=1e-5)


class Dropper(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_dropout_modes():
    x = (torch.zeros(2, 4),)
    with pytest.raises(ValueError, match=r"drops out in train mode .*p=0\.5.*dropout='error'"):
        from_torch(Dropper(0.5), x, dropout="error")
    with pytest.warns(UserWarning, match="turns dropout into the identity"):
        model = from_torch(Dropper(0.5), x, dropout="identity")
    assert model.key is None
    assert from_torch(Dropper(0.5), x).key == "dropout_key"  # the default drops at random
    net = Dropper(0.5)
    net.drop.eval()  # a dropout layer in eval mode is the identity in PyTorch too
    model = from_torch(net, x, dropout="error")
    assert net.fc.training is not False and not net.drop.training  # modes restored
    assert set(model.params) == {"fc.weight", "fc.bias"} and model.key is None
    assert from_torch(Dropper(0.0), x, dropout="error").key is None


class TrainDoubles(nn.Module):
    """Twice its linear layer's output in train mode (a Python branch on ``self.training``,
    which no op of the trace shows), then a dropout of probability 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        y = self.fc(x)
        return self.drop(2 * y if self.training else y)


def test_eval_mode_is_decomposed_and_imported_only_when_its_trace_differs(monkeypatch):
    decompositions = []
    decompose = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda self, *a, **k: decompositions.append(1) or decompose(self, *a, **k))
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(0))
    y = np.arange(BATCH) % 3
    model = from_torch(Dropper(0.0), (torch.zeros(BATCH, 4),))  # p=0: the same in both modes
    assert len(decompositions) == 1 and model.eval_func is None
    net = TrainDoubles()
    model = from_torch(net, (x,))
    assert len(decompositions) == 3 and model.eval_func == "main_eval"
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1))
    loss, grads = trainer.gradients((x.numpy(),), y)
    expected = nn.functional.cross_entropy(net.train()(x), torch.from_numpy(y))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    np.testing.assert_allclose(grads["fc.weight"], net.fc.weight.grad.numpy(), rtol=GRAD_RTOL,
                               atol=GRAD_ATOL)
    with torch.no_grad():
        np.testing.assert_allclose(trainer.predict((x.numpy(),)), net.eval()(x).numpy(),
                                   rtol=1e-5, atol=1e-6)


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x  # data-dependent control flow: export cannot trace


class Unconvertible(nn.Module):
    def forward(self, x):
        return torch.special.i0(x)  # no converter in TVM 0.27's importer


@pytest.mark.parametrize("net, cause", [(Branchy(), "torch.export cannot trace Branchy"),
                                        (Unconvertible(), "TVM's importer cannot convert "
                                         r"Unconvertible .*i0")])
def test_what_cannot_be_imported_is_named(net, cause):
    with pytest.raises(ValueError, match=f"from_torch: {cause}"):
        from_torch(net, (torch.ones(2, 3),))


def test_transformers_sdpa_attention_that_cannot_be_exported_is_named():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    net = Logits(transformers.GPT2LMHeadModel(config))
    assert net.model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"torch.export cannot trace .*GPT2LMHeadModel uses "
                       r"'sdpa' attention: set config._attn_implementation = 'eager'"):
        from_torch(net, (torch.zeros(2, 4, dtype=torch.int64),))


def test_negative_indices_count_from_the_end_and_compile_quietly(capfd):
    """``x[:, -1]`` imports as a take of index -1: PyTorch's value and gradient (TVM's importer
    takes it in "fast" mode, which reads out of bounds), and no compile warning."""
    torch.manual_seed(0)

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(7, 4), torch.nn.Linear(4, 3)

        def forward(self, ids):
            return self.head(self.embed(ids)[:, -1])

    net, ids, y = Last(), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([0, 2])
    model = from_torch(net, (ids,))
    assert 'mode="fast"' not in model.mod.script()
    capfd.readouterr()
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1), cache=False)
    captured = capfd.readouterr()
    assert "Warning" not in captured.err + captured.out, captured.err
    loss, grads = trainer.gradients(ids.numpy(), y.numpy())
    expected = torch.nn.functional.cross_entropy(net(ids), y)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, param in net.named_parameters():
        np.testing.assert_allclose(grads[name], param.grad.numpy(), rtol=1e-4, atol=1e-6)


class Indexing(nn.Module):
    """``x[index]`` in one of PyTorch's advanced-indexing forms, then a linear layer."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.pick(x).reshape(len(x), -1, 4).mean(dim=1))


_INDEXINGS = {  # x of shape (8, 6, 5, 4)
    # index shapes (6, 1) and (3,) broadcast to (6, 3): ConvBERT's span convolution's unfold
    "broadcast": lambda x: x[:, torch.arange(6)[:, None], torch.tensor([0, 2, 4])],
    "negative": lambda x: x[:, torch.tensor([-1, 0, -2])],
    "separated": lambda x: x[torch.arange(8), :, torch.tensor([1]), :],  # the index dims first
    "all": lambda x: x[torch.arange(8)[:, None, None], torch.arange(6)[None, :, None],
                       torch.tensor([[[4, 3, 2, 1]]])],
}


@pytest.mark.parametrize("name", list(_INDEXINGS))
def test_advanced_indexing_follows_torch(name):
    torch.manual_seed(0)
    net = Indexing(_INDEXINGS[name])
    x = torch.randn(8, 6, 5, 4)
    trainer = Trainer.for_model(from_torch(net, (x,)), CrossEntropyLoss(), SGD(0.1))
    y = np.arange(8) % 5
    loss, grads = trainer.gradients(x.numpy(), y)
    x64 = x.double().requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(net.double()(x64), torch.from_numpy(y))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for key, param in net.named_parameters():
        np.testing.assert_allclose(grads[key], param.grad.numpy(), rtol=1e-4, atol=1e-6)


class IntegerDivision(nn.Module):
    """``log(positions / 2)`` of an int64 tensor (true division: floats, as DeBERTa-v2's
    log-bucketed relative positions), scaling a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        positions = torch.arange(1, 5)
        return self.head(x * torch.log(positions / 2 + 1))


def test_integer_true_division_is_a_float():
    torch.manual_seed(0)
    net, x = IntegerDivision(), torch.randn(8, 4)
    trainer = Trainer.for_model(from_torch(net, (x,)), CrossEntropyLoss(), SGD(0.1))
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(trainer.predict(x.numpy()), expected, rtol=1e-5, atol=1e-6)


def test_relu_gradient_at_zero_is_pytorchs():
    """A ReLU fed exact zeros (a zero bias on a zero input row, as Swinv2's position-bias MLP):
    PyTorch's gradient there is 0 (TVM's ``relu`` rule would pass ``g``), and a NaN stays NaN."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))
    nn.init.zeros_(net[0].bias)
    x = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    y = np.array([0, 1])
    trainer = Trainer.for_model(from_torch(net, (x,)), CrossEntropyLoss(), SGD(0.1))
    _, grads = trainer.gradients(x.numpy(), y)
    torch.nn.functional.cross_entropy(net(x), torch.from_numpy(y)).backward()
    for key, param in net.named_parameters():
        np.testing.assert_allclose(grads[key], param.grad.numpy(), rtol=1e-5, atol=1e-7)
    nan = np.array([[np.nan, 0.0], [1.0, -1.0]], "float32")
    assert np.isnan(trainer.predict(nan)[0]).all()


class Countdown(nn.Module):
    """``x + arange(8, -8, -1) * w``: a negative step (Funnel's relative positions)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(x + torch.arange(8, -8, -1) * self.w)


def test_arange_with_a_negative_step_has_torchs_length():
    torch.manual_seed(0)
    net, x = Countdown(), torch.randn(8, 16)
    trainer = Trainer.for_model(from_torch(net, (x,)), CrossEntropyLoss(), SGD(0.1))
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(trainer.predict(x.numpy()), expected, rtol=1e-5, atol=1e-5)


class GatedMLP(nn.Module):
    """A Llama or Qwen2 MLP, ``down(silu(gate(x)) * up(x))``."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(12, 48), nn.Linear(12, 48), nn.Linear(48, 5)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def test_silu_is_imported_whole_with_pytorchs_gradients():
    """Core ATen writes SiLU ``x * sigmoid(x)``; from_torch keeps ``relax.nn.silu``, so that mixed
    precision rounds its result once, as autocast's ``silu`` does, and no sigmoid is held for
    the backward pass. Its gradients are PyTorch's float64 ones, in float32 to float32's
    precision and in bf16 as close as autocast's."""
    torch.manual_seed(0)
    net = GatedMLP()
    rng = np.random.default_rng(0)
    x, y = 2 * rng.standard_normal((32, 12)).astype("float32"), rng.integers(0, 5, 32)
    model = from_torch(net, (torch.from_numpy(x),))
    text = model.mod["main"].script()
    assert "R.nn.silu" in text and "R.sigmoid" not in text

    def torch_grads(dtype, autocast: bool):
        twin = GatedMLP().to(dtype)
        twin.load_state_dict(net.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = twin(torch.from_numpy(x).to(dtype))
        nn.functional.cross_entropy(logits.to(dtype), torch.from_numpy(y)).backward()
        return {k: p.grad.double().numpy() for k, p in twin.named_parameters()}

    exact, autocast = torch_grads(torch.float64, False), torch_grads(torch.float32, True)
    for precision in ("fp32", "bf16"):
        trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1), precision=precision)
        _, grads = trainer.gradients(x, y)
        for name, want in exact.items():
            if precision == "fp32":
                np.testing.assert_allclose(grads[name], want, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           err_msg=name)
            else:
                assert _distance(grads[name], want) <= 2 * _distance(autocast[name], want), name
