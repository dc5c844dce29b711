"""A model written with ``tvm.relax.frontend.nn`` trains with the same Trainer."""

import numpy as np
import pytest
from tvm.relax.frontend import nn

from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_nn_module, load_digits


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(nn.relu(self.norm(self.fc1(x))))


SPEC = {"forward": {"x": nn.spec.Tensor((32, 64), "float32")}}


def test_nn_module_trains_on_digits():
    model = from_nn_module(MLP(), SPEC, seed=0)
    names = ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"]
    assert list(model.params) == names  # named as nn.Module names them
    assert [p.name for p in model.mod["forward"].params] == ["x", *names]
    bound = 1 / np.sqrt(64)
    assert np.abs(model.params["fc1.weight"]).max() <= bound
    assert np.abs(model.params["fc1.bias"]).max() <= bound
    np.testing.assert_array_equal(model.params["norm.weight"], np.ones(32, "float32"))

    data = load_digits()
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(2e-3))
    losses = trainer.fit(data.x_train, data.y_train, epochs=2, progress=False)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) / 2
    assert trainer.evaluate(data.x_test, data.y_test)["accuracy"] > 0.85
    assert set(trainer.state_dict()) == set(names)


def test_given_params_and_errors():
    fc1 = np.full((32, 64), 0.5, "float32")
    model = from_nn_module(MLP(), SPEC, params={"fc1.weight": fc1})
    np.testing.assert_array_equal(model.params["fc1.weight"], fc1)
    with pytest.raises(ValueError, match=r"no parameters named \['fc3.weight'\]"):
        from_nn_module(MLP(), SPEC, params={"fc3.weight": fc1})
    with pytest.raises(ValueError, match="pass func_name"):
        from_nn_module(MLP(), {**SPEC, "other": SPEC["forward"]})
