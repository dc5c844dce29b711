"""Vectorized loops over math functions that LLVM's code generation in TVM 0.27 has no vector
form of run serially (a pass over scheduled PrimFuncs, CPU).

TVM lowers a scalar ``T.sinh`` or ``T.cosh`` to a libm call, but the build of a vectorized loop
over one fails in code generation ("unknown intrinsic tirx.cosh"), after the schedules were
verified: ``sinh``'s gradient is a ``cosh``, so any program with ``sinh`` failed to compile.
:class:`SerialLibmCalls` turns each vectorized loop whose body calls one of them into a serial
loop, so each element gets the scalar call ``tvm.compile`` makes (the same values); the loops
around it keep their parallelism.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import Op

from .._modules import with_functions

SCALAR_ONLY = ("tirx.sinh", "tirx.cosh")
"""Math intrinsics whose vectorized form TVM 0.27's LLVM code generation rejects."""


def _calls_scalar_only(stmt) -> bool:
    ops = [Op.get(name) for name in SCALAR_ONLY]
    found = []
    tvm_ffi.structural_walk(
        stmt,
        [(tvm.ir.Call, lambda call: found.append(call) if any(call.op.same_as(o) for o in ops)
          else None)],
        order="pre",
    )  # fmt: skip
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="SerialLibmCalls")
class SerialLibmCalls:
    """Make each vectorized loop over a :data:`SCALAR_ONLY` call in the module's PrimFuncs a
    serial loop (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        def serial(loop: tirx.For):
            if loop.kind != tirx.ForKind.VECTORIZED or not _calls_scalar_only(loop.body):
                return loop
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                            loop.thread_binding, loop.annotations, loop.step)  # fmt: skip

        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _calls_scalar_only(func.body):
                body = tvm_ffi.structural_map(func.body, (tirx.For, serial))
                if not body.same_as(func.body):
                    updates[gvar] = func.with_body(body)
        return with_functions(mod, updates)
