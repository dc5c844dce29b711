"""``FoldRepeatedHeads``: grouped-query attention's products without repeating the key/value heads.

A model with grouped-query attention (Llama, Qwen2, Mistral, ...: ``kv`` key/value heads shared
by ``rep`` query heads each) repeats its keys and values to the query heads' count before the
two products of attention, as Hugging Face's ``repeat_kv`` does::

    k_rep = reshape(broadcast_to(expand_dims(k, 2), (b, kv, rep, s, d)), (b, kv * rep, s, d))
    scores = matmul(q, permute_dims(k_rep))          # q: (b, kv * rep, s, d)
    out = matmul(probs, v_rep)

The repeat is a copy ``rep`` times the size of the keys (and of the values), and the backward
pass sums the repeated gradient back over the copies. Since query head ``h`` reads key head
``h // rep``, the ``rep`` query heads of a group can instead be stacked as the rows of one
product::

    scores = reshape(matmul(reshape(q, (b * kv, rep * s, d)), permute_dims(k)), (b, h, s, s))

The same multiply-adds in fewer, larger products, with no repeat and no sum in the backward
pass: the keys' gradient is one product over ``rep * s`` rows. Each score is the same dot
product as before (the same ``d`` terms).

The pass rewrites ``matmul(lhs, rhs)`` where ``rhs`` is, through batch reshapes, a transpose of
its last two axes and no-op broadcasts, a ``broadcast_to`` that repeats only its last batch
axis; ``lhs`` must have ``rhs``'s batch shape (no broadcast), and both static shapes. Other
products are left as they are.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..exprs import is_op
from ..schedules._common import may_change, static_shape
from .simplify import remove_unused

__all__ = ["FoldRepeatedHeads"]


@tvm.transform.module_pass(opt_level=0, name="FoldRepeatedHeads")
class FoldRepeatedHeads:
    """Module pass: products that read a tensor repeated over its heads read it once (see the
    module docstring). ``func_names``: the Relax functions to rewrite (all by default)."""

    def __init__(self, func_names=None):
        self.func_names = None if func_names is None else set(func_names)

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        fold = _Fold(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and (self.func_names is None
                                                     or gvar.name_hint in self.func_names):
                fold.folded = 0
                new = fold.visit_expr(func)
                if fold.folded:  # without the repeats it no longer reads
                    fold.builder_.update_func(gvar, remove_unused(new))
        return fold.builder_.get()


@mutator
class _Fold(PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: is_op(value, "relax.matmul")):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.matmul"):
            return call
        lhs, rhs = call.args
        found = self._repeated(rhs)
        if found is None:
            return call
        source, transposed, rep = found
        lhs_shape, out_shape = static_shape(lhs), static_shape(call)
        rhs_shape = static_shape(rhs)
        if lhs_shape is None or out_shape is None or lhs_shape[:-2] != rhs_shape[:-2]:
            return call
        groups = math.prod(rhs_shape[:-2]) // rep
        rows, depth = lhs_shape[-2:]
        emit = self.builder_.emit
        stacked = emit(relax.op.reshape(lhs, (groups, rep * rows, depth)))
        once = emit(relax.op.reshape(source, (groups, *static_shape(source)[-2:])))
        if transposed:
            once = emit(relax.op.permute_dims(once, [0, 2, 1]))
        product = emit(relax.op.matmul(stacked, once, out_dtype=call.attrs.out_dtype))
        self.folded += 1
        return relax.op.reshape(product, out_shape)

    def _repeated(self, rhs: relax.Expr):
        """``(source, transposed, rep)`` when ``rhs`` (static shape ``(*batch, k, n)``) is
        ``source`` (``(*batch', 1, k, n)``, or ``(.., n, k)`` when ``transposed``) repeated
        ``rep`` times along its last batch axis and viewed with ``rhs``'s batch shape; else
        None."""
        shape = static_shape(rhs)
        if shape is None or len(shape) < 3:
            return None
        batch, last = math.prod(shape[:-2]), shape[-2:]
        transposed, expr = False, rhs
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            current = static_shape(expr)
            if value is None or current is None:
                return None
            inner = value.args[0] if isinstance(value, relax.Call) and value.args else None
            inner_shape = static_shape(inner) if inner is not None else None
            if inner_shape is None or len(inner_shape) < 3:
                return None
            want = last[::-1] if transposed else last
            if is_op(value, "relax.permute_dims"):
                axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None \
                    else list(range(len(current)))[::-1]
                n = len(current)
                if axes != [*range(n - 2), n - 1, n - 2]:
                    return None
                transposed = not transposed
            elif is_op(value, "relax.reshape") or is_op(value, "relax.broadcast_to"):
                if current[-2:] != want or inner_shape[-2:] != want:
                    return None
                if math.prod(inner_shape[:-2]) != batch:
                    return self._repeat(value, inner, inner_shape, current, transposed)
            else:
                return None
            expr = inner
        return None

    @staticmethod
    def _repeat(value, inner, inner_shape, current, transposed):
        """The result of :meth:`_repeated` when ``value`` is the repeating ``broadcast_to``."""
        if not is_op(value, "relax.broadcast_to") or len(inner_shape) != len(current):
            return None
        axis = len(current) - 3
        if inner_shape[axis] != 1 or current[axis] == 1:
            return None
        if inner_shape[:axis] != current[:axis]:
            return None
        return inner, transposed, current[axis]
