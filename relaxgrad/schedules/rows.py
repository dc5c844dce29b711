"""Row-local kernels on the CPU: reductions along the innermost axes fused with the elementwise
work around them, and computed one row at a time.

Softmax's and layer norm's gradients are sums along each row (``sum(g * y, -1)``) whose results
the row's elementwise ops read right back (``(g - s) * y``). ``FuseOps`` never fuses a reduction
into its consumers, so each such sum is its own kernel and the row goes through memory between
them: softmax's gradient was two kernels, layer norm's nine. Two steps fix that:

- :class:`FuseRowReductions` (before ``FuseOps``) marks a PrimFunc that reduces only the
  innermost axes of its input, row by row, as injective, so that ``FuseOps`` fuses it with
  its elementwise consumers and producers;
- :class:`RowLocal` (a schedule rule, tried before ``ParallelLoops``) schedules a function whose
  blocks all run over the same leading axes, the rows, and read each other's results only at
  their own row: one parallel loop over rows, every block computed inside it for that row,
  reductions along the row accumulated in vectors. A row of a few KiB stays in the L1 cache
  between the blocks.
"""

from __future__ import annotations

import itertools

import tvm
from tvm import s_tir, tirx
from tvm.ir import IRModule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from .._module import with_functions
from ._common import COMM_REDUCE, INJECTIVE, REDUCE, SPATIAL, calls_any, is_one, sblocks
from .cpu import _cpu_blocks, _static_product, _tile, _vector_lanes

_get_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


@tvm.transform.module_pass(opt_level=0, name="FuseRowReductions")
class FuseRowReductions:
    """Mark each PrimFunc that reduces the innermost axes of its input, row by row, over at
    least ``min_rows`` rows, as injective (``op_pattern``), so that ``FuseOps`` fuses it with
    the elementwise ops that read its result (see the module docstring)."""

    def __init__(self, min_rows: int = 64):
        self.min_rows = min_rows

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {
            gvar: func.with_attr("op_pattern", INJECTIVE)
            for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc)
            and func.attrs is not None
            and int(func.attrs.get("op_pattern", -1)) == COMM_REDUCE
            and _reduces_rows(func, self.min_rows)
        }
        return with_functions(mod, updates)


def _reduces_rows(func: tirx.PrimFunc, min_rows: int) -> bool:
    """One block that reads one buffer at ``[rows..., reduced...]``: its spatial iterators
    (those of extent 1 aside, kept dimensions) then its reduction iterators, in order."""
    blocks = sblocks(func)
    if len(blocks) != 1 or len(blocks[0].reads) != 1 or len(blocks[0].writes) != 1:
        return False
    iters = list(blocks[0].iter_vars)
    spatial = _spatial_prefix(blocks[0])
    if spatial == len(iters) or any(int(i.iter_type) != REDUCE for i in iters[spatial:]):
        return False
    rows = [i for i in iters[:spatial] if not is_one(i.dom.extent)]
    indices = [r.min for r in blocks[0].reads[0].region]
    wanted = [i.var for i in rows + iters[spatial:]]
    return (
        len(indices) == len(wanted)
        and all(x.same_as(v) for x, v in zip(indices, wanted))
        and _static_product([i.dom.extent for i in rows]) >= min_rows
    )


