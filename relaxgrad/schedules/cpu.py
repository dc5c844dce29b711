"""CPU schedule rules: tiled matmuls and parallel, vectorized loops."""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline_contiguous_spatial
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.gpu.matmul import (
    IterKind,
    auto_inline_producers,
    detect_iter_traits,
    get_index_map,
    get_reduction_blocks,
)
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features
from tvm.tirx.analysis import undefined_vars

from ..errors import GradientError
from ._common import SPATIAL, is_one, sblocks


class TiledMatmul(ScheduleRule):
    """Matmul-like CPU functions: ``C[s, i, j] = sum_k A[.., i, .., k] * B[.., k, .., j]``
    (batch dims ``s``, operands in any layout), with injective prologues and epilogues.

    Prologues (e.g. a transpose) are inlined into the matmul and epilogues (bias, relu, the
    ``where`` of relu's adjoint) into one block computed per tile. Each thread takes a
    ``cols``-wide panel of ``B``, packs it contiguously, and sweeps it with ``rows x cols``
    register tiles of ``C``: ``k`` innermost but for the unrolled rows and vectorized
    columns. Threads only run when the matmul has at least ``parallel_macs`` multiply-adds.

    Parameters
    ----------
    rows : int
        Rows of ``C`` per register tile.
    vectors : int
        SIMD vectors per row of a register tile (``cols = vectors * lanes``).
    parallel_macs : int
        Multiply-adds from which the panels run on parallel threads.
    """

    def __init__(self, rows: int = 4, vectors: int = 2, parallel_macs: int = 1 << 20):
        self.rows, self.vectors, self.parallel_macs = rows, vectors, parallel_macs

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if target.kind.name != "llvm":
            return None
        if not _may_have(func, 1, reducing=True):
            return None
        sch = s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(sch.get_sblock("root")))
        if not reductions:
            return None
        main = reductions[0]
        auto_inline_producers(sch, main)
        index_maps = get_index_map(sch.get(main))
        if index_maps is None:
            return None
        rows, cols = _fused_tiles(
            sch.get(main),
            self.rows,
            self.vectors * _vector_lanes(target, sch.get(main).writes[0].source.dtype),
        )
        sch.transform_block_layout(main, index_maps[0])  # iters: [S, I, J, K]
        epilogue = _epilogue(sch, main)
        if epilogue is None:
            return None
        s, i, j, k = sch.get_loops(main)
        macs = _static_product(get_extent(sch, loop) for loop in (s, i, j, k))
        io, ii = sch.split(i, [None, rows])
        jo, ji = sch.split(j, [None, cols])
        sch.reorder(s, jo, io, k, ii, ji)
        panel = sch.fuse(s, jo)
        packed = sch.cache_read(main, _operand_with(sch.get(main), 2), "global")
        sch.compute_at(packed, panel)
        sch.vectorize(sch.get_loops(packed)[-1])
        if macs >= self.parallel_macs:
            sch.parallel(panel)
        sch.unroll(ii)
        sch.vectorize(ji)
        sch.reverse_compute_at(epilogue, io)
        sch.vectorize(sch.get_loops(epilogue)[-1])
        sch.decompose_reduction(main, k)
        return sch


def _fused_tiles(block: tirx.SBlock, rows: int, cols: int) -> tuple[int, int]:
    """Tile sizes for the ``I`` and ``J`` iters of a matmul-like ``block`` near ``rows`` and
    ``cols``.

    Where several of the block's iters fuse into ``I`` (e.g. the image rows and columns of a
    convolution), a tile must not straddle the innermost one: the tile of ``C`` it writes
    would not be a box, and the epilogue, computed per box, would read values not yet
    computed. Such a tile is cut to a divisor of the innermost extent.
    """
    *_, traits = detect_iter_traits(block)
    tiles = []
    for kind, want in ((IterKind.kIter_I, rows), (IterKind.kIter_J, cols)):
        extents = [t.extent for t in traits if t.kind == kind]
        inner = int(extents[-1]) if isinstance(extents[-1], tirx.IntImm) else extents[-1]
        tile = _tile(inner, want)
        fits = len(extents) == 1 or (isinstance(inner, int) and inner % tile == 0)
        tiles.append(tile if fits else 1)
    return tiles[0], tiles[1]


