"""``UpdateInPlace``: an optimizer function that writes its new parameters and state into the
tensors it was given, as PyTorch's optimizers do, instead of allocating a second copy of them.

It applies to the Relax functions marked ``relaxgrad.in_place``
(:meth:`Optimizer.add_to(..., in_place=True) <relaxgrad.training.Optimizer.add_to>`, which a
:class:`~relaxgrad.training.Trainer` compiles): ``f(params, gradients, optim_states, controls)
-> (new_params, new_optim_states, report)``. After ``FuseTIR`` each new parameter (or state
tensor) is an output of a fused kernel that reads the old one; such a call becomes
``call_tir_inplace`` writing that output into the old tensor, when it is safe:

- in the Relax function, the old tensor (an element of the ``params`` or ``optim_states``
  tuple) is an argument of that call only once and read by no later binding, nor returned;
- in the kernel, every block that reads the old tensor either runs in a loop nest before the
  one that writes the output, or runs in the same loop nest, before or as the writing block,
  reading the element the writing block writes (both index the tensors by the same loop
  variables, in order): no block reads an element after it was overwritten.

Any other output keeps its own allocation. The gradients and controls are never written.

In every other Relax function (a loss adjoint: the forward and backward pass), a kernel writes
its output into an argument of at least ``min_bytes`` (1 MiB) when that argument is a tensor the
function computed itself (a kernel's result, or the reshape of one nothing else reads), of the
output's shape and dtype, which no later binding reads, nor returns, nor reads but as a
kernel's argument, and the kernel, all of whose blocks are spatial (elementwise, broadcast,
injective: TVM's scheduling primitives refuse a reduction that reads a buffer a later block
overwrites), allows it (as above). E.g. the cross-entropy's gradient
(:class:`~relaxgrad.training.CrossEntropyLoss`) overwrites the logits, its last reader: one
buffer of ``tokens x vocabulary`` instead of two. The function's parameters are never
written.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule
from tvm.sym import Analyzer

from ._common import is_reshape_kernel

__all__ = ["IN_PLACE", "UpdateInPlace", "pending", "scheduled_in_place"]

#: The attribute of an optimizer function whose results may overwrite its parameters and state
#: (:meth:`Optimizer.add_to(..., in_place=True) <relaxgrad.training.Optimizer.add_to>`).
IN_PLACE = "relaxgrad.in_place"

_OWNED = (0, 2)  # the params and optim_states tuples: the caller's tensors to overwrite
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")

#: The smallest tensor, in bytes, that a kernel overwrites when it is the last to read it
TEMPORARY_BYTES = 1 << 20


@tvm.transform.module_pass(opt_level=0, name="UpdateInPlace")
class UpdateInPlace:
    """Module pass: the marked optimizer functions update in place, and kernels of the other
    functions write into a large tensor of the function's own that no later binding reads
    (module docstring). ``min_bytes``: the smallest such tensor (``None``: none)."""

    def __init__(self, min_bytes: int | None = TEMPORARY_BYTES):
        self.min_bytes = min_bytes if min_bytes is not None else float("inf")

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates, given = {}, mod
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            marked = func.attrs is not None and bool(func.attrs.get(IN_PLACE))
            new, kernels = (_rewrite(mod, func) if marked
                            else _temporaries(mod, func, self.min_bytes))
            if kernels:
                updates[gv] = new.without_attr(IN_PLACE) if marked else new
                for gv_prim, prim in kernels.items():
                    mod = _with_prim(mod, gv_prim, prim)
        for gv, func in updates.items():  # (mod is _with_prim's copy by now)
            mod[gv] = func
        if updates:  # the out-of-place kernels no call reads now: not scheduled nor built
            for gv in _kernels_called(given) - _kernels_called(mod):
                del mod[gv]
        return mod


def _kernels_called(mod: IRModule) -> set:
    """The GlobalVars of the PrimFuncs the module's Relax functions call."""
    found = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            found.update(relax.analysis.all_global_vars(func))
    return {gv for gv in found if gv in mod and isinstance(mod[gv], tirx.PrimFunc)}


