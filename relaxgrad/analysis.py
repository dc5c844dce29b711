"""Measure what a compiled adjoint costs: planned memory after TVM's lowering, and a fast
liveness estimate before it."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import IRModule

from . import _ty
from .transforms.policies import ALIAS_OPS, FREE_OPS, Program, program_from_function

__all__ = [
    "estimate_activation_bytes",
    "live_peak_bytes",
    "planned_memory",
    "planned_memory_split",
]

_STORAGE_OPS = ("relax.vm.alloc_storage", "relax.memory.alloc_storage")
_TENSOR_OPS = ("relax.vm.alloc_tensor", "relax.memory.alloc_tensor")


def planned_memory(mod: IRModule, func_name: str, target: str = "llvm") -> int:
    """Bytes of storage TVM's default pipeline plans for ``mod[func_name]``.

    Runs TVM's default pipeline (legalization, fusion, static memory planning, VM lowering) for
    ``target`` and sums the sizes of the storage the function allocates (and of any tensor the
    planner left to the runtime). Outputs count too: they are allocated like any other tensor.

    Parameters
    ----------
    mod : IRModule
        The module.
    func_name : str
        The function to measure.
    target : str
        The target to lower for.

    Returns
    -------
    int
        The planned bytes.
    """
    return planned_memory_split(mod, func_name, target)["total"]


def planned_memory_split(mod: IRModule, func_name: str, target: str = "llvm") -> dict[str, int]:
    """:func:`planned_memory`, split into the storage of outputs and the rest.

    After lowering, each tensor is allocated from a storage (``alloc_storage`` then
    ``alloc_tensor``) or by the runtime (``builtin.alloc_tensor``). A storage is an *output*
    storage when a tensor allocated from it reaches the function's return (directly, through
    var aliases, tuples or tuple items); for an adjoint that is the result and the gradients.
    Everything else (activations kept for the backward pass, recomputed values, temporaries)
    is *other*.

    Parameters
    ----------
    mod : IRModule
        The module.
    func_name : str
        The function to measure.
    target : str
        The target to lower for.

    Returns
    -------
    dict[str, int]
        ``{"outputs": ..., "other": ..., "total": ...}`` in bytes.
    """
    with tvm.target.Target(target):
        lowered = relax.get_pipeline("default")(mod)
    func = lowered[func_name]
    storage_bytes: dict[int, int] = {}  # storage (or runtime tensor) -> bytes
    sources: dict[int, list[int]] = {}  # var -> the storages (or vars) its value comes from
    for block in func.body.blocks:
        for binding in block.bindings:
            var, value = _ty.key(binding.var), binding.value
            name = _op_name(value)
            if name in _STORAGE_OPS:
                storage_bytes[var] = int(np.prod([int(v) for v in value.args[0].values]))
            elif name == "relax.builtin.alloc_tensor":  # a tensor the planner left to the runtime
                dtype = np.dtype(_ty.dtype_of(value)).itemsize
                storage_bytes[var] = int(np.prod(_ty.static_shape(value))) * dtype
            elif name in _TENSOR_OPS:
                sources[var] = [_ty.key(value.args[0])]
            elif isinstance(value, (relax.Var, relax.Tuple, relax.TupleGetItem)):
                sources[var] = [_ty.key(v) for v in _vars_in(value)]
    outputs: set[int] = set()
    stack = [_ty.key(v) for v in _vars_in(func.body.body)]
    while stack:
        key = stack.pop()
        if key in outputs:
            continue
        outputs.add(key)
        stack.extend(sources.get(key, ()))
    total = sum(storage_bytes.values())
    out = sum(size for key, size in storage_bytes.items() if key in outputs)
    return {"outputs": out, "other": total - out, "total": total}


def _op_name(value) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return str(value.op.name)
    return None


def _vars_in(expr) -> list:
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in _vars_in(f)]
    if isinstance(expr, relax.TupleGetItem):
        return _vars_in(expr.tuple_value)
    return []


def live_peak_bytes(program: Program) -> int:
    """Peak bytes of live non-output intermediates when ``program`` runs in order.

    A value is allocated at its node and freed after its last use (a value never used is
    freed at once); the inputs of a node are still live while its value is allocated.
    Aliases (tuples, tuple items, ``var`` bindings) hold no bytes but keep what they alias
    live; parameters, constants and outputs (and what outputs alias) are not counted.

    Parameters
    ----------
    program : Program
        The function as plain data (from
        :func:`~relaxgrad.transforms.policies.program_from_function`).

    Returns
    -------
    int
        The peak, in bytes.
    """
    nodes = program.nodes
    roots: list[frozenset] = []  # the non-alias nodes whose storage each node's value uses
    for i, node in enumerate(nodes):
        if node.op in ALIAS_OPS:
            roots.append(frozenset().union(*(roots[j] for j in node.inputs)))
        else:
            roots.append(frozenset((i,)))
    excluded = {i for i, n in enumerate(nodes) if n.op in FREE_OPS}
    for o in program.outputs:
        excluded |= roots[o]
    last_use = list(range(len(nodes)))
    for i, node in enumerate(nodes):
        for j in node.inputs:
            for r in roots[j]:
                last_use[r] = i
    dying: dict[int, list[int]] = {}
    for r, i in enumerate(last_use):
        dying.setdefault(i, []).append(r)
    live = peak = 0
    for i, node in enumerate(nodes):
        counted = node.op not in ALIAS_OPS and i not in excluded
        if counted:
            live += node.nbytes
            peak = max(peak, live)
        for r in dying.get(i, ()):
            if nodes[r].op not in ALIAS_OPS and r not in excluded:
                live -= nodes[r].nbytes
    return peak


def estimate_activation_bytes(func: relax.Function) -> int:
    """A fast estimate of the peak bytes of live intermediate tensors of ``func``.

    Walks the bindings of the Relax function in order, before any lowering, and applies
    :func:`live_peak_bytes` (outputs and parameters are not counted; shapes must be static,
    unknown sizes count 0). TVM's memory planner reuses storage the same way, but fusion and
    legalization change which intermediates exist, so compare with the ``"other"`` part of
    :func:`planned_memory_split` as an estimate.

    Parameters
    ----------
    func : relax.Function
        A function whose body is binding blocks (e.g. an adjoint).

    Returns
    -------
    int
        The estimated peak, in bytes.
    """
    return live_peak_bytes(program_from_function(func))
