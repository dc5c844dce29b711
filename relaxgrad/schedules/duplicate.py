"""Cheap elementwise producers recomputed in each consumer's kernel, a Relax rewrite between
``AnnotateTIROpPattern`` and ``FuseOps`` (CPU).

``FuseOps`` fuses a producer into its consumer only when the consumer is the producer's sole
reader. An adjoint often reads a forward value twice: ``t = x + bias`` feeds ``relu(t)`` in the
forward part and ``where(t < 0, 0, g)`` in the backward one, so ``t`` is written to memory and
read back, and ``relu`` runs as a kernel of its own; a normalization's gradient reads
``c = x - mean`` in two reductions and an elementwise kernel. :class:`DuplicateCheapProducers`
gives each further reader (elementwise, injective or a reduction, all of which fuse their
elementwise producers) its own copy of such a producer (an elementwise or broadcast PrimFunc
with one operand of the result's size, the others smaller): each copy fuses into its reader,
and ``x`` is kept instead of ``t`` (the same size), so the memory does not grow. A copy reads
its producer's operands, so one of them that is itself such a producer gains a reader; rounds
repeat until none is copied (batch norm's gradient: ``c * rstd`` copied, then ``c``).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._common import static_shape

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_FUSABLE = 3  # relax's OpPatternKind up to kCommReduce: elementwise, broadcast, injective, reduce


@tvm.transform.module_pass(opt_level=0, name="DuplicateCheapProducers")
class DuplicateCheapProducers:
    """Copy a cheap elementwise producer for each of its readers after the first (see the
    module docstring)."""

    def __init__(self, max_rounds: int = 4):
        self.max_rounds = max_rounds

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        # A copy reads its producer's operands: when one of them is itself a cheap producer, it
        # has a reader more, which the next round gives a copy of its own (``c = x - mean``
        # read by the copies of ``c * rstd`` in a batch norm's gradient).
        todo = None  # the functions a round rewrites: all, then those the last one changed
        for _ in range(self.max_rounds):
            rewriter, changed = _Rewriter(mod), set()
            for gvar, func in mod.functions_items():
                if isinstance(func, relax.Function) and (todo is None or gvar in todo):
                    copies = rewriter.copies
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
                    if rewriter.copies > copies:
                        changed.add(gvar)
            mod = rewriter.builder_.get()
            if not changed:
                break
            todo = changed
        return mod


def _patterns(mod: IRModule) -> dict:
    """The ``op_pattern`` of each PrimFunc of ``mod`` that has one, by its GlobalVar."""
    patterns = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs and "op_pattern" in func.attrs:
            patterns[gvar] = int(func.attrs["op_pattern"])
    return patterns


def _pattern(patterns: dict, call) -> int | None:
    """The ``op_pattern`` of the PrimFunc ``call`` runs through ``call_tir``, else None."""
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
        return None
    return patterns.get(call.args[0])


def _size(expr) -> int | None:
    shape = static_shape(expr)
    return None if shape is None else math.prod(shape)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.patterns = _patterns(mod)
        self.cheap: dict = {}  # producer var -> its call, for the producers worth copying
        self.seen: set = set()  # producers whose first reader has been emitted
        self.copies = 0

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.cheap, self.seen = self._cheap_producers(func), set()
        if not self.cheap:
            return func  # nothing to copy: no need to rebuild it binding by binding
        return super().visit_function_(func)

    def _cheap_producers(self, func: relax.Function) -> dict:
        if not isinstance(func.body, relax.SeqExpr):
            return {}
        bindings = [b for block in func.body.blocks
                    if isinstance(block, relax.DataflowBlock) for b in block.bindings]  # fmt: skip
        readers: dict = {}
        for b in bindings:
            value = b.value
            if _pattern(self.patterns, value) is not None:
                for arg in set(value.args[1]):  # a reader of one var twice (c * c) once
                    readers.setdefault(arg, []).append(b)
        read_anywhere: dict = {}  # the reads of each var by bindings (a call reads it once)
        for b in bindings:
            for var in relax.analysis.free_vars(b.value):
                read_anywhere[var] = read_anywhere.get(var, 0) + 1
        for var in relax.analysis.free_vars(func.body.body):  # the function's result
            read_anywhere[var] = read_anywhere.get(var, 0) + 1
        cheap, known = {}, {}

        def size_of(expr):  # each var's size once (static_shape is slow-ish in Python)
            if expr not in known:
                known[expr] = _size(expr)
            return known[expr]

        for b in bindings:
            pattern = _pattern(self.patterns, b.value)
            if pattern is None or pattern > 1 or not isinstance(b.var, relax.DataflowVar):
                continue
            size = size_of(b.var)
            args = list(b.value.args[1])
            sizes = [size_of(a) for a in args]
            if size is None or None in sizes or sum(s == size for s in sizes) != 1:
                continue
            if any(s > size for s in sizes):
                continue
            users = readers.get(b.var, [])
            if len(users) < 2 or read_anywhere.get(b.var, 0) != len(users):
                continue  # read by something other than call_tir, e.g. a tuple or the output
            patterns = [_pattern(self.patterns, u.value) for u in users]
            if all(p is not None and p <= _FUSABLE for p in patterns):
                cheap[b.var] = b.value
        return cheap

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if _pattern(self.patterns, value) is None or not self.cheap:
            return super().visit_var_binding_(binding)
        args = list(value.args[1])
        copies = {}
        for arg in dict.fromkeys(args):  # each var once, in order
            if arg in self.cheap:
                if arg in self.seen:
                    copies[arg] = self.builder_.emit(self.visit_expr(self.cheap[arg]), "dup")
                    self.copies += 1
                self.seen.add(arg)
        if not copies:
            return super().visit_var_binding_(binding)
        args = [copies.get(arg, arg) for arg in args]
        operands = relax.Tuple([self.visit_expr(a) for a in args])
        new_value = relax.Call(value.op, [value.args[0], operands, *value.args[2:]],
                               value.attrs, value.ty_args)  # fmt: skip
        return super().visit_var_binding_(relax.VarBinding(binding.var, new_value))