class RowLocal(ScheduleRule):
    """A CPU function of several blocks, reductions among them, that all iterate first over the
    same rows (leading axes of equal extents) and read each other's results only at their own
    row: the rows run in one parallel loop with every block computed inside it, elementwise
    loops vectorized, reductions along the row accumulated in vector partials."""

    def __init__(self, min_rows: int = 64):
        self.min_rows = min_rows

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        return first_scheduled(func, target, self._apply)

    def _apply(self, sch: s_tir.Schedule, infos, target: Target) -> s_tir.Schedule | None:
        if len(infos) < 2 or all(info.is_injective() for info in infos):
            return None
        blocks = [sch.get(info.block_rv) for info in infos]
        rows = _shared_rows(blocks)
        if not rows or _static_product(rows) < self.min_rows:
            return None
        try:
            self._schedule(sch, infos, len(rows), target)
        except (s_tir.ScheduleError, tvm.error.InternalError, _Redundant):
            return None
        return sch

    def _schedule(self, sch: s_tir.Schedule, infos, depth: int, target: Target) -> None:
        # 1. Reductions along the row into vector partials (each still in its own loop nest).
        order = []  # (block, iterations per row, vector lanes if elementwise), producers first
        for info in infos:
            block = sch.get(info.block_rv)
            lanes = _vector_lanes(target, block.writes[0].source.dtype)
            per_row = _static_product(info.dom()[depth:])
            partial = None if info.is_injective() else _partials(sch, info.block_rv, lanes)
            if partial is not None:
                order.append((partial, per_row * lanes, None))
            order.append((info.block_rv, per_row, lanes if info.is_injective() else None))
        # 2. Every block inside the last one's row loop, which runs in parallel.
        anchor = order[-1][0]
        loops = sch.get_loops(anchor)
        row = sch.fuse(*loops[:depth]) if depth > 1 else loops[0]
        sch.parallel(row)
        for block_rv, per_row, _ in reversed(order[:-1]):
            sch.compute_at(block_rv, row, preserve_unit_loops=False)
            inner = sch.get_loops(block_rv)[1:]
            if _static_product([get_extent(sch, loop) for loop in inner]) > per_row:
                raise _Redundant
        # 3. Vectors: elementwise loops, and the partials' lanes.
        for block_rv, _, lanes in order:
            vectorize_in_row(sch, block_rv, lanes, 1)


def _reduces(sch: s_tir.Schedule, block_rv, loop_rv) -> bool:
    """Whether ``loop_rv`` drives a reduction iterator of the block."""
    var = sch.get(loop_rv).loop_var
    realize = _get_realize(sch, block_rv)
    return any(
        int(iter_var.iter_type) == REDUCE and var in set(undefined_vars(value))
        for iter_var, value in zip(realize.block.iter_vars, realize.iter_values)
    )


_COSTLY = frozenset(tvm.ir.Op.get(f"tirx.{name}") for name in
                   ("exp", "exp2", "tanh", "sigmoid", "erf", "log", "log1p", "pow"))  # fmt: skip


def _costly_shared(func: tirx.PrimFunc) -> set[str]:
    """The spatial blocks of ``func`` that compute a transcendental function (``exp``,
    ``tanh``, ...) and whose result two or more blocks read: a softmax's ``exp(x - max)``,
    read by the row's sum and by the division. Inlined, each reader computed it again (the
    exponential was half of a softmax's arithmetic); the row rules (:class:`RowLocal`,
    :class:`~relaxgrad.schedules.RowColumnLocal`) compute such a block once per row into a
    buffer of the row's size instead (:func:`first_scheduled`)."""
    blocks = sblocks(func)
    readers: dict = {}
    for block in blocks:
        for buffer in {r.source for r in block.reads}:
            readers[buffer] = readers.get(buffer, 0) + 1
    kept = set()
    for block in blocks:
        if any(int(i.iter_type) != SPATIAL for i in block.iter_vars) or len(block.writes) != 1:
            continue
        if readers.get(block.writes[0].source, 0) < 2:
            continue
        if calls_any(block.body, _COSTLY):
            kept.add(block.name_hint)
    return kept


def first_scheduled(func: tirx.PrimFunc, target: Target, schedule) -> s_tir.Schedule | None:
    """``schedule(sch, infos, target)`` of the first of ``func``'s blockings that it
    schedules: the blocks of :func:`_costly_shared` left as blocks, where there are any, then
    every spatial block inlined (:func:`~relaxgrad.schedules.cpu._cpu_blocks`); None if it
    schedules neither."""
    sch, infos = _cpu_blocks(func, target, least=2, reducing=True)
    if len(infos) < 2:
        return None
    kept = _costly_shared(func)
    if kept:
        found = schedule(*_inlined_but(func, kept), target)
        if found is not None:
            return found
    return schedule(sch, infos, target)


def _inlined_but(func: tirx.PrimFunc, kept: set[str]):
    """A schedule of ``func`` and its blocks' infos after inlining the spatial blocks but
    ``kept`` (by name), as dlight's ``try_inline_contiguous_spatial`` inlines them all."""
    sch = s_tir.Schedule(func)
    infos, run = [], []
    for info in normalize_prim_func(sch) or []:
        if info.is_injective() and sch.get(info.block_rv).name_hint not in kept:
            run.append(info)
            continue
        infos.extend(try_inline(sch, run) if run else [])
        infos.append(info)
        run = []
    infos.extend(try_inline(sch, run) if run else [])
    return sch, infos


class _Redundant(Exception):
    """A block computed inside the row loop would compute more than its row."""


