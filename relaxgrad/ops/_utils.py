"""Helpers shared by the rule families. Broadcast reduction lives here and only here."""

from __future__ import annotations

import functools
import operator

from tvm import relax
from tvm.sym import Analyzer
from tvm.relax import BlockBuilder, Expr

from .. import _ty


def fit_shape(ctx: BlockBuilder, grad: Expr, like: Expr) -> Expr:
    """``grad`` reduced to the shape of ``like``: itself if the shapes already match, else
    ``collapse_sum_to(grad, like.shape)`` (undoes broadcasting)."""
    target = _ty.shape_of(like)
    got = _ty.shape_of(ctx.normalize(grad))
    if got is not None and _same_shape(got.values, target.values):
        return grad
    return relax.op.collapse_sum_to(grad, target)


def _same_shape(lhs, rhs) -> bool:
    if len(lhs) != len(rhs):
        return False
    analyzer = Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(lhs, rhs))


def const(value, like: Expr | str) -> _ty.Constant:
    """A scalar constant with the dtype of ``like`` (an expr or a dtype string)."""
    dtype = like if isinstance(like, str) else _ty.dtype_of(like)
    return relax.const(value, dtype)


def shape_prod(expr: Expr, axis=None) -> int:
    """Number of elements of ``expr`` over ``axis`` (all axes when None); static shapes only."""
    shape = _ty.static_shape(expr)
    if axis is None:
        return functools.reduce(operator.mul, shape, 1)
    return functools.reduce(operator.mul, (shape[int(i)] for i in axis), 1)
