"""From a module with adjoints to a VM executable, on CPU and GPU targets.

Both kinds of target get TVM's pipeline for their kind with our own scheduling step after
fusion, which picks a rule per PrimFunc. GPU targets use :class:`ScheduleGPU`: TVM 0.27's stock
step (``dlight.ApplyDefaultSchedule``) fails the whole build as soon as one rule raises, and
``gpu.Reduction`` raises on every reduction to a scalar with an epilogue (``R.mean``,
``cross_entropy_with_logits``), that is, on every loss; the next rule, ``GeneralReduction``,
would launch one kernel per input element for it, so :class:`FullReduction` comes first.

CPU targets (by default this machine's CPU, :func:`host_target`) first rewrite, before
legalization, 2-D convolutions and their gradients into im2col/col2im gathers and matmuls
(:class:`ConvToMatmul`), and matmuls of at least ~1M multiply-adds into calls of OpenBLAS's
``sgemm`` (:class:`MatmulToBLAS`; the ``scipy-openblas32`` wheel's, for this machine's CPU).
Then :class:`ScheduleCPU`: ``tvm.compile`` leaves every CPU PrimFunc as naive single-threaded
loops, so a 1024-wide matmul runs about 100 times slower than it could. :class:`TiledMatmul`
gives the remaining matmuls (with their fused epilogues) register tiles, a packed panel of the
right operand, vectorization and threads; :class:`ParallelLoops` parallelizes and vectorizes the
rest. A PrimFunc that no rule schedules is built as it is.

``relaxgrad.compile`` is the function; targets and pipelines live here, the schedule steps and
their rules in ``relaxgrad.schedules``. Both kinds of
target first lower ``call_tir_with_grad`` to ``call_tir`` (it has no lowering of its own).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Mapping

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.target import Target

from ._stack import with_deep_stack
from .cache import cached
from .errors import GradientError
from .schedules import (
    Bf16MatmulToOneDNN,
    ConvToMatmul,
    DuplicateCheapProducers,
    ExactCastPairs,
    FastMath,
    FoldConstantCalls,
    FoldConstantOps,
    FuseColumnSums,
    FuseOpsInOrder,
    FuseRowGroups,
    FuseRowReductions,
    HoldRecomputed,
    IntegerPowers,
    KeepReversedReadsApart,
    LegalizeOpsOnce,
    MatmulToBLAS,
    MeanAsSum,
    MergeSiblingKernels,
    NllLossGradAsMask,
    ReleaseRecomputed,
    ReshapeOutputs,
    RowSparseGradients,
    ScheduleCPU,
    ScheduleGPU,
    SerialVectorLoops,
    ShareStatistics,
    UpdateInPlace,
    WideColumnSums,
    WindowScatter,
    blas,
    default_cpu_rules,
    onednn,
)
from .schedules._common import calls_of, is_gpu
from .schedules.concat import legalize_concat
from .schedules.cpu import forget_inlined
from .schedules.scatter import legalize_take_backward, legalize_take_backward_gpu
from .schedules.scopes import WithoutSeqScopes
from .transforms import LowerCallTIRWithGrad
from .transforms.plan_memory import PackBlockMemory, PlanBlockMemory
from .transforms.simplify import RemoveUnused

__all__ = [
    "DEFAULT_CUDA_ARCH",
    "Executable",
    "compile",
    "cpu_pipeline",
    "cpu_target",
    "gpu_pipeline",
    "host_target",
    "resolve_target",
    "target_device",
]

DEFAULT_CUDA_ARCH = "sm_90"
"""The arch given to a bare ``"cuda"`` target when no CUDA device is present to detect it."""

_log = logging.getLogger(__name__)

builds = 0
"""How many modules this process has built (compiles not served by the cache)."""

rebuilds = 0
"""How many of those CPU builds failed with unchecked schedules and ran again with each
schedule checked (about three times the compile: see :func:`_build_cpu`)."""


def compile(  # noqa: A001 (mirrors tvm.compile)
    mod: IRModule,
    target: str | Mapping | Target | None = None,
    *,
    schedule: tvm.transform.Pass | None = None,
    cache: bool = False,
) -> relax.VMExecutable:
    """Compile a Relax module (e.g. one with ``<name>_adjoint`` functions) to a VM executable.

    Parameters
    ----------
    mod : IRModule
        The module; its Relax functions are legalized, fused, scheduled and built.
    target : str, dict or Target, optional
        By default this machine's CPU (:func:`host_target`: AVX2, AVX-512, ... where it has
        them); ``"llvm"`` for a portable x86-64 (or other architecture) build; ``"cuda"``, a
        JSON-dict target such as ``{"kind": "cuda", "arch": "sm_90"}``, or a
        ``tvm.target.Target``; see :func:`resolve_target`.
    schedule : Pass, optional
        The schedule step; defaults to ``ScheduleGPU()`` for GPU targets and ``ScheduleCPU()``
        for CPU ones (for CPU ones, first unchecked: see :func:`_build_cpu`). Pass your own
        instance to choose the rules or to read its ``choices`` afterwards.
    cache : bool
        Load the executable from :mod:`relaxgrad.cache` when this module was compiled for this
        target before (in any process), and store it there otherwise; ignored with a
        ``schedule`` of your own.

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
    if cache and schedule is None:
        return with_deep_stack(cached, mod, target, lambda: _compile(mod, target, None),
                               _load_cached)
    return with_deep_stack(_compile, mod, target, schedule)