def _with_prim(mod: IRModule, gv: tvm.ir.GlobalVar, prim) -> IRModule:
    mod = mod.clone()
    mod[gv] = prim.with_attr("global_symbol", gv.name_hint)
    return mod


def _bindings(func: relax.Function):
    return [b for block in func.body.blocks for b in block.bindings]


def _rewrite(mod: IRModule, func: relax.Function):
    """``(func with in-place calls, {GlobalVar of a new kernel: its PrimFunc})``."""
    params = list(func.params)
    owned = {params[i] for i in _OWNED if i < len(params)}
    bindings = _bindings(func)
    values = {b.var: b.value for b in bindings}
    origin = {}  # var -> (param position, element) for elements of the owned tuples
    for b in bindings:
        if (isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in owned):
            origin[b.var] = (params.index(b.value.tuple_value), int(b.value.index))
    target = _targets(func, values, params)  # new var -> (param position, element)
    last_use, whole = {}, -1  # whole: the last binding reading an owned tuple as a whole
    for i, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            last_use[v] = i
            if v in owned and not isinstance(b.value, relax.TupleGetItem):
                whole = i
    returned = set(relax.analysis.free_vars(func.body.body))
    outputs = {}  # call var -> {output index: new var}
    for b in bindings:
        value = b.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in values:
            outputs.setdefault(value.tuple_value, {})[int(value.index)] = b.var
    candidates = {}
    for i, b in enumerate(bindings):
        call = b.value
        if not (isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
            continue
        args = list(call.args[1].fields)
        outs = outputs.get(b.var, {}) if isinstance(b.var.ty, relax.TupleType) else {0: b.var}
        inplace = {}
        for k, out in outs.items():
            if out not in target:
                continue
            j = [n for n, a in enumerate(args) if origin.get(a) == target[out]]
            if len(j) != 1 or args.count(args[j[0]]) != 1:
                continue
            old = args[j[0]]
            later = [v for v, n in last_use.items() if n > i and origin.get(v) == origin[old]]
            if later or old in returned or whole > i or owned & returned:
                continue
            inplace[k] = j[0]
        if inplace:
            candidates[b.var] = inplace
    return _apply(mod, func, candidates)


def _temporaries(mod: IRModule, func: relax.Function, min_bytes: int):
    """:func:`_rewrite` for the tensors ``func`` makes itself (module docstring)."""
    bindings = _bindings(func)
    values = {b.var: b.value for b in bindings}
    uses = {}  # var -> [(binding index, whether only as an argument of a computing call)]
    for i, b in enumerate(bindings):
        plain = _computing(mod, b.value)
        arguments = set(b.value.args[1].fields) if plain else set()
        for v in relax.analysis.free_vars(b.value):
            uses.setdefault(v, []).append((i, v in arguments))
    returned = set(relax.analysis.free_vars(func.body.body))

    def fresh(var) -> bool:
        """Whether ``var`` is a tensor only this function holds: a computing call's result,
        or the reshape of one that nothing else reads (a reshape becomes a view)."""
        value = values.get(var)
        if _computing(mod, value) and isinstance(var.ty, relax.TensorType):
            return True
        source = _reshaped(mod, value)
        return source is not None and len(uses.get(source, [])) == 1 and fresh(source)

    candidates = {}
    for i, b in enumerate(bindings):
        call = b.value
        if (not _computing(mod, call) or isinstance(b.var.ty, relax.TupleType)
                or not _spatial(mod[call.args[0]])):
            continue
        args = list(call.args[1].fields)
        for j, arg in enumerate(args):
            used = uses.get(arg, [])
            if (isinstance(arg, relax.Var) and args.count(arg) == 1 and arg not in returned
                    and all(plain for _, plain in used) and max(n for n, _ in used) == i
                    and tvm_ffi.structural_equal(arg.ty, b.var.ty)
                    and _bytes(arg.ty) >= min_bytes and fresh(arg)):
                candidates[b.var] = {0: j}
                break
    return _apply(mod, func, candidates)


def _spatial(prim) -> bool:
    """Whether every block of ``prim`` is spatial (no reduction): the schedule rules schedule
    such a kernel in place as they do out of place, which TVM's scheduling primitives refuse
    for a reduction reading the buffer a later block overwrites."""
    if not isinstance(prim.body, s_tir.SBlockRealize):
        return False
    return all(iv.iter_type == tirx.IterVar.DataPar for _, r in _blocks(prim)
               for iv in r.block.iter_vars)


def _computing(mod: IRModule, value) -> bool:
    """Whether ``value`` is a ``call_tir`` of a kernel that is not a reshape (which TVM
    turns into a view of its argument)."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
        return False
    prim = mod[value.args[0]]
    return isinstance(prim, tirx.PrimFunc) and not is_reshape_kernel(prim)


def _reshaped(mod: IRModule, value):
    """The tensor that ``value`` reshapes (``R.reshape``, or a reshape kernel), else None."""
    if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.reshape")):
        return value.args[0]
    if (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)
            and len(value.args[1].fields) == 1
            and is_reshape_kernel(mod[value.args[0]])):
        return value.args[1].fields[0]
    return None


def _bytes(ty) -> int:
    """A tensor type's bytes; 0 unless its shape is static."""
    size = _size(ty.shape.values) if getattr(ty, "shape", None) is not None else None
    return 0 if size is None else size * tvm.DataType(ty.dtype).bits // 8


def _apply(mod: IRModule, func: relax.Function, candidates: dict):
    """``func`` with each ``call_tir`` bound to a var of ``candidates`` (var -> {output index:
    argument index}) in place where its kernel allows (:func:`_safe`), and the new kernels."""
    bindings = _bindings(func)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    new_values, kernels, made = {}, {}, {}
    normalizer = relax.BlockBuilder()  # gives the new calls their types
    for b in bindings:
        if b.var not in candidates:
            continue
        call = b.value
        args = list(call.args[1].fields)
        prim = mod[call.args[0]]
        n_out = len(call.ty.fields) if isinstance(call.ty, relax.TupleType) else 1
        inplace = _safe(prim, len(args), n_out, candidates[b.var])
        inplace = {k: j for k, j in inplace.items() if _same_point(prim, j, len(args) + k)}
        if not inplace:
            continue
        indices = [inplace.get(k, -1) for k in range(n_out)]
        out_ty = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]
        key = (call.args[0].name_hint, tuple(indices))
        if key not in made:  # one in-place kernel for all the calls alike
            kernel = _pending(prim, len(args), n_out, inplace)
            made[key] = tvm.ir.GlobalVar(_fresh(f"{call.args[0].name_hint}_inplace", names))
            relax.expr._update_type(made[key], kernel.ty)
            kernels[made[key]] = kernel
        gv = made[key]
        new_values[b.var] = normalizer.normalize(
            relax.call_tir_inplace(gv, call.args[1], indices, out_ty))
    if not new_values:
        return func, {}

    blocks = []
    for block in func.body.blocks:
        new = [relax.VarBinding(b.var, new_values[b.var]) if b.var in new_values else b
               for b in block.bindings]  # fmt: skip
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind(new))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs), kernels


