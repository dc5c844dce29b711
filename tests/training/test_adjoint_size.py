"""Adjoint size stays proportional to the forward: adjoint bindings <= 6x forward bindings for the
bench models and for a model of EfficientNet's blocks (ZeroPad2d, depthwise convolution,
squeeze-excitation, BatchNorm, and the global pool of a window larger than its input, whose
gradient once emitted one pad per window offset: 16,384 pads for a 128x128 window), whose
gradients are also checked against PyTorch's."""

import numpy as np
import pytest

from relaxgrad.analysis import count_bindings
from relaxgrad.training import SGD, CrossEntropyLoss, MSELoss, Trainer, cnn, from_torch, mlp
from relaxgrad.training.trainer import training_module

torch = pytest.importorskip("torch")
nn = torch.nn

BOUND = 6


def _ratio(model) -> float:
    mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1),
                          model.func_name)
    forward = count_bindings(mod[model.func_name])
    return count_bindings(mod[f"{model.func_name}_loss_adjoint"]) / forward


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduced):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce, self.expand = nn.Conv2d(channels, reduced, 1), nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        scale = torch.sigmoid(self.expand(nn.functional.silu(self.reduce(self.pool(x)))))
        return x * scale


def efficientnet_blocks(channels=8, window=16):
    """EfficientNet's stem and one MBConv block at 16x16, then its head: a pool of
    ``window`` x ``window`` on a 4x4 map with ceil_mode (as transformers' EfficientNet pools
    with a window of hidden_dim)."""
    return nn.Sequential(
        nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(3, channels, 3, stride=2), nn.BatchNorm2d(channels),
        nn.SiLU(),
        nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels),  # depthwise
        nn.BatchNorm2d(channels), nn.SiLU(), SqueezeExcite(channels, 2),
        nn.Conv2d(channels, 16, 1), nn.BatchNorm2d(16),
        nn.AvgPool2d(window, ceil_mode=True), nn.Flatten(), nn.Linear(16, 5),
    )


@pytest.mark.parametrize("build", [lambda: mlp(32, hidden=(64, 64)), lambda: cnn(8)],
                         ids=["mlp", "cnn"])
def test_bench_models(build):
    assert _ratio(build()) <= BOUND


def test_transformer_block():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    net = nn.Sequential(layer, nn.Flatten(), nn.Linear(32 * 8, 10))
    assert _ratio(from_torch(net, (torch.randn(2, 8, 32),))) <= BOUND


def test_efficientnet_blocks_size_and_gradients_against_pytorch():
    torch.manual_seed(0)
    net = efficientnet_blocks()
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 3, 1, 4])
    model = from_torch(net, (x,))
    assert _ratio(model) <= BOUND
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1))
    loss, grads = trainer.gradients(x.numpy(), y.numpy())

    reference = efficientnet_blocks().double()
    reference.load_state_dict(net.state_dict())
    reference.train()
    expected = nn.functional.cross_entropy(reference(x.double()), y)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    # float32 against float64: a gradient that is zero in exact arithmetic (a convolution's
    # bias before a BatchNorm) is rounding noise, so the tolerance is relative to the largest
    scale = max(np.abs(p.grad.numpy()).max() for p in reference.parameters())
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(grads[name], param.grad.numpy(), atol=1e-5 * scale,
                                   rtol=1e-3, err_msg=name)


def test_batch_norm_adjoint_carries_no_zeros_of_unused_fields():
    """Train-mode BatchNorm comes from TVM's importer as a tuple of five (two unused) and the
    model's result as a tuple (prediction, new running statistics): read through the tuples,
    the adjoint carried zeros back through every other field (136 bindings for conv, batch
    norm, relu, dense; 67 without the detours)."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    model = from_torch(net, (torch.randn(2, 3, 8, 8),))
    # (MSELoss: a cross-entropy of its own takes ~40 bindings, forward and backward, which
    # would hide what this counts)
    mod = training_module(model.mod, list(model.params), MSELoss(), SGD(0.1), "main")
    adjoint = mod["main_loss_adjoint"]
    assert count_bindings(adjoint) <= 3 * count_bindings(mod["main"])
    assert "R.zeros" not in adjoint.script()
