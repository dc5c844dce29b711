"""Dropout through from_torch and the Trainer: the masks are keyed Philox streams (gradients equal
PyTorch's with the same masks), a fresh key per step and micro-batch, reproducible from the seed
and across save/load; eval mode drops nothing; other random ops are refused by name; Hugging
Face models with their default dropout train."""

import copy
import warnings

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax

import relaxgrad
from relaxgrad.ops import random
from relaxgrad.testing import FAST_LLVM
from relaxgrad.training import (
    SGD,
    Adam,
    CrossEntropyLoss,
    MSELoss,
    Trainer,
    append_loss,
    from_torch,
)
from relaxgrad.transforms import policies

RATES = (0.5, 0.2)


class Net(nn.Module):
    """Two dropouts: ``nn.Dropout`` (native_dropout) and an in-place one (bernoulli)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.drop1, self.drop2 = nn.Dropout(RATES[0]), nn.Dropout(RATES[1], inplace=True)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(torch.relu(self.fc1(x)))))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8)).astype("float32")
    y = rng.standard_normal((8, 3)).astype("float32")
    net = Net()
    model = from_torch(net, (torch.from_numpy(x[:4]),))
    trainer = Trainer.for_model(model, MSELoss(), SGD(0.1), target="llvm", seed=3)
    return net, model, trainer, x, y


def _gradients(trainer, x, y, counter=None):
    if counter is not None:
        trainer.key_counter = counter
    return trainer.gradients(x, y)


@pytest.fixture(scope="module")
def our_masks():
    """``masks(key)``: the masks of Net's two dropout sites (in graph order) under ``key``."""
    shapes = [(4, 16), (4, 3)]
    likes = [relax.Var(f"like{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    key = relax.Var("key", random.KEY_TYPE)
    bb = relax.BlockBuilder()
    with bb.function("main", [*likes, key]):
        with bb.dataflow():
            masks = [bb.emit_output(random.bernoulli(bb, like, key, 1 - rate, site))
                     for site, (like, rate) in enumerate(zip(likes, RATES))]
        bb.emit_func_output(relax.Tuple(masks))
    vm = relax.VirtualMachine(tvm.compile(bb.get(), FAST_LLVM), tvm.cpu())
    dummies = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in shapes]
    return lambda k: [m.numpy() for m in vm["main"](*dummies, tvm.runtime.tensor(
        np.array(k, "uint32")))]


def test_from_torch_adds_a_key_to_the_train_function_only(setup):
    _, model, _, _, _ = setup
    assert model.key == "dropout_key"
    assert model.mod[model.func_name].params[-1].name == "dropout_key"
    assert "dropout_key" not in [p.name for p in model.mod[model.eval_func].params]


def test_the_trainer_compiles_only_the_functions_it_calls(setup):
    net, model, trainer, x, _ = setup
    assert {gv.name_hint for gv in trainer.mod.get_global_vars()} >= {"main", "main_loss"}
    assert model.eval_func == "main_eval"
    for unused in ("main", "main_loss"):  # the train-mode forward and the loss the adjoint has
        with pytest.raises(AttributeError, match=f"no function '{unused}'"):
            trainer.vm[unused]
    served = copy.deepcopy(net).eval()  # what it serves: predictions in eval mode
    served.load_state_dict(trainer.state_dict())
    with torch.no_grad():
        expected = served(torch.from_numpy(x[:4])).numpy()
    np.testing.assert_allclose(trainer.predict(x[:4]), expected, rtol=1e-5, atol=1e-6)


def test_gradients_equal_pytorch_with_the_same_masks(setup, our_masks):
    net, _, trainer, x, y = setup
    loss, grads = _gradients(trainer, x[:4], y[:4], counter=0)  # key (seed, 0)
    masks = our_masks([3, 0])
    assert 0 < masks[0].mean() < 1 and 0 < masks[1].mean() < 1
    net.zero_grad()
    h = torch.relu(net.fc1(torch.from_numpy(x[:4]))) * torch.from_numpy(masks[0]) / 0.5
    out = net.fc2(h) * torch.from_numpy(masks[1]) / 0.8
    expected = nn.functional.mse_loss(out, torch.from_numpy(y[:4]))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_each_call_draws_new_masks_and_the_seed_reproduces_them(setup):
    _, _, trainer, x, y = setup
    first = _gradients(trainer, x[:4], y[:4], counter=0)
    second = _gradients(trainer, x[:4], y[:4])
    assert trainer.key_counter == 2 and first[0] != second[0]
    again = _gradients(trainer, x[:4], y[:4], counter=0)
    assert again[0] == first[0]
    for name in first[1]:
        np.testing.assert_array_equal(again[1][name], first[1][name])
    trainer.seed = 4
    try:
        assert _gradients(trainer, x[:4], y[:4], counter=0)[0] != first[0]
    finally:
        trainer.seed = 3


def test_each_micro_batch_gets_its_own_key(setup):
    _, _, trainer, x, y = setup
    halves = [_gradients(trainer, x[:4], y[:4], counter=0),
              _gradients(trainer, x[4:], y[4:], counter=1)]
    trainer.accumulate = 2
    try:
        loss, grads = _gradients(trainer, x, y, counter=0)
    finally:
        trainer.accumulate = 1
    assert trainer.key_counter == 2
    np.testing.assert_allclose(loss, np.mean([h[0] for h in halves]), rtol=1e-6)
    for name in grads:
        np.testing.assert_allclose(grads[name], np.mean([h[1][name] for h in halves], axis=0),
                                   rtol=1e-5, atol=1e-7)


def test_save_and_load_continue_the_key_stream(setup, tmp_path):
    _, _, trainer, x, y = setup
    trainer.key_counter = 5
    trainer.save(tmp_path / "state")
    expected = _gradients(trainer, x[:4], y[:4])
    _gradients(trainer, x[:4], y[:4])
    trainer.seed = 9
    trainer.load(tmp_path / "state")
    assert (trainer.seed, trainer.key_counter) == (3, 5)
    assert _gradients(trainer, x[:4], y[:4])[0] == expected[0]


def test_predict_runs_eval_mode(setup):
    net, _, trainer, x, _ = setup
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(x)).numpy()
    net.train()
    counter = trainer.key_counter
    np.testing.assert_allclose(trainer.predict(x), expected, rtol=1e-5, atol=1e-6)
    assert trainer.key_counter == counter


