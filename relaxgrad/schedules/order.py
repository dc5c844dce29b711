"""``FuseOps`` that emits each kernel where its last operation was (a Relax pass, CPU and GPU).

TVM 0.27's ``FuseOps`` emits a fused kernel at the place of the last binding of its group, but
first sorts the groups topologically by a depth-first walk that starts, for each group, at its
*first* binding and visits everything the group reads before it. A group whose bindings lie far
apart therefore drags all that its last binding waits for ahead of whatever came between. A
training step makes such groups: with mixed precision, a tied embedding's gradient is the LM
head's weight gradient rounded to bf16 and widened again (elementwise, right after the head's
product, at the start of the backward pass), then added to the embedding lookup's gradient (at
its end); the casts and the add fuse, so the whole data backward pass was emitted before every
parameter gradient between them, and each weight gradient's product ran after it, keeping the
output gradient it reads alive all the way (GPT-2 small's bf16 step on a CPU without bf16
units: 504 MiB of float32 conversions of those gradients alive at its peak).

:class:`FuseOpsInOrder` first moves each elementwise, broadcast or injective producer that has
one reader, itself such a kernel or a reduction (a kernel ``FuseOps`` fuses it into), to just
before that reader, chains whole, so that a group's bindings stand together where its last one
stood; then runs ``FuseOps``. The values are the same; only the order changes, and with it the
lifetimes the memory planner sees.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule

from .. import _ty
from .._module import with_functions
from ._common import (
    BROADCAST,
    COMM_REDUCE,
    ELEMWISE,
    INJECTIVE,
    op_patterns,
    with_dataflow_blocks,
)
from .duplicate import _pattern

__all__ = ["FuseOpsInOrder"]

_FUSES_INTO = {ELEMWISE: COMM_REDUCE, BROADCAST: COMM_REDUCE, INJECTIVE: INJECTIVE}
"""The widest ``op_pattern`` of a reader ``FuseOps`` fuses a producer of each pattern into
(TVM's ``GraphPartitioner``: elementwise and broadcast kernels into injective ones and
reductions, injective ones into injective ones only)."""


@tvm.transform.module_pass(opt_level=0, name="FuseOpsInOrder")
class FuseOpsInOrder:
    """Producers moved to their one fusing reader, then ``relax.transform.FuseOps()`` (see the
    module docstring). ``moved`` counts the bindings placed elsewhere in the last run."""

    def __init__(self):
        self.moved = 0

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        self.moved = 0
        patterns = op_patterns(mod)
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                rewritten = with_dataflow_blocks(
                    func, lambda bindings: self._sunk(bindings, patterns))
                if rewritten is not None:
                    updates[gvar] = rewritten
        return relax.transform.FuseOps()(with_functions(mod, updates))

    def _sunk(self, bindings: list, patterns: dict) -> list | None:
        order = sunk_order(bindings, patterns)
        if order is None:
            return None
        self.moved += sum(i != j for i, j in enumerate(order))
        return [bindings[i] for i in order]


def sunk_order(bindings: list, patterns: dict) -> list[int] | None:
    """The order of a dataflow block's ``bindings`` (indices) with each producer (see the
    module docstring) just before its reader, or None where none moves. ``patterns``: the
    ``op_pattern`` of each PrimFunc (:func:`op_patterns`)."""
    index = {_ty.key(b.var): i for i, b in enumerate(bindings)}
    users = relax.analysis.udchain(relax.DataflowBlock(bindings))  # (a dataflow var's: here)
    before: dict[int, list[int]] = {}  # reader -> the producers to emit just before it
    for i, binding in enumerate(bindings):
        pattern = _pattern(patterns, binding.value)
        var = binding.var
        if pattern not in _FUSES_INTO or not isinstance(var, relax.DataflowVar):
            continue
        readers = users.get(var, ())
        if len(readers) != 1:
            continue  # read twice
        j = index[_ty.key(readers[0])]
        reader_pattern = _pattern(patterns, bindings[j].value)
        if reader_pattern is not None and reader_pattern <= _FUSES_INTO[pattern]:
            before.setdefault(j, []).append(i)
    attached = {i for producers in before.values() for i in producers}
    order: list[int] = []
    for root in range(len(bindings)):
        if root in attached:
            continue
        stack = [(root, False)]  # each binding after its producers, theirs first (no recursion:
        while stack:  # a chain may be thousands of bindings long)
            i, expanded = stack.pop()
            if expanded:
                order.append(i)
            else:
                stack.append((i, True))
                stack.extend((p, False) for p in reversed(before.get(i, ())))
    return None if order == list(range(len(bindings))) else order
