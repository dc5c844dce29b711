"""A model symbolic in its batch: one compile, every batch size, no padding."""

import numpy as np

from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, cnn, load_digits, mlp


def test_symbolic_mlp_gradients_equal_static_ones_at_any_batch():
    symbolic = mlp(batch_size="n", seed=0)
    assert symbolic.batch_size is None
    trainer = Trainer(symbolic.mod, symbolic.params, CrossEntropyLoss(), SGD(0.1))
    digits = load_digits()
    for size in (5, 32):
        static = mlp(batch_size=size, seed=0)
        reference = Trainer(static.mod, static.params, CrossEntropyLoss(), SGD(0.1))
        x, y = digits.x_train[:size], digits.y_train[:size]
        loss, grads = trainer.gradients(x, y)
        ref_loss, ref_grads = reference.gradients(x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for name, g in grads.items():
            np.testing.assert_allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6)


def test_symbolic_cnn_trains_on_the_last_partial_batch():
    model = cnn(batch_size="n", channels=(4, 8), seed=0)
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), SGD(0.05))
    digits = load_digits(image=True)
    x, y = digits.x_train[:100], digits.y_train[:100]
    losses = trainer.fit(x, y, epochs=3, batch_size=32, progress=False)
    assert len(losses) == 3 * 4  # 32 + 32 + 32 + 4: the last batch is not padded or dropped
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
