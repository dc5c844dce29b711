"""Module plumbing shared by the passes and the trainer."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule


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
