"""Rules for reductions and scans (relax.op.statistical)."""

from __future__ import annotations

import functools
import operator

import numpy as np
from tvm import relax, tirx
from tvm.relax.op import (
    astype,
    broadcast_to,
    cumprod,
    cumsum,
    equal,
    expand_dims,
    flatten,
    flip,
    mean,
    permute_dims,
    reshape,
    strided_slice,
    sum,
    triu,
    where,
)
from tvm.relax.op.nn import pad

from .. import _ty
from ..errors import GradientError
from ._utils import const, count, scalar
from .registry import register_gradient


def _restore_axes(grad, orig_call):
    """Re-insert the reduced axes into ``grad`` when the reduction dropped them."""
    axis = orig_call.attrs.axis
    if not orig_call.attrs.keepdims and axis:
        return expand_dims(grad, axis)
    return grad


def _reduced_axes(x, axis) -> list[int]:
    """The non-negative axes a reduction over ``axis`` (None: all) covers."""
    ndim = _ty.ndim_of(x)
    return list(range(ndim)) if axis is None else sorted(int(a) % ndim for a in axis)


@register_gradient("relax.sum")
def sum_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = sum(x, axis, keepdims)``; backward: ``[broadcast_to(g, x.shape)]``."""
    x = orig_call.args[0]
    return [broadcast_to(_restore_axes(output_grad, orig_call), _ty.shape_of(x))]


@register_gradient("relax.mean")
def mean_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = mean(x, axis, keepdims)``; backward: ``[broadcast_to(g / n, x.shape)]``."""
    x = orig_call.args[0]
    grad = output_grad / scalar(count(x, orig_call.attrs.axis), output_grad)
    return [broadcast_to(_restore_axes(grad, orig_call), _ty.shape_of(x))]


@register_gradient("relax.variance")
def variance_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = variance(x, axis, keepdims)``; backward:
    ``[g * (2 / n * x - 2 / n**2 * sum(x, axis, keepdims=True))]``."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    n = count(x, axis)
    centered = scalar(2.0 / n, x) * x - scalar(2.0 / n / n, x) * sum(x, axis, keepdims=True)
    return [_restore_axes(output_grad, orig_call) * centered]


@register_gradient("relax.cumsum")
def cumsum_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = cumsum(x, axis, exclusive)``; backward: the reversed cumsum
    ``[sum(g, axis) - cumsum(g, axis) (+ g unless exclusive)]``, in x's dtype."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    flat = axis is None  # a cumsum over the flattened x
    axis = None if flat else int(axis)
    grad = sum(output_grad, axis, keepdims=True) - cumsum(output_grad, axis)
    if not orig_call.attrs.exclusive:
        grad = grad + (flatten(output_grad) if flat else output_grad)
    if flat:
        grad = reshape(grad, _ty.shape_of(x))
    if orig_call.attrs.dtype is not None:
        grad = astype(grad, _ty.dtype_of(x))
    return [grad]


