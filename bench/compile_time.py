"""Compile cost per model: adjoint size against the forward, ``relaxgrad.compile`` against
``tvm.compile`` of the same training module.

For each model it builds what the Trainer compiles (the model, its loss, the loss's adjoint,
the optimizer step: ``relaxgrad.training.trainer.training_module``), counts the bindings of the
forward (the model function) and of the adjoint, and times, in this one run, ``tvm.compile``
and ``relaxgrad.compile`` of that module for the same target (this machine's CPU), alternately
``--runs`` times (medians), then ``relaxgrad.compile(..., cache=True)`` once more after a cached
compile (a fresh cache folder): the time to load the built library. It prints one row per
model, the ratios, and the growth of each compile from the 4-block to the 16-block transformer
(a linear pipeline grows 4x).

Models: ``mlp`` and ``cnn`` (``relaxgrad.training``'s), ``transformer4`` / ``transformer16``
(PyTorch ``nn.TransformerEncoderLayer`` stacks, d 64, seq 16, through ``from_torch``), and tiny
Hugging Face ``transformers`` models through ``from_torch``: ``hf-resnet``, ``hf-bert``,
``hf-mobilenetv2``, ``hf-efficientnet``; ``--big`` adds ``resnet50`` (the full-size Hugging Face
config, batch 8, 224x224); ``--zoo`` adds every model of the test suite's Hugging Face zoo
(``tests/zoo/models.py``: ``zoo-gpt2``, ``zoo-llama``, ...). Run
``python bench/compile_time.py [--models ...] [--big] [--zoo]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

MODELS = ("mlp", "cnn", "transformer4", "transformer16", "hf-resnet", "hf-bert",
          "hf-mobilenetv2", "hf-efficientnet")  # fmt: skip


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--big", action="store_true", help="add full-size ResNet-50")
    parser.add_argument("--zoo", action="store_true", help="add the test suite's zoo models")
    parser.add_argument("--runs", type=int, default=1, help="compiles per model and compiler")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


ARGS = parse_args()
os.environ.setdefault("TVM_NUM_THREADS", str(ARGS.threads))
os.environ["RELAXGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="relaxgrad-bench-cache-")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import Logits  # noqa: E402

import relaxgrad  # noqa: E402
from relaxgrad.analysis import count_bindings  # noqa: E402
from relaxgrad.pipeline import host_target  # noqa: E402
from relaxgrad.testing import tvm_compile_quietly  # noqa: E402
from relaxgrad.training import SGD, CrossEntropyLoss, cnn, from_torch, mlp  # noqa: E402
from relaxgrad.training.trainer import training_module  # noqa: E402

torch.set_num_threads(ARGS.threads)


def transformer(blocks: int):
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
    net = torch.nn.Sequential(encoder, torch.nn.Flatten(), torch.nn.Linear(64 * 16, 10))
    return from_torch(net, (torch.randn(4, 16, 64),))


def hugging_face(name: str):
    import transformers as hf

    torch.manual_seed(0)
    image = torch.randn(2, 3, 32, 32)
    if name == "hf-resnet":
        config = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                 depths=[1, 1, 1, 1], num_labels=10)
        return from_torch(Logits(hf.ResNetForImageClassification(config)), (image,))
    if name == "hf-mobilenetv2":
        config = hf.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=10,
                                      classifier_dropout_prob=0.0)
        return from_torch(Logits(hf.MobileNetV2ForImageClassification(config)), (image,))
    if name == "hf-efficientnet":
        config = hf.EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.1,
                                       hidden_dim=128, num_labels=10, dropout_rate=0.0,
                                       drop_connect_rate=0.0)
        return from_torch(Logits(hf.EfficientNetForImageClassification(config)), (image,))
    if name == "hf-bert":
        config = hf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, num_labels=10,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config._attn_implementation = "eager"
        tokens = torch.randint(1, 100, (2, 16))
        return from_torch(Logits(hf.BertForSequenceClassification(config), "input_ids"),
                          (tokens,))
    if name == "resnet50":
        config = hf.ResNetConfig(num_labels=10)  # the published ResNet-50 sizes
        return from_torch(Logits(hf.ResNetForImageClassification(config)),
                          (torch.randn(8, 3, 224, 224),))
    raise ValueError(f"unknown model {name!r}")


def build(name: str):
    if name == "mlp":
        return mlp(32, hidden=(256, 256))
    if name == "cnn":
        return cnn(16)
    if name.startswith("transformer"):
        return transformer(int(name.removeprefix("transformer")))
    if name.startswith("zoo-"):
        module, inputs, _ = zoo()[name.removeprefix("zoo-")](np.random.default_rng(0))
        return from_torch(module, inputs)
    return hugging_face(name)


def zoo() -> dict:
    """The test suite's zoo of tiny Hugging Face models (``tests/zoo/models.py``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.zoo.models import ZOO

    return ZOO


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main():
    target = host_target()
    names = ARGS.models + (["resnet50"] if ARGS.big else [])
    names += [f"zoo-{name}" for name in zoo()] if ARGS.zoo else []
    rows, times = [], {}
    header = (f"{'model':16} {'forward':>8} {'adjoint':>8} {'adj/fwd':>8} {'tvm.compile s':>14} "
              f"{'relaxgrad s':>12} {'ratio':>6} {'cached s':>9}")  # fmt: skip
    print(header, flush=True)
    for name in names:
        model = build(name)
        mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1),
                              model.func_name)
        forward = count_bindings(mod[model.func_name])
        adjoint = count_bindings(mod[f"{model.func_name}_loss_adjoint"])
        tvm_s, ours_s = [], []
        for _ in range(ARGS.runs):
            tvm_s.append(timed(tvm_compile_quietly, mod, target))
            ours_s.append(timed(relaxgrad.compile, mod, target))
        t, o = statistics.median(tvm_s), statistics.median(ours_s)
        relaxgrad.compile(mod, target, cache=True)
        loaded = timed(relaxgrad.compile, mod, target, cache=True)
        times[name] = (t, o)
        rows.append((name, forward, adjoint, t, o))
        print(f"{name:16} {forward:8d} {adjoint:8d} {adjoint / forward:8.2f} {t:14.1f} {o:12.1f} "
              f"{o / t:6.2f} {loaded:9.2f}", flush=True)
    if "transformer4" in times and "transformer16" in times:
        (t4, o4), (t16, o16) = times["transformer4"], times["transformer16"]
        print(f"4 -> 16 transformer blocks: tvm.compile x{t16 / t4:.2f}, "
              f"relaxgrad.compile x{o16 / o4:.2f} (linear: x4)")
    worst = max(o / t for _, _, _, t, o in rows)
    print(f"largest ratio relaxgrad.compile / tvm.compile: {worst:.2f}; largest adjoint/forward: "
          f"{max(a / f for _, f, a, _, _ in rows):.2f}")


if __name__ == "__main__":
    main()
