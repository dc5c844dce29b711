"""Kernels over the same rows merged into one (CPU): a layer norm's backward in one pass.

After fusion, a layer norm's gradient is still five kernels: the row sums that recompute the
mean and the variance (each read by several kernels, so ``FuseOps`` fuses neither with its
readers), the input's gradient, and the sums over the rows of gamma's and beta's gradients.
Each reads the rows from memory again. Two steps make them one pass over the rows:

- :class:`FuseRowGroups` (after ``FuseTIR``) merges a kernel that reduces along its rows with
  the kernels after it that read its results or its inputs, one by one while the merged
  function is one that :class:`RowColumnLocal` (or :class:`RowLocal`) schedules, into one
  PrimFunc returning every result read elsewhere (``FuseTIR`` writes it);
- :class:`RowColumnLocal` (a schedule rule, after :class:`ColumnLocal`) schedules such a
  function: blocks over the same rows, reading each other's results only at their own row, and
  sums over those rows. The rows are split over the threads; each computes its rows with every
  block in turn, a row still in cache, and adds them into partial sums of its own; the partial
  sums are added last.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target

from ._common import (
    REDUCE,
    SPATIAL,
    is_one,
    read_counts,
    sblocks,
    static_shape,
    with_dataflow_blocks,
    without_unit_reductions,
)
from .blas import THREADS
from .columns import _is_call_tir
from .cpu import _mentions, _tile, _vector_lanes
from .rows import (
    RowLocal,
    _get_realize,
    _partials,
    _reduces,
    _shared_rows,
    first_scheduled,
    vectorize_in_row,
)

_MAX_MEMBERS = 8  # kernels in one group
_WINDOW = 24  # bindings after a group's first kernel that may join it
_MAX_BUFFERS = 32  # a kernel with more (MobileViT's unfold: a concatenation of 250 slices)
# joins no group: trying to schedule each merge with it took 4.5 s, and none scheduled


class RowColumnLocal(ScheduleRule):
    """A CPU function of blocks over the same rows (leading axes of equal extents), reductions
    along the row among them, that read each other's results only at their own row, and of
    sums over those rows that no block reads: the rows are split over the threads, each running
    its rows through every block in order and adding them into partial sums of its own,
    vectorized along the row; the partial sums are added after. Functions that sum nothing
    (a split's parts) are left to :class:`ParallelLoops`, which vectorizes each block."""

    def __init__(self, min_rows: int = 64, tasks: int | None = None):
        self.min_rows = min_rows
        self.tasks = tasks

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        return first_scheduled(func, target, self._apply)

    def _apply(self, sch: s_tir.Schedule, infos, target: Target) -> s_tir.Schedule | None:
        if len(infos) < 2:
            return None
        blocks = [sch.get(info.block_rv) for info in infos]
        plan = _plan(sch, infos, blocks)
        if plan is None:
            return None
        depth, rows, is_sum = plan
        count = math.prod(rows)
        tasks = _tile(count, self.tasks or THREADS)
        if count < self.min_rows or count % tasks:
            return None
        row_infos = [info for info, summed in zip(infos, is_sum) if not summed]
        sums = [info.block_rv for info, summed in zip(infos, is_sum) if summed]
        try:
            self._schedule(sch, row_infos, sums, depth, tasks, target)
        except (s_tir.ScheduleError, tvm.error.InternalError):
            return None
        return sch if _in_order(sch.mod["main"]) else None

    def _schedule(self, sch, row_infos, sums, depth: int, tasks: int, target: Target) -> None:
        # 1. Reductions along the row into vector partials, as RowLocal does.
        order = []  # (block, vector lanes if elementwise), producers first
        for info in row_infos:
            lanes = _vector_lanes(target, sch.get(info.block_rv).writes[0].source.dtype)
            partial = None if info.is_injective() else _partials(sch, info.block_rv, lanes)
            if partial is not None:
                order.append((partial, None))
            order.append((info.block_rv, lanes if info.is_injective() else None))
        # 2. Sums over the rows into one partial sum per task (rfactor over the task).
        partials = []
        for block_rv in sums:
            loops = sch.get_loops(block_rv)
            summed = [loop for loop in loops if _reduces(sch, block_rv, loop)]
            sch.reorder(*summed, *(loop for loop in loops if loop not in summed))
            row = sch.fuse(*summed) if depth > 1 else summed[0]
            outer, _ = sch.split(row, [tasks, None])
            partials.append(sch.rfactor(outer, factor_axis=0))
        # 3. Every block's rows split the same way; the loops over the tasks merged into one
        # parallel loop, and those over a task's rows into one, the blocks in order inside.
        # (``merge`` puts the loop where the last loop given was, checking nothing: the
        # partial sums are merged last-first, so that their loop stays before every total.)
        outers = []
        for block_rv, _ in order:
            loops = sch.get_loops(block_rv)
            row = sch.fuse(*loops[:depth]) if depth > 1 else loops[0]
            outers.append(sch.split(row, [tasks, None])[0])
        firsts = [sch.get_loops(p)[0] for p in reversed(partials)]
        if len(firsts) > 1:
            firsts = [sch.merge(*firsts)]
        outer = sch.merge(*outers, *firsts) if len(outers) + len(firsts) > 1 else outers[0]
        inners = [sch.get_loops(b)[1] for b in [*(b for b, _ in order), *partials]]
        if len(inners) > 1:
            sch.merge(*inners)
        sch.parallel(outer)
        # 4. Vectors along the row.
        for block_rv, lanes in order:
            vectorize_in_row(sch, block_rv, lanes, 2)
        for partial in partials:
            lanes = _vector_lanes(target, sch.get(partial).writes[0].source.dtype)
            vectorize_in_row(sch, partial, lanes, 2)
            sch.decompose_reduction(partial, sch.get_loops(partial)[1])


def _plan(sch, infos, blocks) -> tuple[int, list[int], list[bool]] | None:
    """``(depth, rows, is_sum)``: the number of row axes, their extents, and which blocks sum
    over the rows (the others run over them); None unless the function is one
    :class:`RowColumnLocal` schedules (a block over the rows at least)."""
    written = {w.source for block in blocks for w in block.writes}
    is_sum = [_row_sum_depth(block, written) is not None for block in blocks]
    if all(is_sum):
        return None
    row_blocks = [b for b, summed in zip(blocks, is_sum) if not summed]
    rows = _shared_rows(row_blocks)
    depths = {_row_sum_depth(b, written) for b, summed in zip(blocks, is_sum) if summed}
    if not rows or len(depths) > 1:
        return None
    (depth,) = depths or {len(rows)}
    sums = [b for b, summed in zip(blocks, is_sum) if summed]
    extents = [[int(i.dom.extent) for i in b.iter_vars if _is_reduce(i)] for b in sums]
    if len(rows) < depth or any(e != rows[:depth] for e in extents):
        return None
    if not all(_along_row(b) for b in row_blocks if any(_is_reduce(i) for i in b.iter_vars)):
        return None  # a reduction over another axis: strided, as a row's would be
    summed = {w.source for b in sums for w in b.writes}
    if any(r.source in summed for b in blocks for r in b.reads):
        return None  # a sum read back: the rows would need it before it is complete
    for info, block, summed_block in zip(infos, blocks, is_sum):
        if not summed_block and not _loops_bind_rows(sch, info.block_rv, block, depth):
            return None
    return depth, rows[:depth], is_sum


def _row_sum_depth(block: s_tir.SBlock, written) -> int | None:
    """How many row axes ``block`` sums over, if it is a sum over the rows: reduction
    iterators only over the leading axes of every buffer it reads that a block writes, kept
    (spatial) iterators only in what it writes."""
    spatial = [i.var for i in block.iter_vars if int(i.iter_type) == SPATIAL]
    reduced = [i.var for i in block.iter_vars if _is_reduce(i)]
    if not reduced or len(spatial) + len(reduced) != len(block.iter_vars) or block.init is None:
        return None
    for write in block.writes:
        if any(_mentions(r.min, v) for r in write.region for v in reduced):
            return None
    leading = [r for r in block.reads if len(r.region) >= len(reduced)]
    if not leading:
        return None
    for read in block.reads:
        region = read.region
        if read.source in written or read in leading:
            heads = region[: len(reduced)]
            if not all(r.min.same_as(v) and is_one(r.extent) for r, v in zip(heads, reduced)):
                return None
            if any(_mentions(r.min, v) for r in region[len(reduced) :] for v in reduced):
                return None
    return len(reduced)


def _is_reduce(iter_var) -> bool:
    return int(iter_var.iter_type) == REDUCE


def _along_row(block: s_tir.SBlock) -> bool:
    """Whether ``block`` reduces along the innermost axis of what it reads: its last iterator
    is a reduction's, the last index of a read and no other index."""
    if not block.iter_vars or not _is_reduce(block.iter_vars[-1]):
        return False
    last = block.iter_vars[-1].var
    along = False
    for read in block.reads:
        *others, inner = read.region
        if any(_mentions(r.min, last) for r in others):
            return False
        along = along or inner.min.same_as(last)
    return along


def _may_start(func: tirx.PrimFunc, min_rows: int) -> bool:
    """Whether a group may start at a kernel ``func``: one that reduces along its rows over at
    least ``min_rows`` rows (:func:`_most_rows`), and whose blocks other than sums over rows
    share their rows (:func:`_shared_rows`). A group's function has the kernel's blocks among
    its own, so a kernel whose blocks run over different rows (a train-mode batch norm: a sum
    per channel of NCHW, and its NCHW output) starts none; trying one candidate group after
    another cost a fused build and the rules' checks each (2 s of a small MobileNetV2's
    compile, and no group; 0.3 s of a small MLP's, whose rows are too few for the rules)."""
    if not _plain(func):
        return False
    blocks = sblocks(func)
    along = [block for block in blocks if _along_row(block)]
    if not along or min(_most_rows(block) for block in along) < min_rows:
        return False
    written = {w.source for block in blocks for w in block.writes}
    rows = [block for block in blocks if _row_sum_depth(block, written) is None]
    return bool(rows) and _shared_rows(rows) is not None


def _most_rows(block: s_tir.SBlock) -> float:
    """The most rows a group's function can have, a block reducing along the row among its
    blocks: the rows are leading spatial iterators of every block over them (the product of
    this block's spatial extents bounds them) or, a block with no spatial iterator being a sum
    over the rows, the extents it sums (the product of all of them). Unbounded (``inf``) for a
    symbolic extent."""
    spatial = [i for i in block.iter_vars
               if int(i.iter_type) == SPATIAL and not is_one(i.dom.extent)]
    extents = [i.dom.extent for i in (spatial or block.iter_vars)]
    if not all(isinstance(e, tirx.IntImm) for e in extents):
        return math.inf
    return math.prod(int(e) for e in extents)


def _loops_bind_rows(sch, block_rv, block: s_tir.SBlock, depth: int) -> bool:
    """Whether the block's first ``depth`` loops are its first ``depth`` iterators."""
    loops = sch.get_loops(block_rv)
    values = _get_realize(sch, block_rv).iter_values
    return len(loops) >= depth and all(
        values[k].same_as(sch.get(loops[k]).loop_var) for k in range(depth)
    )


def _in_order(func: tirx.PrimFunc) -> bool:
    """Whether no statement of the root block reads what a later one writes."""
    root = func.body.block.body if isinstance(func.body, s_tir.SBlockRealize) else func.body
    stmts = list(root.seq) if isinstance(root, tirx.SeqStmt) else [root]
    accesses = []
    for stmt in stmts:
        reads, writes = set(), set()

        def visit(block, reads=reads, writes=writes):
            reads.update(r.source for r in block.reads)
            writes.update(w.source for w in block.writes)

        tvm_ffi.structural_walk(stmt, [(s_tir.SBlock, visit)], order="pre")
        accesses.append((reads, writes))
    return all(
        not (accesses[i][0] & accesses[j][1])
        for i in range(len(accesses))
        for j in range(i + 1, len(accesses))
    )


@tvm.transform.module_pass(opt_level=0, name="FuseRowGroups")
class FuseRowGroups:
    """After ``FuseTIR``: a kernel that reduces along its rows and the kernels after it that
    read its results or its inputs, merged into one PrimFunc while :class:`RowColumnLocal` or
    :class:`RowLocal` schedules the result (see the module docstring). Runs inside the
    target's scope (``with target:``); changes nothing off the CPU."""

    def __init__(self, min_rows: int = 64):
        self.rules = [RowColumnLocal(min_rows), RowLocal(min_rows)]
        self.min_rows = min_rows

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        target = Target.current(allow_none=True)
        if target is None or target.kind.name != "llvm":
            return mod
        builder = relax.BlockBuilder(mod)
        changed, cache = False, {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            if func.attrs is not None and func.attrs.get("Primitive", False):
                continue
            grouper = _Grouper(mod, func, target, self.rules, builder, self.min_rows, cache)
            new = grouper.rewrite()
            if new is not None:
                builder.update_func(gvar, new)
                changed = True
        if not changed:
            return mod
        return relax.transform.DeadCodeElimination()(builder.get())


class _Grouper:
    """The groups of one Relax function, found binding by binding, and the function with each
    group's kernels one call."""

    def __init__(self, mod, func, target, rules, builder, min_rows: int, cache: dict):
        self.mod, self.func, self.target, self.rules = mod, func, target, rules
        self.min_rows = min_rows
        self.cache = cache  # structural hash -> [(primitive function, PrimFunc or None)]
        self.builder = builder
        self.reads = read_counts(func)
        self.starts: dict = {}  # GlobalVar -> _may_start of its PrimFunc
        self.plain: dict = {}  # GlobalVar -> _plain of its PrimFunc
        self.read: dict = {}  # a binding's index in its block -> _Grouper._reads of it

    def rewrite(self) -> relax.Function | None:
        return with_dataflow_blocks(self.func, self._grouped)

    def _grouped(self, bindings: list) -> list | None:
        groups = []  # (member indices, merged PrimFunc, its args, its results)
        end, items = -1, _tuple_items(bindings)
        position = {b.var: i for i, b in enumerate(bindings)}
        self.read = {}
        for first, binding in enumerate(bindings):
            if first > end and self._reduces_rows(binding):
                stop = min(first + 1 + _WINDOW, len(bindings))
                found = self._grow(bindings, items, position, first, stop)
                if found is not None:
                    groups.append(found)
                    end = found[0][-1]  # groups do not overlap
        return self._emitted(bindings, groups) if groups else None

    def _grow(self, bindings, items: dict, position: dict, first: int, stop: int):
        """The largest group of ``bindings[first:stop]`` from ``first`` on whose merged
        function a rule schedules, as ``(members, PrimFunc, args, results)``; None if it
        would have one kernel. ``items``: :func:`_tuple_items`; ``position``: each var's
        binding index."""
        members, best = [first, *_parts(items, bindings, first)], None
        outputs = {bindings[i].var for i in members}
        inputs = set(_args(bindings[first].value))
        tainted: set = set()  # vars computed from the group's results outside it

        def since(args: set) -> set:  # those computed after the group starts
            return {a for a in args if position.get(a, -1) >= first}

        for index in range(first + 1, stop):
            if index in members:
                continue
            binding = bindings[index]
            call, args = self._reads(bindings, index)
            reads_group = bool(args & outputs)
            joinable = (
                call
                and len(members) < _MAX_MEMBERS
                and not args & tainted
                and (reads_group or self._shares_rows(binding, args, inputs, since(args) - outputs))
                and self._plain(binding.value.args[0])
            )
            candidate = sorted([*members, index, *_parts(items, bindings, index)])
            merged = None
            if joinable and candidate[-1] < stop:
                merged = self._merged(bindings, candidate)
            if merged is not None:
                members = candidate
                outputs |= {bindings[i].var for i in candidate}
                inputs |= args - outputs
                best = (members, *merged)
            elif reads_group or args & tainted:
                tainted.add(binding.var)
        return best

    def _reads(self, bindings, index: int) -> tuple[bool, frozenset]:
        """Whether ``bindings[index]`` is a ``call_tir``, and the vars it reads (its operands
        if so), read once per block: each binding is in the window of up to ``_WINDOW``
        groups' starts."""
        found = self.read.get(index)
        if found is None:
            binding = bindings[index]
            call = _is_call_tir(binding.value)
            args = frozenset(_args(binding.value)) if call else frozenset(_free(binding))
            found = self.read[index] = (call, args)
        return found

    def _plain(self, gvar) -> bool:
        if gvar not in self.plain:
            self.plain[gvar] = _plain(self.mod[gvar])
        return self.plain[gvar]

    def _shares_rows(self, binding, args: set, inputs: set, later: set) -> bool:
        """Whether ``binding``, which reads none of the group's results, reads one of its
        inputs and nothing computed since the group started, and computes one tensor of the
        trailing shape of an input's at least ``min_rows`` times smaller (a sum over the
        rows)."""
        if not args & inputs or args & later:
            return False
        out = static_shape(binding.var)
        if out is None:
            return False
        for arg in _args(binding.value):
            shape = static_shape(arg)
            if shape is None or len(shape) <= len(out) or shape[len(shape) - len(out) :] != out:
                continue
            if math.prod(shape[: len(shape) - len(out)]) >= self.min_rows:
                return True
        return False

    def _reduces_rows(self, binding) -> bool:
        if not isinstance(binding, relax.VarBinding) or not _is_call_tir(binding.value):
            return False
        gvar = binding.value.args[0]
        if gvar not in self.starts:
            self.starts[gvar] = _may_start(self.mod[gvar], self.min_rows)
        return self.starts[gvar]

    def _merged(self, bindings, members: list[int]):
        """``(PrimFunc, args, results)`` of the kernels at ``members`` (call_tirs and the
        items of their tuples) merged, if a rule schedules it; else None."""
        params, args, inner, body = {}, [], {}, []
        for binding in (bindings[i] for i in members):
            value = binding.value
            if isinstance(value, relax.TupleGetItem):
                value = relax.TupleGetItem(inner[value.tuple_value], value.index)
            else:
                if not isinstance(value.args[1], relax.Tuple):
                    return None
                fields = []
                for arg in value.args[1].fields:
                    if isinstance(arg, relax.Var) and arg not in inner and arg not in params:
                        params[arg] = relax.Var(arg.name, arg.ty)
                        args.append(arg)
                    fields.append(inner.get(arg, params.get(arg, arg)))
                typed = value.ty
                value = relax.Call(value.op, [value.args[0], relax.Tuple(fields), *value.args[2:]],
                                   value.attrs, value.ty_args)  # fmt: skip
                # typed as the original call: _fused_prim_func's normalization types the calls
                # of a function in place, and a cached (typed) one never equalled a new one
                relax.expr._update_type(value, typed)
            inner[binding.var] = relax.Var(binding.var.name, binding.var.ty)
            body.append(relax.VarBinding(inner[binding.var], value))
        read_inside = read_counts(*(bindings[i].value for i in members))
        bound = [bindings[i].var for i in members]
        results = [v for v in bound if self.reads.get(v, 0) > read_inside.get(v, 0)]
        if not results or not all(isinstance(r.ty, relax.TensorType) for r in results):
            return None
        func = _primitive([params[a] for a in args], body, [inner[r] for r in results])
        key = tvm_ffi.structural_hash(func)
        cached = [prim for other, prim in self.cache.get(key, []) if
                  tvm_ffi.structural_equal(other, func)]  # fmt: skip
        if cached:
            prim = cached[0]
        else:
            prim = _fused_prim_func(self.mod, func)
            prim = prim if prim is not None and self._schedules(prim) else None
            self.cache.setdefault(key, []).append((func, prim))
        return None if prim is None else (prim, args, results)

    def _schedules(self, prim: tirx.PrimFunc) -> bool:
        func = without_unit_reductions(prim)
        for rule in self.rules:
            try:
                if rule.apply(func, self.target, False) is not None:
                    return True
            except Exception:  # noqa: BLE001 (a rule that raises does not schedule it)
                continue
        return False

    def _emitted(self, bindings: list, groups: list) -> list:
        """``bindings`` with each group's kernels one call, at its last member's place, and
        the bindings among them that read its results (or such bindings') after it."""
        out, member_of, held = [], {}, {}
        for group in groups:
            member_of.update({i: group for i in group[0]})
        for index, binding in enumerate(bindings):
            group = member_of.get(index)
            if group is not None:
                held.setdefault(id(group), ([], set()))[1].add(binding.var)
                if index == group[0][-1]:
                    out.extend(self._call(group))
                    out.extend(held.pop(id(group))[0])
                continue
            waiting = [h for h in held.values() if _free(binding) & h[1]]
            if waiting:  # groups do not overlap: only the open one
                waiting[0][0].append(binding)
                waiting[0][1].add(binding.var)
            else:
                out.append(binding)
        return out

    def _call(self, group) -> list:
        _, prim, args, results = group
        gvar = self.builder.add_func(prim, "fused_rows")
        ty = [r.ty for r in results]
        call = relax.op.call_tir(gvar, relax.Tuple(args), ty if len(ty) > 1 else ty[0])
        if len(results) == 1:
            return [relax.VarBinding(results[0], call)]
        both = relax.DataflowVar("rows", relax.TupleType(ty))
        items = [relax.VarBinding(r, relax.TupleGetItem(both, k)) for k, r in enumerate(results)]
        return [relax.VarBinding(both, call), *items]


def _tuple_items(bindings) -> dict:
    """The indices of the bindings of the items of each tuple var that ``bindings`` item, in
    order: one pass, where a scan per tuple would be quadratic in the bindings."""
    items: dict = {}
    for i, binding in enumerate(bindings):
        if isinstance(binding.value, relax.TupleGetItem):
            items.setdefault(binding.value.tuple_value, []).append(i)
    return items


def _parts(items: dict, bindings, index: int) -> list[int]:
    """The bindings after ``index`` of the items of its tuple, if it binds one (``items``:
    :func:`_tuple_items` of ``bindings``)."""
    return [i for i in items.get(bindings[index].var, ()) if i > index]


def _plain(func) -> bool:
    """A PrimFunc of blocks with iterators only (no opaque block, e.g. an extern call's), and
    at most :data:`_MAX_BUFFERS` buffers."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) > _MAX_BUFFERS:
        return False
    blocks = sblocks(func)
    return bool(blocks) and all(len(b.iter_vars) > 0 for b in blocks)


def _args(call) -> list:
    fields = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
    return [f for f in fields if isinstance(f, relax.Var)]


def _free(binding) -> set:
    return set(relax.analysis.free_vars(binding.value))


def _primitive(params, body, results) -> relax.Function:
    """A primitive function of ``body`` returning ``results``."""
    ret = results[0] if len(results) == 1 else relax.Tuple(results)
    seq = relax.SeqExpr([relax.DataflowBlock(body)], ret)
    ret_ty = results[0].ty if len(results) == 1 else relax.TupleType([r.ty for r in results])
    return relax.Function(params, seq, ret_ty, True).with_attr("Primitive", True)


def _fused_prim_func(mod, func: relax.Function) -> tirx.PrimFunc | None:
    """The PrimFunc that ``FuseTIR`` writes for ``func``, a primitive function of call_tirs of
    ``mod``'s PrimFuncs."""
    params, ret_ty = func.params, func.ret_ty
    # only the PrimFuncs the group calls: a module of all of them is hashed again by every
    # BlockBuilder, once per trial merge (64 of MobileNetV2's 175 s of compile time)
    called = {b.value.args[0] for block in func.body.blocks for b in block.bindings
              if isinstance(b.value, relax.Call) and _is_call_tir(b.value)}  # fmt: skip
    builder = relax.BlockBuilder(IRModule({g: mod[g] for g in called}))
    gvar = builder.add_func(func, "group")
    outer = [relax.Var(p.name, p.ty) for p in params]
    result = relax.Var("result", ret_ty)
    block = relax.DataflowBlock([relax.VarBinding(result, relax.Call(gvar, outer))])
    main = relax.Function(outer, relax.SeqExpr([block], result), ret_ty, True)
    builder.add_func(main.with_attr("global_symbol", "main"), "main")  # public: kept
    try:
        fused = relax.transform.FuseTIR()(builder.get())
    except Exception:  # noqa: BLE001 (what FuseTIR cannot merge stays as it was)
        return None
    prims = [f for g, f in fused.functions_items()
             if isinstance(f, tirx.PrimFunc) and g.name_hint.startswith("group")]  # fmt: skip
    return prims[0] if len(prims) == 1 else None