def _extremum(op_name: str):
    """Register the rule of ``max``/``min``: ``g`` goes to the elements equal to the result,
    shared evenly among ties."""

    def rule(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        hit = astype(equal(x, _restore_axes(orig_var, orig_call)), _ty.dtype_of(x))
        share = _restore_axes(output_grad, orig_call) / sum(hit, orig_call.attrs.axis, True)
        return [hit * share]

    name = op_name.split(".")[-1]
    rule.__doc__ = (
        f"Forward: ``y = {name}(x, axis, keepdims)``; backward: "
        f"``[(x == y) * g / count(x == y, axis)]``."
    )
    register_gradient(op_name, rule)
    return rule


max_grad = _extremum("relax.max")
min_grad = _extremum("relax.min")


@register_gradient("relax.std")
def std_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = sqrt(variance(x, axis, keepdims))``; backward:
    ``[g * (x - mean(x, axis)) / (n * y)]``."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    n = scalar(count(x, axis), x)
    centered = x - mean(x, axis, keepdims=True)
    return [
        _restore_axes(output_grad, orig_call) * centered / (n * _restore_axes(orig_var, orig_call))
    ]


def _exclusive_cumprod(x, dims: list):
    """``cumprod(x, -1, exclusive=True)`` as an inclusive cumprod of x shifted right by a 1
    (TVM's exclusive scan has no GPU schedule in relaxgrad.compile)."""
    widths = [0] * (2 * len(dims))
    widths[-2] = 1
    shifted = strided_slice(pad(x, widths, pad_value=1.0), [len(dims) - 1], [0], [dims[-1]])
    return cumprod(shifted, -1)


def _product_of_others(x, axes: list[int]):
    """For each element of ``x``, the product of the other elements of its reduction group
    over ``axes``: exclusive cumprods from both ends, exact where x has zeros."""
    ndim = _ty.ndim_of(x)
    kept = [a for a in range(ndim) if a not in axes]
    moved = permute_dims(x, kept + axes) if kept + axes != list(range(ndim)) else x
    dims = _ty.shape_values(x)
    size = functools.reduce(operator.mul, [dims[a] for a in axes])
    grouped_dims = [dims[a] for a in kept] + [size]
    grouped = reshape(moved, grouped_dims)
    left = _exclusive_cumprod(grouped, grouped_dims)
    right = flip(_exclusive_cumprod(flip(grouped, -1), grouped_dims), -1)
    others = reshape(left * right, [dims[a] for a in kept + axes])
    if moved is x:
        return others
    inverse = [0] * ndim
    for i, a in enumerate(kept + axes):
        inverse[a] = i
    return permute_dims(others, inverse)


@register_gradient("relax.prod")
def prod_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = prod(x, axis, keepdims)``; backward: ``[g * prod(others)]``, the product
    of the other elements of each group (no division: exact where x has zeros)."""
    x = orig_call.args[0]
    axes = _reduced_axes(x, orig_call.attrs.axis)
    if not axes:  # a 0-d x or axis=[]: nothing is reduced, y = x
        return [output_grad]
    others = _product_of_others(x, axes)
    return [_restore_axes(output_grad, orig_call) * others]


def _cumprod_pairs(x, dims: list, dtype: str, exclusive: bool):
    """``p[..., j, i] = prod(x[..., k] for k <= i (k < i if exclusive), k != j)`` over the last
    axis of ``x`` (of shape ``dims``), zero unless ``i >= j`` (``i > j`` if exclusive): the
    partials ``dy_i / dx_j`` of the cumprod over that axis."""
    n = dims[-1]
    if not isinstance(n, (int, tirx.IntImm)):
        raise GradientError("Gradient: relax.cumprod has no gradient rule for a symbolic axis")
    rows = broadcast_to(expand_dims(x, -2), list(dims) + [n])
    skip = relax.const(np.eye(int(n), dtype=bool))
    rows = where(skip, const(1, dtype), rows)
    pairs = _exclusive_cumprod(rows, list(dims) + [n]) if exclusive else cumprod(rows, -1)
    return triu(pairs, 1 if exclusive else 0)


@register_gradient("relax.cumprod")
def cumprod_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = cumprod(x, axis, exclusive)``; backward: ``[sum_i g_i * dy_i / dx_j]``, from
    the n x n products of :func:`_cumprod_pairs` (no division: exact where x has zeros)."""
    x = orig_call.args[0]
    attrs = orig_call.attrs
    g = astype(output_grad, _ty.dtype_of(x)) if attrs.dtype is not None else output_grad
    dims, ndim, dtype = _ty.shape_values(x), _ty.ndim_of(x), _ty.dtype_of(x)
    if any(isinstance(d, tirx.IntImm) and int(d) == 0 for d in dims):  # empty: nothing flows
        return [relax.op.zeros(_ty.shape_of(x), dtype)]
    if attrs.axis is None:  # over the flattened x
        pairs = _cumprod_pairs(flatten(x), [count(x)], dtype, bool(attrs.exclusive))
        return [reshape(sum(pairs * expand_dims(flatten(g), -2), -1), dims)]
    axis = int(attrs.axis) % ndim
    order = [a for a in range(ndim) if a != axis] + [axis]
    if axis != ndim - 1:  # move the axis last
        x, g, dims = permute_dims(x, order), permute_dims(g, order), [dims[a] for a in order]
    grad = sum(_cumprod_pairs(x, dims, dtype, bool(attrs.exclusive)) * expand_dims(g, -2), -1)
    if axis != ndim - 1:
        grad = permute_dims(grad, [order.index(a) for a in range(ndim)])
    return [grad]
