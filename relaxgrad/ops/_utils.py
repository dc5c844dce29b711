"""Helpers shared by the rule families. Broadcast reduction lives here and only here."""

from __future__ import annotations

import functools
import operator

import tvm_ffi
from tvm import relax, tirx
from tvm.relax import BlockBuilder, Expr
from tvm.sym import Analyzer

from .. import _ty
from ..errors import GradientError


def fit_shape(ctx: BlockBuilder, grad: Expr, like: Expr, op_name: str = "an op") -> Expr:
    """``grad`` reduced to the shape of ``like``: itself if the shapes already match, else
    ``collapse_sum_to(grad, like.shape)`` (undoes broadcasting). A shape given by a var (e.g.
    ``zeros(shape_of(x))``) is read from the var's type; a GradientError naming ``op_name`` is
    raised when ``like``'s shape is unknown."""
    target = _known_shape(like)
    if target is None:
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for an operand of unknown shape "
            f"({_ty.type_of(like)})"
        )
    got = _known_shape(ctx.normalize(grad))
    if got is not None and (
        tvm_ffi.structural_equal(got, target) or _same_shape(got.values, target.values)
    ):
        return grad
    return relax.op.collapse_sum_to(grad, target)


def _known_shape(expr: Expr) -> relax.ShapeExpr | None:
    """The shape of tensor ``expr`` as a ShapeExpr, or None when its type does not give it."""
    shape = _ty.shape_of(expr)
    if shape is None or isinstance(shape, relax.ShapeExpr):
        return shape
    values = getattr(_ty.type_of(shape), "values", None)  # a shape var of a known shape
    return None if values is None else relax.ShapeExpr(values)


def _same_shape(lhs, rhs) -> bool:
    if len(lhs) != len(rhs):
        return False
    analyzer = Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(lhs, rhs, strict=True))


def const(value, like: Expr | str) -> _ty.Constant:
    """A scalar constant with the dtype of ``like`` (an expr or a dtype string)."""
    dtype = like if isinstance(like, str) else _ty.dtype_of(like)
    return relax.const(value, dtype)


def count(expr: Expr, axis=None):
    """Number of elements of ``expr`` over ``axis`` (all axes when None): a Python int when those
    dims are static, else a tirx expression in the dtype of ``expr`` (symbolic dims)."""
    dims = _ty.shape_values(expr)
    if axis is not None:
        dims = [dims[int(i)] for i in axis]
    if all(isinstance(d, tirx.IntImm) for d in dims):
        return functools.reduce(operator.mul, (int(d) for d in dims), 1)
    return tirx.Cast(_ty.dtype_of(expr), functools.reduce(operator.mul, dims))


def scalar(value, like: Expr | str) -> Expr:
    """``value`` as a 0-d tensor of the dtype of ``like``: a constant for a Python number, else
    computed at run time from a tirx expression such as a symbolic :func:`count`."""
    if isinstance(value, (int, float)):
        return const(value, like)
    dtype = like if isinstance(like, str) else _ty.dtype_of(like)
    prim = relax.prim_value(value if _ty.dtype_of(value) == dtype else tirx.Cast(dtype, value))
    # Relax broadcasts a prim value as a tensor of shape (1,): add it to a 0-d zero, back to 0-d.
    return relax.op.reshape(relax.op.add(relax.op.zeros((), dtype), prim), ())


def numel(expr: Expr):
    """Number of elements of ``expr`` as a shape value (an int when static, else a tirx
    expression); unlike :func:`count`, usable in shapes."""
    dims = _ty.shape_values(expr)
    if all(isinstance(d, tirx.IntImm) for d in dims):
        return functools.reduce(operator.mul, (int(d) for d in dims), 1)
    return functools.reduce(operator.mul, dims)


def static_dims(expr: Expr, op_name: str, axes=None) -> tuple[int, ...]:
    """The dims of ``expr`` on ``axes`` (all when None) as ints; raises GradientError naming
    ``op_name`` where one is symbolic. The dims off ``axes`` (e.g. a batch) may be symbolic."""
    if axes is None:
        try:
            return _ty.static_shape(expr)
        except TypeError:
            raise GradientError(
                f"Gradient: {op_name} has no gradient rule for symbolic shapes "
                f"({_ty.type_of(expr)})"
            ) from None
    dims = [_ty.shape_values(expr)[a] for a in axes]
    symbolic = [a for a, d in zip(axes, dims) if not isinstance(d, tirx.IntImm)]
    if symbolic:
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for symbolic dims on axes {symbolic} of "
            f"{_ty.type_of(expr)} (only other axes, such as a batch, may be symbolic)"
        )
    return tuple(int(d) for d in dims)


def relayout(expr, src: str, dst: str, op_name: str):
    """``expr`` permuted from layout ``src`` to layout ``dst`` (itself when they are equal)."""
    if src == dst:
        return expr
    if sorted(src) != sorted(dst):
        raise GradientError(
            f"Gradient: {op_name} has no gradient rule for layout {src} (only for permutations "
            f"of {dst}, such as NHWC)"
        )
    return relax.op.permute_dims(expr, [src.index(axis) for axis in dst])
