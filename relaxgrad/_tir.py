"""TIR expression helpers shared by gradient rules and schedules."""

from __future__ import annotations

from tvm import tirx


def guarded(data, indices, inside, fill=0):
    """``data[indices]`` where ``inside``, else ``fill``, reading ``data`` in bounds whatever
    ``indices`` are: the read is at the indices clamped into the buffer's shape.

    Not ``Select(inside, data[clamped], fill)``: TVM's simplifier, which knows ``inside`` in a
    select's first operand, drops the clamps there, and a select evaluates both operands, so
    the kernel would read past the buffer (a segfault where it ends at a page). The read is
    bound by a ``Let`` outside the select instead (:func:`selected`), which keeps its clamps."""
    clamped = [tirx.max(tirx.min(i, int(e) - 1), 0) for i, e in zip(indices, data.shape)]
    return selected(data[tuple(clamped)], inside, fill)


def selected(read, inside, fill=0):
    """``read`` (a buffer read at indices in bounds) where ``inside``, else ``fill``, with the
    read bound outside the select, so that the simplifier keeps its indices (see
    :func:`guarded`)."""
    if read.dtype == "bfloat16":
        # TVM's bf16 legalization (bf16 computed in float32) cannot take a Let of bf16: a
        # branch instead, which reads only where ``inside`` holds
        return tirx.if_then_else(inside, read, tirx.const(fill, read.dtype))
    value = tirx.Var("v", read.dtype)
    return tirx.Let(value, read, tirx.Select(inside, value, tirx.const(fill, read.dtype)))