def _load_cached(path: str) -> Executable:
    """An executable that :func:`relaxgrad.cache.cached` stored (``export_library``'s file)."""
    with open(path, "rb") as f:
        data = f.read()
    calls_blas = blas.SGEMM is not None and blas.SGEMM.encode() in data
    calls_onednn = onednn.SYMBOL.encode() in data
    return Executable(tvm.runtime.load_module(path), calls_blas, path, calls_onednn)


#: ``PassContext`` options :func:`compile` sets unless the caller's context sets them.
#: ``tirx.disable_assert``: no argument checks in each kernel's packed-function wrapper (ndim,
#: dtype, shape, strides, alignment, device of every buffer), which the VM calls only with the
#: tensors it allocated or checked itself: it checks the Relax function's parameters against
#: their annotations before any kernel runs (wrong shapes and dtypes still raise, naming the
#: parameter). The checks are most of a training step's machine code and of the time LLVM
#: takes to write it (MobileViT's: 36 -> 10 s to write, 9.7 -> 4.0 MB).
KERNEL_CONFIG = {"tirx.disable_assert": True}


@contextlib.contextmanager
def _kernel_config():
    """The caller's ``PassContext`` with :data:`KERNEL_CONFIG` under its own settings; as it is
    under pass instruments (which a second context would enter again)."""
    current = tvm.transform.PassContext.current()
    if len(current.instruments) > 0 or all(key in current.config for key in KERNEL_CONFIG):
        yield
        return
    with tvm.transform.PassContext(opt_level=current.opt_level,
                                   required_pass=list(current.required_pass),
                                   disabled_pass=list(current.disabled_pass),
                                   config={**KERNEL_CONFIG, **dict(current.config)}):
        yield


def _compile(mod: IRModule, target: Target, schedule) -> relax.VMExecutable:
    with _kernel_config():
        return _build(mod, target, schedule)


def _build(mod: IRModule, target: Target, schedule) -> relax.VMExecutable:
    global builds
    builds += 1
    mod = LowerCallTIRWithGrad()(mod)
    if is_gpu(target):
        return tvm.compile(mod, target, relax_pipeline=gpu_pipeline(target, schedule))
    if target.kind.name == "llvm":
        calls: set[str] = set()
        try:
            built = _build_cpu(mod, cpu_target(target), schedule, calls)
        finally:
            forget_inlined()
        return Executable(built.mod, blas.available(target) and blas.SGEMM in calls,
                          onednn_linked=onednn.available(target) and onednn.SYMBOL in calls)
    return tvm.compile(mod, target)


def _build_cpu(mod: IRModule, target: Target, schedule, calls: set) -> relax.VMExecutable:
    """``mod`` built with :func:`cpu_pipeline`; adds to ``calls`` the library functions its
    kernels call (the marks of the pipeline's result, read by
    :func:`~relaxgrad.schedules._common.calls_of`: reading the LLVM module's text instead took
    0.2-1 s a build). With the default schedule step, the schedules are first taken unchecked
    (``ScheduleCPU(verify=False)``): lowering each function to check it costs about as much
    again as the build's own lowering (2 s of a small MobileNetV2's compile), and the rules'
    schedules lower. Should the build fail, it runs again with each schedule checked, one that
    TVM cannot lower giving way to the next rule."""

    def build(step):
        @tvm.transform.module_pass(opt_level=0, name="relaxgrad.RecordCalls")
        def record(module, _context):
            calls.update(calls_of(module))
            return module

        pipeline = tvm.transform.Sequential([cpu_pipeline(target, step), record])
        return tvm.compile(mod, target, relax_pipeline=pipeline)

    if schedule is not None:
        return build(schedule)
    try:
        return build(ScheduleCPU(default_cpu_rules(), verify=False))
    except GradientError:
        raise
    except Exception as err:  # noqa: BLE001 - a TVM error of the build: again, schedules checked
        lines = str(err).strip().splitlines()  # (TVM's message is its last line)
        _log.info("compile: the build failed with unchecked schedules (%s); building again",
                  lines[-1][:300] if lines else type(err).__name__)
        global rebuilds
        rebuilds += 1
        calls.clear()
        return build(None)


