"""Model builders: signatures, initial values, and numerically checked gradients of their
losses."""

import numpy as np
import pytest

from relaxgrad.testing import check_gradients
from relaxgrad.training import CrossEntropyLoss, append_loss, cnn, mlp


def test_mlp_signature_and_init():
    model = mlp(batch_size=8, in_features=6, hidden=(5, 4), num_classes=3, seed=2)
    func = model.mod["main"]
    assert [p.name for p in func.params] == ["x", *model.params]
    assert {k: v.shape for k, v in model.params.items()} == {
        "fc0_weight": (5, 6), "fc0_bias": (5,), "fc1_weight": (4, 5), "fc1_bias": (4,),
        "fc2_weight": (3, 4), "fc2_bias": (3,)}
    assert model.batch_size == 8
    bound = 1 / np.sqrt(6)  # PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert np.abs(model.params["fc0_weight"]).max() <= bound
    np.testing.assert_array_equal(mlp(seed=2).params["fc0_bias"], mlp(seed=2).params["fc0_bias"])


def test_cnn_signature():
    model = cnn(batch_size=4, channels=(2, 3), pools=("avg", "max"))
    assert {k: v.shape for k, v in model.params.items()} == {
        "conv0_weight": (2, 1, 3, 3), "conv0_bias": (2,), "conv1_weight": (3, 2, 3, 3),
        "conv1_bias": (3,), "fc_weight": (10, 12), "fc_bias": (10,)}
    assert tuple(int(d) for d in model.mod["main"].ret_ty.shape) == (4, 10)
    with pytest.raises(ValueError, match="one entry per stage"):
        cnn(channels=(2, 3), pools=("max",))
    with pytest.raises(ValueError, match="stage 3 cannot 'max'-pool a 1x1"):
        cnn(channels=(2, 2, 2, 2), pools=("max",) * 4)


@pytest.mark.parametrize("build", [mlp, cnn], ids=["mlp", "cnn"])
def test_loss_gradients(build):
    """Gradients of the appended cross-entropy w.r.t. every parameter, in float64."""
    kwargs = {"hidden": (6,)} if build is mlp else {"channels": (2, 3)}
    model = build(batch_size=3, dtype="float64", seed=0, **kwargs)
    mod = append_loss(model.mod, CrossEntropyLoss())
    rng = np.random.default_rng(0)
    x_shape = tuple(int(d) for d in mod["main"].params[0].ty.shape)
    inputs = [rng.standard_normal(x_shape), *model.params.values(),
              np.array([1, 7, 3], "int64")]
    result = check_gradients(mod, "main_loss", inputs, wrt=range(1, len(model.params) + 1))
    assert result.ok, str(result)
