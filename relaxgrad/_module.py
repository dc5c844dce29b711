"""IRModule plumbing shared by the passes, the schedules and the trainer: copies of a module
with functions added or replaced (the caller's module is never changed)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule

__all__ = ["reachable", "with_function", "with_functions"]


def with_function(mod: IRModule, name: str, func) -> IRModule:
    """A copy of ``mod`` with ``func`` as public function ``name`` (replacing one of that
    name); ``mod`` itself is left as it was."""
    new = mod.clone()
    existing = [gv for gv in new.get_global_vars() if gv.name_hint == name]
    if existing:
        gv = existing[0]
    else:  # typed, as BlockBuilder.add_func makes them, so that callers can build calls of it
        gv = tvm.ir.GlobalVar(name)
        if isinstance(func, relax.Function):
            relax.expr._update_type(gv, func.ty)
    new[gv] = func.with_attr("global_symbol", name)
    return new


def with_functions(mod: IRModule, updates: dict) -> IRModule:
    """A copy of ``mod`` with the functions in ``updates`` (GlobalVar -> function) replaced;
    ``mod`` itself when there are none. The caller's module is left as it was."""
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def reachable(mod: IRModule, names) -> IRModule:
    """``mod`` with the Relax functions named in ``names`` and the functions they call (Relax
    functions and PrimFuncs, directly or through others) only; ``mod`` itself is left as it
    was. Raises ``KeyError`` for a name ``mod`` has no function of."""
    todo = [mod.get_global_var(name) for name in names]
    present, kept = set(mod.get_global_vars()), {}
    while todo:
        gvar = todo.pop()
        if gvar in kept:
            continue
        kept[gvar] = mod[gvar]
        if isinstance(kept[gvar], relax.Function):
            todo.extend(gv for gv in relax.analysis.all_global_vars(kept[gvar])
                        if gv not in kept and gv in present)  # fmt: skip
    return IRModule({gv: kept[gv] for gv in mod.get_global_vars() if gv in kept},
                    attrs=mod.attrs)
