"""One training step (forward + backward + Adam update): relaxgrad-compiled vs PyTorch eager.

Both run on the CPU with the same number of threads (``--threads``, default 2: TVM_NUM_THREADS
and ``torch.set_num_threads``), the same model, initial weights, minibatch and optimizer
(Adam, lr 1e-3, cross-entropy on 10 classes):

- ``digits``: MLP 64-64-10, batch 32;
- ``mlp``: MLP 1024 -> 4 x 1024 -> 10, batch 256;
- ``cnn``: two ``conv3x3 -> batch_norm (training) -> relu -> maxpool 2x2`` stages (32, 64
  channels) and a dense head, on 3x32x32 images, batch 64;
- ``transformer``: a pre-norm encoder block (d 256, 4 heads, feed-forward 1024, relu, no
  dropout; PyTorch's ``nn.TransformerEncoderLayer``) on sequences of 128, mean-pooled into a
  dense head, batch 16.

The two frameworks' runs alternate (a PyTorch run of ``--steps`` steps, a pause, a relaxgrad
run, a pause, ``--runs`` times), so that load from other jobs on the machine falls on both
alike. Per model it prints each framework's median step time (the median of its run medians,
and their spread min-max), the ratio relaxgrad / PyTorch (the median of the paired runs'
ratios, and their spread), and relaxgrad's adjoint / forward time (``main_loss_adjoint`` vs
``main_loss``, timed alternately; the median of the runs' ratios and their spread). Both run
with denormals flushed to zero (relaxgrad's gemms flush them; ``torch.set_flush_denormal``):
trained on one minibatch, a model's gradients reach denormals, on which the CPU slows down
several times (PyTorch's MLP step from about 40 to 220 ms after some 40 steps). Run
``python bench/train_step.py [--models cnn transformer] [--target llvm]``; the default
target is this machine's CPU (``relaxgrad.pipeline.host_target()``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

MODEL_NAMES = ("digits", "mlp", "cnn", "transformer")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per model and framework")
    parser.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=list(MODEL_NAMES))
    parser.add_argument(
        "--target", default="native",
        help="TVM target for relaxgrad: 'native' (pipeline.host_target(), the default) or e.g. "
             "'llvm' for a portable build",
    )  # fmt: skip
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from _common import adjoint_over_forward, fmt, loss_function, spread, torch_adam_step  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax import op  # noqa: E402

from relaxgrad.pipeline import host_target  # noqa: E402
from relaxgrad.training import Adam, CrossEntropyLoss, Trainer  # noqa: E402

torch.set_num_threads(ARGS.threads)
torch.set_flush_denormal(True)


class Builder:
    """Parameters (PyTorch's default init, PyTorch's layouts) for both frameworks."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.vars: list[relax.Var] = []
        self.values: dict[str, np.ndarray] = {}

    def param(self, name, shape, fan_in=None, value=None):
        if value is None:
            bound = 1.0 / np.sqrt(fan_in)
            value = self.rng.uniform(-bound, bound, shape)
        self.values[name] = np.asarray(value, "float32").reshape(shape)
        var = relax.Var(name, relax.TensorType(shape, "float32"))
        self.vars.append(var)
        return var

    def dense(self, name, x, n_in, n_out):
        w = self.param(f"{name}.weight", (n_out, n_in), n_in)
        b = self.param(f"{name}.bias", (n_out,), n_in)
        return op.add(op.matmul(x, op.permute_dims(w)), b)

    def layer_norm(self, name, x, d):
        g = self.param(f"{name}.weight", (d,), value=np.ones(d))
        b = self.param(f"{name}.bias", (d,), value=np.zeros(d))
        return op.nn.layer_norm(x, g, b, [-1])

    def function(self, x: relax.Var, body) -> tvm.IRModule:
        bb = relax.BlockBuilder()
        with bb.function("main"):  # parameters are created while the body is emitted
            with bb.dataflow():
                out = bb.emit_output(body(bb))
            bb.emit_func_output(out, params=[x, *self.vars])
        return bb.get()


