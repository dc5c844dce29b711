"""Keyed random numbers: Philox 4x32-10 in TE, and the dropout built on it.

Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011; the
generator of Random123, cuRAND and JAX) maps a 128-bit counter and a 64-bit key to 128 random
bits with ten rounds of 32-bit multiplies and xors. It has no state: the bits of element ``i``
are a pure function of ``(key, i, site)``, so a value recomputed for the backward pass (a
checkpoint, split mode) gets the same mask as the forward pass without saving it.

The key is a ``(2,)`` ``uint32`` tensor, an input of the function (:data:`KEY_TYPE`); each
dropout site of a function has its own stream (the site index is counter word 2). Element
``i`` (row-major over the shape) takes word ``i % 4`` of the block with counter
``(i // 4, 0, site, 0)`` (so a tensor has at most ``2**34`` elements), and is kept when its top
24 bits, as a fraction of ``2**24``, are at least the dropout rate.

A checkpoint policy may recompute a mask rather than keep it (it needs only the key), and split
mode always does (:data:`MASK_ATTR`): its residual is the 8-byte key, not the mask.

No gradient rule is needed: the mask is a ``call_tir`` of the key alone, and ``where``'s rule
gives its condition no gradient, so the backward of ``where(keep, x * scale, 0)`` is
``where(keep, g * scale, 0)`` with the same ``keep``.
"""

from __future__ import annotations

import functools
import math

from tvm import relax, te, tirx
from tvm.ir import Op
from tvm.relax import BlockBuilder, Expr

from .. import _ty
from ..errors import GradientError

__all__ = [
    "KEY_TYPE", "MASK_ATTR", "bernoulli", "dropout", "is_key", "is_mask", "keep_mask",
    "philox4x32",
]

#: The type of a key: two ``uint32`` words.
KEY_TYPE = relax.TensorType((2,), "uint32")

_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_W = (0x9E3779B9, 0xBB67AE85)  # key schedule (Weyl) increments
_ROUNDS = 10
#: Attribute of the PrimFuncs that draw masks: split mode recomputes a mask from its key instead
#: of keeping it for the backward pass (it saves the key, not the mask).
MASK_ATTR = "relaxgrad.random_mask"
_BITS = 24  # random bits per element compared with the rate
_CALL_TIR = Op.get("relax.call_tir")


def _u32(value: int) -> tirx.PrimExpr:
    return tirx.const(value & 0xFFFFFFFF, "uint32")


def _u64(value: int) -> tirx.PrimExpr:
    return tirx.const(value, "uint64")


def philox4x32(counter, key, finish, rounds: int = _ROUNDS) -> tirx.PrimExpr:
    """``finish(words)`` of the Philox 4x32 output of ``counter`` under ``key`` (TIR).

    Parameters
    ----------
    counter : sequence of 4 uint32 PrimExprs
        The counter.
    key : sequence of 2 uint32 PrimExprs
        The key.
    finish : callable
        Maps the 4 output words (uint32 vars) to the expression to return.
    rounds : int
        Number of rounds (10 for Philox 4x32-10).

    Returns
    -------
    PrimExpr
        ``finish``'s expression inside the ``Let`` bindings of the rounds (each word is bound
        once, so the expression grows linearly with ``rounds``).
    """

    def mulhilo(multiplier: int, word, name: str):
        product = tirx.Var(name, "uint64")
        value = _u64(multiplier) * word.astype("uint64")
        hi = (product >> _u64(32)).astype("uint32")
        lo = (product & _u64(0xFFFFFFFF)).astype("uint32")  # (a bare cast trips TVM's bounds)
        return product, value, hi, lo

    def step(r: int, words: list) -> tirx.PrimExpr:
        if r == rounds:
            return finish(words)
        k0 = key[0] + _u32(r * _W[0]) if r else key[0]
        k1 = key[1] + _u32(r * _W[1]) if r else key[1]
        p0, v0, hi0, lo0 = mulhilo(_M[0], words[0], f"p{r}_0")
        p1, v1, hi1, lo1 = mulhilo(_M[1], words[2], f"p{r}_1")
        new = [hi1 ^ words[1] ^ k0, lo1, hi0 ^ words[3] ^ k1, lo0]
        names = [tirx.Var(f"c{r}_{i}", "uint32") for i in range(4)]
        body = step(r + 1, names)
        for var, value in reversed(list(zip(names, new))):
            body = tirx.Let(var, value, body)
        return tirx.Let(p0, v0, tirx.Let(p1, v1, body))

    return step(0, list(counter))


def keep_mask(key: te.Tensor, shape, rate: float, site: int = 0) -> te.Tensor:
    """TE: a bool tensor of ``shape``, each element True with probability ``1 - rate`` (its top
    24 random bits as a fraction of ``2**24`` are at least ``rate``)."""
    threshold = _u32(math.ceil(rate * 2**_BITS))

    def keep(word):
        return (word >> _u32(32 - _BITS)) >= threshold

    return te.compute(shape, lambda *idx: _element_bits(key, shape, idx, site, keep),
                      name="keep")


