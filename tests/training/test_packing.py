"""Packing (relaxgrad.training.pack): a packed row's loss and gradients are those of its
sequences run one by one (the mean over all their scored tokens), through one compiled shape;
and PyTorch's on the same packed inputs."""

import numpy as np
import pytest

from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, from_torch, pack

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

LENGTH, VOCAB, ROWS = 16, 40, 2


class PackedLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        logits = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1])


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=LENGTH)
    config._attn_implementation = "eager"
    module = PackedLM(tf.LlamaForCausalLM(config))
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, VOCAB, n) for n in (5, 9, 3, 7)]
    packed = pack(sequences, LENGTH, rows=ROWS)
    model = from_torch(module, tuple(torch.from_numpy(a) for a in packed.inputs))
    trainer = Trainer.for_model(model, CrossEntropyLoss(ignore_index=-100), SGD(0.1),
                                progress=False)
    return module, sequences, packed, trainer


def test_layout():
    packed = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 6, labels=[[-100, 3, 7], [5, -100],
                                                                 [7, 8, 9, 1]])
    assert packed.rows == [[0, 1], [2]]
    np.testing.assert_array_equal(packed.input_ids, [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(packed.position_ids, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(packed.labels.reshape(2, 6), [[-100, 3, 7, 5, -100, -100],
                                                                [7, 8, 9, 1, -100, -100]])
    attends = packed.attention_mask[0, 0] == 0
    np.testing.assert_array_equal(attends, [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                            [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                                            [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]])
    default = pack([[1, 2, 3]], 4)
    np.testing.assert_array_equal(default.labels, [2, 3, -100, -100])


def test_bad_input():
    with pytest.raises(ValueError, match="each must have 1 to 4"):
        pack([[1, 2, 3, 4, 5]], 4)
    with pytest.raises(ValueError, match="need 2 rows"):
        pack([[1, 2, 3], [4, 5]], 4, rows=1)
    with pytest.raises(ValueError, match="3 labels"):
        pack([[1, 2]], 4, labels=[[1, 2, 3]])


def test_packed_gradients_are_those_of_the_sequences_one_by_one(case):
    _, sequences, packed, trainer = case
    loss, grads = trainer.gradients(packed.inputs, packed.labels)
    total, weighted, weighted_loss = 0, {}, 0.0
    for s in sequences:
        alone = pack([s], LENGTH, rows=ROWS)
        n = int((alone.labels != -100).sum())
        loss_i, grads_i = trainer.gradients(alone.inputs, alone.labels)
        total += n
        weighted_loss += n * loss_i
        for name, g in grads_i.items():
            weighted[name] = weighted.get(name, 0) + n * g.astype(np.float64)
    assert loss == pytest.approx(weighted_loss / total, rel=1e-5)
    for name, g in grads.items():
        expected = weighted[name] / total
        assert np.linalg.norm(g - expected) <= 1e-5 * np.linalg.norm(expected) + 1e-9, name


def test_packed_gradients_match_pytorch(case):
    module, _, packed, trainer = case
    loss, grads = trainer.gradients(packed.inputs, packed.labels)
    reference = module.train()
    reference.zero_grad()
    logits = reference(*(torch.from_numpy(a) for a in packed.inputs))
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(packed.labels),
                                                 ignore_index=-100)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for name, p in reference.named_parameters():
        ref = p.grad.numpy()
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * np.linalg.norm(ref) + 1e-7, name
