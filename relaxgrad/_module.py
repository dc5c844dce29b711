"""Module plumbing shared by the passes and the trainer."""

from __future__ import annotations

import tvm
from tvm.ir import IRModule


def with_function(mod: IRModule, name: str, func) -> IRModule:
    """A copy of ``mod`` with ``func`` as public function ``name`` (replacing one of that
    name); ``mod`` itself is left as it was."""
    new = mod.clone()
    existing = [gv for gv in new.get_global_vars() if gv.name_hint == name]
    new[existing[0] if existing else tvm.ir.GlobalVar(name)] = func.with_attr("global_symbol", name)
    return new
