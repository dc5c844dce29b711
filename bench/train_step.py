"""One training step (forward + backward + Adam update): relaxgrad-compiled vs PyTorch eager.

Both run on the CPU with the same number of threads (``--threads``, default: all cores), the
same model, initial weights, minibatch and optimizer. Prints the median step time of each and
the ratio relaxgrad / PyTorch for the digits MLP (64-64-10, batch 32) and a wider MLP
(1024 x 4 hidden layers, batch 256). Run: ``python bench/train_step.py``; add
``--target native`` to build for this machine's CPU (AVX2, FMA, ...) rather than a generic one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model")
    parser.add_argument(
        "--target",
        default="llvm",
        help="TVM target for relaxgrad; 'native' for this machine's CPU (pipeline.host_target)",
    )
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts

import numpy as np  # noqa: E402
import torch  # noqa: E402

from relaxgrad.pipeline import host_target  # noqa: E402
from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, mlp  # noqa: E402

torch.set_num_threads(ARGS.threads)

MODELS = {
    "digits MLP 64-64-10, batch 32": dict(batch_size=32, in_features=64, hidden=(64,)),
    "wide MLP 4x1024, batch 256": dict(batch_size=256, in_features=1024, hidden=(1024,) * 4),
}


def torch_twin(params: dict[str, np.ndarray], hidden: int) -> torch.nn.Module:
    layers = []
    for i in range(hidden + 1):
        w, b = params[f"fc{i}_weight"], params[f"fc{i}_bias"]
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w))
            linear.bias.copy_(torch.from_numpy(b))
        layers += [linear, torch.nn.ReLU()] if i < hidden else [linear]
    return torch.nn.Sequential(*layers)


def median_time(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_step_time(model, x, y, hidden: int) -> float:
    net = torch_twin(model.params, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(tx), ty)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return median_time(step, ARGS.steps)


def relaxgrad_step_time(model, x, y) -> float:
    target = host_target() if ARGS.target == "native" else ARGS.target
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(1e-3), target=target)
    return median_time(lambda: trainer.step(x, y), ARGS.steps)


def main() -> None:
    print(f"threads: {ARGS.threads}, relaxgrad target: {ARGS.target}, torch {torch.__version__}")
    rng = np.random.default_rng(0)
    cases = []
    for name, config in MODELS.items():
        model = mlp(**config)
        x = rng.standard_normal((config["batch_size"], config["in_features"])).astype("float32")
        y = rng.integers(0, 10, config["batch_size"]).astype("int64")
        cases.append((name, model, x, y, len(config["hidden"])))
    # PyTorch first: TVM's thread pool keeps spinning after its kernels and would slow it down.
    torch_times = [torch_step_time(model, x, y, hidden) for _, model, x, y, hidden in cases]
    print(f"{'model':<34} {'relaxgrad ms':>13} {'torch ms':>9} {'ratio':>6}")
    for (name, model, x, y, _), theirs in zip(cases, torch_times):
        ours = relaxgrad_step_time(model, x, y)
        print(f"{name:<34} {ours * 1e3:>13.3f} {theirs * 1e3:>9.3f} {ours / theirs:>6.2f}",
              flush=True)


if __name__ == "__main__":
    main()
