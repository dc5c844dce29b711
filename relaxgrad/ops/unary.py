"""Rules for elementwise unary ops (relax.op.unary) and the elementwise activations of
relax.op.nn (relu, silu, gelu, gelu_tanh, leakyrelu, softplus, selu)."""

from __future__ import annotations

import math

from tvm.relax.op import (
    astype,
    cos,
    cosh,
    equal,
    erf,
    exp,
    greater,
    less,
    rsqrt,
    sigmoid,
    sin,
    sinh,
    tanh,
    where,
)
from tvm.relax.op.grad import no_grad

from .. import _ty
from ._utils import const
from .registry import register_gradient, register_no_grad


def _unary(op_name: str, with_attrs: bool = False):
    """Register ``fn(x, y, g) -> dx`` (``fn(x, y, g, attrs)`` with ``with_attrs``) as the rule of
    a one-argument op."""

    def decorate(fn):
        def rule(orig_var, orig_call, output_grad, ctx):
            extra = (orig_call.attrs,) if with_attrs else ()
            return [fn(orig_call.args[0], orig_var, output_grad, *extra)]

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


@_unary("relax.erf")
def erf_grad(x, y, g):
    """Forward: ``y = erf(x)``; backward: ``[g * 2 / sqrt(pi) * exp(-x * x)]``."""
    return g * const(2 / math.sqrt(math.pi), x) * exp(-(x * x))


@_unary("relax.tan")
def tan_grad(x, y, g):
    """Forward: ``y = tan(x)``; backward: ``[g * (1 + y * y)]``."""
    return g * (const(1, x) + y * y)


@_unary("relax.sinh")
def sinh_grad(x, y, g):
    """Forward: ``y = sinh(x)``; backward: ``[g * cosh(x)]``."""
    return g * cosh(x)


@_unary("relax.cosh")
def cosh_grad(x, y, g):
    """Forward: ``y = cosh(x)``; backward: ``[g * sinh(x)]``."""
    return g * sinh(x)


@_unary("relax.asin")
def asin_grad(x, y, g):
    """Forward: ``y = asin(x)``; backward: ``[g * rsqrt(1 - x * x)]``."""
    return g * rsqrt(const(1, x) - x * x)


@_unary("relax.acos")
def acos_grad(x, y, g):
    """Forward: ``y = acos(x)``; backward: ``[-g * rsqrt(1 - x * x)]``."""
    return -g * rsqrt(const(1, x) - x * x)


@_unary("relax.atan")
def atan_grad(x, y, g):
    """Forward: ``y = atan(x)``; backward: ``[g / (1 + x * x)]``."""
    return g / (const(1, x) + x * x)


@_unary("relax.asinh")
def asinh_grad(x, y, g):
    """Forward: ``y = asinh(x)``; backward: ``[g * rsqrt(x * x + 1)]``."""
    return g * rsqrt(x * x + const(1, x))


@_unary("relax.acosh")
def acosh_grad(x, y, g):
    """Forward: ``y = acosh(x)``; backward: ``[g * rsqrt(x * x - 1)]``."""
    return g * rsqrt(x * x - const(1, x))


@_unary("relax.atanh")
def atanh_grad(x, y, g):
    """Forward: ``y = atanh(x)``; backward: ``[g / (1 - x * x)]``."""
    return g / (const(1, x) - x * x)


@_unary("relax.rsqrt")
def rsqrt_grad(x, y, g):
    """Forward: ``y = 1 / sqrt(x)``; backward: ``[-0.5 * g * y * y * y]``."""
    return const(-0.5, x) * g * (y * y * y)


@_unary("relax.square")
def square_grad(x, y, g):
    """Forward: ``y = x * x``; backward: ``[2 * g * x]``."""
    return const(2, x) * g * x


@register_gradient("relax.clip")
def clip_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = clip(x, lo, hi)``; backward: ``[where(y == x, g, 0), no_grad, no_grad]``
    (``g`` passes where x is inside ``[lo, hi]``, bounds included)."""
    x, lo, hi = orig_call.args
    return [where(equal(orig_var, x), output_grad, const(0, x)), no_grad(lo), no_grad(hi)]


# Piecewise constant (zero gradient almost everywhere) or not differentiable at all.
register_no_grad(
    f"relax.{name}"
    for name in (
        "sign", "floor", "ceil", "round", "trunc", "isnan", "isinf", "isfinite",
        "logical_not", "bitwise_not",
    )
)  # fmt: skip


@_unary("relax.nn.gelu")
def gelu_grad(x, y, g):
    """Forward: ``y = x * Phi(x)``; backward: ``[g * (Phi(x) + x * exp(-x * x / 2) / sqrt(2 pi))]``
    (``erf`` in float32 for float16, as TVM's kernel)."""
    scaled = x * const(math.sqrt(0.5), x)
    if _ty.dtype_of(x) == "float16":
        cdf_erf = astype(erf(astype(scaled, "float32")), "float16")
    else:
        cdf_erf = erf(scaled)
    cdf = const(0.5, x) + const(0.5, x) * cdf_erf
    pdf = const(1 / math.sqrt(2 * math.pi), x) * exp(-(scaled * scaled))
    return g * (cdf + x * pdf)


_GELU_K, _GELU_C = math.sqrt(2 / math.pi), 0.044715


@_unary("relax.nn.gelu_tanh")
def gelu_tanh_grad(x, y, g):
    """Forward: ``y = 0.5 x (1 + t)``, ``t = tanh(k (x + c x^3))``; backward:
    ``[g * (0.5 (1 + t) + 0.5 x (1 - t * t) k (1 + 3 c x^2))]``."""
    x2 = x * x
    t = tanh(const(_GELU_K, x) * x * (const(1, x) + const(_GELU_C, x) * x2))
    half = const(0.5, x)
    inner = const(_GELU_K, x) * (const(1, x) + const(3 * _GELU_C, x) * x2)
    return g * (half * (const(1, x) + t) + half * x * (const(1, x) - t * t) * inner)


@_unary("relax.nn.leakyrelu", with_attrs=True)
def leakyrelu_grad(x, y, g, attrs):
    """Forward: ``y = where(x > 0, x, alpha * x)``; backward: ``[where(x > 0, g, alpha * g)]``."""
    return where(greater(x, const(0, x)), g, const(float(attrs.alpha), x) * g)


@_unary("relax.nn.softplus", with_attrs=True)
def softplus_grad(x, y, g, attrs):
    """Forward: ``y = where(b x > threshold, x, log(1 + exp(b x)) / b)``; backward:
    ``[where(b x > threshold, g, g * sigmoid(b x))]``."""
    bx = const(float(attrs.beta), x) * x
    return where(greater(bx, const(float(attrs.threshold), x)), g, g * sigmoid(bx))


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@_unary("relax.nn.selu")
def selu_grad(x, y, g):
    """Forward: ``y = scale * where(x > 0, x, alpha (exp(x) - 1))``; backward:
    ``[where(x > 0, scale * g, g * (y + scale * alpha))]``."""
    return where(
        greater(x, const(0, x)),
        const(_SELU_SCALE, x) * g,
        g * (y + const(_SELU_SCALE * _SELU_ALPHA, x)),
    )
