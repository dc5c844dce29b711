"""The few places that know TVM 0.27's type API (``.ty``, ``TensorType``, ``TupleType``).

Everything else in relaxgrad asks these helpers, so an upstream rename touches one file.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import PrimType, Type


def type_of(expr: relax.Expr) -> Type | None:
    """The checked type of ``expr`` (None when it has not been normalized)."""
    return getattr(expr, "ty", None)


def _as_type(expr_or_ty) -> Type:
    return expr_or_ty if isinstance(expr_or_ty, Type) else type_of(expr_or_ty)


def is_tensor(expr_or_ty) -> bool:
    ty = _as_type(expr_or_ty)
    return isinstance(ty, relax.TensorType)


def is_tuple(expr_or_ty) -> bool:
    ty = _as_type(expr_or_ty)
    return isinstance(ty, relax.TupleType)


def dtype_of(expr_or_ty) -> str:
    """The dtype string of a tensor expr or TensorType."""
    ty = _as_type(expr_or_ty)
    dtype = ty.dtype
    if isinstance(dtype, PrimType):
        dtype = dtype.dtype
    return str(dtype)


def shape_of(expr_or_ty) -> relax.ShapeExpr | None:
    """The ShapeExpr of a tensor expr or TensorType (None when the shape is unknown)."""
    ty = _as_type(expr_or_ty)
    return ty.shape


def shape_values(expr_or_ty) -> list:
    """The dims of a tensor (tirx PrimExprs) as a list; requires a known shape."""
    return list(shape_of(expr_or_ty).values)


def static_shape(expr_or_ty) -> tuple[int, ...]:
    """The dims as Python ints; raises TypeError on symbolic dims."""
    return tuple(int(v) for v in shape_values(expr_or_ty))


def ndim_of(expr_or_ty) -> int:
    """The rank of a tensor (-1 when unknown)."""
    ty = _as_type(expr_or_ty)
    return int(ty.ndim)


def is_float_dtype(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def is_float_tensor(expr_or_ty) -> bool:
    ty = _as_type(expr_or_ty)
    return isinstance(ty, relax.TensorType) and is_float_dtype(dtype_of(ty))


def is_scalar_tensor(expr_or_ty) -> bool:
    ty = _as_type(expr_or_ty)
    return isinstance(ty, relax.TensorType) and int(ty.ndim) == 0


def tuple_fields(expr_or_ty) -> list[Type]:
    ty = _as_type(expr_or_ty)
    return list(ty.fields)


def nested_all(ty: Type, pred) -> bool:
    """Whether every leaf of a (nested) tuple type satisfies ``pred``."""
    if isinstance(ty, relax.TupleType):
        return all(nested_all(f, pred) for f in ty.fields)
    return pred(ty)


# TVM 0.27 moved the constant node to tvm.ir; relax has no alias for it.
Constant = tvm.ir.Constant


def key(node) -> int:
    """A cheap identity key for an IR node, for dicts and sets.

    Python wrappers of the same node are distinct objects whose ``__eq__`` is slow (it checks
    for primitive-typed expressions), so hot maps key nodes by their C++ handle instead.
    """
    return node.__chandle__()