def _epilogue(sch: s_tir.Schedule, main) -> s_tir.schedule.SBlockRV | None:
    """Inline every other block into one that writes the result from ``main``'s accumulator
    (a new write-back block when there is no epilogue); None when that is not possible."""
    root = sch.get_sblock("root")
    inlined = True
    while inlined:
        inlined = False
        for block in sch.get_child_blocks(root):
            if sch.get(block).same_as(sch.get(main)):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:  # an output, or a block that cannot be inlined
                continue
            inlined = True
    others = [b for b in sch.get_child_blocks(root) if not sch.get(b).same_as(sch.get(main))]
    if not others:
        return sch.cache_write(main, 0, "local")
    consumers = sch.get_consumers(main)
    if (
        len(others) != 1
        or len(consumers) != 1
        or not sch.get(consumers[0]).same_as(sch.get(others[0]))
        or not _elementwise_on(sch.get(others[0]), sch.get(main).writes[0].source)
    ):
        return None
    sch.set_scope(main, 0, "local")
    return others[0]


def _elementwise_on(block: tirx.SBlock, buffer) -> bool:
    """Whether ``block`` reads ``buffer`` only at the point it writes (so that it can run per
    tile of ``buffer``: no transpose or broadcast of the matmul's result)."""
    (write,) = block.writes
    reads = [r for r in block.reads if r.source.same_as(buffer)]
    return all(
        len(r.region) == len(write.region)
        and all(
            tvm_ffi.structural_equal(a.min, b.min) and is_one(a.extent)
            for a, b in zip(r.region, write.region, strict=True)
        )
        for r in reads
    )


def _operand_with(block: tirx.SBlock, position: int) -> int:
    """The index in ``block.reads`` of the operand indexed by the block's ``position``-th iter."""
    var = block.iter_vars[position].var
    for index, read in enumerate(block.reads):
        if any(_mentions(r.min, var) for r in read.region):
            return index
    raise GradientError(f"TiledMatmul: block {block.name_hint} reads nothing indexed by {var}")


