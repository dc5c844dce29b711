"""A LoRA fine-tune of a tiny Llama (dropout, prompt-masked labels, AdamW with warmup + cosine,
clipping) that checkpoints after every step; run as a script, it is killed (SIGKILL) as step
``KILLED_AT`` begins. tests/training/test_lora.py resumes it and compares with an
uninterrupted run."""

import os
import signal
import sys

import numpy as np
import torch

KILLED_AT = 5
ROWS, SEQ, VOCAB, BATCH, EPOCHS = 8, 8, 48, 2, 3


def data():
    rng = np.random.default_rng(7)
    x = rng.integers(0, VOCAB, (ROWS, SEQ))
    y = rng.integers(0, VOCAB, (ROWS, SEQ))
    y[:, :3] = -100  # the prompt
    return x, y


class Logits(torch.nn.Module):
    """A causal LM's logits, one row per token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(ids).logits
        return logits.reshape(-1, logits.shape[-1])


def model():
    """The LoRA model (imported once; each :func:`trainer` of it starts from its weights)."""
    import transformers as tf

    from relaxgrad.training import from_torch, lora

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            max_position_embeddings=32, use_cache=False, attention_dropout=0.2)
    config._attn_implementation = "eager"
    net = Logits(tf.LlamaForCausalLM(config)).train()
    x, _ = data()
    adapted = lora(from_torch(net, (torch.from_numpy(x[:BATCH]),)), ["q_proj", "v_proj"], r=4,
                   alpha=8, seed=3)
    assert adapted.key is not None  # dropout is drawn, so the key's counter must resume too
    return adapted


def trainer(adapted):
    """A fresh Trainer of :func:`model`'s result."""
    from relaxgrad.training import AdamW, CrossEntropyLoss, Trainer, schedules

    total = EPOCHS * ROWS // BATCH
    return Trainer.for_model(adapted, CrossEntropyLoss(ignore_index=-100), AdamW(3e-2),
                             schedule=schedules.cosine(2, total), max_grad_norm=0.5,
                             progress=False, seed=11)


def train(run, checkpoint=None) -> list[float]:
    """Step ``run`` from its step count to the end over the rows in order (a batch of
    ``BATCH`` rows, its labels flattened as the model's logits are), saving ``checkpoint``
    after each step; returns the losses."""
    x, y = data()
    losses = []
    while run.steps < EPOCHS * ROWS // BATCH:
        rows = slice(run.steps * BATCH % ROWS, run.steps * BATCH % ROWS + BATCH)
        losses.append(run.step(x[rows], y[rows].reshape(-1)))
        if checkpoint is not None:
            run.save(checkpoint)
    return losses


if __name__ == "__main__":
    run = trainer(model())
    step = run.step

    def dying_step(*args):
        if run.steps == KILLED_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(*args)

    run.step = dying_step
    train(run, checkpoint=os.path.join(sys.argv[1], "ckpt"))
