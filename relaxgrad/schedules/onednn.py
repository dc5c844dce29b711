"""bfloat16 matmuls as calls into oneDNN's ``dnnl_gemm_bf16bf16f32`` (a Relax rewrite, CPU).

:class:`Bf16MatmulToOneDNN` rewrites ``R.matmul(a, b, out_dtype="float32")`` of bfloat16
operands (what :class:`~relaxgrad.transforms.MixedPrecision` emits, forward and backward; static
shapes, ``a`` and ``b`` each of the result's batch shape or 2-D) into ``R.call_tir`` of a PrimFunc
that calls oneDNN's bf16 GEMM with float32 accumulation and result (``T.call_extern``). oneDNN
is what PyTorch's CPU autocast runs: it picks AMX, AVX512_BF16 or AVX-512 code for the CPU at
run time. The library is the ``onednn-cpu-gomp`` wheel's (oneDNN 3.2, CPU only, OpenMP from
GCC's ``libgomp``): loaded here with ``RTLD_GLOBAL`` so that code compiled in this process finds
the symbol, and linked by an exported library (:func:`link_options`), which finds a copy beside
itself (``Trainer.export`` ships one) or the wheel's.

Permutes of the last two axes feeding the product become the GEMM's transpose flags (the
backward's ``g @ w^T``), as for OpenBLAS. The batch, or else the rows, are split over a
``T.parallel`` loop on TVM's thread pool with oneDNN's OpenMP set to one thread in each task
(``omp_set_num_threads`` sets the calling thread's own count).

The kernel is chosen by the CPU's features at run time (:func:`bf16_kernel`): oneDNN where the
CPU runs bf16 dot products faster than float32 ones, which is where it has AMX-BF16, or
AVX512_BF16 without the AVX512_FP16 of Intel's Sapphire Rapids and later: an AMD EPYC (Zen 4, 2
cores) ran a 2048x2048x2048 bf16 product at 0.41-0.43 TFLOP/s in oneDNN, OpenBLAS's sgemm its
float32 product at 0.10. Elsewhere a bf16 product is computed as the float32 product of its
operands converted to float32, which is the same arithmetic (a product of two bf16 values is
exact in float32, and both accumulate in float32) and runs in OpenBLAS's sgemm: on an Intel Xeon
with AVX512_BF16 and AVX512_FP16 whose AMX a virtual machine did not expose (2 cores), oneDNN's
bf16 GEMM ran at 0.17 TFLOP/s and sgemm at 0.32. ``RELAXGRAD_BF16_GEMM=onednn`` or ``=float32``
overrides the choice. Where oneDNN is missing too, or the target is another machine's, TVM's own
code computes the product (bf16 converted to float32 in the kernel: correct, slower).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys

import tvm
from tvm import relax
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script import tirx as T

from .. import _ty
from ._common import (
    OPAQUE,
    calling,
    is_op,
    may_change,
    parsed_script,
    rewrite_functions,
    static_shape,
)
from .blas import THREADS, _untransposed, native_arch

__all__ = ["Bf16MatmulToOneDNN", "available", "bf16_kernel", "cpu_model", "faster_bf16", "isa",
           "library_path", "link_options", "missing_units"]

SYMBOL = "dnnl_gemm_bf16bf16f32"
_SET_THREADS = "omp_set_num_threads"
_MIN_MACS = 1 << 15  # below this, TVM's own loop is as fast as a call


def library_path() -> str | None:
    """oneDNN's shared library from the ``onednn-cpu-gomp`` wheel (in the environment's
    ``lib``), or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libdnnl.so.3")
        if os.path.exists(path):
            return path
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``), empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


UNITS = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}
"""The CPU features (``/proc/cpuinfo`` flags) that do arithmetic in each low precision."""


def missing_units(precision: str) -> bool:
    """Whether this CPU is known to have none of ``precision``'s arithmetic units
    (:data:`UNITS`; False where its flags cannot be read, or for ``"fp32"``)."""
    flags = cpu_flags()
    return bool(flags) and precision in UNITS and not flags & set(UNITS[precision])


@functools.cache
def _loaded() -> bool:
    """oneDNN loaded globally, on a CPU with AVX-512 (its bf16 GEMM's least ISA)."""
    path = library_path()
    if path is None or "avx512f" not in cpu_flags():
        return False
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return getattr(lib, SYMBOL, None) is not None


