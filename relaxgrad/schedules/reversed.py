"""Kernels that read an index decreasing along a loop (``flip``, a negative stride) kept out of
fusion (a pass after ``AnnotateTIROpPattern``, before ``FuseOps``).

Fused with what it reads through a reshape, a ``flip`` reads ``x[(3 - v) // 2, (3 - v) % 2]``,
and TVM 0.27 builds such a ``floordiv`` / ``floormod`` of a decreasing index wrong: the kernel
read the element one past the right one (a flipped outer product of two values gave
``[21, 12, 11, 2]`` for ``[22, 21, 12, 11]``; ``bench/fuzz.py --compiled`` found it in a
program's loss, off by 1.3%). ``tvm.compile`` does not fuse, so each of its kernels reads a
decreasing index of a buffer of its own shape, without dividing it, and is right.
:class:`KeepReversedReadsApart` marks each legalized kernel that reads or writes a decreasing
index opaque, so that ``FuseOps`` leaves it its own kernel, as ``tvm.compile`` runs it.
"""

from __future__ import annotations

import tvm
import tvm.sym
import tvm_ffi
from tvm import tirx
from tvm.ir import IRModule, TensorLoad

from .. import _ty
from .._module import with_functions
from ._common import OPAQUE


@tvm.transform.module_pass(opt_level=0, name="KeepReversedReadsApart")
class KeepReversedReadsApart:
    """Mark the PrimFuncs that index a buffer with a decreasing index ``op_pattern`` opaque
    (see the module docstring). ``marked`` counts them in the last run."""

    def __init__(self):
        self.marked = 0

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
                continue
            pattern = func.attrs.get("op_pattern", None)
            if pattern is not None and int(pattern) < OPAQUE and _indexes_decreasing(func):
                updates[gvar] = func.with_attr("op_pattern", OPAQUE)
        self.marked = len(updates)
        return with_functions(mod, updates)


def _indexes_decreasing(func: tirx.PrimFunc) -> bool:
    found = []

    def check(access) -> None:
        if any(decreasing(index) for index in access.indices):
            found.append(access)

    tvm_ffi.structural_walk(func.body, [((TensorLoad, tirx.BufferStore), check)])
    return bool(found)


def decreasing(index) -> bool:
    """Whether ``index`` is linear in its vars with a negative coefficient on one (a reshape's
    ``v // 56`` is not linear: its kernels fuse as before)."""
    seen: dict = {}

    def add(var) -> None:
        seen[_ty.key(var)] = var

    tvm_ffi.structural_walk(index, [(tirx.Var, add)])
    if not seen:
        return False
    terms = tvm.sym.detect_linear_equation(index, list(seen.values()))
    return bool(terms) and any(isinstance(c, tirx.IntImm) and c.value < 0 for c in terms[:-1])