def _shared_rows(blocks: list[s_tir.SBlock]) -> list[int] | None:
    """The extents of the leading spatial iterators that every block has (same extents), and
    that index the leading dimensions of every buffer a block writes and every intermediate one
    it reads, in order."""
    written = [w.source for block in blocks for w in block.writes]
    first = blocks[0].iter_vars
    depth = min(_spatial_prefix(block) for block in blocks)
    for block in blocks:
        iters = block.iter_vars
        regions = [*block.writes, *(r for r in block.reads if _any_same(r.source, written))]
        depth = min(depth, _leading(_equal_extents(a, b) for a, b in zip(first, iters)))
        for region in regions:
            axes = _indexed_axes(region)
            depth = min(depth, _leading(r.min.same_as(i.var) for r, i in zip(axes, iters)))
    return [int(i.dom.extent) for i in first[:depth]] if depth else None


def _indexed_axes(region) -> list:
    """A buffer region's axes but those of a buffer dimension of 1 at index 0, which no
    iterator indexes once TVM has dropped the unit iterators (a batch of one, as a language
    model's fine-tuning step's ``(1, heads, seq, seq)`` softmax)."""
    return [r for r, n in zip(region.region, region.source.shape)
            if not (is_one(n) and isinstance(r.min, tirx.IntImm) and int(r.min) == 0)]


def _leading(flags) -> int:
    """How many of ``flags`` are true before the first false one."""
    return sum(1 for _ in itertools.takewhile(bool, flags))


def _spatial_prefix(block: s_tir.SBlock) -> int:
    return _leading(int(i.iter_type) == SPATIAL for i in block.iter_vars)


def _equal_extents(a, b) -> bool:
    extents = (a.dom.extent, b.dom.extent)
    return all(isinstance(e, tirx.IntImm) for e in extents) and int(extents[0]) == int(extents[1])


def _any_same(obj, objs) -> bool:
    return any(obj.same_as(other) for other in objs)


def vectorize_in_row(sch: s_tir.Schedule, block_rv, lanes: int | None, depth: int) -> None:
    """Vectorize a block computed inside ``depth`` loops over the rows: an elementwise block's
    loops (``lanes`` given), or the lanes of a reduction's partials (:func:`_partials`)."""
    if lanes is not None:
        _vectorize_inner(sch, block_rv, lanes, depth)
    elif _is_partial(sch, block_rv):
        lanes_loop, *others = sorted(
            sch.get_loops(block_rv)[depth:], key=lambda loop: _reduces(sch, block_rv, loop)
        )  # compute_at lays loops out in the order of the iterators: lanes first
        sch.reorder(*others, lanes_loop)
        sch.vectorize(lanes_loop)
        sch.decompose_reduction(block_rv, sch.get_loops(block_rv)[depth])


def _vectorize_inner(sch: s_tir.Schedule, block_rv, lanes: int, depth: int) -> None:
    loops = sch.get_loops(block_rv)[depth:]
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    _, inner = sch.split(fused, [None, _tile(get_extent(sch, fused), 2 * lanes)])
    sch.vectorize(inner)


def _partials(sch: s_tir.Schedule, block_rv, lanes: int):
    """Split the innermost reduction loop of ``block_rv`` by ``lanes`` and factor it out into
    a block of ``lanes`` partial results (returned). Where ``lanes`` does not divide the loop,
    by the largest divisor of it above ``lanes / 2`` and up to ``2 * lanes`` (29 for GPT-2's
    50257 logits, whose log-softmax was scalar: 2 ns per logit); None where there is none, or
    where the loop is shorter than two vectors. (A split that does not divide leaves a
    predicate, which the partials' vectorized loop did not honour: it read past the row.)"""
    loops = sch.get_loops(block_rv)
    extent = get_extent(sch, loops[-1])
    if not isinstance(extent, int):
        return None
    if extent % lanes:
        divisors = [d for d in range(2 * lanes, lanes // 2, -1) if extent % d == 0]
        if not divisors:
            return None
        lanes = divisors[0]
    if extent < 2 * lanes:
        return None
    if not _reduces(sch, block_rv, loops[-1]):
        return None
    _, inner = sch.split(loops[-1], [None, lanes])
    return sch.rfactor(inner, factor_axis=len(sch.get(block_rv).writes[0].region))


def _is_partial(sch: s_tir.Schedule, block_rv) -> bool:
    return sch.get(block_rv).name_hint.endswith("_rf")
