"""``relax.concat`` as one copy loop nest per part (CPU).

TVM legalizes ``concat`` into one loop nest over the result whose every element picks its part
with a chain of ``if_then_else`` on the concatenated axis. Fused, split and vectorized over the
flattened result, a vector may straddle two parts, so LLVM gathers every part's lanes and
blends them: the concatenation of three 768 x 768 weights (the gemm of an attention's q, k and
v gradients, :class:`~relaxgrad.schedules.blas.MatmulToBLAS`) took 0.31 ms, 25 GB/s.

:func:`legalize_concat` builds, for static shapes, a PrimFunc with one block per part, each
copying its part into its slice of the result over loops from 0: each block's loops fuse,
vectorize and run in parallel (:class:`~relaxgrad.schedules.cpu.ParallelLoops`) as a plain
copy (0.08 ms there).
"""

from __future__ import annotations

import math

from tvm import relax, tirx
from tvm.ir import Op
from tvm.script import tirx as T

from ._common import INJECTIVE, parsed_text, static_shape


def concat_func(shapes: list[list[int]], axis: int, dtype: str) -> tirx.PrimFunc:
    """The PrimFunc ``(p_0, ..., p_n, out)`` of ``concat`` along ``axis`` of parts of
    ``shapes``: a block per non-empty part (int64 shapes and indices, as TVM's legalizations
    have, so that ``FuseTIR`` maps its buffers onto theirs). Parsed once per kind: a model
    concatenates the same shapes in every layer (a rotary embedding's halves), and parsing
    took 0.1 s a call (4.4 s of a 24-layer Qwen2's compile)."""
    out_shape = list(shapes[0])
    out_shape[axis] = sum(shape[axis] for shape in shapes)

    def i64(values) -> str:
        return ", ".join(f"T.int64({v})" for v in values)

    params = [f"p{i}: T.Buffer(({i64(shape)},), '{dtype}')" for i, shape in enumerate(shapes)]
    lines = [
        "@T.prim_func(s_tir=True)",
        f"def concat({', '.join(params)}, out: T.Buffer(({i64(out_shape)},), '{dtype}')):",
        '    T.func_attr({"tirx.noalias": True, "op_pattern": INJECTIVE})',
    ]
    ndim, offset = len(out_shape), 0
    loops = ", ".join(f"i{d}" for d in range(ndim))
    iters = ", ".join(f"v{d}" for d in range(ndim))
    for i, shape in enumerate(shapes):
        if 0 not in shape:
            target = ", ".join(
                f"v{d} + T.int64({offset})" if d == axis else f"v{d}" for d in range(ndim)
            )
            lines += [
                f"    for {loops} in T.grid({i64(shape)}):",
                f"        with T.sblock('part{i}'):",
                f"            {iters} = T.axis.remap('{'S' * ndim}', [{loops}])",
                f"            out[{target}] = p{i}[{iters}]",
            ]
        offset += shape[axis]
    extra = {"T": T, "INJECTIVE": INJECTIVE}
    return parsed_text("\n".join(lines) + "\n", extra)


_MIN_ELEMENTS = 1 << 18  # results from which the copies pay for their PrimFunc's parsing


def legalize_concat(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``concat``'s legalization: :func:`concat_func` for a tuple of static shapes whose
    result has at least ``_MIN_ELEMENTS``, else TVM's (a small concatenation, as a rotary
    embedding's halves in a tiny model, runs in microseconds either way, and parsing a
    PrimFunc per kind of them cost Mistral's compile 0.4 s)."""
    fields = call.args[0]
    shapes = [static_shape(f) for f in fields.fields] if isinstance(fields, relax.Tuple) else []
    out_shape = static_shape(call)
    flat = call.attrs.axis is None  # the parts flattened first
    static = shapes and all(s for s in shapes) and out_shape is not None
    if flat or not static or math.prod(out_shape) < _MIN_ELEMENTS:
        return Op.get("relax.concat").get_attr("FLegalize")(bb, call)
    axis = int(call.attrs.axis) % len(out_shape)
    dtype = call.ty.dtype
    gvar = bb.add_func(concat_func(shapes, axis, dtype), "concatenate")
    return relax.call_tir(gvar, list(fields.fields), relax.TensorType(out_shape, dtype))
