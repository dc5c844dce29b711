"""Vectorized loops that TVM 0.27 builds wrong, or cannot build, run serially (a pass over
scheduled PrimFuncs, CPU).

- Math functions that LLVM's code generation in TVM 0.27 has no vector form of: TVM lowers a
  scalar ``T.sinh`` or ``T.cosh`` to a libm call, but the build of a vectorized loop over one
  fails in code generation ("unknown intrinsic tirx.cosh"), after the schedules were
  verified: ``sinh``'s gradient is a ``cosh``, so any program with ``sinh`` failed to compile.
- Blocks of several results, as an argmax's index and value: vectorized, they computed other
  indices (a 1x1 max-pool of stride 2 had an all-zero gradient), serial, the right ones.

:class:`SerialVectorLoops` turns each vectorized loop over either into a serial loop, so each
element gets what ``tvm.compile`` computes (the same values); the loops around it keep their
parallelism.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Op

from .._module import with_functions

SCALAR_ONLY = ("tirx.sinh", "tirx.cosh")
"""Math intrinsics whose vectorized form TVM 0.27's LLVM code generation rejects."""


def _needs_serial(stmt) -> bool:
    """Whether ``stmt`` calls a :data:`SCALAR_ONLY` intrinsic or holds a block of several
    results."""
    ops = [Op.get(name) for name in SCALAR_ONLY]
    found = []
    tvm_ffi.structural_walk(
        stmt,
        [(tvm.ir.Call, lambda call: found.append(call) if any(call.op.same_as(o) for o in ops)
          else None),
         (s_tir.SBlock, lambda block: found.append(block) if len(block.writes) > 1 else None)],
        order="pre",
    )  # fmt: skip
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="SerialVectorLoops")
class SerialVectorLoops:
    """Make each vectorized loop over a :data:`SCALAR_ONLY` call or a block of several results
    in the module's PrimFuncs a serial loop (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        def serial(loop: tirx.For):
            if loop.kind != tirx.ForKind.VECTORIZED or not _needs_serial(loop.body):
                return loop
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                            loop.thread_binding, loop.annotations, loop.step)  # fmt: skip

        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _needs_serial(func.body):
                body = tvm_ffi.structural_map(func.body, (tirx.For, serial))
                if not body.same_as(func.body):
                    updates[gvar] = func.with_body(body)
        return with_functions(mod, updates)
