"""Rules for elementwise binary ops (relax.op.binary): arithmetic, comparison, logical."""

from __future__ import annotations

from tvm.relax.op import (
    add,
    divide,
    exp,
    floor,
    greater_equal,
    less,
    log,
    reshape,
    trunc,
    where,
)
from tvm.relax.op.grad import no_grad

from .. import _ty
from ._utils import const, fit_shape
from .registry import register_gradient, register_no_grad


def _as_tensor(ctx, arg):
    """``arg``, or a prim value (``R.prim_value(2.0)``) made a 0-d tensor: ``0 + arg`` (of shape
    ``(1,)``: Relax broadcasts a prim value so) reshaped to ``()``."""
    if _ty.is_tensor(arg):
        return arg
    return ctx.normalize(reshape(add(const(0, arg), arg), ()))


def _binary(fn):
    """Build a rule from ``fn(x, y, z, g) -> (dx, dy)``; each partial is reduced to its input's
    shape (undoing broadcasting). An operand that is not a tensor (a ``PrimValue`` such as the
    ``2.0`` of ``multiply(x, R.prim_value(2.0))``) gets ``no_grad``; ``fn`` sees it as a 0-d
    tensor."""

    def rule(orig_var, orig_call, output_grad, ctx):
        op_name = str(orig_call.op.name)
        args = orig_call.args
        partials = fn(*[_as_tensor(ctx, arg) for arg in args], orig_var, output_grad)
        return [
            fit_shape(ctx, d, arg, op_name) if _ty.is_tensor(arg) else no_grad(arg)
            for d, arg in zip(partials, args, strict=True)
        ]

    rule.__doc__ = fn.__doc__
    return rule


@register_gradient("relax.add")
@_binary
def add_grad(x, y, z, g):
    """Forward: ``z = x + y``; backward: ``[g, g]``."""
    return g, g


@register_gradient("relax.subtract")
@_binary
def subtract_grad(x, y, z, g):
    """Forward: ``z = x - y``; backward: ``[g, -g]``."""
    return g, -g


@register_gradient("relax.multiply")
@_binary
def multiply_grad(x, y, z, g):
    """Forward: ``z = x * y``; backward: ``[g * y, g * x]``."""
    return g * y, g * x


@register_gradient("relax.divide")
@_binary
def divide_grad(x, y, z, g):
    """Forward: ``z = x / y``; backward: ``[g / y, -g * z / y]``."""
    return g / y, -g * z / y


@register_gradient("relax.power")
@_binary
def power_grad(x, y, z, g):
    """Forward: ``z = x ** y``; backward: ``[g * y * x ** (y - 1), g * z * log(x)]``."""
    return g * y * (x ** (y - const(1, y))), g * z * log(x)


@register_gradient("relax.maximum")
@_binary
def maximum_grad(x, y, z, g):
    """Forward: ``z = maximum(x, y)``; backward: ``[where(x < y, 0, g), where(x >= y, 0, g)]``."""
    zero = const(0, x)
    return where(less(x, y), zero, g), where(greater_equal(x, y), zero, g)


@register_gradient("relax.minimum")
@_binary
def minimum_grad(x, y, z, g):
    """Forward: ``z = minimum(x, y)``; backward: ``[where(x >= y, 0, g), where(x < y, 0, g)]``."""
    zero = const(0, x)
    return where(greater_equal(x, y), zero, g), where(less(x, y), zero, g)


@register_gradient("relax.floor_mod")
@_binary
def floor_mod_grad(x, y, z, g):
    """Forward: ``z = x - floor(x / y) * y``; backward: ``[g, -g * floor(x / y)]``."""
    return g, -g * floor(divide(x, y))


@register_gradient("relax.mod")
@_binary
def mod_grad(x, y, z, g):
    """Forward: ``z = x - trunc(x / y) * y``; backward: ``[g, -g * trunc(x / y)]``."""
    return g, -g * trunc(divide(x, y))


@register_gradient("relax.log_add_exp")
@_binary
def log_add_exp_grad(x, y, z, g):
    """Forward: ``z = log(exp(x) + exp(y))``; backward: ``[g * exp(x - z), g * exp(y - z)]``."""
    return g * exp(x - z), g * exp(y - z)


@register_gradient("relax.atan2")
@_binary
def atan2_grad(x, y, z, g):
    """Forward: ``z = atan2(x, y)``; backward: ``[g * y / (x^2 + y^2), -g * x / (x^2 + y^2)]``."""
    scaled = g / (x * x + y * y)
    return scaled * y, -scaled * x


# Comparisons, logical and bitwise ops, and floor_divide (piecewise constant) have no gradient.
register_no_grad(
    f"relax.{name}"
    for name in (
        "equal", "not_equal", "greater", "greater_equal", "less", "less_equal",
        "logical_and", "logical_or", "logical_xor",
        "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift",
        "floor_divide",
    )
)  # fmt: skip