def _fresh(name: str, names: set) -> str:
    base, n = name, 1
    while name in names:
        name, n = f"{base}{n}", n + 1
    names.add(name)
    return name


def _targets(func, values, params) -> dict:
    """The vars the function returns as new parameters (field 0) and new state (field 1), each
    with the ``(param position, element)`` it replaces."""

    def resolve(expr):
        while isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        return expr

    result = resolve(func.body.body)
    if not isinstance(result, relax.Tuple) or len(result.fields) < 2:
        return {}
    targets = {}
    for field, position in zip(result.fields[:2], _OWNED):
        fields = resolve(field)
        if not isinstance(fields, relax.Tuple):
            continue
        for element, var in enumerate(fields.fields):
            if isinstance(var, relax.Var):
                targets[var] = (position, element)
    return targets


def _blocks(prim) -> list[tuple[int, s_tir.SBlockRealize]]:
    """The kernel's blocks in order, each with the index of its top-level loop nest."""
    root = prim.body.block
    top = root.body
    stmts = list(top.seq) if isinstance(top, tirx.SeqStmt) else [top]
    found = []
    for t, stmt in enumerate(stmts):
        tvm_ffi.structural_walk(
            stmt, [(s_tir.SBlockRealize, lambda r, t=t: found.append((t, r)))])
    return found


