"""The same model trained with relaxgrad and with PyTorch, from the same initial weights, on the
same batches, with the same optimizer, follows the same loss curve.

Tolerance (float32 on both sides): over the first ``STEPS`` steps, the per-step loss relative
difference ``|ours - torch| / |torch|`` stays below ``1e-4`` for SGD and momentum SGD and below
``1e-3`` for Adam and AdamW. Both compute every step in float32 with different kernels (and
different summation orders), so the curves drift apart by rounding; Adam drifts faster because
it divides by ``sqrt(v)``: a gradient entry at rounding-noise level still moves its weight by
about ``lr``, in a direction the rounding decides.
"""

import numpy as np
import pytest

from relaxgrad.training import (
    SGD,
    Adam,
    AdamW,
    CrossEntropyLoss,
    MomentumSGD,
    Trainer,
    cnn,
    load_digits,
    minibatches,
    mlp,
)

torch = pytest.importorskip("torch")

STEPS = 100
SGD_RTOL, ADAM_RTOL = 1e-4, 1e-3


def torch_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ), {"0": "fc0", "2": "fc1"}


def torch_cnn():
    nn = torch.nn
    layers = [nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
              nn.Flatten(), nn.Linear(128, 10)]
    return nn.Sequential(*layers), {"0": "conv0", "3": "conv1", "7": "fc"}


def _twin(factory, params):
    """The torch twin of a relaxgrad model, loaded with the same parameter values."""
    net, names = factory()
    state = {}
    for key in net.state_dict():
        layer, kind = key.split(".")
        state[key] = torch.tensor(params[f"{names[layer]}_{kind}"])
    net.load_state_dict(state)
    return net


# id -> (model builder, torch twin, our optimizer, torch optimizer, rtol)
CASES = {
    "mlp-sgd": (mlp, torch_mlp, lambda: SGD(0.1), lambda p: torch.optim.SGD(p, 0.1), SGD_RTOL),
    "mlp-adam": (mlp, torch_mlp, lambda: Adam(2e-3), lambda p: torch.optim.Adam(p, 2e-3),
                 ADAM_RTOL),
    "cnn-momentum": (cnn, torch_cnn, lambda: MomentumSGD(0.02, 0.9, weight_decay=1e-4),
                     lambda p: torch.optim.SGD(p, 0.02, momentum=0.9, weight_decay=1e-4),
                     SGD_RTOL),
    "cnn-adamw": (cnn, torch_cnn, lambda: AdamW(2e-3), lambda p: torch.optim.AdamW(p, 2e-3),
                  ADAM_RTOL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_curve_matches_torch(case):
    build, twin, ours, theirs, rtol = CASES[case]
    model = build(batch_size=32, seed=0)
    data = load_digits(image=build is cnn)
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), ours())
    net = _twin(twin, model.params)
    optimizer = theirs(net.parameters())

    rng = np.random.default_rng(0)
    batches = [idx for _ in range(3) for idx in minibatches(len(data.y_train), 32, rng)]
    ours_curve, torch_curve = [], []
    for idx in batches[:STEPS]:
        x, y = data.x_train[idx], data.y_train[idx]
        ours_curve.append(trainer.step(x, y))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        optimizer.step()
        torch_curve.append(loss.item())

    ours_curve, torch_curve = np.array(ours_curve), np.array(torch_curve)
    rel = np.abs(ours_curve - torch_curve) / np.abs(torch_curve)
    print(f"{case}: max relative loss difference over {STEPS} steps {rel.max():.2e} "
          f"(step {rel.argmax() + 1}); loss {torch_curve[0]:.3f} -> {torch_curve[-1]:.3f}")
    assert rel.max() <= rtol, f"step {rel.argmax() + 1}: ours {ours_curve[rel.argmax()]}, " \
                              f"torch {torch_curve[rel.argmax()]}"
    assert torch_curve[-1] < torch_curve[0] / 2  # the curve is a real training run
