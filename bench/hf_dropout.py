"""Hugging Face models with their default configs, dropout on, trained by relaxgrad and by
PyTorch from the same weights on the same minibatch: GPT-2 (a language model on 2 x 32 tokens),
BERT (sequence classification, 4 x 32 tokens) and MobileNetV2 (the whole network, 4 x 3 x 64 x
64 images). Sizes are the default configs' except GPT-2's and BERT's layers and widths, cut to
keep the compile short (``--full`` keeps them).

For each model: the import and compile time, then ``--steps`` Adam steps (lr 1e-3) with
relaxgrad (``from_torch``'s real dropout, a new key each step) and with PyTorch in train mode;
it prints both loss curves' first and last three values. Their masks differ, so the curves are
not equal, but both fall. Run ``python bench/hf_dropout.py [--models mobilenet_v2] [--full]``.
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["gpt2", "bert", "mobilenet_v2"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the configs' own layer counts")
    return parser.parse_args()


ARGS = parse_args()
os.environ.setdefault("TVM_NUM_THREADS", str(ARGS.threads))

import copy  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as hf  # noqa: E402
from _common import Logits  # noqa: E402

from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_torch  # noqa: E402

torch.set_num_threads(ARGS.threads)


def build(name: str, rng):
    small = {} if ARGS.full else {"n_layer": 2, "n_embd": 128, "n_head": 4}
    if name == "gpt2":
        config = hf.GPT2Config(**small)
        config._attn_implementation = "eager"
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (2, 32)))
        targets = rng.integers(0, config.vocab_size, 64)
        return Logits(hf.GPT2LMHeadModel(config), "input_ids", flat=True), ids, targets
    if name == "bert":
        sizes = {} if ARGS.full else {"num_hidden_layers": 2, "hidden_size": 128,
                                      "num_attention_heads": 4, "intermediate_size": 512}
        config = hf.BertConfig(num_labels=3, **sizes)
        config._attn_implementation = "eager"
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (4, 32)))
        return Logits(hf.BertForSequenceClassification(config), "input_ids"), ids, \
            rng.integers(0, 3, 4)
    if name == "mobilenet_v2":
        config = hf.MobileNetV2Config(num_labels=3)
        images = torch.from_numpy(rng.standard_normal((4, 3, 64, 64)).astype("float32"))
        return Logits(hf.MobileNetV2ForImageClassification(config), "pixel_values"), images, \
            rng.integers(0, 3, 4)
    raise ValueError(f"unknown model {name!r}")


def main():
    for name in ARGS.models:
        torch.manual_seed(0)
        net, x, y = build(name, np.random.default_rng(0))
        reference = copy.deepcopy(net)
        start = time.perf_counter()
        model = from_torch(net, (x,))
        trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3), cache=False,
                                    progress=False)
        built = time.perf_counter() - start
        ours = [trainer.step(x.numpy(), y) for _ in range(ARGS.steps)]
        optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
        target, theirs = torch.from_numpy(y), []
        reference.train()
        for _ in range(ARGS.steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(reference(x), target)
            loss.backward()
            optimizer.step()
            theirs.append(loss.item())
        print(f"{name}: import + compile {built:.0f} s, dropout key {model.key!r}")
        for who, losses in (("relaxgrad", ours), ("PyTorch", theirs)):
            head = ", ".join(f"{v:.3f}" for v in losses[:3])
            tail = ", ".join(f"{v:.3f}" for v in losses[-3:])
            print(f"  {who:9} losses {head} ... {tail}")


if __name__ == "__main__":
    main()
