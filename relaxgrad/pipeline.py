"""From a module with adjoints to a VM executable, on CPU and GPU targets.

Both kinds of target get TVM's pipeline for their kind with our own scheduling step after
fusion, which picks a rule per PrimFunc. GPU targets use :class:`ScheduleGPU`: TVM 0.27's stock
step (``dlight.ApplyDefaultSchedule``) fails the whole build as soon as one rule raises, and
``gpu.Reduction`` raises on every reduction to a scalar with an epilogue (``R.mean``,
``cross_entropy_with_logits``), that is, on every loss; the next rule, ``GeneralReduction``,
would launch one kernel per input element for it, so :class:`FullReduction` comes first.

CPU targets use :class:`ScheduleCPU`: ``tvm.compile`` leaves every CPU PrimFunc as naive
single-threaded loops, so a 1024-wide matmul runs about 100 times slower than it could.
:class:`TiledMatmul` gives matmuls (with their fused epilogues) register tiles, a packed
panel of the right operand, vectorization and threads; :class:`ParallelLoops` parallelizes and
vectorizes the rest. A PrimFunc that no rule schedules is built as it is.

``relaxgrad.compile`` is the function; the rest lives in ``relaxgrad.pipeline``. Both kinds of
target first lower ``call_tir_with_grad`` to ``call_tir`` (it has no lowering of its own).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline_contiguous_spatial
from tvm.s_tir.dlight.base import get_extent, max_threads_per_block
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

from .errors import GradientError
from .transforms import LowerCallTIRWithGrad

__all__ = [
    "DEFAULT_CUDA_ARCH",
    "FullReduction",
    "ParallelLoops",
    "ScheduleCPU",
    "ScheduleGPU",
    "TiledMatmul",
    "compile",
    "cpu_pipeline",
    "default_cpu_rules",
    "default_gpu_rules",
    "gpu_pipeline",
    "host_target",
    "resolve_target",
]

DEFAULT_CUDA_ARCH = "sm_90"
"""The arch given to a bare ``"cuda"`` target when no CUDA device is present to detect it."""

_log = logging.getLogger(__name__)


def compile(  # noqa: A001 (mirrors tvm.compile)
    mod: IRModule,
    target: str | Mapping | Target = "llvm",
    *,
    schedule: tvm.transform.Pass | None = None,
) -> relax.VMExecutable:
    """Compile a Relax module (e.g. one with ``<name>_adjoint`` functions) to a VM executable.

    Parameters
    ----------
    mod : IRModule
        The module; its Relax functions are legalized, fused, scheduled and built.
    target : str, dict or Target
        ``"llvm"``, ``"cuda"``, a JSON-dict target such as ``{"kind": "cuda", "arch": "sm_90"}``,
        or a ``tvm.target.Target``; see :func:`resolve_target`.
    schedule : Pass, optional
        The schedule step; defaults to ``ScheduleGPU()`` for GPU targets and ``ScheduleCPU()``
        for CPU ones. Pass your own instance to choose the rules or to read its ``choices``
        afterwards.

    Returns
    -------
    relax.VMExecutable
        Load it with ``relax.VirtualMachine(executable, device)``.

    Raises
    ------
    GradientError
        If ``mod`` is not an IRModule, the target is malformed, or a PrimFunc has no GPU schedule.
    """
    if not isinstance(mod, IRModule):
        raise GradientError(f"compile: expected an IRModule, got {type(mod).__name__}")
    target = resolve_target(target)
    mod = LowerCallTIRWithGrad()(mod)
    if _is_gpu(target):
        return tvm.compile(mod, target, relax_pipeline=gpu_pipeline(target, schedule))
    if target.kind.name == "llvm":
        return tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target, schedule))
    return tvm.compile(mod, target)


def resolve_target(target: str | Mapping | Target) -> Target:
    """A ``Target`` from a string, a JSON-style dict or a ``Target``.

    A CUDA target without an ``arch`` gets the arch of the local GPU, or
    :data:`DEFAULT_CUDA_ARCH` when there is none (TVM itself would pick ``sm_50``).
    """
    if isinstance(target, Target):
        return target
    if isinstance(target, str) and target.strip() == "cuda":
        target = {"kind": "cuda"}
    if isinstance(target, Mapping):
        target = dict(target)
        if target.get("kind") == "cuda" and "arch" not in target:
            target["arch"] = _local_cuda_arch()
    elif not isinstance(target, str):
        raise GradientError(
            f"compile: target must be a str, dict or tvm.target.Target, not {type(target).__name__}"
        )
    try:
        return Target(target)
    except Exception as err:  # TVM raises ValueError or TVMError depending on the form
        raise GradientError(f"compile: invalid target {target!r}: {err}") from err


def host_target() -> Target:
    """An ``llvm`` target for this machine's CPU (AVX2, FMA, ... where it has them).

    A bare ``"llvm"`` target builds for a generic CPU of its architecture (SSE2 on x86-64),
    which runs anywhere but computes matmuls several times slower.
    """
    return Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def gpu_pipeline(target: Target, schedule: tvm.transform.Pass | None = None) -> tvm.transform.Pass:
    """The Relax pipeline for a GPU target: TVM's CUDA pipeline (relax/backend/cuda/pipeline.py)
    with ``schedule`` (default ``ScheduleGPU()``) as its scheduling step.

    The passes are listed here rather than taken from ``relax.pipeline``, whose
    ``dataflow_lower_passes`` fails for CUDA on TVM 0.27 (the CUDA backend does not export it).
    """
    cuda_graph = [relax.transform.RewriteCUDAGraph()] if target.kind.name == "cuda" else []
    schedule = schedule if schedule is not None else ScheduleGPU()
    return _pipeline(schedule, cuda_graph, "relaxgrad.gpu_pipeline")


def cpu_pipeline(target: Target, schedule: tvm.transform.Pass | None = None) -> tvm.transform.Pass:
    """The Relax pipeline for an ``llvm`` target: TVM's CPU pipeline
    (relax/backend/cpu_generic/pipeline.py, with fusion) with ``schedule`` (default
    ``ScheduleCPU()``) as its scheduling step after fusion.

    ``tvm.compile`` itself uses the generic pipeline for CPU targets, which does not fuse (TVM
    worries about pure packed calls kept for their side effects; adjoints have none). The
    functions compute the same values; a fused matmul keeps its epilogue in the matmul's tiles.
    """
    del target  # the schedule reads each PrimFunc's target, or the current one
    schedule = schedule if schedule is not None else ScheduleCPU()
    return _pipeline(schedule, [], "relaxgrad.cpu_pipeline")


def _pipeline(
    schedule: tvm.transform.Pass, after_planning: list[tvm.transform.Pass], name: str
) -> tvm.transform.Pass:
    """Legalize, fuse, ``schedule``, then TVM's lowering and VM passes."""
    passes = [
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        schedule,
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        *after_planning,
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]
    return tvm.transform.Sequential(passes, name=name)


