"""The schedule steps: per PrimFunc, the first rule that works."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import IRModule
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target

from .._module import with_functions
from ..errors import GradientError
from ._common import (
    THREAD_ENV_ATTRS,
    first_line,
    is_gpu,
    is_scheduled,
    sblocks,
    without_unit_reductions,
)
from .columns import ColumnLocal
from .cpu import ParallelLoops, TiledMatmul
from .gpu import FullReduction
from .groups import RowColumnLocal
from .inplace import pending, scheduled_in_place
from .rows import RowLocal

_log = logging.getLogger(__name__)


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
            if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
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
        return with_functions(mod, updates)

    def _schedule(self, name: str, func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
        if pending(func):  # an in-place kernel: its out-of-place original, scheduled
            return scheduled_in_place(func, lambda f: self._schedule(name, f, target))
        self._refuse(name, func)
        tried = []
        func = without_unit_reductions(func)  # which dlight's normalization mishandles
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
                message = f"{rule_name} raised {type(err).__name__}: {first_line(err)}"
                self.errors.setdefault(name, []).append(message)
                tried.append(message)
                _log.debug("%s: %s: %s", self._name, name, message)
                continue
            self.choices[name] = rule_name
            _log.debug("%s: %s scheduled by %s", self._name, name, rule_name)
            return scheduled
        return self._unscheduled(name, target, tried)

    _name = "Schedule"

    def _refuse(self, name: str, func: tirx.PrimFunc) -> None:
        """Raise for a PrimFunc that the rules are known to schedule wrong."""

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
        return is_gpu(target)

    def _refuse(self, name: str, func: tirx.PrimFunc) -> None:
        # TVM's max_pool2d_backward kernel (an argmax block, then a sum over windows), as
        # dlight's Fallback schedules it, loses the first row of some windows on an H200 (the
        # gradient of 2x2 pools of a 2x8x8x8 input: 73 of 1,024 elements wrong; right at
        # 8x16x32x32). relaxgrad's own kernels take the pools a model has (overlapping windows:
        # the gradient rule's gather; tiling ones: ConvToMatmul); the rest are refused.
        if any(b.name_hint == "maxpool_grad_argmax" for b in sblocks(func)):
            raise GradientError(
                f"ScheduleGPU: {name} is TVM's max_pool2d_backward kernel, which dlight's "
                "Fallback schedules wrong on CUDA; relaxgrad takes a max pool's gradient on a "
                "GPU where its windows overlap, or tile an NCHW input of static shape without "
                "padding or ceil_mode"
            )

    def _check(self, func: tirx.PrimFunc, name: str, target: Target) -> None:
        _verify(func, name, target)

    def _unscheduled(self, name: str, target: Target, tried: list[str]) -> None:
        raise GradientError(
            f"ScheduleGPU: no schedule rule could schedule PrimFunc {name} for target "
            f"{target.kind.name} ({'; '.join(tried) or 'no rules given'})"
        )


def default_cpu_rules(min_rows: int = 64) -> list[ScheduleRule]:
    """:class:`TiledMatmul`, then :class:`RowLocal` (functions whose blocks share their rows, as
    softmax's and layer norm's fused gradients), then :class:`ColumnLocal` (column sums with
    the elementwise kernel of their input), then :class:`RowColumnLocal` (row-local blocks
    with sums over the rows, as a layer norm's whole gradient), then :class:`ParallelLoops` for
    everything else, reductions included. The row rules apply from ``min_rows`` rows.

    dlight's ``cpu.Reduction`` is left out: it computes every block under the leading spatial
    loop, so the mean over ``(N, H, W)`` of a batch norm, with its ``x - mean`` epilogue, sweeps
    the whole NCHW tensor per channel (40x slower than :class:`ParallelLoops` on a CNN's batch
    norm, and no faster on softmax and layer norm). So is ``cpu.GEMV``: it vectorizes 128 rows
    around each row's reduction loop, which LLVM took 2 to 5 minutes to compile for a layer
    norm gradient's ``sum(g * gamma)`` over rows of 256 (:class:`ParallelLoops` accumulates
    vector partials along the row instead)."""
    return [TiledMatmul(), RowLocal(min_rows), ColumnLocal(min_rows), RowColumnLocal(min_rows),
            ParallelLoops()]  # fmt: skip


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
        (tirx.AttrStmt, lambda attr: skip if attr.attr_key in THREAD_ENV_ATTRS else None),
        (tirx.BufferStore, lambda store: stores.append(store.buffer.name)),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return stores

