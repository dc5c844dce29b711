"""``relaxgrad demo``: train the digits MLP on CPU with relaxgrad and print the accuracy; under
``torchrun --nproc-per-node N`` it trains data parallel on the N processes."""

from __future__ import annotations

import os
import time

from .datasets import load_digits
from .losses import CrossEntropyLoss
from .models import mlp
from .optimizers import Adam
from .trainer import Trainer

__all__ = ["run_demo"]


def run_demo(epochs: int = 20, target: str = "llvm") -> int:
    """Train a 64-64-10 MLP on scikit-learn's digits with Adam; 0 when test accuracy >= 95%.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) each rank trains on its shard of each batch of
    32 rows per rank, with the learning rate scaled by the number of ranks; rank 0 prints.
    """
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    data = load_digits()
    model = mlp(batch_size=32, seed=0)
    start = time.perf_counter()
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(2e-3 * ranks),
                      target=target, distributed=ranks > 1)
    say = print if trainer.dp is None or trainer.dp.rank == 0 else _quiet
    say(f"compiled loss adjoint and Adam step in {time.perf_counter() - start:.1f} s")
    if trainer.dp is not None:
        say(f"data parallel on {ranks} processes: each step all-reduces the gradients of "
            f"{ranks} x 32 rows")
    start = time.perf_counter()
    trainer.fit(data.x_train, data.y_train, epochs=epochs)
    result = trainer.evaluate(data.x_test, data.y_test)
    say(f"trained {epochs} epochs in {time.perf_counter() - start:.1f} s: test accuracy "
        f"{result['accuracy']:.2%}, test loss {result['loss']:.4f}")
    return 0 if result["accuracy"] >= 0.95 else 1


def _quiet(*args) -> None:
    """print, on the ranks that do not."""