def _element_bits(key: te.Tensor, shape, idx, site: int, finish) -> tirx.PrimExpr:
    """``finish`` of element ``idx``'s word of the Philox stream of ``(key, site)``."""
    flat = functools.reduce(
        lambda acc, pair: acc * pair[1].astype("int64") + pair[0].astype("int64"),
        zip(idx, shape), tirx.const(0, "int64"))
    block, lane = flat // 4, flat % 4
    counter = [block.astype("uint32"), _u32(0), _u32(site), _u32(0)]

    def select(words):
        value = words[3]
        for i in (2, 1, 0):
            value = tirx.Select(lane == i, words[i], value)
        return finish(value)

    return philox4x32(counter, [key[0], key[1]], select)


def is_key(expr_or_ty) -> bool:
    """Whether an expr or type is a key: a ``(2,)`` uint32 tensor (:data:`KEY_TYPE`)."""
    if not _ty.is_tensor(expr_or_ty) or _ty.dtype_of(expr_or_ty) != "uint32" \
            or _ty.shape_of(expr_or_ty) is None:
        return False
    dims = _ty.shape_values(expr_or_ty)
    return len(dims) == 1 and isinstance(dims[0], tirx.IntImm) and int(dims[0]) == 2


def _check(x: Expr, key: Expr, rate: float, what: str) -> None:
    if not is_key(key):
        raise GradientError(f"{what}: the key must be a (2,) uint32 tensor, not "
                            f"{_ty.type_of(key)}")
    if not _ty.is_float_tensor(x) or _ty.shape_of(x) is None:
        raise GradientError(f"{what}: x must be a float tensor of known shape, not "
                            f"{_ty.type_of(x)}")
    dims = _ty.shape_values(x)
    if all(isinstance(d, tirx.IntImm) for d in dims) and math.prod(int(d) for d in dims) > 2**34:
        raise GradientError(f"{what}: a mask has at most 2**34 elements, not {dims}")
    if not 0.0 <= float(rate) <= 1.0:
        raise GradientError(f"{what}: the rate must be in [0, 1], not {rate}")


def bernoulli(bb: BlockBuilder, like: Expr, key: Expr, prob: float, site: int = 0) -> Expr:
    """Emit a bool tensor of ``like``'s shape, each element True with probability ``prob``
    (``torch.bernoulli(like, prob)`` as a mask), from stream ``site`` of ``key``."""
    like, key = bb.normalize(like), bb.normalize(key)
    _check(like, key, 1.0 - prob, "bernoulli")
    shape = _ty.shape_values(like)
    keep = bb.emit_te(keep_mask, key, shape, 1.0 - prob, site, primfunc_name_hint="philox_keep")
    gv = bb.lookup_binding(keep).args[0]
    bb.update_func(gv, bb.get()[gv].with_attr(MASK_ATTR, True))
    return keep


def is_mask(value: Expr, mod) -> bool:
    """Whether ``value`` calls a PrimFunc of ``mod`` that draws a random mask (a pure function
    of its key, cheap to recompute)."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
        return False
    func = mod.functions.get(value.args[0])
    return func is not None and bool((func.attrs or {}).get(MASK_ATTR, False))


def dropout(
    bb: BlockBuilder, x: Expr, key: Expr, rate: float, site: int = 0
) -> tuple[Expr, Expr]:
    """Emit the dropout of ``x``: ``where(keep, x / (1 - rate), 0)``, ``keep`` drawn from
    stream ``site`` of ``key`` (:func:`keep_mask`).

    Parameters
    ----------
    bb : relax.BlockBuilder
        The builder, inside a function (the mask's PrimFunc is added to its module).
    x : relax.Expr
        A float tensor of known rank.
    key : relax.Expr
        A ``(2,)`` ``uint32`` tensor (:data:`KEY_TYPE`), e.g. a parameter of the function;
        a new key gives a new mask.
    rate : float
        The probability of dropping an element, in ``[0, 1]``.
    site : int
        The stream of this dropout: give each dropout of a function its own.

    Returns
    -------
    (relax.Expr, relax.Expr)
        ``(y, keep)``: the result (not yet emitted) and the emitted bool mask.

    Raises
    ------
    GradientError
        If ``key`` is not a ``(2,)`` uint32 tensor, ``x`` not a float tensor of known shape,
        or ``rate`` not in ``[0, 1]``.
    """
    x, key = bb.normalize(x), bb.normalize(key)
    _check(x, key, rate, "dropout")
    dtype = _ty.dtype_of(x)
    zero = relax.const(0, dtype)
    if rate >= 1.0:
        return relax.op.zeros_like(x), bb.emit(relax.op.zeros(_ty.shape_of(x), "bool"))
    keep = bernoulli(bb, x, key, 1.0 - rate, site)
    scaled = x if rate == 0.0 else x * relax.const(1.0 / (1.0 - rate), dtype)
    return relax.op.where(keep, scaled, zero), keep
