"""Independent kernels that read a common tensor, merged under one parallel loop (a pass over
the scheduled module, CPU).

A batch norm's backward reduces its output's gradient twice per channel, for its bias's
gradient (``sum g``) and its scale's (``sum g * xhat``), and a residual block's downsampling
shortcut reduces the same gradient a third time. Each kernel ran one parallel loop over the
channels and streamed the whole gradient from memory (ResNet-50 at batch 8: 8x256x56x56,
25.7 MB, three times). :class:`MergeSiblingKernels` puts such kernels' bodies under one loop:
each iteration runs the first kernel's body, then the second's, which finds its slice of the
common tensor (a channel's, 100 KB) still in cache.

Two ``call_tir`` bindings of one dataflow block are merged when:

- their PrimFuncs are scheduled, without calls out of TIR (no BLAS) and not reshapes (which
  become views later), and each is one parallel loop of the same extent (its root block's
  allocations aside);
- they read a common tensor of at least ``min_bytes``, within ``window`` bindings of each other;
- neither reads the other's result, and no binding between them reads the first's (the merged
  call takes the second's place; later kernels can join it the same way).

The values are unchanged: each body computes what it did, in the same order within its
iteration, and the two never write a common buffer.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule

from .. import _ty
from ._common import is_op, static_shape, with_dataflow_blocks
from .columns import _is_call_tir

_EXTERN = ("tirx.call_extern", "tirx.call_packed", "tirx.call_pure_extern")


@tvm.transform.module_pass(opt_level=0, name="MergeSiblingKernels")
class MergeSiblingKernels:
    """Merge independent scheduled kernels that read a common tensor into one parallel loop
    (see the module docstring). ``merged`` counts the kernels that joined another in the last
    run."""

    def __init__(self, min_bytes: int = 1 << 20, window: int = 8):
        self.min_bytes, self.window = min_bytes, window
        self.merged = 0

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        merger = _Merger(mod, self.min_bytes, self.window)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                new = merger.rewrite(func)
                if new is not None:
                    merger.builder.update_func(gvar, new)
        self.merged = merger.merged
        return merger.builder.get() if merger.merged else mod


class _Group:
    """Kernels to run as one: their bindings, the loop extent they share, what they read and
    the vars they bind."""

    def __init__(self, binding, extent: int, args: list, since: int):
        self.members, self.extent = [binding], extent
        self.args, self.outs = set(args), {binding.var}
        self.since, self.position = since, -1

    def add(self, binding, args: list, since: int) -> None:
        self.members.append(binding)
        self.args |= set(args)
        self.outs.add(binding.var)
        self.since = since


class _Merger:
    def __init__(self, mod: IRModule, min_bytes: int, window: int):
        self.mod, self.min_bytes, self.window = mod, min_bytes, window
        self.builder = relax.BlockBuilder(mod)
        self.loops: dict = {}  # GlobalVar -> the extent of its PrimFunc's loop, or None
        self.merged = 0

    def rewrite(self, func: relax.Function) -> relax.Function | None:
        return with_dataflow_blocks(func, self._merged)

    def _merged(self, bindings: list) -> list | None:
        out: list = []  # bindings, and groups at their place (None where a group left)
        groups: list[_Group] = []  # the open ones: they may still move down
        for index, binding in enumerate(bindings):
            reads = set(relax.analysis.free_vars(binding.value))
            written = _overwritten(binding.value)
            groups = [g for g in groups  # a group read here stays before this binding, and
                      # one reading what this binding overwrites (in place) too
                      if not reads & g.outs and not written & set(g.args)
                      and index - g.since <= self.window]  # fmt: skip
            kernel = self._kernel(binding)
            if kernel is None:
                out.append(binding)
                continue
            extent, args = kernel
            target = next((g for g in reversed(groups)
                           if g.extent == extent and self._share(g.args, args)), None)
            if target is None:
                target = _Group(binding, extent, args, index)
                groups.append(target)
            else:
                target.add(binding, args, index)
                out[target.position] = None
                self.merged += 1
            target.position = len(out)
            out.append(target)  # at this binding's place
        if not any(isinstance(g, _Group) and len(g.members) > 1 for g in out):
            return None
        result = []
        for item in out:
            if isinstance(item, _Group):
                result.extend(self._emitted(item) if len(item.members) > 1 else item.members)
            elif item is not None:
                result.append(item)
        return result

    def _kernel(self, binding) -> tuple[int, list] | None:
        """``(loop extent, tensor operands)`` of a mergeable kernel's binding; else None."""
        value = binding.value
        if not (isinstance(binding, relax.VarBinding) and _is_call_tir(value)
                and len(value.args) == 2 and _ty.is_tensor(binding.var)):  # fmt: skip
            return None
        gvar = value.args[0]
        if gvar not in self.loops:
            self.loops[gvar] = _loop_extent(self.mod[gvar])
        extent = self.loops[gvar]
        if extent is None:
            return None
        fields = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else []
        if not all(isinstance(f, relax.Var) for f in fields):  # (a constant operand)
            return None
        return extent, list(fields)

    def _share(self, args: set, other: list) -> bool:
        for var in args.intersection(other):
            shape = static_shape(var)
            if shape is not None and math.prod(shape) * _itemsize(var) >= self.min_bytes:
                return True
        return False

    def _emitted(self, group: _Group) -> list:
        prims = [self.mod[b.value.args[0]] for b in group.members]
        operands = [list(b.value.args[1].fields) for b in group.members]
        gvar = self.builder.add_func(_merged_prim_func(prims, [len(o) for o in operands]),
                                     "siblings")  # fmt: skip
        types = [b.var.ty for b in group.members]
        call = relax.call_tir(gvar, relax.Tuple([a for o in operands for a in o]), types)
        results = relax.DataflowVar("siblings", relax.TupleType(types))
        bindings = [relax.VarBinding(results, call)]
        for i, member in enumerate(group.members):
            bindings.append(relax.VarBinding(member.var, relax.TupleGetItem(results, i)))
        return bindings