def default_gpu_rules() -> list[ScheduleRule]:
    """dlight's CUDA rules in TVM's order, with :class:`FullReduction` before
    ``GeneralReduction`` (which schedules a reduction to a scalar as one launch per element)."""
    return [
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.Reduction(),
        FullReduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


class _ScheduleStep:
    """Schedule every unscheduled PrimFunc for the step's kind of target with the first rule
    that works for it; :class:`ScheduleGPU` and :class:`ScheduleCPU` differ in the kind, the
    checks and what happens to a PrimFunc that no rule schedules."""

    def __init__(self, rules: Sequence[ScheduleRule], verify: bool):
        self.rules = list(rules)
        self.verify = verify
        self.choices: dict[str, str] = {}
        self.errors: dict[str, list[str]] = {}

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        self.choices, self.errors = {}, {}
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            target = func.attrs.get("target") if func.attrs else None
            target = target or Target.current(allow_none=True)
            if target is None:
                raise GradientError(
                    f"{self._name}: no target for PrimFunc {gvar.name_hint}: run the pass "
                    "inside `with target:` or give the function a target attribute"
                )
            if self._wants(target):
                scheduled = self._schedule(gvar.name_hint, func, target)
                if scheduled is not None:
                    updates[gvar] = scheduled
        if not updates:
            return mod
        mod = mod.clone()  # leave the caller's module as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    def _schedule(self, name: str, func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
        tried = []
        for rule in self.rules:
            rule_name = type(rule).__name__
            try:
                sch = rule.apply(func, target, False)
                if sch is None:
                    tried.append(f"{rule_name} does not apply")
                    continue
                scheduled = _first(sch).mod["main"].with_attr("tirx.is_scheduled", True)
                if self.verify:
                    self._check(scheduled, name, target)
            except Exception as err:  # dlight and TIR lowering fail with TVM errors: next rule
                message = f"{rule_name} raised {type(err).__name__}: {_first_line(err)}"
                self.errors.setdefault(name, []).append(message)
                tried.append(message)
                _log.debug("%s: %s: %s", self._name, name, message)
                continue
            self.choices[name] = rule_name
            _log.debug("%s: %s scheduled by %s", self._name, name, rule_name)
            return scheduled
        return self._unscheduled(name, target, tried)

    _name = "Schedule"

    def _wants(self, target: Target) -> bool:
        raise NotImplementedError

    def _check(self, func: tirx.PrimFunc, name: str, target: Target) -> None:
        raise NotImplementedError

    def _unscheduled(self, name: str, target: Target, tried: list[str]) -> tirx.PrimFunc | None:
        raise NotImplementedError


@tvm.transform.module_pass(opt_level=0, name="ScheduleGPU")
class ScheduleGPU(_ScheduleStep):
    """Schedule every unscheduled GPU PrimFunc with the first rule that works for it.

    A rule returning ``None`` does not apply. A rule that raises, or whose schedule fails the
    checks of ``verify``, is recorded in ``errors`` and the next rule is tried:
    the choice is per function. After a run, ``choices`` maps each PrimFunc name to the name of
    its rule. A PrimFunc that no rule schedules raises :class:`GradientError`.

    Parameters
    ----------
    rules : list of ScheduleRule, optional
        Tried in order; defaults to :func:`default_gpu_rules`.
    verify : bool
        Before accepting a schedule, check that every store is inside a GPU thread binding
        (TVM 0.27 would compile one outside to host code on device memory) and run it through
        TVM's TIR lowering (which catches e.g. a cross-thread reduction whose combiner TVM
        cannot match, and would otherwise fail the whole build).
    """

    _name = "ScheduleGPU"

    def __init__(self, rules: Sequence[ScheduleRule] | None = None, verify: bool = True):
        super().__init__(rules if rules is not None else default_gpu_rules(), verify)

    def _wants(self, target: Target) -> bool:
        return _is_gpu(target)

    def _check(self, func: tirx.PrimFunc, name: str, target: Target) -> None:
        _verify(func, name, target)

    def _unscheduled(self, name: str, target: Target, tried: list[str]) -> None:
        raise GradientError(
            f"ScheduleGPU: no schedule rule could schedule PrimFunc {name} for target "
            f"{target.kind.name} ({'; '.join(tried) or 'no rules given'})"
        )


def default_cpu_rules() -> list[ScheduleRule]:
    """:class:`TiledMatmul`, dlight's CPU rules (``GEMV``, ``Reduction``: softmax-like
    functions), then :class:`ParallelLoops` for everything else."""
    return [TiledMatmul(), dl.cpu.GEMV(), dl.cpu.Reduction(), ParallelLoops()]


@tvm.transform.module_pass(opt_level=0, name="ScheduleCPU")
class ScheduleCPU(_ScheduleStep):
    """Schedule every unscheduled ``llvm`` PrimFunc with the first rule that works for it.

    As :class:`ScheduleGPU` (per-function choice, ``choices``, ``errors``), except that a
    PrimFunc that no rule schedules is left as it was: the CPU runs naive loops too.

    Parameters
    ----------
    rules : list of ScheduleRule, optional
        Tried in order; defaults to :func:`default_cpu_rules`.
    verify : bool
        Before accepting a schedule, run it through TVM's TIR lowering, so that a schedule
        TVM cannot lower falls through to the next rule instead of failing the build.
    """

    _name = "ScheduleCPU"

    def __init__(self, rules: Sequence[ScheduleRule] | None = None, verify: bool = True):
        super().__init__(rules if rules is not None else default_cpu_rules(), verify)

    def _wants(self, target: Target) -> bool:
        return target.kind.name == "llvm"

    def _check(self, func: tirx.PrimFunc, name: str, target: Target) -> None:
        _lower(func, name, target if target.host is not None else target.with_host(target))

    def _unscheduled(self, name: str, target: Target, tried: list[str]) -> None:
        _log.debug("ScheduleCPU: %s left unscheduled (%s)", name, "; ".join(tried))
        return None


def _first(sch: s_tir.Schedule | list[s_tir.Schedule]) -> s_tir.Schedule:
    return sch[0] if isinstance(sch, list) else sch


def _verify(func: tirx.PrimFunc, name: str, target: Target) -> None:
    """Check that a scheduled ``func`` runs on the device and survives TVM's TIR lowering."""
    outside = _host_stores(func)
    if outside:
        # TVM 0.27's VerifyMemory lets these through: the host would write device memory.
        raise GradientError(
            f"ScheduleGPU: the schedule of {name} writes {', '.join(sorted(set(outside)))} "
            "outside any GPU thread binding (did the rule forget to bind?)"
        )
    if target.host is None:
        target = target.with_host(Target("llvm" if tvm.runtime.enabled("llvm") else "c"))
    _lower(func, name, target)


def _lower(func: tirx.PrimFunc, name: str, target: Target) -> None:
    """Run ``func`` through TVM's TIR lowering for ``target`` (raises where TVM would)."""
    lower, _, _ = tvm.tirx.get_default_tir_pipeline(target)
    func = func.with_attr("target", target).with_attr("global_symbol", name)
    with target:
        lower(IRModule({name: func}))


def _host_stores(func: tirx.PrimFunc) -> list[str]:
    """Names of the buffers that ``func`` writes outside every thread binding."""
    stores, skip = [], tvm_ffi.WalkResult.SKIP
    callbacks = [
        (tirx.For, lambda loop: skip if loop.kind == tirx.ForKind.THREAD_BINDING else None),
        (tirx.AttrStmt, lambda attr: skip if attr.attr_key in _THREAD_ENV_ATTRS else None),
        (tirx.BufferStore, lambda store: stores.append(store.buffer.name)),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return stores


_THREAD_ENV_ATTRS = ("thread_extent", "virtual_thread")


class FullReduction(ScheduleRule):
    """Reductions to a scalar, with scalar epilogues: one block, one cross-thread reduction.

    Applies when every block (after inlining spatial prologues) has no spatial extent, e.g.
    ``mean`` (sum, then divide) or ``cross_entropy_with_logits`` fused with an add. Each
    reduction runs on ``threads`` threads that each reduce a strided slice and then combine;
    the epilogues run on the same block after it. One thread block does all the work, which
    suits loss-sized inputs; reductions of many millions of elements want a multi-block one.
    """

    def __init__(self, threads: int = 1024):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not _is_gpu(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        infos = try_inline_contiguous_spatial(sch, infos) if infos else None
        if not infos or not all(_is_scalar_block(info) for info in infos):
            return None
        reduces = ["R" in info.dom_kind() for info in infos]
        if not any(reduces):
            return None
        threads = min(self.threads, max_threads_per_block(target))
        last = infos[-1].block_rv
        if reduces[-1]:
            bx = sch.add_unit_loop(_thread_reduce(sch, last, threads))
        else:
            bx = sch.add_unit_loop(last)
            sch.bind(sch.add_unit_loop(last), "threadIdx.x")
        sch.bind(bx, "blockIdx.x")
        for info, reduce in zip(reversed(infos[:-1]), reversed(reduces[:-1]), strict=True):
            block = info.block_rv
            # A cross-thread result is written by one thread and read by all: shared memory.
            for i, _ in enumerate(sch.get(block).writes):
                sch.set_scope(block, i, "shared" if reduce else "local")
            sch.compute_at(block, bx, preserve_unit_loops=True)
            if reduce:
                _thread_reduce(sch, block, threads, skip=1)
            else:
                sch.bind(sch.add_unit_loop(block), "threadIdx.x")
        return sch


def _thread_reduce(sch: s_tir.Schedule, block, threads: int, skip: int = 0):
    """Fuse the loops of ``block`` (below the first ``skip``) and bind them to ``threads``
    threads, each reducing a strided slice; returns the thread loop."""
    fused = sch.fuse(*sch.get_loops(block)[skip:])
    serial, tx = sch.split(fused, [None, threads])
    sch.reorder(tx, serial)
    sch.bind(tx, "threadIdx.x")
    return tx


def _is_scalar_block(info) -> bool:
    """No iteration but reductions and unit spatial iters (normalization adds those)."""
    return all(
        it.kind == "R"
        or (it.kind == "S" and isinstance(it.dom, int | tirx.IntImm) and int(it.dom) == 1)
        for it in info.iters
    )


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
            tvm_ffi.structural_equal(a.min, b.min) and _is_one(a.extent)
            for a, b in zip(r.region, write.region, strict=True)
        )
        for r in reads
    )


def _is_one(expr) -> bool:
    return isinstance(expr, int | tirx.IntImm) and int(expr) == 1


def _operand_with(block: tirx.SBlock, position: int) -> int:
    """The index in ``block.reads`` of the operand indexed by the block's ``position``-th iter."""
    var = block.iter_vars[position].var
    for index, read in enumerate(block.reads):
        if any(var in set(undefined_vars(r.min)) for r in read.region):
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
        if target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        infos = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        if not infos:
            return None
        for info in infos:
            dtype = sch.get(info.block_rv).writes[0].source.dtype
            lanes = 4 * _vector_lanes(target, dtype)  # a few vectors per iteration
            if info.is_injective():
                self._injective(sch, info, lanes)
            else:
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
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            outer, inner = sch.split(fused, [None, _tile(get_extent(sch, fused), lanes)])
        sch.vectorize(inner)
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
            sch.vectorize(inner)
            sch.decompose_reduction(info.block_rv, first_reduction)


def _reads_transposed(block: tirx.SBlock, var: tirx.Var) -> bool:
    """Whether ``block`` reads a buffer whose innermost index is ``var``, an outer loop's."""
    return any(r.region and r.region[-1].min.same_as(var) for r in block.reads)


def _indexes_innermost(block: tirx.SBlock, var: tirx.Var) -> bool:
    """Whether every buffer ``block`` reads or writes has ``var`` as its innermost index."""
    regions = [*block.reads, *block.writes]
    return all(r.region and r.region[-1].min.same_as(var) for r in regions)


def _vector_lanes(target: Target, dtype) -> int:
    """Elements of ``dtype`` in one SIMD register of ``target`` (128-bit registers if unknown)."""
    bits = 128
    try:
        if llvm_cpu_has_features(["avx512f"], target):
            bits = 512
        elif llvm_cpu_has_features(["avx"], target):
            bits = 256
    except Exception:  # noqa: BLE001 (TVM raises for targets LLVM does not know)
        pass
    return max(bits // tvm.runtime.DataType(str(dtype)).bits, 1)


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


def _is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    """Marked scheduled, or already binding GPU threads (e.g. TVM's own CUDA kernels of
    ``scatter_elements``, which legalization emits without the mark)."""
    if func.attrs and func.attrs.get("tirx.is_scheduled", False):
        return True
    found = []
    callbacks = [
        (tirx.For, lambda loop: found.append(loop) if loop.kind == tirx.ForKind.THREAD_BINDING
         else None),
        (tirx.AttrStmt, lambda attr: found.append(attr) if attr.attr_key in _THREAD_ENV_ATTRS
         else None),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return bool(found)


def _local_cuda_arch() -> str:
    device = tvm.cuda(0)
    if device.exist:
        return "sm_" + device.compute_version.replace(".", "")
    return DEFAULT_CUDA_ARCH


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"