class ParallelLoops(ScheduleRule):
    """Any CPU function, block by block, after inlining what can be inlined.

    An injective block has its loops fused, vectorized by ``lanes`` and, from
    ``parallel_elements`` iterations, run on parallel threads. A reduction block runs its
    leading spatial loops on parallel threads (from ``parallel_elements`` iterations in all);
    when its innermost spatial loop indexes the innermost dimension of what it reads (a sum
    over rows, as in a bias gradient), that loop goes inside the reduction, vectorized.
    """

    def __init__(self, parallel_elements: int = 1 << 15):
        self.parallel_elements = parallel_elements

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = _cpu_blocks(func, target)
        if not infos:
            return None
        for info in infos:
            dtype = sch.get(info.block_rv).writes[0].source.dtype
            lanes = 4 * _vector_lanes(target, dtype)  # a few vectors per iteration
            if info.is_injective():
                self._injective(sch, info, lanes)
                continue
            trial = sch.copy()
            try:
                self._partial_vectors(trial, info, _vector_lanes(target, dtype))
                sch = trial
            except _NotApplicable:
                self._reduction(sch, info, lanes)
        return sch

    def _injective(self, sch: s_tir.Schedule, info, lanes: int) -> None:
        loops = sch.get_loops(info.block_rv)
        if not loops:
            return
        extent = _static_product(info.dom())
        if len(loops) > 1 and _reads_transposed(sch.get(info.block_rv), info.iters[-2].var):
            # Square tiles, so that the strided reads of a transpose stay in cache.
            rows, cols = (_tile(get_extent(sch, loop), lanes // 2) for loop in loops[-2:])
            io, ii = sch.split(loops[-2], [None, rows])
            jo, ji = sch.split(loops[-1], [None, cols])
            sch.reorder(io, jo, ii, ji)
            outer, inner = sch.fuse(*loops[:-2], io, jo), ji
        else:
            outer, inner = _vector_split(sch, info, loops, lanes)
        _vectorize_unrolled(sch, inner, lanes // 4)
        if extent >= self.parallel_elements:
            sch.parallel(outer)

    def _reduction(self, sch: s_tir.Schedule, info, lanes: int) -> None:
        kinds = info.dom_kind()
        spatial = len(kinds) - len(kinds.lstrip("S"))
        if spatial == 0:
            return
        loops = sch.get_loops(info.block_rv)
        last, first_reduction = loops[spatial - 1], loops[spatial]
        inner = None
        if _indexes_innermost(sch.get(info.block_rv), info.iters[spatial - 1].var):
            last, inner = sch.split(last, [None, _tile(get_extent(sch, last), lanes)])
            sch.reorder(*loops[spatial:], inner)
        outer = [*loops[: spatial - 1], last]
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if _static_product(info.dom()) >= self.parallel_elements:
            sch.parallel(fused)
        if inner is not None:
            _vectorize_unrolled(sch, inner, lanes // 4)
            sch.decompose_reduction(info.block_rv, first_reduction)

    def _partial_vectors(self, sch: s_tir.Schedule, info, lanes: int) -> None:
        """Accumulate ``lanes``-wide vectors of partial results over the innermost reduction
        loop, when it runs along the innermost dimension of what the block reads, then reduce
        each vector (raises :class:`_NotApplicable` otherwise)."""
        kinds = info.dom_kind()
        spatial = len(kinds) - len(kinds.lstrip("S"))
        block = sch.get(info.block_rv)
        if spatial == 0 or kinds[spatial:] != "R" * (len(kinds) - spatial):
            raise _NotApplicable
        if _indexes_innermost(block, info.iters[spatial - 1].var):
            raise _NotApplicable  # the plain rule vectorizes the spatial loop
        reduced = info.iters[-1].var
        if not _reads_along(block, reduced):
            raise _NotApplicable
        loops = sch.get_loops(info.block_rv)
        last = loops[-1]
        if _contiguous_pair(sch, info, block, spatial, loops):  # (h, w) of NCHW: one loop
            last = sch.fuse(loops[-2], loops[-1])
        extent = get_extent(sch, last)
        if not isinstance(extent, int):
            raise _NotApplicable
        width = next((w for w in (lanes, lanes // 2) if w > 1 and extent % w == 0), None)
        # else the widest divisor up to two vectors (14x14: 28 lanes, 7x7: 7), not scalar adds
        width = width or next((d for d in range(2 * lanes, max(lanes // 4, 2) - 1, -1)
                               if extent % d == 0), None)  # fmt: skip
        if width is None:
            raise _NotApplicable
        try:
            _, inner = sch.split(last, [None, width])
            partial = sch.rfactor(inner, factor_axis=len(block.writes[0].region))
            outer = sch.get_loops(partial)[:spatial]
            fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            if _static_product(info.dom()) >= self.parallel_elements:
                sch.parallel(fused)
            sch.reverse_compute_at(info.block_rv, fused)
            sch.vectorize(sch.get_loops(partial)[-1])
            sch.decompose_reduction(partial, sch.get_loops(partial)[1])
        except (s_tir.ScheduleError, tvm.error.InternalError) as err:  # e.g. rfactor's checks
            raise _NotApplicable from err


def _contiguous_pair(sch: s_tir.Schedule, info, block: tirx.SBlock, spatial: int, loops) -> bool:
    """Whether the last two loops reduce the last two dimensions, in full, of every buffer the
    block reads along them: fused, they run along one contiguous row."""
    if len(info.iters) - spatial < 2:
        return False
    outer, inner = info.iters[-2].var, info.iters[-1].var
    extents = [get_extent(sch, loop) for loop in loops[-2:]]
    uses = [r for r in block.reads
            if any(_mentions(x.min, outer) or _mentions(x.min, inner) for x in r.region)]
    return bool(uses) and all(isinstance(e, int) for e in extents) and all(
        len(r.region) >= 2
        and r.region[-2].min.same_as(outer)
        and r.region[-1].min.same_as(inner)
        and [int(d) for d in r.source.shape[-2:]] == extents
        and not any(_mentions(x.min, outer) or _mentions(x.min, inner) for x in r.region[:-2])
        for r in uses
    )


class _NotApplicable(Exception):
    """A schedule rule's variant does not apply to a block."""


def _vectorize_unrolled(sch: s_tir.Schedule, loop, native: int) -> None:
    """Vectorize ``loop`` in vectors of ``native`` lanes (one SIMD register), unrolled where
    it runs several: a loop of 64 float32 as one 64-lane vector made LLVM legalize every wide
    operation, and its index arithmetic, lane group by lane group (an elementwise kernel of
    ResNet-50: 5x slower to compile and 2x slower to run than 4 unrolled 16-lane vectors)."""
    extent = get_extent(sch, loop)
    if isinstance(extent, int) and extent > native and extent % native == 0:
        unrolled, loop = sch.split(loop, [None, native])
        sch.unroll(unrolled)
    sch.vectorize(loop)


def _vector_split(sch: s_tir.Schedule, info, loops: list, lanes: int) -> tuple:
    """The loops of an injective block fused and split into ``(outer, inner)``, ``inner``
    about ``lanes`` long. Where the block reads a buffer broadcast along its trailing loops (a
    per-channel scale in NCHW), only those trailing loops are split, by a tile dividing their
    extent, so that each vector lies in one channel and reads the scale once: a vector across
    channels gathers it lane by lane (slow to run, and to compile)."""
    trailing = _uniform_suffix(sch.get(info.block_rv), [it.var for it in info.iters])
    if 0 < trailing < len(loops):
        group = loops[-trailing:]
        extents = [get_extent(sch, loop) for loop in group]
        if all(isinstance(e, int) for e in extents):
            extent, step = math.prod(extents), max(lanes // 4, 1)
            tile = next((d for d in range(lanes, step - 1, -step) if extent % d == 0), None)
            tile = tile or next((d for d in range(min(lanes, extent), step - 1, -1)
                                 if extent % d == 0), None)  # fmt: skip
            if tile is not None:
                fused = sch.fuse(*group) if len(group) > 1 else group[0]
                middle, inner = sch.split(fused, [None, tile])
                return sch.fuse(*loops[:-trailing], middle), inner
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    return tuple(sch.split(fused, [None, _tile(get_extent(sch, fused), lanes)]))


def _uniform_suffix(block: tirx.SBlock, variables: list) -> int:
    """The number of trailing ``variables`` such that every buffer ``block`` reads is indexed by
    all of them or by none of them (read in full along them, or broadcast)."""
    reads = [{v for x in r.region for v in undefined_vars(x.min)} for r in block.reads]
    for count in range(len(variables), 0, -1):
        suffix = set(variables[-count:])
        if all(not (uses & suffix) or suffix <= uses for uses in reads):
            return count
    return 0


def _reads_along(block: tirx.SBlock, var: tirx.Var) -> bool:
    """Whether ``block`` reads some buffer along ``var`` (its innermost index, trailing
    dimensions of size 1 aside: a 1x1 convolution's ``(O, I, 1, 1)`` weight is a row of
    ``I``) and every buffer it reads with ``var`` there only."""

    def along(region) -> bool:
        inner = _innermost_dimension(region.source)
        return region.region[inner].min.same_as(var) and not any(
            _mentions(x.min, var) for k, x in enumerate(region.region) if k != inner)

    uses = [r for r in block.reads if any(_mentions(x.min, var) for x in r.region)]
    return bool(uses) and all(along(r) for r in uses)


def _innermost_dimension(buffer) -> int:
    """The innermost dimension of ``buffer`` whose size is not a static 1 (0 if none is)."""
    inner = len(buffer.shape) - 1
    while inner > 0 and isinstance(buffer.shape[inner], tirx.IntImm) and (
            int(buffer.shape[inner]) == 1):  # fmt: skip
        inner -= 1
    return inner


def _mentions(expr, var: tirx.Var) -> bool:
    return var in set(undefined_vars(expr))


def _reads_transposed(block: tirx.SBlock, var: tirx.Var) -> bool:
    """Whether ``block`` reads a buffer whose innermost index is ``var``, an outer loop's,
    along rows that vary: not a vector of one value per ``var`` (a batch norm's per-channel
    scale, broadcast along the image, whose kernels were tiled as transposes, reading 32
    channels' rows at once for nothing)."""

    def transposed(region) -> bool:
        return (len(region) > 1 and region[-1].min.same_as(var)
                and not isinstance(region[-2].min, tirx.IntImm))  # fmt: skip

    return any(transposed(r.region) for r in block.reads)


def _indexes_innermost(block: tirx.SBlock, var: tirx.Var) -> bool:
    """Whether every buffer ``block`` writes has ``var`` as its innermost index, and every
    buffer it reads either that or a constant one (a value broadcast along ``var``, e.g. a
    per-row scale in a sum over rows)."""

    def innermost(region, broadcast_ok: bool) -> bool:
        if not region.region:
            return False
        last = region.region[-1]
        if last.min.same_as(var):
            return True
        extent = last.extent
        return broadcast_ok and isinstance(last.min, tirx.IntImm) and int(extent) == 1

    return all(innermost(r, True) for r in block.reads) and all(
        innermost(r, False) for r in block.writes
    )


MAX_INLINED_LOADS = 512
"""The most loads one block may read once the spatial blocks are inlined into it: a chain of
blocks that each read the one before twice (a max-pool gradient's window of ``maximum`` and
``equal`` masks) inlines into an expression exponential in its length, which took dlight's
inlining a minute and LLVM more. Such a function is left to be built as it is."""


def _cpu_blocks(
    func: tirx.PrimFunc, target: Target, least: int = 1, reducing: bool = False
) -> tuple[s_tir.Schedule | None, list]:
    """A schedule of ``func`` and its blocks' infos after inlining the spatial ones (dlight's
    normalization), or ``(None, [])`` off the CPU (an ``llvm`` target), where inlining
    would grow past :data:`MAX_INLINED_LOADS`, or where a rule would find fewer than
    ``least`` blocks or (``reducing``) only injective ones: those are read off ``func``
    before building a schedule, which costs more than most rules' checks."""
    if target.kind.name != "llvm" or not _may_have(func, least, reducing):
        return None, []
    key = tvm_ffi.structural_hash(func)
    for other, sch, infos in _INLINED.get(key, []):
        if other.same_as(func) or tvm_ffi.structural_equal(other, func):
            _INLINED.move_to_end(key)
            return sch.copy(), list(infos)  # the block RVs are valid in the copy
    if inlined_loads(func) > MAX_INLINED_LOADS:
        return None, []
    sch = s_tir.Schedule(func)
    infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch)) or []
    _INLINED.setdefault(key, []).append((func, sch, infos))
    if len(_INLINED) > _INLINED_FUNCS:
        _INLINED.popitem(last=False)
    return sch.copy(), list(infos)


_INLINED: OrderedDict = OrderedDict()
"""Structural hash -> ``[(func, schedule, infos)]`` of :func:`_cpu_blocks`, least recently
used first: each rule that tries a function, in ``FuseRowGroups``' trials and in the schedule
step, starts from a copy of the one normalization and inlining of it (dlight's inlining tries
every pair of blocks, and a function is tried by up to six rules)."""
_INLINED_FUNCS = 1024


def forget_inlined() -> None:
    """Empty :func:`_cpu_blocks`' cache (``relaxgrad.compile`` does after each build, so that
    one compile does not time or keep another's work)."""
    _INLINED.clear()


def _may_have(func: tirx.PrimFunc, least: int, reducing: bool) -> bool:
    """Whether ``func`` has ``least`` blocks, one of them not spatial if ``reducing``: inlining
    only removes blocks, and leaves a spatial block's iterators spatial. A function of scalar
    blocks only (every iterator of extent 1: an optimizer's sum of a model's squared gradient
    norms, one addition a parameter) has no loop to schedule, and normalizing it would cost
    time quadratic in its blocks (2 s for a 16-block transformer's 196)."""
    blocks = sblocks(func)
    if len(blocks) < least or all(_scalar(block) for block in blocks):
        return False
    return not reducing or any(
        int(iv.iter_type) != SPATIAL for block in blocks for iv in block.iter_vars
    )


def _scalar(block: s_tir.SBlock) -> bool:
    """Whether every iterator of ``block`` has extent 1."""
    return all(isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value == 1
               for iv in block.iter_vars)  # fmt: skip


def inlined_loads(func: tirx.PrimFunc) -> int:
    """The most loads any block of ``func`` would read with every spatial block (one without
    a reduction) inlined into its readers: each load of such a block's result counts that
    block's own loads, recursively."""
    spatial = {}  # buffer -> inlined loads of the spatial block that writes it
    most = 0
    for block in sblocks(func):
        loads = []
        tvm_ffi.structural_walk(block.body, [(tvm.ir.TensorLoad, loads.append)])
        size = sum(spatial.get(load.source, 1) for load in loads) or 1
        most = max(most, size)
        if block.init is None and len(block.writes) == 1:
            spatial[block.writes[0].source] = size
        if most > MAX_INLINED_LOADS:
            break  # as good as infinite
    return most


def _vector_lanes(target: Target, dtype) -> int:
    """Elements of ``dtype`` in one SIMD register of ``target`` (128-bit registers if unknown)."""
    return max(_vector_bits(str(target)) // tvm.runtime.DataType(str(dtype)).bits, 1)


@functools.lru_cache(maxsize=64)
def _vector_bits(target: str) -> int:
    """The SIMD register width of the target ``target`` (its JSON): asking LLVM costs about
    0.2 ms, asked for every block of every kernel."""
    try:
        if llvm_cpu_has_features(["avx512f"], Target(target)):
            return 512
        if llvm_cpu_has_features(["avx"], Target(target)):
            return 256
    except Exception:  # noqa: BLE001 (TVM raises for targets LLVM does not know)
        pass
    return 128


def _tile(extent, want: int) -> int:
    """A tile size near ``want`` for a loop of ``extent``: the extent itself when smaller, else
    the largest divisor in ``[want / 2, want]`` (no tail), else ``want``."""
    if not isinstance(extent, int):
        return want
    if extent <= want:
        return extent
    return next((d for d in range(want, want // 2 - 1, -1) if extent % d == 0), want)


def _static_product(extents) -> int:
    """The product of the static extents; a dynamic one counts as large."""
    product = 1
    for extent in extents:
        product *= int(extent) if isinstance(extent, int | tirx.IntImm) else 1 << 20
    return product
