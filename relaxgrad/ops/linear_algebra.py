"""Rules for relax.op.linear_algebra."""

from __future__ import annotations

from tvm.relax.op import expand_dims, matmul, permute_dims, squeeze

from .. import _ty
from ._utils import fit_shape
from .registry import register_gradient


def _swap_last_two(tensor, ndim: int):
    return permute_dims(tensor, [i if i < ndim - 2 else 2 * ndim - 3 - i for i in range(ndim)])


def _matmul_partials(a, b, a_dim: int, b_dim: int, g):
    """``(da, db)`` of ``c = a @ b`` before broadcast reduction; 1-D operands get promoted."""
    if a_dim > 1 and b_dim > 1:
        return matmul(g, _swap_last_two(b, b_dim)), matmul(_swap_last_two(a, a_dim), g)
    if a_dim == 1 and b_dim > 1:
        g2 = expand_dims(g, -2)
        return matmul(g2, _swap_last_two(b, b_dim)), matmul(expand_dims(a, 1), g2)
    if b_dim == 1 and a_dim > 1:
        g2 = expand_dims(g, -1)
        return matmul(g2, expand_dims(b, 0)), squeeze(matmul(_swap_last_two(a, a_dim), g2), [-1])
    return g * b, g * a


@register_gradient("relax.matmul")
def matmul_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``c = matmul(a, b)``; backward: ``[g @ b^T, a^T @ g]`` (last two axes swapped,
    batch axes reduced)."""
    a, b = orig_call.args
    da, db = _matmul_partials(a, b, len(_ty.shape_values(a)), len(_ty.shape_values(b)), output_grad)
    return [fit_shape(ctx, da, a), fit_shape(ctx, db, b)]
