"""Gradients that are zero but at a few rows, computed on those rows (a Relax rewrite before
legalization, CPU).

A model that reads a few positions of a sequence, as a classifier reads its first token
(BERT's pooler: ``take(hidden, 0, axis=1)``), gets the gradient ``take_backward(g, hidden, i,
axis=1)``: a ``(B, S, ...)`` tensor of zeros but at rows ``i``. Everything its backward does
row by row then works on zeros: BERT-base's last layer ran its layer norms', feed-forward's and
output projection's backward, six gemms of 1024 rows, for 8 rows that are not zero.
:class:`RowSparseGradients` keeps such a gradient as its nonzero rows, ``(B, k, ...)``, and
carries them through the ops that keep the other rows zero:

- a reshape that keeps the ``(B, S)`` leading axes, or merges them into one (``from_torch``'s
  linear layers flatten their input's rows): the rows' reshape;
- ``multiply`` by any tensor, ``divide`` by one, ``negative``, and ``add`` / ``subtract`` of
  two such gradients: the same op on the rows (the other operand's rows, taken where it has
  them; a dense ``add`` makes the result dense);
- ``sum`` / ``mean`` along other axes: the rows'; a ``sum`` or ``collapse_sum_to`` over the
  rows: the rows' sum;
- ``matmul(d, w)`` (a linear layer's input gradient): the rows' product; ``matmul(d^T, x)``
  and ``matmul(x^T, d)`` (its weight gradient): the product of the rows of both.

Wherever else such a gradient is read (an attention's heads, a residual sum with a dense
gradient, a result), it is written dense once: its rows padded with zeros. Only gradients of
rows ``[start, start + k)`` along axis 1, ``4 k <= S``, with constant indices, of at least
``min_elements`` elements are kept so: below it the kernels the rows add cost the compile more
than they save (the test suite's 2 x 8 x 32 BERT: 0.5 s more, 1.5x ``tvm.compile``'s time). The
values are the dense computation's (a zero row times a finite value is zero).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import is_op, may_change, rebind, rewrite_functions, static_shape

_TAKE_BACKWARD = Op.get("relax.grad.take_backward")
_PERMUTE = Op.get("relax.permute_dims")
_KEEPS_ZEROS = {"relax.multiply", "relax.divide", "relax.add", "relax.subtract"}


MIN_ELEMENTS = 1 << 16
"""The fewest elements of a gradient :class:`RowSparseGradients` keeps as rows, by default."""


@tvm.transform.module_pass(opt_level=0, name="RowSparseGradients")
class RowSparseGradients:
    """Keep gradients that are zero but at a few rows of a sequence, of at least
    ``min_elements`` elements (default :data:`MIN_ELEMENTS`), as those rows (see the module
    docstring)."""

    def __init__(self, min_elements: int | None = None):
        self.min_elements = MIN_ELEMENTS if min_elements is None else min_elements

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        rewriter = _Rewriter(mod, self.min_elements)
        mod = rewrite_functions(rewriter, mod)
        return relax.transform.DeadCodeElimination()(mod) if rewriter.changed else mod


class _Rows:
    """A dense tensor of shape ``shape``, ``(B, S, *rest)`` or ``(B * S, *rest)``, zero but at
    rows ``start`` to ``start + count`` of ``S``: ``value`` holds them, of ``shape`` with ``S``
    (or ``B * S``) as ``count`` (``B * count``)."""

    def __init__(self, value, shape, batch: int, seq: int, start: int, count: int):
        self.value, self.shape = value, list(shape)
        self.batch, self.seq, self.start, self.count = batch, seq, start, count

    def merged(self, shape) -> bool | None:
        """Whether ``shape`` has the rows merged into its first axis (True), as two leading
        axes (False), or neither (None)."""
        if list(shape[:2]) == [self.batch, self.seq]:
            return False
        if shape and shape[0] == self.batch * self.seq:
            return True
        return None

    def kept(self, shape) -> list[int]:
        """``shape`` (of a tensor like this one) with only the kept rows."""
        if self.merged(shape):
            return [self.batch * self.count, *shape[1:]]
        return [self.batch, self.count, *shape[2:]]

    def like(self, value, shape) -> _Rows:
        return _Rows(value, shape, self.batch, self.seq, self.start, self.count)

    def same_rows(self, other: _Rows) -> bool:
        return (self.batch, self.seq, self.start, self.count) == (
            other.batch, other.seq, other.start, other.count
        )  # fmt: skip


def _is_source(value, min_elements: int) -> bool:
    """Whether ``value`` may be a gradient this pass keeps as rows (its cheap test)."""
    if not is_op(value, _TAKE_BACKWARD) or int(value.attrs.axis) != 1:
        return False
    shape = static_shape(value)
    return isinstance(value.args[2], _ty.Constant) and math.prod(shape or [0]) >= min_elements


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, min_elements: int):
        super().__init__(mod)
        self.min_elements = min_elements
        self.changed = False
        self.taken: dict = {}  # (dense var, rows, shape) -> its kept rows, emitted once
        self.rows: dict = {}  # var -> _Rows
        self.transposed: dict = {}  # var bound to permute_dims(d) of a 2-D d in rows -> d
        self.dense: dict = {}  # var in rows (or transposed) -> its dense value, once written
        self.values: dict = {}  # var -> the value bound to it (in the function as it was)

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: _is_source(value, self.min_elements)):
            return func
        self.changed = True
        if isinstance(func.body, relax.SeqExpr):
            self.values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        return super().visit_function_(func)

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.taken, self.dense = {}, {}  # their vars are this block's
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        if self._kept(var, value):
            return None
        if self.rows:
            for read in relax.analysis.free_vars(value):
                if read in self.rows or read in self.transposed:
                    self._write_dense(read)
        return super().visit_var_binding_(binding)

    def _write_dense(self, var) -> None:
        if var in self.dense:
            return
        emit, op = self.builder_.emit, relax.op
        if var in self.transposed:
            self._write_dense(self.transposed[var])
            dense = emit(op.permute_dims(self.dense[self.transposed[var]], [1, 0]))
        else:
            rows = self.rows[var]
            value, merged = rows.value, rows.merged(rows.shape)
            if merged:
                value = emit(op.reshape(value, [rows.batch, rows.count, *rows.shape[1:]]))
            padding = [0, 0] * len(static_shape(value))
            padding[2:4] = [rows.start, rows.seq - rows.start - rows.count]
            dense = emit(op.nn.pad(value, padding))
            if merged:
                dense = emit(op.reshape(dense, rows.shape))
        self.dense[var] = dense
        self.set_var_remap(var, dense)

    def _keep(self, var, rows: _Rows, value=None, shape=None) -> bool:
        """Bind ``var`` to ``rows``, or to rows like them of ``value`` (emitted) and ``shape``,
        where it is a dataflow var (else it is written dense)."""
        if not isinstance(var, relax.DataflowVar):
            return False
        if value is not None:
            rows = rows.like(self.builder_.emit(value), shape)
        self.rows[var] = rows
        return True

    def _kept(self, var, value) -> bool:
        """Bind ``var`` in rows (or its dense value, emitted) where ``value`` allows it."""
        if isinstance(value, relax.Var):
            if value in self.rows:
                return self._keep(var, self.rows[value])
            if value in self.transposed and isinstance(var, relax.DataflowVar):
                self.transposed[var] = self.transposed[value]
                return True
            return False
        if not isinstance(value, relax.Call) or not isinstance(value.op, Op):
            return False
        shape = static_shape(var)
        if shape is None:
            return False
        name = value.op.name
        if name == "relax.grad.take_backward":
            return _is_source(value, self.min_elements) and self._source(var, value, shape)
        if name == "relax.matmul":
            return self._matmul(var, value, shape)
        if name in _KEEPS_ZEROS:
            return self._binary(var, value, shape)
        args = value.args
        rows = self.rows.get(args[0]) if args and isinstance(args[0], relax.Var) else None
        if rows is None:
            return False
        op = relax.op
        if name == "relax.permute_dims":
            axes = value.attrs.axes
            if len(rows.shape) == 2 and rows.merged(rows.shape) and isinstance(
                var, relax.DataflowVar
            ) and (axes is None or [int(a) for a in axes] == [1, 0]):
                self.transposed[var] = args[0]
                return True
            return False
        if name == "relax.negative" and shape == rows.shape:
            return self._keep(var, rows, op.negative(rows.value), shape)
        if name == "relax.reshape":
            return self._reshape(var, rows, shape)
        if name in ("relax.sum", "relax.mean"):
            return self._sum(var, value, rows, shape)
        if name == "relax.collapse_sum_to":
            lead = len(rows.shape) - (1 if rows.merged(rows.shape) else 2)
            if len(shape) > lead:
                return False  # the rows are not all summed
            rebind(self, var, op.collapse_sum_to(rows.value, shape))
            return True
        return False

    def _source(self, var, call, shape) -> bool:
        """``take_backward(g, x, indices, axis=1)`` (:func:`_is_source`) of contiguous indices
        within the rows (a negative one, whose meaning depends on the mode, is left alone), a
        quarter of them at most: its rows are ``g``'s."""
        g, indices = call.args[0], call.args[2]
        if len(shape) < 3 or static_shape(g) is None or not isinstance(var, relax.DataflowVar):
            return False
        values = [int(v) for v in indices.value.numpy().reshape(-1).tolist()]
        batch, seq = shape[:2]
        start, count = (values[0], len(values)) if values else (0, 0)
        if not values or values != list(range(start, start + count)):
            return False
        if start < 0 or start + count > seq or 4 * count > seq:
            return False
        kept = [batch, count, *shape[2:]]
        if math.prod(static_shape(g)) != math.prod(kept):
            return False
        g = self.visit_expr(g)
        value = g if static_shape(g) == kept else self.builder_.emit(relax.op.reshape(g, kept))
        self.rows[var] = _Rows(value, shape, batch, seq, start, count)
        return True

    def _reshape(self, var, rows: _Rows, shape) -> bool:
        merged = rows.merged(shape)
        if merged is None or math.prod(shape) != math.prod(rows.shape):
            return False
        kept = rows.kept(shape)
        return self._keep(var, rows, relax.op.reshape(rows.value, kept), shape)

    def _binary(self, var, call, shape) -> bool:
        name = call.op.name
        a, b = call.args
        first, second = self.rows.get(a), self.rows.get(b)
        if first is None and second is None:
            return False
        op = getattr(relax.op, name.split(".")[-1])
        rows = first if first is not None else second
        merged = rows.merged(shape)
        for kept in (first, second):  # of the result's rank and rows (broadcast along the rest)
            if kept is not None and (
                len(kept.shape) != len(shape) or kept.merged(kept.shape) != merged
                or not kept.same_rows(rows)
            ):  # fmt: skip
                return False
        if merged is None:
            return False
        if first is not None and second is not None:
            if name == "relax.divide":
                return False
            return self._keep(var, rows, op(first.value, second.value), shape)
        if name in ("relax.add", "relax.subtract") or (
            name == "relax.divide" and second is not None
        ):
            return False  # a dense sum is dense; so is a division by zeros
        other = self._taken(b if first is not None else a, rows, shape)
        if other is None:
            return False
        pair = (rows.value, other) if first is not None else (other, rows.value)
        return self._keep(var, rows, op(*pair), shape)

    def _taken(self, expr, rows: _Rows, result=None):
        """The kept rows of a dense ``expr`` broadcast to ``result`` (a shape like ``rows``'s,
        by default theirs): itself where it is the same on every row; or None."""
        if isinstance(expr, relax.Var) and (expr in self.rows or expr in self.transposed):
            return None
        result = rows.shape if result is None else result
        shape = static_shape(expr)
        if shape is None or len(shape) > len(result):
            return None
        key = (expr, rows.batch, rows.seq, rows.start, rows.count, tuple(result))
        if key not in self.taken:
            self.taken[key] = self._take(self.visit_expr(expr), shape, rows, result)
        return self.taken[key]

    def _take(self, expr, shape, rows: _Rows, result):
        full = [1] * (len(result) - len(shape)) + list(shape)
        merged = rows.merged(result)
        lead = full[:1] if merged else full[:2]
        if lead == [1] or (not merged and lead[1] == 1):  # the same on every row
            return expr
        emit, op = self.builder_.emit, relax.op
        start, end = rows.start, rows.start + rows.count
        if merged and lead == [rows.batch * rows.seq]:
            split = emit(op.reshape(expr, [rows.batch, rows.seq, *full[1:]]))
            taken = emit(op.strided_slice(split, [1], [start], [end]))
            return emit(op.reshape(taken, [rows.batch * rows.count, *full[1:]]))
        if not merged and lead in ([rows.batch, rows.seq], [1, rows.seq]):
            if full != list(shape):
                expr = emit(op.reshape(expr, full))
            return emit(op.strided_slice(expr, [1], [start], [end]))
        return None

    def _sum(self, var, call, rows: _Rows, shape) -> bool:
        rank = len(rows.shape)
        axes = call.attrs.axis
        axes = list(range(rank)) if axes is None else sorted(int(a) % rank for a in axes)
        keepdims = bool(call.attrs.keepdims)
        row_axes = [0] if rows.merged(rows.shape) else [0, 1]
        summed = [a for a in row_axes if a in axes]
        op = relax.op.sum if call.op.name == "relax.sum" else relax.op.mean
        if not summed:
            return self._keep(var, rows, op(rows.value, axes, keepdims), shape)
        if summed != row_axes or call.op.name != "relax.sum" or keepdims:
            return False  # a mean over the rows counts the zero rows
        rebind(self, var, relax.op.sum(rows.value, axes, keepdims))
        return True

    def _matmul(self, var, call, shape) -> bool:
        a, b = call.args
        emit, op = self.builder_.emit, relax.op
        if a in self.transposed and b not in self.rows and b not in self.transposed:
            rows = self.rows[self.transposed[a]]  # d^T x: the kept rows of both
            if (static_shape(b) or [0])[0] != rows.batch * rows.seq or len(static_shape(b)) != 2:
                return False
            other = self._taken(b, rows)
            if other is None:
                return False
            rebind(self, var, op.matmul(emit(op.permute_dims(rows.value, [1, 0])), other))
            return True
        if b in self.rows and a not in self.rows and a not in self.transposed:
            rows, bound = self.rows[b], self.values.get(a)  # x^T d
            if not is_op(bound, _PERMUTE) or len(rows.shape) != 2:
                return False
            source = bound.args[0]
            axes = bound.attrs.axes
            if axes is not None and [int(x) for x in axes] != [1, 0]:
                return False
            if source in self.rows or source in self.transposed or not rows.merged(rows.shape):
                return False
            if (static_shape(source) or [0])[0] != rows.batch * rows.seq:
                return False
            other = self._taken(source, rows)
            if other is None or len(static_shape(source)) != 2:
                return False
            rebind(self, var, op.matmul(emit(op.permute_dims(other, [1, 0])), rows.value))
            return True
        rows = self.rows.get(a)
        if rows is None or b in self.rows or b in self.transposed:
            return False
        weight = static_shape(b)
        if weight is None or len(weight) != 2 or rows.merged(shape) is None:
            return False
        if len(rows.shape) < (2 if rows.merged(rows.shape) else 3):
            return False  # the rows would be the product's k
        return self._keep(var, rows, op.matmul(rows.value, self.visit_expr(b)), shape)