def _overwritten(value) -> set:
    """The vars a ``call_tir_inplace`` writes into (none for any other value)."""
    if not is_op(value, tvm.ir.Op.get("relax.call_tir_inplace")):
        return set()
    fields = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
    return {fields[int(i)] for i in value.attrs.inplace_indices if int(i) >= 0}


def _itemsize(var) -> int:
    dtype = tvm.runtime.DataType(_ty.dtype_of(var))
    return max(1, dtype.bits * dtype.lanes // 8)


def _loop_extent(prim) -> int | None:
    """The extent of the parallel loop that is all of ``prim``'s body (a scheduled PrimFunc
    without extern calls, not a reshape); None otherwise."""
    if not isinstance(prim, tirx.PrimFunc) or not (prim.attrs and prim.attrs.get(
            "tirx.is_scheduled", False)):
        return None
    realize = prim.body
    if not isinstance(realize, s_tir.SBlockRealize) or realize.block.iter_vars:
        return None
    root = realize.block
    loop = root.body
    if root.init is not None or root.match_buffers or not isinstance(loop, tirx.For):
        return None
    if loop.kind != tirx.ForKind.PARALLEL or not isinstance(loop.extent, tirx.IntImm):
        return None
    if not (isinstance(loop.min, tirx.IntImm) and int(loop.min.value) == 0):
        return None
    calls = []
    tvm_ffi.structural_walk(
        prim.body,
        [(tvm.ir.Call, lambda c: calls.append(c) if getattr(c.op, "name", "") in _EXTERN
          else None)],
    )  # fmt: skip
    if calls or relax.analysis.has_reshape_pattern(prim):
        return None
    return int(loop.extent.value)


def _merged_prim_func(prims: list, inputs: list[int]) -> tirx.PrimFunc:
    """One PrimFunc running ``prims`` (each one parallel loop of the same extent, its first
    ``inputs[i]`` parameters its operands) in one loop: their operands, then their results, as
    parameters; each iteration runs their bodies in order."""
    # fresh vars and buffers for each: a kernel can join another call of its own PrimFunc
    prims = [s_tir.renew_defs(p) for p in prims]
    loops = [p.body.block.body for p in prims]
    var = loops[0].loop_var
    bodies = []
    for loop in loops:
        own = loop.loop_var
        bodies.append(tvm_ffi.structural_map(
            loop.body, (tirx.Var, lambda x, own=own: var if x.same_as(own) else x)))
    loop = tirx.For(var, loops[0].min, loops[0].extent, tirx.ForKind.PARALLEL,
                    tirx.SeqStmt(bodies), annotations=loops[0].annotations)  # fmt: skip
    allocs = [buffer for p in prims for buffer in p.body.block.alloc_buffers]
    root = s_tir.SBlock([], [], [], "root", loop, alloc_buffers=allocs)
    params = [x for p, n in zip(prims, inputs) for x in p.params[:n]]
    params += [x for p, n in zip(prims, inputs) for x in p.params[n:]]
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, "s_tir": True}
    return tirx.PrimFunc(params, s_tir.SBlockRealize([], True, root)).with_attrs(attrs)