def mlp(batch: int, sizes: list[int]):
    builder = Builder()
    x = relax.Var("x", relax.TensorType((batch, sizes[0]), "float32"))

    def body(bb):
        h = x
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            h = bb.emit(builder.dense(f"{2 * i}", h, n_in, n_out))
            if i < len(sizes) - 2:
                h = bb.emit(op.nn.relu(h))
        return h

    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    return builder.function(x, body), builder.values, net, (batch, sizes[0])


def cnn(batch: int = 64, image=(3, 32, 32), channels=(32, 64)):
    builder = Builder()
    x = relax.Var("x", relax.TensorType((batch, *image), "float32"))
    layers = []

    def body(bb):
        h, c_in, size = x, image[0], image[1]
        for i, c_out in enumerate(channels):
            w = builder.param(f"{4 * i}.weight", (c_out, c_in, 3, 3), c_in * 9)
            b = builder.param(f"{4 * i}.bias", (c_out,), c_in * 9)
            h = bb.emit(op.add(op.nn.conv2d(h, w, padding=1), op.reshape(b, (1, c_out, 1, 1))))
            gamma = builder.param(f"{4 * i + 1}.weight", (c_out,), value=np.ones(c_out))
            beta = builder.param(f"{4 * i + 1}.bias", (c_out,), value=np.zeros(c_out))
            zeros, ones = (relax.const(np.full(c_out, v, "float32")) for v in (0, 1))
            norm = op.nn.batch_norm(h, gamma, beta, zeros, ones, 1, training=True)
            h = bb.emit(op.nn.relu(bb.emit(relax.TupleGetItem(bb.emit(norm), 0))))
            h = bb.emit(op.nn.max_pool2d(h, 2, 2))
            c_in, size = c_out, size // 2
        h = bb.emit(op.reshape(h, (batch, c_in * size * size)))
        return builder.dense(f"{4 * len(channels) + 1}", h, c_in * size * size, 10)

    c_in, size = image[0], image[1]
    for c_out in channels:
        layers += [torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out),
                   torch.nn.ReLU(), torch.nn.MaxPool2d(2)]  # fmt: skip
        c_in, size = c_out, size // 2
    net = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(c_in * size**2, 10))
    return builder.function(x, body), builder.values, net, (batch, *image)


class EncoderNet(torch.nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.block = torch.nn.TransformerEncoderLayer(
            d, heads, ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.block(x).mean(dim=1))


def transformer(batch: int = 16, seq: int = 128, d: int = 256, heads: int = 4, ff: int = 1024):
    builder = Builder()
    x = relax.Var("x", relax.TensorType((batch, seq, d), "float32"))
    dh = d // heads

    def split_heads(bb, t):  # (B, S, d) -> (B, H, S, dh)
        return bb.emit(op.permute_dims(op.reshape(t, (batch, seq, heads, dh)), [0, 2, 1, 3]))

    def body(bb):
        h = bb.emit(builder.layer_norm("block.norm1", x, d))
        q, k, v = (split_heads(bb, builder.dense(f"block.{n}_proj", h, d, d)) for n in "qkv")
        scores = op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                             relax.const(1.0 / np.sqrt(dh), "float32"))  # fmt: skip
        probs = bb.emit(op.nn.softmax(bb.emit(scores), -1))
        attn = bb.emit(op.permute_dims(op.matmul(probs, v), [0, 2, 1, 3]))
        attn = bb.emit(op.reshape(attn, (batch, seq, d)))
        h = bb.emit(op.add(x, builder.dense("block.self_attn.out_proj", attn, d, d)))
        f = bb.emit(builder.layer_norm("block.norm2", h, d))
        f = bb.emit(op.nn.relu(builder.dense("block.linear1", f, d, ff)))
        h = bb.emit(op.add(h, builder.dense("block.linear2", f, ff, d)))
        pooled = bb.emit(op.mean(h, axis=[1]))
        return builder.dense("head", pooled, d, 10)

    func = builder.function(x, body)
    values = builder.values
    # PyTorch keeps q, k and v's projections in one in_proj matrix.
    torch_values = {k: v for k, v in values.items() if "_proj" not in k or "out_proj" in k}
    for part in ("weight", "bias"):
        torch_values[f"block.self_attn.in_proj_{part}"] = np.concatenate(
            [values[f"block.{n}_proj.{part}"] for n in "qkv"]
        )
    net = EncoderNet(d, heads, ff)
    return func, values, net, (batch, seq, d), torch_values


