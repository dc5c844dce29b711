"""The README's main job: differentiate an MLP with relaxgrad, compile it, print loss and
gradient norms, and check the gradients against finite differences.

Run: ``python -m relaxgrad.example``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.testing import check_gradients


def mlp_module(dtype: str = "float32", batch: int = 8) -> tvm.IRModule:
    """``loss = cross_entropy(log_softmax(relu(x @ w0 + b0) @ w1 + b1), label)``."""
    shapes = {"x": (batch, 16), "w0": (16, 32), "b0": (32,), "w1": (32, 10), "b1": (10,),
              "label": (batch, 10)}
    x, w0, b0, w1, b1, label = (relax.Var(n, relax.TensorType(s, dtype)) for n, s in shapes.items())
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w0, b0, w1, b1, label]):
        with bb.dataflow():
            h = bb.emit(op.nn.relu(op.add(op.matmul(x, w0), b0)))
            logits = bb.emit(op.nn.log_softmax(op.add(op.matmul(h, w1), b1)))
            loss = bb.emit_output(op.nn.cross_entropy_with_logits(logits, label))
        bb.emit_func_output(loss)
    return bb.get()


def main() -> None:
    mlp = mlp_module("float32")
    params = mlp["main"].params
    mod = relaxgrad.Gradient("main", require_grads=params[1:5])(mlp)
    print(mod["main_adjoint"].script()[:1500], "...\n")

    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype("float32")
    weights = [
        (rng.standard_normal((16, 32)) * 0.3).astype("float32"),
        np.zeros(32, "float32"),
        (rng.standard_normal((32, 10)) * 0.3).astype("float32"),
        np.zeros(10, "float32"),
    ]
    label = np.eye(10, dtype="float32")[rng.integers(0, 10, 8)]
    inputs = [x, *weights, label]
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    print(f"loss = {float(loss.numpy()):.6f}")
    for param, grad in zip(params[1:5], grads):
        print(f"|d loss / d {param.name}| = {np.linalg.norm(grad.numpy()):.6f}")

    # Finite differences through relu kinks are unreliable in float32: check the float64 twin
    # of the same graph on the same inputs.
    inputs64 = [a.astype("float64") for a in inputs]
    result = check_gradients(mlp_module("float64"), inputs=inputs64, wrt=[1, 2, 3, 4])
    print(f"finite-difference check (float64 twin): {'passed' if result.ok else 'FAILED'} "
          f"(max error {result.max_error:.2g})")
    if not result.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