class Executable(relax.VMExecutable):
    """A CPU executable of :func:`compile`: a ``relax.VMExecutable`` whose ``export_library``
    links the OpenBLAS its sgemm calls need (:func:`relaxgrad.schedules.blas.link_options`),
    so that the exported library loads in a process that only has TVM's runtime.

    Parameters
    ----------
    mod : tvm.runtime.Module
        The VM executable's module.
    blas_linked : bool
        Whether the code calls OpenBLAS.
    onednn_linked : bool
        Whether the code calls oneDNN (:mod:`relaxgrad.schedules.onednn`).
    """

    def __init__(self, mod: tvm.runtime.Module, blas_linked: bool, library: str | None = None,
                 onednn_linked: bool = False):
        super().__init__(mod)
        self.blas_linked, self.onednn_linked = blas_linked, onednn_linked
        self.library = library  # the library it was loaded from (relaxgrad.cache)

    def export_library(self, file_name, **kwargs):
        """``relax.VMExecutable.export_library`` with the OpenBLAS's linker options appended
        to ``options``: the library finds it beside itself (``$ORIGIN``), else in the
        ``scipy-openblas32`` wheel it was built with. An executable loaded from the cache is
        that library already: it is copied."""
        if self.library is not None:
            if kwargs:
                raise GradientError(f"export_library: {self.library} is a built library (from "
                                    f"relaxgrad.cache); it cannot be linked again with {kwargs}")
            shutil.copyfile(self.library, file_name)
            return None
        if self.blas_linked:
            kwargs["options"] = [*kwargs.get("options", []), *blas.link_options()]
        if self.onednn_linked:
            kwargs["options"] = [*kwargs.get("options", []), *onednn.link_options()]
        return super().export_library(file_name, **kwargs)


def resolve_target(target: str | Mapping | Target | None) -> Target:
    """A ``Target`` from a string, a JSON-style dict or a ``Target`` (None: :func:`host_target`).

    A CUDA target without an ``arch`` gets the arch of the local GPU, or
    :data:`DEFAULT_CUDA_ARCH` when there is none (TVM itself would pick ``sm_50``).
    """
    if target is None:
        return host_target()
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


def target_device(target: str | Mapping | Target) -> tvm.runtime.Device:
    """The device that code built for ``target`` runs on: the CPU for ``llvm`` and ``c``, else
    device 0 of the target's kind.

    Parameters
    ----------
    target : str, dict or tvm.target.Target
        The target.

    Returns
    -------
    tvm.runtime.Device
        Its device.
    """
    if not isinstance(target, Target):
        target = Target(target)
    kind = target.kind.name
    return tvm.cpu() if kind in ("llvm", "c") else tvm.device(kind, 0)


def cpu_target(target: Target) -> Target:
    """``target`` (an ``llvm`` one) with LLVM's loop vectorizer turned off.

    relaxgrad's CPU schedules vectorize their loops themselves, in TIR; LLVM's loop vectorizer
    only sees the loops TVM leaves scalar, and LLVM 22 (TVM 0.27's) miscompiles some of them
    for every target from AVX2 up: a 16-iteration loop over a fused index reading
    ``a[4 * (i // 32) + i % 4]`` was vectorized as a contiguous load of ``a[4 * (i // 32) + i]``,
    past the end of ``a`` (MobileViT's layer-norm gradient over one patch: the stem
    convolution's weight gradient came out NaN, with a finite loss).
    """
    options = [*target.attrs.get("cl-opt", []), "-vectorize-loops:bool=false"]
    return Target({**target.export(), "cl-opt": list(dict.fromkeys(options))})


