"""Round trips through a wider float dropped, a Relax rewrite before legalization.

A mixed-precision adjoint widens and narrows the same value in turn: the forward holds a value
in bfloat16 and reads it back in float32, and the gradient of each ``astype`` is an ``astype``
back, so chains such as ``astype(astype(astype(astype(g, f32), bf16), f32), bf16)`` of a bf16
``g`` reach the kernels. Widening a 16-bit float to float32 (or float32 to float64) is exact,
so narrowing the result back gives the value it started from: :class:`ExactCastPairs` reads
``astype(astype(y, wide), dtype(y))`` as ``y``, and through layout ops between the two
(``astype(reshape(astype(y, wide)), dtype(y))`` as ``reshape(y)``) and the gradient's aliases
(``g = g_f32``: a product's output gradient held in bf16 kept both casts for its products).
Besides the work, each bf16 rounding in a fused kernel is a ``Let`` over the float's bits
(:mod:`.fast_math`), and a chain of them nested in one expression made LLVM's code generation
of one rotary embedding's gradient take minutes.

A cast between bfloat16 and float16 is written through float32: TVM's simplifier takes a round
trip between the two 16-bit floats (``Cast(float16, Cast(bfloat16, x))``) for an exact one and
drops it, though each holds values the other rounds.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import bound_values, may_change, rewrite_functions

_ASTYPE = Op.get("relax.astype")
#: dtype -> the floats that hold each of its values exactly (bf16 is not in float16 nor the
#: reverse)
_WIDER = {"bfloat16": ("float32", "float64"), "float16": ("float32", "float64"),
          "float32": ("float64",)}


def _is_astype(expr) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(_ASTYPE)


_LAYOUTS = tuple(Op.get(f"relax.{name}") for name in
                 ("reshape", "permute_dims", "expand_dims", "squeeze", "flatten"))  # fmt: skip


def _is_layout(expr) -> bool:
    """Whether ``expr`` moves values without computing (a reshape, a transpose)."""
    return isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in _LAYOUTS)


@tvm.transform.module_pass(opt_level=0, name="ExactCastPairs")
class ExactCastPairs:
    """Rewrite ``astype(v, d)`` with ``v = astype(y, w)``, ``y`` of dtype ``d`` and ``w`` a float
    that holds every ``d`` exactly, into ``y``; and a cast between bfloat16 and float16 into
    casts through float32 (see the module docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return rewrite_functions(_Rewriter(mod), mod)


@mutator
class _Rewriter(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        values = bound_values(func)
        if not may_change(func, lambda value: self._source(value, values) is not None
                          or _between_16_bit(value)):
            return func
        self.values = values
        return super().visit_function_(func)

    @staticmethod
    def _source(value, values: dict):
        """``y`` when ``value`` is ``astype(astype(y, wide), dtype(y))``, through aliases and
        layout ops between the two (``astype(reshape(astype(y, wide)), dtype(y))``:
        ``reshape(y)``), else None."""
        if not _is_astype(value) or not isinstance(value.args[0], relax.Var):
            return None
        layouts, inner = [], values.get(value.args[0])
        while isinstance(inner, relax.Var) or (
                _is_layout(inner) and isinstance(inner.args[0], relax.Var)):
            if not isinstance(inner, relax.Var):  # (a var is an alias: the gradient's)
                layouts.append(inner)
                inner = inner.args[0]
            inner = values.get(inner)
        if not _is_astype(inner) or not _ty.is_tensor(inner.args[0]):
            return None
        y = inner.args[0]
        dtype = _ty.dtype_of(y)
        if str(value.attrs.dtype) != dtype or str(inner.attrs.dtype) not in _WIDER.get(dtype, ()):
            return None
        for layout in reversed(layouts):  # the same moves, of the narrow values
            y = relax.Call(layout.op, [y, *layout.args[1:]], layout.attrs, layout.ty_args)
        return y

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        y = self._source(call, self.values)
        if y is not None:
            return self.visit_expr(y)
        if _between_16_bit(call):
            wide = self.builder_.emit(relax.op.astype(self.visit_expr(call.args[0]), "float32"))
            return relax.op.astype(wide, call.attrs.dtype)
        return super().visit_call_(call)


def _between_16_bit(value) -> bool:
    return (_is_astype(value) and _ty.is_tensor(value.args[0])
            and {_ty.dtype_of(value.args[0]), str(value.attrs.dtype)} == {"bfloat16", "float16"})