def _pointwise(realize, buffer, regions) -> bool:
    """Whether ``realize``'s block accesses ``buffer`` (in ``regions``) only at its own
    spatial iteration point, its iterations being the loop variables themselves in order."""
    block = realize.block
    ivars = [iv.var for iv in block.iter_vars]
    if not all(isinstance(v, tirx.Var) for v in realize.iter_values):
        return False
    for region in regions:
        if not region.source.same_as(buffer):
            continue
        if len(region.region) != len(ivars):
            return False
        for rng, ivar in zip(region.region, ivars):
            if not (rng.min.same_as(ivar) and isinstance(rng.extent, tirx.IntImm)
                    and int(rng.extent.value) == 1):
                return False
    return True


def _safe(prim, n_args: int, n_out: int, inplace: dict[int, int]) -> dict[int, int]:
    """The entries of ``inplace`` (output index -> argument index) that are safe in ``prim``
    (module docstring)."""
    if not isinstance(prim, tirx.PrimFunc) or not isinstance(prim.body, s_tir.SBlockRealize):
        return {}
    params = list(prim.params)
    if len(params) < n_args + n_out:
        return {}
    blocks = _blocks(prim)
    safe = {}
    for k, j in inplace.items():
        arg, out = params[j], params[n_args + k]
        writers = [(n, t, r) for n, (t, r) in enumerate(blocks)
                   if any(w.source.same_as(out) for w in r.block.writes)]
        if len(writers) != 1 or any(w.source.same_as(arg) for _, r in blocks
                                    for w in r.block.writes):
            continue
        n_w, t_w, writer = writers[0]
        loops = list(writer.iter_values)
        ok = _pointwise(writer, out, writer.block.writes)
        for n, (t, r) in enumerate(blocks):
            reads = [x for x in r.block.reads if x.source.same_as(arg)]
            if not reads or t < t_w:
                continue
            ok = ok and t == t_w and n <= n_w and _pointwise(r, arg, reads) and len(
                r.iter_values) == len(loops) and all(
                    a.same_as(b) for a, b in zip(r.iter_values, loops))
        if ok:
            safe[k] = j
    return safe


