"""What dropout costs a training step: relaxgrad's keyed Philox masks vs PyTorch's dropout.

One PyTorch model (``nn.TransformerEncoderLayer``, d 128, 4 heads, feed-forward 512, dropout
0.1 at its four sites, on sequences of 64, mean-pooled into a 10-class head; batch 16) is
trained with Adam on one minibatch by

- relaxgrad, imported with ``from_torch`` twice: ``dropout="random"`` (the default) and
  ``dropout="identity"``;
- PyTorch eager, in train mode, with dropout 0.1 and (the same weights) with dropout 0.

Each framework's step with dropout is timed against its step without, alternately (``--runs``
runs of ``--steps`` steps each, the median of each run), on ``--threads`` threads (default 2).
It prints each median step time, each framework's dropout overhead (with / without dropout)
and relaxgrad / PyTorch with dropout. Run ``python bench/dropout.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_torch  # noqa: E402

torch.set_num_threads(ARGS.threads)
torch.set_flush_denormal(True)
BATCH, SEQ, D = 16, 64, 128


class Encoder(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(D, 4, 512, dropout=dropout, batch_first=True)
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        return self.head(self.block(x).mean(dim=1))


def torch_step(net, x, y):
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net.train()

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def relaxgrad_step(net, x, y, dropout: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_torch(net, (x,), dropout=dropout)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3))
    xs, ys = x.numpy(), y.numpy()
    return lambda: trainer.step(xs, ys)


def median_time(step) -> float:
    times = []
    for _ in range(ARGS.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(with_dropout, without) -> tuple[float, float, float]:
    """Median step times with and without dropout, and their ratio (median of paired runs)."""
    for step in (with_dropout, without):
        step(), step()
    pairs = [(median_time(with_dropout), median_time(without)) for _ in range(ARGS.runs)]
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[0] / p[1] for p in pairs))


def main() -> None:
    torch.manual_seed(0)
    net = Encoder()
    x = torch.randn(BATCH, SEQ, D)
    y = torch.from_numpy(np.random.default_rng(0).integers(0, 10, BATCH))
    ours = overhead(relaxgrad_step(net, x, y, "random"), relaxgrad_step(net, x, y, "identity"))
    still = Encoder(dropout=0.0)  # the same weights, no dropout (attention's included)
    still.load_state_dict(net.state_dict())
    theirs = overhead(torch_step(net, x, y), torch_step(still, x, y))
    print(f"threads {ARGS.threads}, {ARGS.runs} runs x {ARGS.steps} steps; ms per step")
    print(f"{'':<10} {'dropout':>9} {'none':>9} {'overhead':>9}")
    for name, (drop, none, ratio) in (("relaxgrad", ours), ("torch", theirs)):
        print(f"{name:<10} {drop * 1e3:9.2f} {none * 1e3:9.2f} {ratio:9.3f}")
    print(f"relaxgrad / torch with dropout: {ours[0] / theirs[0]:.3f}")


if __name__ == "__main__":
    main()
