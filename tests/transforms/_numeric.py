"""Helpers of the split / custom-gradient / higher-order tests: compile, wrap, finite
differences."""

import numpy as np
import tvm
from tvm import relax


def compiled(mod):
    """A VirtualMachine of ``mod`` compiled for the CPU."""
    return relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())


def tensor(a):
    return tvm.runtime.tensor(np.asarray(a))


def fd_gradient(f, inputs, i, eps=1e-6):
    """Central-difference gradient of the scalar ``f(*inputs)`` w.r.t. the array ``inputs[i]``."""
    x = inputs[i]
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        vals = []
        for sign in (1, -1):
            moved = x.copy()
            moved[idx] += sign * eps
            args = list(inputs)
            args[i] = moved
            vals.append(f(*args))
        grad[idx] = (vals[0] - vals[1]) / (2 * eps)
    return grad