_ISAS = {0x1: "sse41", 0x3: "avx", 0x7: "avx2", 0x407: "avx2_vnni", 0xC07: "avx2_vnni_2",
         0x27: "avx512_core", 0x67: "avx512_core_vnni", 0xE7: "avx512_core_bf16",
         0x1EF: "avx512_core_fp16", 0xFEF: "avx512_core_amx", 0x1FEF: "avx512_core_amx_fp16"}
"""oneDNN's ``dnnl_cpu_isa_t`` values (oneDNN 3's ``dnnl_types.h``) by its names."""


def isa() -> str | None:
    """The instruction set oneDNN's kernels use on this CPU (``dnnl_get_effective_cpu_isa``, by
    oneDNN's name: ``avx512_core_amx``, ``avx512_core_bf16``, ...), or None without oneDNN."""
    if not _loaded():
        return None
    value = ctypes.CDLL(library_path()).dnnl_get_effective_cpu_isa()
    return _ISAS.get(value, hex(value))


def bf16_kernel() -> str:
    """``"onednn"`` or ``"float32"``: how this machine runs bfloat16 products (see the module
    docstring; ``RELAXGRAD_BF16_GEMM`` overrides)."""
    chosen = os.environ.get("RELAXGRAD_BF16_GEMM")
    if chosen in ("onednn", "float32"):
        return chosen
    return "onednn" if faster_bf16(cpu_flags()) else "float32"


def faster_bf16(flags: set[str]) -> bool:
    """Whether a CPU with these ``/proc/cpuinfo`` flags runs oneDNN's bf16 GEMM faster than
    float32 products: AMX-BF16, or AVX512_BF16 without AVX512_FP16 (AMD's Zen 4 and later,
    Intel's Cooper Lake; see the module docstring)."""
    return "amx_bf16" in flags or ("avx512_bf16" in flags and "avx512_fp16" not in flags)


def available(target=None) -> bool:
    """Whether oneDNN's bf16 GEMM is loaded and ``target`` (default: the current one) builds
    for this machine's CPU."""
    if not _loaded():
        return False
    target = target if target is not None else tvm.target.Target.current(allow_none=True)
    return target is None or native_arch(target)


def link_options() -> list[str]:
    """Linker options for an exported library calling oneDNN: ``-l`` of :func:`library_path`
    and run paths ``$ORIGIN`` then the wheel's folder."""
    path = library_path()
    if path is None:
        return []
    folder = os.path.dirname(path)
    return [f"-L{folder}", "-Wl,--no-as-needed", f"-l:{os.path.basename(path)}",
            "-Wl,--as-needed", "-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{folder}"]


