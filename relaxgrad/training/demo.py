"""``relaxgrad demo``: train the digits MLP on CPU with relaxgrad and print the accuracy."""

from __future__ import annotations

import time

from .datasets import load_digits
from .losses import CrossEntropyLoss
from .models import mlp
from .optimizers import Adam
from .trainer import Trainer

__all__ = ["run_demo"]


def run_demo(epochs: int = 20, target: str = "llvm") -> int:
    """Train a 64-64-10 MLP on scikit-learn's digits with Adam; 0 when test accuracy >= 95%."""
    data = load_digits()
    model = mlp(batch_size=32, seed=0)
    start = time.perf_counter()
    trainer = Trainer(model.mod, model.params, CrossEntropyLoss(), Adam(2e-3), target=target)
    print(f"compiled loss adjoint and Adam step in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    trainer.fit(data.x_train, data.y_train, epochs=epochs)
    result = trainer.evaluate(data.x_test, data.y_test)
    print(f"trained {epochs} epochs in {time.perf_counter() - start:.1f} s: test accuracy "
          f"{result['accuracy']:.2%}, test loss {result['loss']:.4f}")
    return 0 if result["accuracy"] >= 0.95 else 1
