"""Measure what a compiled adjoint costs: planned memory after TVM's lowering."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import IRModule

from . import _ty

__all__ = ["planned_memory"]


def planned_memory(mod: IRModule, func_name: str, target: str = "llvm") -> int:
    """Bytes of storage TVM's default pipeline plans for ``mod[func_name]``.

    Runs TVM's default pipeline (legalization, fusion, static memory planning, VM lowering) for
    ``target`` and sums the sizes of the storage the function allocates (and of any tensor the
    planner left to the runtime). Outputs count too: they are allocated like any other tensor.
    """
    target = tvm.target.Target(target)
    with target:
        lowered = relax.get_pipeline("default")(mod)
    total = 0
    for block in lowered[func_name].body.blocks:
        for binding in block.bindings:
            total += _allocated_bytes(binding.value)
    return total


def _allocated_bytes(value) -> int:
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return 0
    name = str(value.op.name)
    if name in ("relax.vm.alloc_storage", "relax.memory.alloc_storage"):
        return int(np.prod([int(v) for v in value.args[0].values]))
    if name == "relax.builtin.alloc_tensor":  # a tensor the planner left to the runtime
        dtype = _ty.dtype_of(value)
        return int(np.prod(_ty.static_shape(value))) * np.dtype(dtype).itemsize
    return 0
