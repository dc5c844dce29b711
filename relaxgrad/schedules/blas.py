"""Large float32 matmuls as calls into the OpenBLAS that numpy ships (a Relax rewrite, CPU).

:class:`MatmulToBLAS` rewrites ``R.matmul(a, b)`` (float32, static shapes, at least
``min_macs`` multiply-adds; ``a`` and ``b`` either of the same batch shape or one of them 2-D)
into ``R.call_dps_packed("relaxgrad.blas.matmul", ...)`` before legalization. A ``permute_dims``
of the last two axes feeding the matmul becomes a transpose flag of ``sgemm``. The packed
function, registered when this module is imported, calls ``cblas_sgemm`` of numpy's
``scipy_openblas`` through ctypes with ``TVM_NUM_THREADS`` threads (all cores by default). Where
no such library is found, the pass changes nothing and TVM's own (scheduled) matmuls run.

An executable built with these calls runs only in a process that imported relaxgrad.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import rewrite_functions, static_shape

PACKED_FUNC = "relaxgrad.blas.matmul"

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _load_sgemm():
    """``cblas_sgemm`` of numpy's bundled OpenBLAS (64-bit ints), single-threaded, or None."""
    here = os.path.dirname(np.__file__)
    for path in sorted(glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_", ""):
            sgemm = getattr(lib, f"{prefix}cblas_sgemm64_", None)
            if sgemm is None:
                continue
            set_threads = getattr(lib, f"{prefix}openblas_set_num_threads64_", None)
            if set_threads is not None:  # we split the work over our own threads
                set_threads(ctypes.c_int(1))
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            scalar = ctypes.c_float
            sgemm.argtypes = [ctypes.c_int] * 3 + [i64] * 3 + [scalar, ptr, i64, ptr, i64]
            sgemm.argtypes += [scalar, ptr, i64]
            sgemm.restype = None
            return sgemm
    return None


_SGEMM = _load_sgemm()
THREADS = int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)
"""Threads per matmul (``TVM_NUM_THREADS``, else all cores)."""
_POOL = ThreadPoolExecutor(THREADS) if THREADS > 1 else None
_SPLIT_MACS = 1 << 22  # from about 0.1 ms of work, splitting pays for the thread handoff


def available() -> bool:
    """Whether an OpenBLAS ``sgemm`` was found (numpy's wheels ship one)."""
    return _SGEMM is not None


def _matmul(a, b, trans_a, trans_b, out) -> None:
    """``out[...] = op(a)[...] @ op(b)[...]`` with op a transpose of the last two axes where
    flagged; ``a`` and ``b`` have ``out``'s batch shape or none (broadcast).

    OpenBLAS runs single-threaded; the batch, or else the rows of ``out``, are split over
    :data:`THREADS` Python threads (ctypes releases the GIL). OpenBLAS's own threads spin
    while they wait for work, which on a loaded machine made a matmul 5-20x slower."""
    m, n = (int(d) for d in out.shape[-2:])
    k = int(a.shape[-2] if trans_a else a.shape[-1])
    batch = math.prod(int(d) for d in out.shape[:-2])
    a_batched, b_batched = len(a.shape) > 2, len(b.shape) > 2
    if a_batched and not b_batched and not trans_a:  # one gemm over the stacked rows of a
        m, batch, a_batched = m * batch, 1, False
    lda, ldb = (m if trans_a else k), (k if trans_b else n)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
    flags = (_ROW_MAJOR, _TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS)

    def gemm(i: int, row: int, rows: int) -> None:
        a_at = pa + 4 * (i * m * k * a_batched + (row if trans_a else row * k))
        b_at, c_at = pb + 4 * i * k * n * b_batched, pc + 4 * (i * m * n + row * n)
        _SGEMM(*flags, rows, n, k, 1.0, a_at, lda, b_at, ldb, 0.0, c_at, n)

    if _POOL is None or batch * m * n * k < _SPLIT_MACS:
        for i in range(batch):
            gemm(i, 0, m)
        return
    if batch >= THREADS:
        tasks = [(i, 0, m) for i in range(batch)]
    else:
        step = -(-m // THREADS)
        tasks = [(i, r, min(step, m - r)) for i in range(batch) for r in range(0, m, step)]
    chunks = [tasks[t::THREADS] for t in range(THREADS)]
    futures = [_POOL.submit(lambda c=c: [gemm(*task) for task in c]) for c in chunks[1:]]
    for task in chunks[0]:
        gemm(*task)
    for future in futures:
        future.result()


if available():
    tvm_ffi.register_global_func(PACKED_FUNC, _matmul, override=True)


@tvm.transform.module_pass(opt_level=0, name="MatmulToBLAS")
class MatmulToBLAS:
    """Rewrite large float32 matmuls into OpenBLAS calls (see the module docstring)."""

    def __init__(self, min_macs: int = 1 << 20):
        self.min_macs = min_macs

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        if not available():
            return mod
        mod = rewrite_functions(_Rewriter(mod, self.min_macs), mod)
        return relax.transform.DeadCodeElimination()(mod)  # the folded permute_dims


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.matmul, self.permute = Op.get("relax.matmul"), Op.get("relax.permute_dims")

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, Op) and call.op.same_as(self.matmul)):
            return call
        shapes = [static_shape(t) for t in (*call.args, call)]
        if any(s is None or len(s) < 2 for s in shapes) or any(
            _ty.dtype_of(t) != "float32" for t in (*call.args, call)
        ):
            return call
        a_shape, b_shape, out_shape = shapes
        batch = out_shape[:-2]
        if any(len(s) > 2 and s[:-2] != batch for s in (a_shape, b_shape)):
            return call  # a broadcast batch: left to TVM
        k = a_shape[-1]
        if math.prod(out_shape) * k < self.min_macs:
            return call
        (a, trans_a), (b, trans_b) = (self._untransposed(x) for x in call.args)
        args = [a, b, relax.prim_value(int(trans_a)), relax.prim_value(int(trans_b))]
        out_type = relax.TensorType(out_shape, "float32")
        return relax.call_dps_packed(PACKED_FUNC, args, out_type)

    def _untransposed(self, x: relax.Expr) -> tuple[relax.Expr, bool]:
        """``(y, True)`` when ``x`` is ``permute_dims(y)`` swapping only the last two axes."""
        bound = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if not (isinstance(bound, relax.Call) and bound.op.same_as(self.permute)):
            return x, False
        ndim = len(static_shape(x))
        axes = bound.attrs.axes
        order = list(reversed(range(ndim))) if axes is None else [int(v) for v in axes]
        swapped = list(range(ndim - 2)) + [ndim - 1, ndim - 2]
        return (bound.args[0], True) if order == swapped else (x, False)
