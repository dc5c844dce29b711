"""From a module with adjoints to a VM executable, on CPU and GPU targets.

CPU targets use TVM's default pipeline unchanged. GPU targets use TVM's CUDA pipeline with our
own scheduling step, :class:`ScheduleGPU`, which picks a rule per PrimFunc. TVM 0.27's stock
step (``dlight.ApplyDefaultSchedule``) fails the whole build as soon as one rule raises, and
``gpu.Reduction`` raises on every reduction to a scalar with an epilogue (``R.mean``,
``cross_entropy_with_logits``), that is, on every loss; the next rule, ``GeneralReduction``,
would launch one kernel per input element for it, so :class:`FullReduction` comes first.

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
from tvm.s_tir.dlight.base import max_threads_per_block
from tvm.target import Target

from .errors import GradientError
from .transforms import LowerCallTIRWithGrad

__all__ = [
    "DEFAULT_CUDA_ARCH",
    "FullReduction",
    "ScheduleGPU",
    "compile",
    "default_gpu_rules",
    "gpu_pipeline",
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
        The GPU schedule step; defaults to ``ScheduleGPU()``. Pass your own instance to choose
        the rules or to read its ``choices`` afterwards. Unused for CPU targets.

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
    if not _is_gpu(target):
        return tvm.compile(mod, target)
    return tvm.compile(mod, target, relax_pipeline=gpu_pipeline(target, schedule))


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


def gpu_pipeline(target: Target, schedule: tvm.transform.Pass | None = None) -> tvm.transform.Pass:
    """The Relax pipeline for a GPU target: TVM's CUDA pipeline (relax/backend/cuda/pipeline.py)
    with ``schedule`` (default ``ScheduleGPU()``) as its scheduling step.

    The passes are listed here rather than taken from ``relax.pipeline``, whose
    ``dataflow_lower_passes`` fails for CUDA on TVM 0.27 (the CUDA backend does not export it).
    """
    cuda_graph = [relax.transform.RewriteCUDAGraph()] if target.kind.name == "cuda" else []
    passes = [
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        schedule if schedule is not None else ScheduleGPU(),
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        *cuda_graph,
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]
    return tvm.transform.Sequential(passes, name="relaxgrad.gpu_pipeline")


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


@tvm.transform.module_pass(opt_level=0, name="ScheduleGPU")
class ScheduleGPU:
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

    def __init__(self, rules: Sequence[ScheduleRule] | None = None, verify: bool = True):
        self.rules = list(rules) if rules is not None else default_gpu_rules()
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
                    f"ScheduleGPU: no target for PrimFunc {gvar.name_hint}: run the pass "
                    "inside `with target:` or give the function a target attribute"
                )
            if _is_gpu(target):
                updates[gvar] = self._schedule(gvar.name_hint, func, target)
        if not updates:
            return mod
        mod = mod.clone()  # leave the caller's module as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    def _schedule(self, name: str, func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
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
                    _verify(scheduled, name, target)
            except Exception as err:  # dlight and TIR lowering fail with TVM errors: next rule
                message = f"{rule_name} raised {type(err).__name__}: {_first_line(err)}"
                self.errors.setdefault(name, []).append(message)
                tried.append(message)
                _log.debug("ScheduleGPU: %s: %s", name, message)
                continue
            self.choices[name] = rule_name
            _log.debug("ScheduleGPU: %s scheduled by %s", name, rule_name)
            return scheduled
        raise GradientError(
            f"ScheduleGPU: no schedule rule could schedule PrimFunc {name} for target "
            f"{target.kind.name} ({'; '.join(tried) or 'no rules given'})"
        )


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


def _is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


def _local_cuda_arch() -> str:
    device = tvm.cuda(0)
    if device.exist:
        return "sm_" + device.compute_version.replace(".", "")
    return DEFAULT_CUDA_ARCH


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"
