"""Rules for elementwise unary ops (relax.op.unary)."""

from __future__ import annotations

from tvm.relax.op import cos, less, sigmoid, sin, where

from ._utils import const
from .registry import register_gradient


def _unary(op_name: str):
    """Register ``fn(x, y, g) -> dx`` as the rule of a one-argument op."""

    def decorate(fn):
        def rule(orig_var, orig_call, output_grad, ctx):
            return [fn(orig_call.args[0], orig_var, output_grad)]

        rule.__doc__ = fn.__doc__
        register_gradient(op_name, rule)
        return rule

    return decorate


@_unary("relax.negative")
def negative_grad(x, y, g):
    """Forward: ``y = -x``; backward: ``[-g]``."""
    return -g


@_unary("relax.abs")
def abs_grad(x, y, g):
    """Forward: ``y = |x|``; backward: ``[g * where(x < 0, -1, 1)]``."""
    one = const(1, x)
    return g * where(less(x, const(0, x)), -one, one)


@_unary("relax.exp")
def exp_grad(x, y, g):
    """Forward: ``y = exp(x)``; backward: ``[g * y]``."""
    return g * y


@_unary("relax.log")
def log_grad(x, y, g):
    """Forward: ``y = log(x)``; backward: ``[g / x]``."""
    return g / x


@_unary("relax.sqrt")
def sqrt_grad(x, y, g):
    """Forward: ``y = sqrt(x)``; backward: ``[0.5 * g / y]``."""
    return const(0.5, x) * g / y


@_unary("relax.sin")
def sin_grad(x, y, g):
    """Forward: ``y = sin(x)``; backward: ``[g * cos(x)]``."""
    return g * cos(x)


@_unary("relax.cos")
def cos_grad(x, y, g):
    """Forward: ``y = cos(x)``; backward: ``[-g * sin(x)]``."""
    return -g * sin(x)


@_unary("relax.tanh")
def tanh_grad(x, y, g):
    """Forward: ``y = tanh(x)``; backward: ``[g * (1 - y * y)]``."""
    return g * (const(1, x) - y * y)


@_unary("relax.sigmoid")
def sigmoid_grad(x, y, g):
    """Forward: ``y = sigmoid(x)``; backward: ``[g * y * (1 - y)]``."""
    return g * y * (const(1, x) - y)


@_unary("relax.nn.relu")
def relu_grad(x, y, g):
    """Forward: ``y = relu(x)``; backward: ``[where(x < 0, 0, g)]``."""
    zero = const(0, x)
    return where(less(x, zero), zero, g)


@_unary("relax.nn.silu")
def silu_grad(x, y, g):
    """Forward: ``y = x * sigmoid(x)``; backward: ``[g * (sigmoid(x) + y * (1 - sigmoid(x)))]``."""
    sig = sigmoid(x)
    return g * (sig + y * (const(1, x) - sig))