def _gemm_script(*, a_shape, a_size, a_stride, b_shape, b_size, b_stride, flag_a, flag_b, k, lda,
                 ldb, m, n, out_shape, out_size, parallel, row_step, rows_per, set_threads,
                 symbol, tasks, a_row):  # fmt: skip
    """The TVMScript of :func:`gemm_func` (read by ``parsed_script``, never called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def gemm(a_handle: T.handle, b_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        a = T.match_buffer(a_handle, a_shape, "bfloat16")
        b = T.match_buffer(b_handle, b_shape, "bfloat16")
        out = T.match_buffer(out_handle, out_shape, "float32")
        a_flat = T.decl_buffer((a_size,), "bfloat16", data=a.data)
        b_flat = T.decl_buffer((b_size,), "bfloat16", data=b.data)
        out_flat = T.decl_buffer((out_size,), "float32", data=out.data)
        for task in T.parallel(tasks) if parallel else T.serial(tasks):
            T.evaluate(T.call_extern("void", set_threads, 1))
            i = task // rows_per
            row = task % rows_per * row_step
            T.evaluate(
                T.call_extern(
                    "int32", symbol, T.int8(flag_a), T.int8(flag_b),
                    T.Cast("int64", T.min(row_step, m - row)), T.int64(n), T.int64(k),
                    T.float32(1),
                    T.address_of(a_flat[i * a_stride + row * a_row]), T.int64(lda),
                    T.address_of(b_flat[i * b_stride]), T.int64(ldb),
                    T.float32(0),
                    T.address_of(out_flat[i * m * n + row * n]), T.int64(n),
                )  # fmt: skip
            )


def gemm_func(a_shape, b_shape, out_shape, trans_a: bool, trans_b: bool) -> tvm.tirx.PrimFunc:
    """A PrimFunc ``(a, b, out)``: ``out[...] = op(a)[...] @ op(b)[...]`` for bfloat16 ``a``
    and ``b`` and a float32 ``out``, each of ``a`` and ``b`` batched like ``out`` or 2-D."""
    m, n = out_shape[-2:]
    k = a_shape[-2] if trans_a else a_shape[-1]
    batch = math.prod(out_shape[:-2])
    a_batched, b_batched = len(a_shape) > 2, len(b_shape) > 2
    if batch > 1 and a_batched and not b_batched and not trans_a:  # one GEMM, a's rows stacked
        m, batch = m * batch, 1
    lda, ldb = (m if trans_a else k), (k if trans_b else n)
    flag_a, flag_b = ord("T" if trans_a else "N"), ord("T" if trans_b else "N")
    a_stride, b_stride = m * k * a_batched, k * n * b_batched
    a_row = 1 if trans_a else k
    rows_per = THREADS if batch < THREADS and m >= 2 * THREADS else 1
    row_step = -(-m // rows_per)
    rows_per = -(-m // row_step)
    tasks = batch * rows_per
    a_size, b_size, out_size = (math.prod(s) for s in (a_shape, b_shape, out_shape))
    parallel = tasks > 1 and batch * m * n * k >= 1 << 20
    symbol, set_threads = SYMBOL, _SET_THREADS
    return calling(parsed_script(_gemm_script, locals()), symbol)


@tvm.transform.module_pass(opt_level=0, name="Bf16MatmulToOneDNN")
class Bf16MatmulToOneDNN:
    """Rewrite bfloat16 matmuls with a float32 result into oneDNN calls (see the module
    docstring)."""

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        from . import blas

        if available() and bf16_kernel() == "onednn":
            rewriter = _Rewriter(mod)
        elif blas.available():  # the float32 product of the operands, for MatmulToBLAS
            rewriter = _Widened(mod)
        else:
            return mod
        return relax.transform.DeadCodeElimination()(rewrite_functions(rewriter, mod))


@mutator
class _Widened(PyExprMutator):
    """``matmul(a, b, out_dtype="float32")`` of bfloat16 operands as the product of their
    float32 conversions (each operand converted once per function)."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.wide: dict = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: _bf16_product(value)):
            return func
        self.wide = {}
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _bf16_product(call):
            return call
        return relax.op.matmul(*(self._wide(x) for x in call.args))

    def _wide(self, x):
        if x not in self.wide:
            self.wide[x] = self.builder_.emit(relax.op.astype(x, "float32"))
        return self.wide[x]


def _bf16_product(call) -> bool:
    return is_op(call, "relax.matmul") and [_ty.dtype_of(t) for t in (*call.args, call)] == [
        "bfloat16", "bfloat16", "float32"]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.matmul = Op.get("relax.matmul")
        self.funcs: dict[tuple, relax.GlobalVar] = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: self._out_shape(value) is not None):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        out_shape = self._out_shape(call)
        if out_shape is None:
            return call
        (a, trans_a), (b, trans_b) = (_untransposed(self, x) for x in call.args)
        a_shape, b_shape = static_shape(a), static_shape(b)
        if trans_a and len(a_shape) > 2 and len(b_shape) == 2:
            a, trans_a = call.args[0], False  # the stacked rows need a as it is
            a_shape = static_shape(a)
        key = (tuple(a_shape), tuple(b_shape), tuple(out_shape), trans_a, trans_b)
        if key not in self.funcs:
            func = gemm_func(a_shape, b_shape, out_shape, trans_a, trans_b)
            self.funcs[key] = self.builder_.add_func(func, "bf16_gemm")
        return relax.call_tir(self.funcs[key], [a, b], relax.TensorType(out_shape, "float32"))

    def _out_shape(self, call) -> list[int] | None:
        """The result's shape if ``call`` is a bf16 matmul with a float32 result to rewrite."""
        if not is_op(call, self.matmul):
            return None
        shapes = [static_shape(t) for t in (*call.args, call)]
        if any(s is None or len(s) < 2 for s in shapes):
            return None
        if [_ty.dtype_of(t) for t in (*call.args, call)] != ["bfloat16", "bfloat16", "float32"]:
            return None
        a_shape, b_shape, out_shape = shapes
        if any(len(s) > 2 and s[:-2] != out_shape[:-2] for s in (a_shape, b_shape)):
            return None  # a broadcast batch: left to TVM
        if math.prod(out_shape) * a_shape[-1] < _MIN_MACS:
            return None
        return out_shape