def _same_point(prim, j: int, o: int) -> bool:
    """Whether in ``prim`` (unscheduled) output parameter ``o`` at each point depends on
    argument ``j`` at that point only, whatever the schedule: every block reading ``j`` or a
    buffer computed from it is spatial and reads those buffers, and writes, at its own
    iteration point (in the row-major order of each buffer, so a reshape's reads count), over
    a domain of the output's size; so does every block writing ``o``. A schedule may then
    inline, reorder, vectorize and parallelize as it likes: each point still reads ``j``
    before it writes it, and no other point reads it."""
    params = list(prim.params)
    arg, out = params[j], params[o]
    size = _size(out.ty.shape)
    if size is None:
        return False
    tainted = [arg]

    def is_tainted(buffer) -> bool:
        return any(buffer.same_as(t) for t in tainted)

    for _, realize in _blocks(prim):
        block = realize.block
        reads_tainted = any(is_tainted(r.source) for r in block.reads)
        writes_out = any(w.source.same_as(out) for w in block.writes)
        if not (reads_tainted or writes_out):
            continue
        if not all(isinstance(v, tirx.Var) for v in realize.iter_values):
            return False
        domain = [iv.dom.extent for iv in block.iter_vars]
        if (any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars)
                or _size(domain) != size):
            return False
        analyzer = Analyzer()
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)
        point = _offset([iv.var for iv in block.iter_vars], domain)
        regions = [r for r in block.reads if is_tainted(r.source)] + list(block.writes)
        for region in regions:
            if (any(not (isinstance(r.extent, tirx.IntImm) and int(r.extent.value) == 1)
                    for r in region.region)
                    or not analyzer.can_prove_equal(
                        _offset([r.min for r in region.region], region.source.ty.shape), point)):
                return False
        tainted.extend(w.source for w in block.writes)
    return True


def _size(shape) -> int | None:
    n = 1
    for d in shape:
        if not isinstance(d, tirx.IntImm):
            return None
        n *= int(d.value)
    return n


def _offset(indices, shape):
    """The row-major offset of ``indices`` in ``shape``."""
    offset = tirx.const(0, "int64")
    for index, extent in zip(indices, shape):
        offset = offset * tirx.Cast("int64", extent) + tirx.Cast("int64", index)
    return offset


#: A pending in-place kernel's out-of-place original, which the schedule step schedules
#: before making it in place (TVM's scheduling primitives refuse a block that reads and writes
#: one buffer), and ``[n_args, n_out, output, argument, ...]``
OUT_OF_PLACE, IN_PLACE_MAP = "relaxgrad.out_of_place", "relaxgrad.in_place_map"


def _pending(prim, n_args: int, n_out: int, inplace: dict[int, int]):
    """``prim`` in place (:func:`_in_place_prim`), carrying its original for the schedule
    step (:func:`scheduled_in_place`)."""
    flat = [n_args, n_out] + [x for k in sorted(inplace) for x in (k, inplace[k])]
    return _in_place_prim(prim, n_args, n_out, inplace).with_attrs(
        {OUT_OF_PLACE: prim, IN_PLACE_MAP: flat})


def pending(prim) -> bool:
    """Whether ``prim`` is an in-place kernel whose original the schedule step schedules."""
    return prim.attrs is not None and OUT_OF_PLACE in prim.attrs


def scheduled_in_place(prim, schedule):
    """A pending in-place ``prim`` scheduled: ``schedule(original)`` (None when no rule
    schedules it) made in place; else ``prim`` itself, its loops naive, without the
    pending attributes."""
    scheduled = schedule(prim.attrs[OUT_OF_PLACE])
    flat = [int(x) for x in prim.attrs[IN_PLACE_MAP]]
    if scheduled is None:
        return prim.without_attr(OUT_OF_PLACE).without_attr(IN_PLACE_MAP)
    n_args, n_out, pairs = flat[0], flat[1], flat[2:]
    inplace = dict(zip(pairs[0::2], pairs[1::2]))
    return _in_place_prim(scheduled, n_args, n_out, inplace)


def _in_place_prim(prim, n_args: int, n_out: int, inplace: dict[int, int]):
    """``prim`` writing output ``k`` into argument ``inplace[k]`` (that output's parameter
    dropped), as ``call_tir_inplace`` calls it."""
    params = list(prim.params)
    alias = {params[n_args + k]: params[j] for k, j in inplace.items()}
    body = tvm_ffi.structural_map(prim.body, (tirx.Var, lambda v: alias.get(v, v)))
    kept = params[:n_args] + [params[n_args + k] for k in range(n_out) if k not in inplace]
    kept += params[n_args + n_out:]  # symbolic shape parameters, if any
    return tirx.PrimFunc(kept, body, attrs=prim.attrs)