def host_target() -> Target:
    """An ``llvm`` target for this machine's CPU (AVX2, FMA, ... where it has them).

    A bare ``"llvm"`` target builds for a generic CPU of its architecture (SSE2 on x86-64),
    which runs anywhere but computes matmuls several times slower.
    """
    return Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def gpu_pipeline(target: Target, schedule: tvm.transform.Pass | None = None) -> tvm.transform.Pass:
    """The Relax pipeline for a GPU target: TVM's CUDA pipeline (relax/backend/cuda/pipeline.py)
    with ``schedule`` (default ``ScheduleGPU()``) as its scheduling step; convolutions as
    im2col and matmuls (:class:`ConvToMatmul`'s GPU form, weight gradients split along K);
    training-mode ``batch_norm`` and ``variance`` written as means (:class:`ShareStatistics`: TVM's
    ``batch_norm`` kernel is one PrimFunc whose reductions dlight's Fallback runs on one thread
    per channel, 57 ms per call at ResNet-50's first stage on an H200); and ``take_backward``
    (an embedding's gradient) legalized as a GPU scatter-add
    (:func:`relaxgrad.schedules.scatter.legalize_take_backward_gpu`), which no dlight rule
    schedules in TVM's legalization.

    The passes are listed here rather than taken from ``relax.pipeline``, whose
    ``dataflow_lower_passes`` fails for CUDA on TVM 0.27 (the CUDA backend does not export it).
    """
    cuda_graph = [relax.transform.RewriteCUDAGraph()] if target.kind.name == "cuda" else []
    schedule = schedule if schedule is not None else ScheduleGPU()
    legalize = LegalizeOpsOnce({"relax.grad.take_backward": legalize_take_backward_gpu})
    before = [HoldRecomputed(), ExactCastPairs(), NllLossGradAsMask(),
              ConvToMatmul(summed_batches=False), ShareStatistics(), WideColumnSums(),
              relax.transform.EliminateCommonSubexpr(), ReleaseRecomputed()]  # fmt: skip
    return _pipeline(schedule, before, [WithoutSeqScopes()], cuda_graph,
                     "relaxgrad.gpu_pipeline", legalize=legalize)  # fmt: skip


def cpu_pipeline(
    target: Target, schedule: tvm.transform.Pass | None = None, min_rows: int = 64
) -> tvm.transform.Pass:
    """The Relax pipeline for an ``llvm`` target: :class:`ExactCastPairs`,
    :class:`RowSparseGradients`,
    :class:`WindowScatter`, :class:`NllLossGradAsMask`, :class:`IntegerPowers`,
    :class:`ConvToMatmul`, :class:`Bf16MatmulToOneDNN`, :class:`MatmulToBLAS`,
    :class:`ShareStatistics`, :class:`MeanAsSum`,
    :class:`WideColumnSums` and ``EliminateCommonSubexpr`` (a batch norm's statistics in its
    forward and gradient, and a convolution's im2col in its forward and weight gradient:
    computed once; a checkpoint policy's recomputations kept apart from what they recompute,
    :class:`HoldRecomputed` before the rewrites, :class:`ReleaseRecomputed` after) and TVM's
    ``RemoveRedundantReshape`` (a reshape of a reshape is one reshape, and one to its input's
    shape none: a language model's bf16 logits went ``(512, V) -> (1, 512, V) -> (512, V)``,
    and the reshapes' blocks kept the cross-entropy's row reductions from merging into one
    pass) before legalization, then
    TVM's CPU pipeline (relax/backend/cpu_generic/pipeline.py, with fusion) with ``schedule``
    (default ``ScheduleCPU()``) as its scheduling step after fusion (``CanonicalizeBindings``, which
    drops the gradient's aliases ``a_adjoint = b``, :class:`RemoveUnused` and
    ``DeadCodeElimination``, which drop the
    tuples of a rewritten batch norm's results that nothing reads: such a tuple kept the
    normalized output from being recomputed where relu's gradient reads it, so relu ran as a
    kernel of its own and the output went through memory, :class:`DuplicateCheapProducers` and
    :class:`FuseRowReductions` before ``FuseOps`` (:class:`FuseOpsInOrder`: each fused kernel
    where its last operation was), :class:`FuseColumnSums` after it,
    :class:`FuseRowGroups` after ``FuseTIR``), then serial loops over ``sinh`` and ``cosh``,
    which LLVM cannot build vectorized, and over blocks of several results, which TVM builds
    wrong vectorized (:class:`SerialVectorLoops`), and float32 ``exp``, ``tanh`` and
    ``sigmoid`` as vectorizable polynomials (:class:`FastMath`).

    ``min_rows``: the fewest rows a function must have for the row and column rewrites
    (``FuseRowReductions``, ``FuseColumnSums``, ``FuseRowGroups`` and, with the default
    schedule, their rules) to apply; below it their thread handoffs cost more than they save
    (``bench/fuzz.py --compiled --min-rows 1`` exercises them on small random programs).

    Legalization is :class:`LegalizeOpsOnce`: ``LegalizeOps`` with each operator's
    legalization reused for the later calls of the same kind (same PrimFuncs, half the time on
    a transformer's adjoint), ``take_backward`` (an embedding's gradient) as a parallel
    scatter-add (:mod:`relaxgrad.schedules.scatter`) instead of TVM's serial loops, and
    ``concat`` as a copy per part (:mod:`relaxgrad.schedules.concat`) instead of a select
    per element.

    ``tvm.compile`` itself uses the generic pipeline for CPU targets, which does not fuse (TVM
    worries about pure packed calls kept for their side effects; adjoints have none). The
    functions compute the same values; a fused matmul keeps its epilogue in the matmul's tiles.
    """
    schedule = schedule if schedule is not None else ScheduleCPU(default_cpu_rules(min_rows))
    summed = blas.available(target)  # no OpenBLAS for another CPU architecture
    before = [HoldRecomputed(), ExactCastPairs(), RowSparseGradients(), WindowScatter(),
              NllLossGradAsMask(), IntegerPowers(), ConvToMatmul(summed), Bf16MatmulToOneDNN(),
              MatmulToBLAS(), ShareStatistics(), MeanAsSum(), WideColumnSums(),
              relax.transform.EliminateCommonSubexpr(), ReleaseRecomputed(),
              relax.transform.RemoveRedundantReshape()]  # fmt: skip
    return _pipeline(
        schedule, before,
        [SerialVectorLoops(), FastMath(), WithoutSeqScopes(), MergeSiblingKernels()], [],
        "relaxgrad.cpu_pipeline",
        before_fusing=[
            relax.transform.CanonicalizeBindings(),
            RemoveUnused(),  # linear in the bindings; then TVM's for the unused functions
            relax.transform.DeadCodeElimination(),
            DuplicateCheapProducers(),
            FuseRowReductions(min_rows),
        ],
        after_fusing=[FuseColumnSums(min_rows)],
        after_fusing_tir=[UpdateInPlace(), FuseRowGroups(min_rows)],
        legalize=LegalizeOpsOnce({"relax.grad.take_backward": legalize_take_backward,
                                  "relax.concat": legalize_concat}),
    )  # fmt: skip


