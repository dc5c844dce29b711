"""Large float32 matmuls as calls into the OpenBLAS that numpy ships (a Relax rewrite, CPU).

:class:`MatmulToBLAS` rewrites ``R.matmul(a, b)`` (float32, static shapes, at least
``min_macs`` multiply-adds; ``a`` and ``b`` either of the same batch shape or one of them 2-D)
into ``R.call_tir`` of a small PrimFunc that calls ``cblas_sgemm`` of numpy's
``scipy_openblas`` (``T.call_extern``) before legalization. A ``permute_dims`` of the last two
axes feeding the matmul becomes a transpose flag of ``sgemm``, and the gradient of a shared
weight, ``collapse_sum_to(matmul(permute(x), g))`` over a batch, one sgemm over the stacked
rows of ``x`` and ``g``.

The batch, or else the rows of the result, are split over a ``T.parallel`` loop: the gemms run
on TVM's own thread pool, as the other kernels do, with OpenBLAS single-threaded. (Python
threads, or OpenBLAS's, competed with TVM's workers, which spin for a while after each
kernel: a 4x1024 MLP's step took twice as long.) The library is loaded with ``RTLD_GLOBAL``
so that the compiled code finds the symbol; where no such library is found, the pass changes
nothing and TVM's own (scheduled) matmuls run.

An executable built with these calls runs only in a process that imported relaxgrad.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor
from tvm.script import tirx as T

from .. import _ty
from ._common import rewrite_functions, static_shape

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _load_sgemm() -> str | None:
    """The symbol of ``cblas_sgemm`` (64-bit ints) in numpy's bundled OpenBLAS, loaded
    globally and set single-threaded, or None."""
    here = os.path.dirname(np.__file__)
    for path in sorted(glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*"))):
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        for prefix in ("scipy_", ""):
            if getattr(lib, f"{prefix}cblas_sgemm64_", None) is None:
                continue
            set_threads = getattr(lib, f"{prefix}openblas_set_num_threads64_", None)
            if set_threads is not None:  # TVM's threads split the work
                set_threads(ctypes.c_int(1))
            return f"{prefix}cblas_sgemm64_"
    return None


SGEMM = _load_sgemm()
THREADS = int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)
"""Tasks a large gemm is cut into (``TVM_NUM_THREADS``, else all cores)."""
_SPLIT_MACS = 1 << 22  # from about 0.1 ms of work, splitting pays for the thread handoff
_SPLIT_K_MAX_OUT = 1 << 16  # results up to this size may be summed from partial ones
_CACHE_BYTES = 1 << 18  # what a k-slice of both operands may take (about an L2 cache)


def available() -> bool:
    """Whether an OpenBLAS ``sgemm`` was found (numpy's wheels ship one)."""
    return SGEMM is not None


def gemm_func(
    a_shape, b_shape, out_shape, trans_a: bool, trans_b: bool, threads: int | None = None
) -> tirx.PrimFunc:
    """A PrimFunc ``(a, b, out)``: ``out[...] = op(a)[...] @ op(b)[...]``, op a transpose of the
    last two axes where flagged; ``a`` and ``b`` have ``out``'s batch shape or none
    (broadcast). ``threads`` tasks at most (:data:`THREADS` by default)."""
    threads = THREADS if threads is None else threads
    m, n = out_shape[-2:]
    k = a_shape[-2] if trans_a else a_shape[-1]
    batch = math.prod(out_shape[:-2])
    if batch == 1 and m * n <= _SPLIT_K_MAX_OUT and k >= 8 * max(m, n) and m * n * k >= _SPLIT_MACS:
        return _split_k_func(a_shape, b_shape, out_shape, trans_a, trans_b, threads)
    a_batched, b_batched = len(a_shape) > 2, len(b_shape) > 2
    if a_batched and not b_batched and not trans_a:  # one gemm over the stacked rows of a
        m, batch, a_batched = m * batch, 1, False
    lda, ldb = (m if trans_a else k), (k if trans_b else n)
    flag_a, flag_b = (_TRANS if trans_a else _NO_TRANS), (_TRANS if trans_b else _NO_TRANS)
    a_stride, b_stride = m * k * a_batched, k * n * b_batched
    a_row = 1 if trans_a else k  # elements between rows of op(a)
    b_col = k if trans_b else 1  # elements between columns of op(b)
    chunks = 1
    if batch * m * n * k >= _SPLIT_MACS and batch < threads:
        chunks = threads
    # Each task takes rows of the result, or columns where it is wider than tall (each task
    # packs its own part of op(b) or op(a) then).
    by_cols = n > m
    size = n if by_cols else m
    step = -(-size // chunks)
    chunks = -(-size // step)
    tasks = batch * chunks
    a_size, b_size, out_size = (math.prod(s) for s in (a_shape, b_shape, out_shape))
    symbol, parallel = SGEMM, tasks > 1 and batch * m * n * k >= _SPLIT_MACS
    row_step, col_step = (0, step) if by_cols else (step, 0)

    @T.prim_func(private=True, check_well_formed=False)
    def gemm(a_handle: T.handle, b_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        a = T.match_buffer(a_handle, a_shape, "float32")
        b = T.match_buffer(b_handle, b_shape, "float32")
        out = T.match_buffer(out_handle, out_shape, "float32")
        a_flat = T.decl_buffer((a_size,), "float32", data=a.data)
        b_flat = T.decl_buffer((b_size,), "float32", data=b.data)
        out_flat = T.decl_buffer((out_size,), "float32", data=out.data)
        for task in T.parallel(tasks) if parallel else T.serial(tasks):
            i = task // chunks
            row = task % chunks * row_step
            col = task % chunks * col_step
            T.evaluate(
                T.call_extern(
                    "void", symbol, _ROW_MAJOR, flag_a, flag_b,
                    T.Cast("int64", T.min(step, m - row) if not by_cols else m),
                    T.Cast("int64", T.min(step, n - col) if by_cols else n),
                    T.int64(k),
                    T.float32(1),
                    T.address_of(a_flat[i * a_stride + row * a_row]),
                    T.int64(lda),
                    T.address_of(b_flat[i * b_stride + col * b_col]), T.int64(ldb),
                    T.float32(0),
                    T.address_of(out_flat[i * m * n + row * n + col]), T.int64(n),
                )  # fmt: skip
            )

    return gemm


def _split_k_func(
    a_shape, b_shape, out_shape, trans_a, trans_b, threads, batched: bool = False
) -> tirx.PrimFunc:
    """:func:`gemm_func` for a small 2-D result of a long ``k`` (a convolution's weight
    gradient: (32, 27) from k = 65536): OpenBLAS runs such a gemm at a fifth of its speed, and
    rows or columns split over threads leave each a sliver. Instead each task sums the products
    of its part of ``k``, in slices of both operands that stay in cache, into a partial result,
    and the partial results are added. Where the result is wider than tall, the tasks compute
    ``op(b)^T @ op(a)^T`` (OpenBLAS was 1.35x faster) and the sum transposes it back.

    ``batched``: ``out = sum_i op(a[i]) @ op(b[i])`` over the leading axis of 3-D ``a`` and
    ``b`` (a weight gradient summed over a batch whose ``k`` is not contiguous across it), one
    batch per slice."""
    m, n = out_shape
    swap = n > m
    if swap:  # out^T = op(b)^T @ op(a)^T: b is the left operand, with the opposite flag
        a_shape, b_shape = b_shape, a_shape
        trans_a, trans_b = not trans_b, not trans_a
        m, n = n, m
    k = a_shape[-2] if trans_a else a_shape[-1]
    lda, ldb = (m if trans_a else k), (k if trans_b else n)
    flag_a, flag_b = (_TRANS if trans_a else _NO_TRANS), (_TRANS if trans_b else _NO_TRANS)
    if batched:  # a slice per batch: its k, a whole matrix apart
        pieces, piece, k_total = a_shape[0], k, a_shape[0] * k
        a_step, b_step = math.prod(a_shape[1:]), math.prod(b_shape[1:])
    else:  # cache-sized slices of k
        piece = min(max(1024, _CACHE_BYTES // (4 * (m + n))), -(-k // threads))
        pieces, k_total = -(-k // piece), k
        a_step = piece * (m if trans_a else 1)  # elements between slices of op(a)
        b_step = piece * (1 if trans_b else n)
    per_task = -(-pieces // threads)
    tasks = -(-pieces // per_task)
    a_size, b_size = math.prod(a_shape), math.prod(b_shape)
    symbol, out_size = SGEMM, m * n

    @T.prim_func(private=True, check_well_formed=False)
    def gemm(a_handle: T.handle, b_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        first = T.match_buffer(a_handle if not swap else b_handle, a_shape, "float32")
        second = T.match_buffer(b_handle if not swap else a_handle, b_shape, "float32")
        out = T.match_buffer(out_handle, out_shape, "float32")
        a_flat = T.decl_buffer((a_size,), "float32", data=first.data)
        b_flat = T.decl_buffer((b_size,), "float32", data=second.data)
        out_flat = T.decl_buffer((out_size,), "float32", data=out.data)
        partial = T.decl_buffer((tasks * out_size,), "float32")
        for task in T.parallel(tasks) if tasks > 1 else T.serial(tasks):
            for step in range(per_task):
                index = task * per_task + step
                if index < pieces:
                    T.evaluate(
                        T.call_extern(
                            "void", symbol, _ROW_MAJOR, flag_a, flag_b,
                            T.int64(m), T.int64(n),
                            T.Cast("int64", T.min(piece, k_total - index * piece)),
                            T.float32(1),
                            T.address_of(a_flat[index * a_step]), T.int64(lda),
                            T.address_of(b_flat[index * b_step]), T.int64(ldb),
                            T.Select(step == 0, T.float32(0), T.float32(1)),
                            T.address_of(partial[task * out_size]), T.int64(n),
                        )  # fmt: skip
                    )
        for i, j in T.grid(m, n):
            total = T.float32(0)
            for task in range(tasks):
                total = total + partial[task * out_size + i * n + j]
            if swap:
                out_flat[j * m + i] = total
            else:
                out_flat[i * n + j] = total

    return gemm


@tvm.transform.module_pass(opt_level=0, name="MatmulToBLAS")
class MatmulToBLAS:
    """Rewrite large float32 matmuls into OpenBLAS calls (see the module docstring)."""

    def __init__(self, min_macs: int = 1 << 20):
        self.min_macs = min_macs

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        if not available():
            return mod
        mod = rewrite_functions(_TransposedProducts(mod), mod)
        mod = rewrite_functions(_SummedProducts(mod, self.min_macs), mod)
        mod = rewrite_functions(_Rewriter(mod, self.min_macs), mod)
        return relax.transform.DeadCodeElimination()(mod)  # the folded permute_dims


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.matmul = Op.get("relax.matmul")
        self.funcs: dict[tuple, relax.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is(call, self.matmul):
            return call
        shapes = [static_shape(t) for t in (*call.args, call)]
        if any(s is None or len(s) < 2 for s in shapes) or not _float32(*call.args, call):
            return call
        a_shape, b_shape, out_shape = shapes
        batch = out_shape[:-2]
        if any(len(s) > 2 and s[:-2] != batch for s in (a_shape, b_shape)):
            return call  # a broadcast batch: left to TVM
        if math.prod(out_shape) * a_shape[-1] < self.min_macs:
            return call
        return self._gemm(*call.args, out_shape)

    def _gemm(self, a: relax.Expr, b: relax.Expr, out_shape: list[int]) -> relax.Expr:
        (a, trans_a), (b, trans_b) = _untransposed(self, a), _untransposed(self, b)
        return self._call(a, b, out_shape, trans_a, trans_b)

    def _call(self, a, b, out_shape, trans_a: bool, trans_b: bool) -> relax.Expr:
        a_shape, b_shape = static_shape(a), static_shape(b)
        key = (tuple(a_shape), tuple(b_shape), tuple(out_shape), trans_a, trans_b)
        if key not in self.funcs:
            func = gemm_func(a_shape, b_shape, out_shape, trans_a, trans_b)
            self.funcs[key] = self.builder_.add_func(func, "sgemm")
        out_type = relax.TensorType(out_shape, "float32")
        return relax.call_tir(self.funcs[key], [a, b], out_type)


@visitor
class _Uses(PyExprVisitor):
    """How many times each var is read in a function."""

    def __init__(self):
        super().__init__()
        self.count: dict = {}

    def visit_var_(self, var: relax.Var) -> None:
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
        self.visit_var_(var)


@mutator
class _TransposedProducts(PyExprMutator):
    """``permute_dims(p)`` swapping the last two axes of a product ``p = matmul(a, b)`` read
    only there becomes ``matmul(b^T, a^T)``, and of ``p = collapse_sum_to(matmul(a, b), (M,
    N))`` becomes ``collapse_sum_to(matmul(b^T, a^T), (N, M))``, a transpose folded into an
    operand's (removed or added) ``permute_dims``, which sgemm's flags take: a linear layer's
    weight gradient, ``(x^T g)^T`` for a ``(out, in)`` weight, is computed in place, not
    computed then transposed."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.matmul, self.permute = Op.get("relax.matmul"), Op.get("relax.permute_dims")
        self.collapse = Op.get("relax.collapse_sum_to")
        self.uses: dict = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        uses = _Uses()
        uses.visit_expr(func)
        self.uses = uses.count
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        product = call.args[0] if _is(call, self.permute) and call.args else None
        shape = static_shape(product) if product is not None else None
        if shape is None or len(shape) < 2 or not _swaps_last_two(call, len(shape)):
            return super().visit_call_(call)
        if self.uses.get(product, 0) != 1 or not _float32(product):
            return super().visit_call_(call)
        bound = self.lookup_binding(self.visit_expr(product))
        summed = _is(bound, self.collapse)
        inner = self.lookup_binding(bound.args[0]) if summed else bound
        if not _is(inner, self.matmul) or any(static_shape(x) is None for x in inner.args):
            return super().visit_call_(call)
        a, b = inner.args
        swapped = relax.op.matmul(self._transposed(b), self._transposed(a))
        if summed:
            return relax.op.collapse_sum_to(swapped, relax.ShapeExpr(shape[:-2] + shape[-1:-3:-1]))
        return swapped

    def _transposed(self, x: relax.Expr) -> relax.Expr:
        """``x`` with its last two axes swapped: the operand of its ``permute_dims``, or a new
        one."""
        y, transposed = _untransposed(self, x)
        if transposed:
            return y
        ndim = len(static_shape(x))
        return self.builder_.emit(relax.op.permute_dims(x, [*range(ndim - 2), ndim - 1, ndim - 2]))


@mutator
class _SummedProducts(PyExprMutator):
    """``collapse_sum_to(matmul(a, b), (M, N))`` over a batch of products, e.g. a shared
    weight's gradient:

    - with ``a = permute(x)``, ``x`` of shape ``(..., S, K)`` and ``b`` of shape ``(..., S, N)``
      and not a transpose (a dense layer's), it becomes
      ``matmul(permute(reshape(x, (-1, K))), reshape(b, (-1, N)))``: one matmul whose ``k``
      runs over the batch too, instead of a batch of them and a sum;
    - with 3-D ``a`` and ``b`` otherwise (a convolution's, ``g[n] @ cols[n]^T``, where ``k``
      is not contiguous across the batch), one call that accumulates the batch's products
      into a partial result per task (:func:`_split_k_func`), if it has ``min_macs``."""

    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.matmul, self.permute = Op.get("relax.matmul"), Op.get("relax.permute_dims")
        self.collapse = Op.get("relax.collapse_sum_to")

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is(call, self.collapse):
            return call
        product = self._bound(call.args[0], self.matmul)
        if product is None or not _float32(product):
            return call
        stacked = self._stacked_rows(call, product)
        return stacked if stacked is not None else self._batch_sum(call, product)

    def _stacked_rows(self, call: relax.Call, product: relax.Call) -> relax.Expr | None:
        permute, g = self._bound(product.args[0], self.permute), product.args[1]
        if permute is None or _untransposed(self, g)[1]:
            return None  # (a transposed g would be copied to stack its rows: a batch sum)
        x = permute.args[0]
        shapes = [static_shape(t) for t in (x, g, call)]
        if any(s is None for s in shapes):
            return None
        x_shape, g_shape, target = shapes
        if not (
            len(x_shape) > 2
            and x_shape[:-1] == g_shape[:-1]
            and target == [x_shape[-1], g_shape[-1]]
            and _swaps_last_two(permute, len(x_shape))
        ):
            return None
        rows = math.prod(x_shape[:-1])
        x2 = self.builder_.emit(relax.op.reshape(x, (rows, x_shape[-1])))
        g2 = self.builder_.emit(relax.op.reshape(g, (rows, g_shape[-1])))
        return relax.op.matmul(self.builder_.emit(relax.op.permute_dims(x2)), g2)

    def _batch_sum(self, call: relax.Call, product: relax.Call) -> relax.Expr:
        (a, trans_a), (b, trans_b) = (_untransposed(self, arg) for arg in product.args)
        shapes = [static_shape(t) for t in (a, b, product, call)]
        if any(s is None for s in shapes):
            return call
        a_shape, b_shape, product_shape, target = shapes
        if not (
            len(a_shape) == len(b_shape) == len(product_shape) == 3
            and a_shape[0] == b_shape[0]
            and target == product_shape[1:]
        ):
            return call
        k = a_shape[1] if trans_a else a_shape[2]
        if math.prod(product_shape) * k < self.min_macs:
            return call
        func = _split_k_func(a_shape, b_shape, target, trans_a, trans_b, THREADS, batched=True)
        gvar = self.builder_.add_func(func, "sgemm_sum")
        return relax.call_tir(gvar, [a, b], relax.TensorType(target, "float32"))

    def _bound(self, expr, op: Op) -> relax.Call | None:
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return bound if _is(bound, op) else None


def _untransposed(mutator: PyExprMutator, x: relax.Expr) -> tuple[relax.Expr, bool]:
    """``(y, True)`` when ``x`` is bound to ``permute_dims(y)`` swapping only the last two
    axes, else ``(x, False)``."""
    bound = mutator.lookup_binding(x) if isinstance(x, relax.Var) else None
    if _is(bound, Op.get("relax.permute_dims")) and _swaps_last_two(bound, len(static_shape(x))):
        return bound.args[0], True
    return x, False


def _swaps_last_two(permute: relax.Call, ndim: int) -> bool:
    axes = permute.attrs.axes
    order = list(reversed(range(ndim))) if axes is None else [int(v) for v in axes]
    return order == [*range(ndim - 2), ndim - 1, ndim - 2]


def _is(expr, op: Op) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, Op) and expr.op.same_as(op)


def _float32(*exprs) -> bool:
    return all(_ty.dtype_of(e) == "float32" for e in exprs)