def build(name: str):
    if name == "digits":
        return ("digits MLP 64-64-10, batch 32", *mlp(32, [64, 64, 10]))
    if name == "mlp":
        return ("MLP 4x1024, batch 256", *mlp(256, [1024] * 5 + [10]))
    if name == "cnn":
        return ("CNN 2x(conv+BN+relu+pool), b 64", *cnn())
    return ("transformer block s128 d256, b 16", *transformer())


PAUSE_S = 0.2
"""Pause after each run: the thread pools of the framework that ran stop spinning."""


def run_median(step) -> float:
    """The median time of ``ARGS.steps`` calls of ``step``, then a pause."""
    times = []
    for _ in range(ARGS.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    time.sleep(PAUSE_S)
    return statistics.median(times)


def paired_times(ours, theirs) -> tuple[tuple, tuple, tuple]:
    """``(median, min, max)`` of our run medians, of theirs and of the paired runs' ratios
    (ours / theirs), over ``ARGS.runs`` runs of each, alternating (theirs first)."""
    for step in (theirs, ours):
        step(), step()
        time.sleep(PAUSE_S)
    pairs = []
    for _ in range(ARGS.runs):
        their_time = run_median(theirs)
        pairs.append((run_median(ours), their_time))
    columns = [[p[0] for p in pairs], [p[1] for p in pairs], [p[0] / p[1] for p in pairs]]
    return tuple(spread(v) for v in columns)


def torch_step(net, values, x, y):
    state = {k: torch.from_numpy(v) for k, v in values.items()}
    missing = set(net.state_dict()) - set(state)
    assert all("running" in k or "batches" in k for k in missing), missing
    net.load_state_dict(state, strict=False)
    net.train()
    return torch_adam_step(net, torch.from_numpy(x), torch.from_numpy(y))


def relaxgrad_trainer(func, values):
    target = host_target() if ARGS.target == "native" else ARGS.target
    return Trainer(func, values, CrossEntropyLoss(), Adam(1e-3), target=target)


def adjoint_ratio(forward, adjoint, args) -> tuple[float, float, float]:
    """(median, min, max) over ``ARGS.runs`` runs of the adjoint's median time over the
    forward's, the two timed alternately (one call of each per round, ``ARGS.steps`` rounds a
    run) so that load from other processes falls on both alike."""
    for _ in range(2):
        forward(*args), adjoint(*args)
    return spread(adjoint_over_forward(forward, adjoint, args, ARGS.steps)
                  for _ in range(ARGS.runs))


def main() -> None:
    target = host_target() if ARGS.target == "native" else ARGS.target
    print(f"threads: {ARGS.threads}, relaxgrad target: {target}, torch {torch.__version__}, "
          f"{ARGS.runs} paired runs x {ARGS.steps} steps, ms: median of run medians (min-max)")
    print(f"{'model':<34} {'relaxgrad ms':>20} {'torch ms':>20} {'ratio':>17} {'adj/fwd':>17}")
    rng = np.random.default_rng(0)
    for name in ARGS.models:
        label, func, values, net, x_shape, *torch_values = build(name)
        torch_values = torch_values[0] if torch_values else values
        x = rng.standard_normal(x_shape).astype("float32")
        y = rng.integers(0, 10, x_shape[0]).astype("int64")
        theirs = torch_step(net, torch_values, x, y)
        trainer = relaxgrad_trainer(func, values)
        ours, their_times, ratio = paired_times(functools.partial(trainer.step, x, y), theirs)
        # Both trained the same number of steps from the same weights: the losses agree.
        our_loss, their_loss = trainer.step(x, y), theirs()
        if not np.isclose(our_loss, their_loss, rtol=5e-2, atol=5e-3):
            print(f"  WARNING: losses differ after training: {our_loss} vs {their_loss}")
        args = trainer._args(x) + [trainer._to_device(y, trainer._target, "target")]
        adj = adjoint_ratio(loss_function(trainer), trainer.vm["main_loss_adjoint"], args)
        print(f"{label:<34} {fmt(ours):>20} {fmt(their_times):>20} {fmt(ratio, 1):>17} "
              f"{fmt(adj, 1):>17}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
