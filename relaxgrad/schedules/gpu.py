"""GPU schedule rules of our own (dlight supplies the rest)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline_contiguous_spatial
from tvm.s_tir.dlight.base import max_threads_per_block
from tvm.target import Target

from ._common import is_gpu


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
        if not is_gpu(target):
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
