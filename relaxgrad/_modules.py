"""IRModule helpers shared by the passes."""

from __future__ import annotations

from tvm.ir import IRModule


def with_functions(mod: IRModule, updates: dict) -> IRModule:
    """A copy of ``mod`` with the functions in ``updates`` (GlobalVar -> function) replaced;
    ``mod`` itself when there are none. The caller's module is left as it was."""
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod
