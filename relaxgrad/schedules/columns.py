"""Column sums computed with the elementwise kernel that produces their input (CPU).

A bias gradient is a sum over the rows, ``collapse_sum_to(g, (N,))`` of a ``g`` of shape
``(..., N)``, and ``g`` is often computed by an elementwise kernel that other kernels read too
(relu's gradient ``where(x < 0, 0, dy)``, read by the weight and input gradients' gemms).
``FuseOps`` cannot fuse a function with two readers into one of them, so the sum is a kernel
of its own that reads ``g`` back from memory: in a transformer's feed-forward layer, 0.4 ms
for a gradient of 8 MiB, a third of what computing it costs. Two steps fix that:

- :class:`FuseColumnSums` (after ``FuseOps``) moves such a sum into the fused function that
  computes ``g``, which then returns ``(g, sum)``;
- :class:`ColumnLocal` (a schedule rule, tried before ``ParallelLoops``) splits the rows of
  such a function over the threads: each computes its rows of ``g`` and adds each row, still in
  cache, to a partial sum of its own, and the few partial sums are added at the end.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.base import get_extent
from tvm.target import Target

from ._common import (
    COMM_REDUCE,
    INJECTIVE,
    REDUCE,
    SPATIAL,
    bound_values,
    is_one,
    is_op,
    read_counts,
    rebind,
    rewrite_functions,
    sblocks,
    static_shape,
)
from .blas import THREADS
from .cpu import _cpu_blocks, _tile, _vector_lanes
from .rows import _reduces


@tvm.transform.module_pass(opt_level=0, name="FuseColumnSums")
class FuseColumnSums:
    """After ``FuseOps``: a kernel that sums a tensor over its leading axes, whose input an
    elementwise fused function computes for other readers too, becomes part of that function,
    which returns both (see the module docstring). Sums over at least ``min_rows`` rows."""

    def __init__(self, min_rows: int = 64):
        self.min_rows = min_rows

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Merger(mod, self.min_rows), mod)


@mutator
class _Merger(PyExprMutator):
    def __init__(self, mod: IRModule, min_rows: int):
        super().__init__(mod)
        self.mod, self.min_rows = mod, min_rows
        self.sums: dict = {}  # summed var -> (the var bound to its sum, the sum's call)
        self.pending: dict = {}  # column-sum var -> the merged call's var

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if func.attrs is not None and func.attrs.get("Primitive", False):
            return func
        self.sums, self.pending = {}, {}
        uses, values = read_counts(func), bound_values(func)
        for block in func.body.blocks if isinstance(func.body, relax.SeqExpr) else []:
            if not isinstance(block, relax.DataflowBlock):
                continue
            here = {b.var for b in block.bindings}
            for binding in block.bindings:
                g = self._summed(binding.value)
                if g is None or g not in here or g in self.sums or uses.get(g, 0) < 2:
                    continue
                if self._elementwise(values.get(g)):
                    self.sums[g] = (binding.var, binding.value)
        if not self.sums:
            return func  # nothing to merge: no need to rebuild it binding by binding
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.pending:
            rebind(self, binding.var, relax.TupleGetItem(self.pending.pop(binding.var), 1))
            return None
        if binding.var not in self.sums:
            return super().visit_var_binding_(binding)
        total, total_call = self.sums[binding.var]
        value = binding.value
        merged = _merged(self.mod[value.op], total_call, self.mod)
        summed = total_call.args[0] if _is_call_tir(total_call) else total_call.op
        name = f"{value.op.name_hint}_{summed.name_hint}"
        args = [self.visit_expr(a) for a in value.args]
        call = relax.Call(self.builder_.add_func(merged, name), args)
        both = self.builder_.emit(call, f"{binding.var.name}_and_sum")
        rebind(self, binding.var, relax.TupleGetItem(both, 0))
        self.pending[total] = both
        return None

    def _summed(self, value) -> relax.Var | None:
        """``g`` of ``call_tir(sum, (g,))``, a sum of ``g`` over its leading axes, or of a call
        of a fused function that casts ``g`` and sums the cast (a float32 sum accumulated in
        float64, :class:`~relaxgrad.schedules.WideColumnSums`)."""
        chain = _column_sum_chain(self.mod, value)
        if chain is None:
            return None
        g, func = chain
        shape = static_shape(g)
        if not isinstance(g, relax.Var) or shape is None:
            return None
        kept = _column_sum(func, len(shape))
        if kept is None or math.prod(shape[: len(shape) - kept]) < self.min_rows:
            return None
        return g

    def _elementwise(self, value) -> bool:
        """Whether ``value`` calls a fused function of elementwise kernels only, one dataflow
        block returning one var."""
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.GlobalVar):
            return False
        callee = self.mod[value.op]
        if not isinstance(callee, relax.Function) or callee.attrs is None:
            return False
        body = callee.body
        if not callee.attrs.get("Primitive", False) or not isinstance(body, relax.SeqExpr):
            return False
        if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
            return False
        if not isinstance(body.body, relax.Var):
            return False
        return all(
            _is_call_tir(b.value) and _pattern(self.mod[b.value.args[0]]) <= INJECTIVE
            for b in body.blocks[0].bindings
        )


def _merged(producer: relax.Function, total: relax.Call, mod: IRModule) -> relax.Function:
    """``producer`` (a fused function) returning ``(g, total(g))`` instead of ``g``; ``total``
    a ``call_tir`` of ``g`` or a call of a fused function of ``g`` (its bindings are copied)."""
    func = relax.utils.copy_with_new_vars(producer)
    *blocks, last = func.body.blocks
    g = func.body.body
    if _is_call_tir(total):
        steps = [(total, total.ty)]
    else:
        callee = relax.utils.copy_with_new_vars(mod[total.op])
        bindings = callee.body.blocks[0].bindings
        steps = [(b.value, b.var.ty) for b in bindings]
    bindings, current = list(last.bindings), g
    for call, ty in steps:
        var = relax.Var("sum", ty)
        value = relax.Call(call.op, [call.args[0], relax.Tuple([current])], call.attrs,
                           call.ty_args)  # fmt: skip
        bindings.append(relax.VarBinding(var, value))
        current = var
    block = relax.DataflowBlock(bindings)
    body = relax.SeqExpr([*blocks, block], relax.Tuple([g, current]))
    ret = relax.TupleType([g.ty, current.ty])
    return relax.Function(func.params, body, ret, func.is_pure, func.attrs)


def _column_sum_chain(mod: IRModule, value) -> tuple | None:
    """``(g, the column sum's PrimFunc)`` of ``call_tir(sum, (g,))``, or of a call of a fused
    function ``(g) -> sum(cast(g))``: elementwise single-operand kernels, then the sum."""
    if _is_call_tir(value):
        args = value.args[1]
        if not isinstance(args, relax.Tuple) or len(args.fields) != 1:
            return None
        func = mod[value.args[0]]
        return (args.fields[0], func) if isinstance(func, tirx.PrimFunc) else None
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.GlobalVar):
        return None
    callee = mod[value.op]
    if not isinstance(callee, relax.Function) or len(callee.params) != 1 or len(value.args) != 1:
        return None
    body = callee.body
    if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1:
        return None
    bindings, current = body.blocks[0].bindings, callee.params[0]
    for binding in bindings:
        call = binding.value
        if not _is_call_tir(call) or not isinstance(call.args[1], relax.Tuple):
            return None
        if len(call.args[1].fields) != 1 or not call.args[1].fields[0].same_as(current):
            return None
        current = binding.var
    if not body.body.same_as(current) or not bindings:
        return None
    *casts, last = bindings
    if any(_pattern(mod[b.value.args[0]]) > INJECTIVE for b in casts):
        return None
    func = mod[last.value.args[0]]
    return (value.args[0], func) if isinstance(func, tirx.PrimFunc) else None


def _is_call_tir(value) -> bool:
    return is_op(value, tvm.ir.Op.get("relax.call_tir"))


def _pattern(func) -> int:
    """The ``op_pattern`` of a PrimFunc (opaque if unknown or not a PrimFunc)."""
    attrs = func.attrs if isinstance(func, tirx.PrimFunc) else None
    return int(attrs.get("op_pattern", 8)) if attrs is not None else 8


def _column_sum(func: tirx.PrimFunc, ndim: int) -> int | None:
    """How many trailing axes ``func`` keeps when it sums its ``ndim``-D input over the
    leading ones (``out[j...] = sum_i in[i..., j...]``, one block), else None."""
    blocks = sblocks(func)
    if len(blocks) != 1 or _pattern(func) != COMM_REDUCE:
        return None
    block, store = blocks[0], blocks[0].body
    if len(block.writes) != 1 or block.init is None or not isinstance(store, tirx.BufferStore):
        return None
    if not isinstance(store.value, tirx.Add):
        return None
    kept = _column_sum_block(block)
    if kept is None or len(block.reads[0].region) != ndim:
        return None
    spatial = [i for i in block.iter_vars if int(i.iter_type) == SPATIAL]
    write = block.writes[0].region
    return kept if all(w.min.same_as(i.var) for w, i in zip(write, spatial)) else None


class ColumnLocal(ScheduleRule):
    """A CPU function of elementwise blocks over ``(rows..., columns...)`` whose last block
    sums the last of them over the rows (what :class:`FuseColumnSums` makes): the rows are
    split over the threads, each computing its rows with every block and adding them into a
    partial sum of its own, vectorized along the columns; the partial sums are added last."""

    def __init__(self, min_rows: int = 64, tasks: int | None = None):
        self.min_rows = min_rows
        self.tasks = tasks

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = _cpu_blocks(func, target, least=2, reducing=True)
        if len(infos) < 2 or infos[-1].is_injective():
            return None
        if not all(info.is_injective() for info in infos[:-1]):
            return None
        total = sch.get(infos[-1].block_rv)
        kept = _column_sum_block(total)
        if kept is None:
            return None
        dom = _static(infos[-2].dom())
        if dom is None or len(dom) != len(total.reads[0].region):
            return None
        if any(_static(info.dom()) != dom for info in infos[:-2]):
            return None  # computed per row, a block of other extents would be redundant
        rows = math.prod(dom[: len(dom) - kept])
        if rows < self.min_rows or not total.reads[0].source.same_as(
            sch.get(infos[-2].block_rv).writes[0].source
        ):
            return None
        tasks = _tile(rows, self.tasks or THREADS)
        if rows % tasks:
            return None
        try:
            self._schedule(sch, infos, len(dom) - kept, tasks, target)
        except (s_tir.ScheduleError, tvm.error.InternalError):
            return None
        return sch

    def _schedule(self, sch: s_tir.Schedule, infos, depth: int, tasks: int, target) -> None:
        lanes = _vector_lanes(target, sch.get(infos[-1].block_rv).writes[0].source.dtype)
        total = infos[-1].block_rv
        loops = sch.get_loops(total)
        kept = [loop for loop in loops if not _reduces(sch, total, loop)]
        summed = [loop for loop in loops if _reduces(sch, total, loop)]
        sch.reorder(*summed, *kept)
        row = sch.fuse(*summed) if depth > 1 else summed[0]
        outer, _ = sch.split(row, [tasks, None])
        partial = sch.rfactor(outer, factor_axis=0)
        # The last elementwise block's rows, split the same way, in parallel.
        anchor = infos[-2].block_rv
        loops = sch.get_loops(anchor)
        row = sch.fuse(*loops[:depth]) if depth > 1 else loops[0]
        outer, inner = sch.split(row, [tasks, None])
        sch.parallel(outer)
        sch.reverse_compute_at(partial, inner, preserve_unit_loops=False)
        for info in reversed(infos[:-2]):
            sch.compute_at(info.block_rv, inner, preserve_unit_loops=False)
        for block_rv in [info.block_rv for info in infos[:-1]] + [partial]:
            columns = sch.get_loops(block_rv)[2:]
            if columns:
                fused = sch.fuse(*columns) if len(columns) > 1 else columns[0]
                _, vector = sch.split(fused, [None, _tile(get_extent(sch, fused), 2 * lanes)])
                sch.vectorize(vector)
        sch.decompose_reduction(partial, sch.get_loops(partial)[1])


def _static(extents) -> list[int] | None:
    values = [int(e) if isinstance(e, int | tirx.IntImm) else None for e in extents]
    return None if None in values else values


def _column_sum_block(block: tirx.SBlock) -> int | None:
    """How many trailing axes ``block`` keeps of the buffer it sums over the leading ones."""
    iters = list(block.iter_vars)
    kept = [i for i in iters if int(i.iter_type) == SPATIAL]
    summed = [i for i in iters if int(i.iter_type) == REDUCE]
    if len(block.reads) != 1 or len(kept) + len(summed) != len(iters) or not kept or not summed:
        return None
    read = block.reads[0].region
    wanted = [i.var for i in summed + kept]
    if len(read) != len(wanted):
        return None
    if not all(r.min.same_as(v) and is_one(r.extent) for r, v in zip(read, wanted)):
        return None
    return len(kept)
