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
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule

__all__ = ["IN_PLACE", "UpdateInPlace"]

#: The attribute of an optimizer function whose results may overwrite its parameters and state
#: (:meth:`Optimizer.add_to(..., in_place=True) <relaxgrad.training.Optimizer.add_to>`).
IN_PLACE = "relaxgrad.in_place"

_OWNED = (0, 2)  # the params and optim_states tuples: the caller's tensors to overwrite


@tvm.transform.module_pass(opt_level=0, name="UpdateInPlace")
class UpdateInPlace:
    """Module pass: the marked optimizer functions update in place (module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        updates = {}
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function) and func.attrs and func.attrs.get(IN_PLACE):
                new, kernels = _rewrite(mod, func)
                if kernels:
                    updates[gv] = new.without_attr(IN_PLACE)
                    for gv_prim, prim in kernels.items():
                        mod = _with_prim(mod, gv_prim, prim)
        for gv, func in updates.items():
            mod[gv] = func
        return mod


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
    names = {gv.name_hint for gv in mod.get_global_vars()}
    new_values, kernels = {}, {}
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
        if not inplace:
            continue
        prim = mod[call.args[0]]
        n_out = len(call.ty.fields) if isinstance(call.ty, relax.TupleType) else 1
        inplace = _safe(prim, len(args), n_out, inplace)
        if not inplace:
            continue
        name = _fresh(f"{call.args[0].name_hint}_inplace", names)
        kernel = _in_place_prim(prim, len(args), n_out, inplace)
        indices = [inplace.get(k, -1) for k in range(n_out)]
        out_ty = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]
        gv = tvm.ir.GlobalVar(name)
        relax.expr._update_type(gv, kernel.ty)
        kernels[gv] = kernel
        new_values[b.var] = relax.call_tir_inplace(gv, call.args[1], indices, out_ty)
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


def _in_place_prim(prim, n_args: int, n_out: int, inplace: dict[int, int]):
    """``prim`` writing output ``k`` into argument ``inplace[k]`` (that output's parameter
    dropped), as ``call_tir_inplace`` calls it."""
    params = list(prim.params)
    alias = {params[n_args + k]: params[j] for k, j in inplace.items()}
    body = tvm_ffi.structural_map(prim.body, (tirx.Var, lambda v: alias.get(v, v)))
    kept = params[:n_args] + [params[n_args + k] for k in range(n_out) if k not in inplace]
    kept += params[n_args + n_out:]  # symbolic shape parameters, if any
    return tirx.PrimFunc(kept, body, attrs=prim.attrs)