def test_identity_mode_drops_nothing():
    net = Net()
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="identity"):
        model = from_torch(net, (x,), dropout="identity")
    assert model.key is None
    vm = relax.VirtualMachine(tvm.compile(model.mod, FAST_LLVM), tvm.cpu())
    args = [x.numpy(), *(model.params[n] for n in ("fc1.weight", "fc1.bias", "fc2.weight",
                                                   "fc2.bias"))]
    out = vm[model.func_name](*(tvm.runtime.tensor(a) for a in args))[0].numpy()
    with torch.no_grad():
        np.testing.assert_allclose(out, net.eval()(x).numpy(), rtol=1e-5, atol=1e-6)


class Random(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.fc, self.draw = nn.Linear(4, 4), draw

    def forward(self, x):
        return self.draw(self.fc(x))


@pytest.mark.parametrize("draw, op", [
    (lambda h: h + torch.randn_like(h), "randn_like"),
    (lambda h: h * torch.rand(2, 4), "rand"),
    (lambda h: h * torch.bernoulli(torch.sigmoid(h)), "rand"),  # decomposed to rand < p
    (lambda h: h + torch.empty_like(h).normal_(), "normal"),
    (lambda h: h + torch.randint(0, 3, (2, 4)), "randint"),
    # active in eval mode too, where PyTorch drops but the eval function has no key
    (lambda h: nn.functional.dropout(h, 0.1, training=True), "native_dropout"),
    (lambda h: nn.functional.scaled_dot_product_attention(h[None], h[None], h[None],
                                                         dropout_p=0.1)[0], "native_dropout"),
])
def test_other_random_ops_are_refused_by_name(draw, op):
    with pytest.raises(ValueError, match=rf"random ops .*{op}"):
        from_torch(Random(draw), (torch.randn(2, 4),))


# -- Hugging Face models with their default dropout --------------------------------------------


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    config._attn_implementation = "eager"

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(config)

        def forward(self, input_ids):
            out = self.model(input_ids=input_ids, use_cache=False)
            return out.logits.reshape(-1, config.vocab_size)

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return LM(), ids, np.random.default_rng(0).integers(0, 32, 16)


def _mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    from transformers.models.mobilenet_v2.modeling_mobilenet_v2 import MobileNetV2ConvLayer

    config = MobileNetV2Config(image_size=16, num_labels=3)
    net = MobileNetV2ForImageClassification(config)
    # one inverted-residual block of the 16 (compiling all takes minutes); the classifier with
    # its in-place dropout (empty_permuted + bernoulli) is the model's own
    backbone = net.mobilenet_v2
    backbone.layer = backbone.layer[:1]
    backbone.conv_1x1 = MobileNetV2ConvLayer(
        config, in_channels=backbone.layer[0].reduce_1x1.convolution.out_channels,
        out_channels=backbone.conv_1x1.convolution.out_channels, kernel_size=1)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = net

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits

    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return Classifier(), pixels, np.array([0, 1, 2, 1])


@pytest.mark.parametrize("build", [_gpt2, _mobilenet_v2], ids=["gpt2", "mobilenet"])
def test_hugging_face_models_train_with_their_default_dropout(build):
    """A transformer's dropouts (embeddings, attention probabilities, residuals: BERT's are the
    same ``nn.Dropout`` and ``F.dropout`` calls, left out to keep the suite's time) and a
    convolutional net's in-place classifier dropout draw from the key."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    net, x, y = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_torch(net, (x,))
    assert model.key == "dropout_key"
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-2), target="llvm")
    x = x.numpy()
    first, second = trainer.gradients(x, y)[0], trainer.gradients(x, y)[0]
    assert first != second  # the masks change from call to call
    losses = [trainer.step(x, y) for _ in range(8)]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3]), losses


@pytest.mark.parametrize("kwargs, message", [
    ({"key": "dropout_key", "eval_func": None}, "needs an evaluation function without it"),
    ({"key": "nope", "eval_func": "main_eval"}, "has no key parameter 'nope'"),
    ({"key": "x", "eval_func": "main_eval"}, r"must be a \(2,\) uint32 tensor"),
    ({"key": "dropout_key", "eval_func": "main_eval", "seed": -1}, r"seed must be an int in"),
])
def test_bad_keys_and_seeds_are_named(setup, kwargs, message):
    _, model, _, _, _ = setup
    with pytest.raises(ValueError, match=message):
        Trainer(model.mod, model.params, MSELoss(), SGD(0.1), **kwargs)


def test_feature_alpha_dropout_draws_from_the_key():
    class Alpha(nn.Module):
        def forward(self, x):
            return nn.functional.feature_alpha_dropout(x, 0.5, self.training)

    x = torch.randn(4, 6, 3)
    model = from_torch(Alpha(), (x,))
    assert model.key == "dropout_key"
    vm = relax.VirtualMachine(tvm.compile(model.mod, FAST_LLVM), tvm.cpu())
    outs = [vm[model.func_name](tvm.runtime.tensor(x.numpy()),
                                tvm.runtime.tensor(np.array([0, k], "uint32")))[0].numpy()
            for k in (0, 0, 1)]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])
    # PyTorch's formula: x * a * m + alpha * a * (m - 1 + p), one m in {0, 1} per channel
    alpha, p = 1.7580993408473766, 0.5
    a = 1 / np.sqrt((alpha * alpha * p + 1) * (1 - p))
    x_np = x.numpy()
    kept, dropped = x_np * a + alpha * a * p, np.full_like(x_np, alpha * a * (p - 1))
    is_kept = np.isclose(outs[0], kept, atol=1e-6).all(axis=-1)
    is_dropped = np.isclose(outs[0], dropped, atol=1e-6).all(axis=-1)
    assert (is_kept ^ is_dropped).all() and is_kept.any() and is_dropped.any()
    eval_out = vm[model.eval_func](tvm.runtime.tensor(x.numpy()))[0].numpy()
    np.testing.assert_allclose(eval_out, x.numpy())


# -- checkpointing and split mode on an imported transformer block with dropout ----------------


@pytest.fixture(scope="module")
def encoder():
    """``main_loss`` of a PyTorch encoder block with dropout 0.2 (four sites), its arguments,
    the trainable params, and its gradients without checkpointing."""
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
    x = torch.randn(2, 4, 8)
    model = from_torch(block, (x,))
    mod = append_loss(model.mod, MSELoss(), model.func_name)
    func = mod["main_loss"]
    wrt = [p for p in func.params if p.name in model.params]
    values = {"src": x.numpy(), "dropout_key": np.array([1, 2], "uint32"), **model.params}
    args = [values.get(p.name, np.zeros((2, 4, 8), "float32")) for p in func.params[:-1]]
    args.append(np.random.default_rng(0).standard_normal((2, 4, 8)).astype("float32"))
    return mod, wrt, args, _loss_gradients(mod, wrt, args, "none")[0]


def _loss_gradients(mod, wrt, args, checkpoint, split=False):
    grad = relaxgrad.Gradient("main_loss", wrt, target_index=0, checkpoint=checkpoint,
                              split=split)(mod)
    vm = relax.VirtualMachine(tvm.compile(grad, FAST_LLVM), tvm.cpu())
    tensors = [tvm.runtime.tensor(a) for a in args]
    if split:
        _, saved = vm["main_loss_fwd"](*tensors)
        return [g.numpy() for g in vm["main_loss_bwd"](*list(saved))], grad
    return [g.numpy() for g in vm["main_loss_adjoint"](*tensors)[1]], grad


@pytest.mark.parametrize("checkpoint", ["markers", "sqrt", "save_dots", policies.budget(0)])
def test_every_checkpoint_policy_gives_the_gradients_of_none(encoder, checkpoint):
    mod, wrt, args, expected = encoder
    grads, _ = _loss_gradients(mod, wrt, args, checkpoint)
    assert any(g.any() for g in expected)
    for ours, theirs in zip(grads, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_split_mode_gives_the_gradients_of_none_and_saves_the_key(encoder):
    mod, wrt, args, expected = encoder
    grads, split = _loss_gradients(mod, wrt, args, "sqrt", split=True)
    residuals = relaxgrad.split_info(split, "main_loss").residuals
    assert "dropout_key" in [r.name for r in residuals]
    assert all(r.dtype != "bool" for r in residuals)
    for ours, theirs in zip(grads, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
