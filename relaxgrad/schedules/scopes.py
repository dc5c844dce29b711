"""TIR builders' markers dropped before code generation (a pass over PrimFuncs, CPU and GPU).

TVM's IRBuilder wraps consecutive statements in ``T.seq_scope()``, an ``AttrStmt`` with key
``pragma_scope`` that only groups them while the function is built. TVM 0.27's legalizations
of ``take``'s gradient (an embedding's), the scatters and ``index_put`` leave it in their
PrimFuncs, and LLVM's code generation prints ``Warning: Unknown pragma pragma_scope`` once per
such kernel: noise on every compile of a model with an embedding. :class:`WithoutSeqScopes`
replaces each marker by its body, which is all it ever meant.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from .._module import with_functions

SEQ_SCOPE = "pragma_scope"


def _has_scope(stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(
        stmt, [(tirx.AttrStmt, lambda s: found.append(s) if s.attr_key == SEQ_SCOPE else None)],
        order="pre",
    )
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="WithoutSeqScopes")
class WithoutSeqScopes:
    """Replace each ``pragma_scope`` ``AttrStmt`` of the module's PrimFuncs by its body."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        def unwrap(stmt: tirx.AttrStmt):
            return stmt.body if stmt.attr_key == SEQ_SCOPE else stmt

        updates = {
            gvar: func.with_body(tvm_ffi.structural_map(func.body, (tirx.AttrStmt, unwrap)))
            for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and _has_scope(func.body)
        }
        return with_functions(mod, updates)
