"""Rules for relax.op.linear_algebra."""

from __future__ import annotations

import string

from tvm import relax
from tvm.relax.op import (
    astype,
    broadcast_to,
    einsum,
    expand_dims,
    matmul,
    permute_dims,
    reshape,
    squeeze,
)

from .. import _ty
from ..errors import GradientError
from ._utils import fit_shape, static_dims
from .registry import register_gradient


def _swap_last_two(tensor, ndim: int):
    return permute_dims(tensor, [i if i < ndim - 2 else 2 * ndim - 3 - i for i in range(ndim)])


def _matmul_partials(a, b, a_dim: int, b_dim: int, g, out_dtype=None):
    """``(da, db)`` of ``c = a @ b`` before broadcast reduction; 1-D operands get promoted.
    ``out_dtype``: the products' result dtype (None: the operands')."""

    def mm(x, y):
        return matmul(x, y, out_dtype=out_dtype)

    if a_dim > 1 and b_dim > 1:
        return mm(g, _swap_last_two(b, b_dim)), mm(_swap_last_two(a, a_dim), g)
    if a_dim == 1 and b_dim > 1:
        g2 = expand_dims(g, -2)
        return mm(g2, _swap_last_two(b, b_dim)), mm(expand_dims(a, 1), g2)
    if b_dim == 1 and a_dim > 1:
        g2 = expand_dims(g, -1)
        return mm(g2, expand_dims(b, 0)), squeeze(mm(_swap_last_two(a, a_dim), g2), [-1])
    if out_dtype is not None:
        g, a, b = astype(g, out_dtype), astype(a, out_dtype), astype(b, out_dtype)
    return g * b, g * a


@register_gradient("relax.matmul")
def matmul_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``c = matmul(a, b)``; backward: ``[g @ b^T, a^T @ g]`` (last two axes swapped,
    batch axes reduced). A product whose ``out_dtype`` widens its result (mixed precision:
    bfloat16 operands, a float32 result) has partials that read ``g`` in the operands' dtype
    and accumulate and reduce in the wide one, then round to the operands' dtype."""
    a, b = orig_call.args
    low, wide = _ty.dtype_of(a), _ty.dtype_of(output_grad)
    g = output_grad if wide == low else astype(output_grad, low)
    dims = len(_ty.shape_values(a)), len(_ty.shape_values(b))
    da, db = _matmul_partials(a, b, *dims, g, None if wide == low else wide)
    da, db = fit_shape(ctx, da, a), fit_shape(ctx, db, b)
    if wide == low:
        return [da, db]
    return [astype(da, low), astype(db, _ty.dtype_of(b))]


@register_gradient("relax.outer")
def outer_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``z = outer(x, y)``; backward: ``[g @ y, x @ g]``."""
    x, y = orig_call.args
    return [matmul(output_grad, y), matmul(x, output_grad)]


def _einsum_terms(subscripts: str, shapes: list[tuple[int, ...]]):
    """The letters of each operand and of the result of einsum ``subscripts``, with "..." and
    the implicit result spelled out, and each size-1 dim broadcast against a larger one renamed
    to a letter of its own (so it is summed, not matched)."""
    spec = subscripts.replace(" ", "")
    lhs, out = spec.split("->") if "->" in spec else (spec, None)
    fresh = (c for c in string.ascii_letters if c not in spec)
    ell_rank = max((len(s) - len(t) + 3 for t, s in zip(lhs.split(","), shapes) if "..." in t),
                   default=0)  # fmt: skip
    ell = [next(fresh) for _ in range(ell_rank)]

    def spell(term: str, ndim: int) -> list[str]:
        head, dots, tail = term.partition("...")
        return (
            list(head)
            + (ell[ell_rank - (ndim - len(head) - len(tail)) :] if dots else [])
            + list(tail)
        )

    terms = [spell(t, len(s)) for t, s in zip(lhs.split(","), shapes)]
    if out is None:  # numpy's implicit result: the "..." dims, then the letters used once
        once = sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1)
        out_terms = ell + once
    else:
        out_terms = spell(out, ell_rank + len(out.replace("...", "")))
    sizes = {}
    for term, shape in zip(terms, shapes):
        for c, d in zip(term, shape):
            sizes[c] = max(sizes.get(c, 1), d)
    terms = [[next(fresh) if d == 1 and sizes[c] > 1 else c for c, d in zip(term, shape)]
             for term, shape in zip(terms, shapes)]  # fmt: skip
    return terms, out_terms


def _einsum_operand_grad(g, operands, terms, out_terms, i, shape):
    """The partial of ``einsum(operands)`` for operand ``i``: g contracted with the other
    operands onto the letters of operand ``i``; letters only operand ``i`` has (summed in the
    forward) are broadcast back."""
    term = terms[i]
    if len(set(term)) != len(term):
        raise GradientError(
            f"Gradient: relax.einsum has no gradient rule for a repeated index within an operand "
            f"({''.join(term)}, a diagonal)"
        )
    others = [j for j in range(len(terms)) if j != i]
    reach = [c for c in term if c in out_terms or any(c in terms[j] for j in others)]
    spec = ",".join(["".join(out_terms)] + ["".join(terms[j]) for j in others])
    grad = einsum([g] + [operands[j] for j in others], f"{spec}->{''.join(reach)}")
    if len(reach) != len(term):
        grad = reshape(grad, [d if c in reach else 1 for c, d in zip(term, shape)])
        grad = broadcast_to(grad, shape)
    return grad


@register_gradient("relax.einsum")
def einsum_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = einsum((x1, ..., xn), subscripts)``; backward: for each ``xi``,
    ``einsum((g, x1, .., xn without xi), "<y>,<others>-><xi>")``, broadcast over the letters
    only ``xi`` has."""
    tup = orig_call.args[0]
    types = _ty.tuple_fields(tup)
    shapes = [static_dims(t, "relax.einsum") for t in types]
    if isinstance(tup, relax.Tuple):
        operands = list(tup.fields)
    else:
        operands = [relax.TupleGetItem(tup, i) for i in range(len(types))]
    terms, out_terms = _einsum_terms(str(orig_call.attrs.subscripts), shapes)
    grads = [
        _einsum_operand_grad(output_grad, operands, terms, out_terms, i, list(shape))
        for i, shape in enumerate(shapes)
    ]
    return [relax.Tuple(grads)]
