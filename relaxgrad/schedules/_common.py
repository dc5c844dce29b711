"""Small helpers shared by the schedule step and its rules."""

from __future__ import annotations

import tvm_ffi
from tvm import tirx
from tvm.target import Target

THREAD_ENV_ATTRS = ("thread_extent", "virtual_thread")


def is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Marked scheduled, or already binding GPU threads (e.g. TVM's own CUDA kernels of
    ``scatter_elements``, which legalization emits without the mark)."""
    if func.attrs and func.attrs.get("tirx.is_scheduled", False):
        return True
    found = []
    callbacks = [
        (tirx.For, lambda loop: found.append(loop) if loop.kind == tirx.ForKind.THREAD_BINDING
         else None),
        (tirx.AttrStmt, lambda attr: found.append(attr) if attr.attr_key in THREAD_ENV_ATTRS
         else None),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return bool(found)



def first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"