def _pipeline(
    schedule: tvm.transform.Pass,
    before_legalizing: list[tvm.transform.Pass],
    after_scheduling: list[tvm.transform.Pass],
    after_planning: list[tvm.transform.Pass],
    name: str,
    before_fusing: list[tvm.transform.Pass] = (),
    after_fusing: list[tvm.transform.Pass] = (),
    after_fusing_tir: list[tvm.transform.Pass] = (),
    legalize: tvm.transform.Pass | None = None,
) -> tvm.transform.Pass:
    """Fold constant operator calls (:class:`FoldConstantOps`), legalize (``legalize``, default
    TVM's ``LegalizeOps``), fold the constant kernels left (:class:`FoldConstantCalls`), fuse,
    ``schedule``, then TVM's lowering and VM passes."""
    passes = [
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        *before_legalizing,
        FoldConstantOps(),  # most of what FoldConstantCalls would build a kernel for
        legalize if legalize is not None else relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        KeepReversedReadsApart(),  # TVM builds a fused flip's index one element off
        FoldConstantCalls(),  # TVM's FoldConstant: a build per call, quadratic in bindings
        *before_fusing,
        FuseOpsInOrder(),  # FuseOps, then each kernel where its last operation was
        *after_fusing,
        relax.transform.FuseTIR(),
        *after_fusing_tir,
        schedule,
        *after_scheduling,
        relax.transform.RewriteDataflowReshape(),
        ReshapeOutputs(),  # and the function's results that copy a kernel's output
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        PackBlockMemory(),  # temporaries of static shape: one storage, packed by lifetime
        PlanBlockMemory(),  # StaticPlanBlockMemory, safe for If (see plan_memory.py)
        *after_planning,
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]
    return tvm.transform.Sequential(passes, name=name)


def _local_cuda_arch() -> str:
    device = tvm.cuda(0)
    if device.exist:
        return "sm_" + device.compute_version.replace(".", "")
    return DEFAULT_CUDA_ARCH
