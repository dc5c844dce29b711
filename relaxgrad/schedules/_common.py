"""Small helpers shared by the schedule step and its rules."""

from __future__ import annotations

import tvm_ffi
from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprVisitor, visitor
from tvm.target import Target

from .. import _ty

THREAD_ENV_ATTRS = ("thread_extent", "virtual_thread")


def is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Marked scheduled, or already binding GPU threads (e.g. TVM's own CUDA kernels of
    ``scatter_elements``, which legalization emits without the mark)."""
    if func.attrs and func.attrs.get("tirx.is_scheduled", False):
        return True
    found = []
    callbacks = [
        (tirx.For, lambda loop: found.append(loop) if loop.kind == tirx.ForKind.THREAD_BINDING
         else None),
        (tirx.AttrStmt, lambda attr: found.append(attr) if attr.attr_key in THREAD_ENV_ATTRS
         else None),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return bool(found)


def rewrite_functions(mutator, mod: IRModule) -> IRModule:
    """``mod`` with every Relax function visited by ``mutator`` (a ``PyExprMutator`` of
    ``mod``), and the functions it added."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def static_shape(expr) -> list[int] | None:
    """The shape of a tensor expr as ints; None unless it is a tensor of static shape."""
    if not _ty.is_tensor(expr) or _ty.shape_of(expr) is None:
        return None
    shape = _ty.shape_values(expr)
    return [int(d) for d in shape] if all(isinstance(d, tirx.IntImm) for d in shape) else None


def first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"


@visitor
class _Reads(PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.count: dict = {}

    def visit_var_(self, var: relax.Var) -> None:
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
        self.visit_var_(var)


def read_counts(expr: relax.Expr) -> dict:
    """How many times each var is read in ``expr`` (a function: in its body)."""
    reads = _Reads()
    reads.visit_expr(expr)
    return reads.count


def bound_values(func: relax.Function) -> dict:
    """The value of each var bound by a ``VarBinding`` in ``func``'s blocks."""
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    return {b.var: b.value for block in blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}  # fmt: skip
