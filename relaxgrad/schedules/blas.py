"""Large float32 matmuls as calls into OpenBLAS (a Relax rewrite, CPU).

:class:`MatmulToBLAS` rewrites ``R.matmul(a, b)`` (float32, static shapes, at least
``min_macs`` multiply-adds; ``a`` and ``b`` either of the same batch shape or one of them 2-D)
into ``R.call_tir`` of a small PrimFunc that calls ``scipy_cblas_sgemm`` (``T.call_extern``)
before legalization. The OpenBLAS is the one of the ``scipy-openblas32`` wheel, a dependency
made to give Python packages an OpenBLAS with a documented library path
(:func:`library_path`): the process loads it here, and a library exported from the
executable links it (:func:`link_options`), so that it runs without relaxgrad.

A ``permute_dims`` of the last two axes feeding the matmul becomes a transpose flag of
``sgemm``, and the gradient of a shared weight, ``collapse_sum_to(matmul(permute(x), g))`` over
a batch, one sgemm over the stacked rows of ``x`` and ``g``. The backward of linear layers
reading one input (an attention's q, k and v projections) runs on the concatenation of their
output gradients: one gemm for the input's gradient, one for the weights'
(:class:`_ConcatenatedProducts`), the former reading each weight where it is
(:func:`parts_gemm_func`). Attention heads merged back into rows are written in place by
their gemms (:class:`_MergedHeads`), the q, k and v gradients' straight into that
concatenation.

The batch, or else the rows of the result, are split over a ``T.parallel`` loop: the gemms run
on TVM's own thread pool, as the other kernels do, with OpenBLAS single-threaded (each gemm
PrimFunc sets it so before its loop, which costs a few nanoseconds, also in a process that never
imported relaxgrad). (Python threads, or OpenBLAS's, competed with TVM's workers, which spin for
a while after each kernel: a 4x1024 MLP's step took twice as long.) The library is loaded with
``RTLD_GLOBAL`` so that code compiled in this process finds the symbol; where the wheel is not
installed, or the target's CPU is not this machine's kind (a cross-compilation), the pass
changes nothing and TVM's own (scheduled) matmuls run.

On x86, each task runs its sgemm calls with denormals flushed to zero (the FTZ and DAZ bits of
its thread's MXCSR, restored after), as TensorFlow's and XLA's CPU kernels do: OpenBLAS runs
10-20x slower on denormal operands, which gradients reach when a model fits its data (a 4x1024
MLP trained on one batch for 30 steps: its adjoint took 5x its forward instead of 2.7x).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform

import tvm
from tvm import relax, tirx
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script import tirx as T

from .. import _ty
from ._common import (
    OPAQUE,
    bound_values,
    calling,
    is_op,
    may_change,
    parsed_script,
    parsed_text,
    read_counts,
    rebind,
    rewrite_functions,
    static_shape,
)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def library_path() -> str | None:
    """The OpenBLAS shared library of the ``scipy-openblas32`` wheel, or None without it."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    return path if os.path.exists(path) else None


def _load_sgemm() -> tuple[str | None, str]:
    """The symbol of ``cblas_sgemm`` (32-bit ints) in :func:`library_path`, loaded globally
    and set single-threaded, or None; and the name of the core whose kernels OpenBLAS runs
    (``""`` without it)."""
    path = library_path()
    if path is None:
        return None, ""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None, ""
    if getattr(lib, "scipy_cblas_sgemm", None) is None:
        return None, ""
    lib.scipy_openblas_set_num_threads(ctypes.c_int(1))  # TVM's threads split the work
    corename = getattr(lib, "scipy_openblas_get_corename", None)
    if corename is not None:
        corename.restype = ctypes.c_char_p
    return "scipy_cblas_sgemm", (corename().decode() if corename is not None else "")


def link_options() -> list[str]:
    """Linker options that make a shared library exported from an executable with sgemm calls
    find OpenBLAS by itself: ``-l`` of :func:`library_path`, and run paths of the exported
    library's own folder (``$ORIGIN``: a copy shipped beside it, as ``Trainer.export`` does),
    then of the wheel. Empty without the wheel."""
    path = library_path()
    if path is None:
        return []
    folder, name = os.path.split(path)
    # (TVM puts options before the objects: without --no-as-needed, the linker drops the -l)
    return [f"-L{folder}", "-Wl,--no-as-needed", f"-l{name[3:-3]}", "-Wl,--as-needed",
            "-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{folder}"]


SGEMM, CORE = _load_sgemm()
THREADS = int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)
"""Tasks a large gemm is cut into (``TVM_NUM_THREADS``, else all cores)."""
_SPLIT_MACS = 1 << 22  # from about 0.1 ms of work, splitting pays for the thread handoff
_SPLIT_K_MAX_OUT = 1 << 16  # results up to this size may be summed from partial ones
_CACHE_BYTES = 1 << 18  # what a k-slice of both operands may take (about an L2 cache)
_STACK_K_BELOW = 512  # a batch sum of products with a shorter k per batch ...
_STACK_OUT_FROM = 1 << 20  # ... and a result this large stacks the batch's k (_stacked_batch)
_UNPACKED_MACS = 1_000_000  # products up to this size skip packing on the cores below
_UNPACKED_CORES = ("skylakex", "cooperlake", "sapphirerapids")  # (they share SkylakeX's kernels)
FLUSH_DENORMALS = platform.machine().lower() in ("x86_64", "amd64")
"""Whether the sgemm calls run with denormals flushed to zero (x86's FTZ and DAZ bits)."""
_FTZ_DAZ = 0x8040  # MXCSR: flush to zero (bit 15), denormals are zero (bit 6)
_SET_THREADS = "scipy_openblas_set_num_threads"


def _mxcsr(intrinsic: str, csr: tirx.Buffer, index: int) -> tirx.PrimExpr:
    """x86's ``stmxcsr`` (keep this thread's MXCSR in ``csr[index]``) or ``ldmxcsr`` (load it
    from there). The gemm functions keep it in ``csr[1]``, set the FTZ and DAZ bits in
    ``csr[0]`` and load that, then load ``csr[1]`` back.

    A plain function called from TVMScript, not a ``T.macro``: expanding a macro walks the
    Python stack with its source lines (``inspect.getouterframes``), which made each gemm
    function take tens of milliseconds to parse inside a compile."""
    return tirx.call_llvm_intrin("void", f"llvm.x86.sse.{intrinsic}", tirx.address_of(csr[index]))


def available(target=None) -> bool:
    """Whether the OpenBLAS ``sgemm`` was loaded, and ``target`` (a ``tvm.target.Target``,
    default the current one or none) builds for this machine's CPU architecture."""
    if SGEMM is None:
        return False
    target = target if target is not None else tvm.target.Target.current(allow_none=True)
    return target is None or native_arch(target)


def native_arch(target) -> bool:
    """Whether an ``llvm`` target's triple (none: this machine's) names this machine's CPU."""
    if target.kind.name != "llvm":
        return False
    triple = str(target.attrs.get("mtriple", "") or "")
    if not triple:
        return True
    machine = platform.machine().lower()
    arch = triple.split("-")[0].lower()
    aliases = {"amd64": "x86_64", "arm64": "aarch64"}
    return aliases.get(arch, arch) == aliases.get(machine, machine)


def unpacked_rows(m: int, n: int, k: int, trans_b: bool) -> int:
    """The rows of each sgemm call for a product ``(m, k) @ (k, n)`` among many (a batch's, a
    head's): ``m``, or fewer where that makes calls that OpenBLAS runs with its kernels for
    small products, which read the operands where they are instead of packing them first
    (those of its SkylakeX core, :data:`CORE`, up to about :data:`_UNPACKED_MACS`
    multiply-adds). An attention head's ``(128, 128) @ (128, 64)`` in two calls of 64 rows
    ran 1.3x faster (single-threaded: 204 GF/s in one call, 262 in two; AVX2 cores, which
    have no such kernels, ran the two calls 2% slower). Not where ``op(b) = b^T``: with
    ``a`` as it is, such calls ran slower in pieces (193 GF/s in one call, 175 in two), and
    with both transposed, in pieces of 43 or 52 rows."""
    macs = m * n * k
    if CORE.lower() not in _UNPACKED_CORES or trans_b or macs <= _UNPACKED_MACS:
        return m
    pieces = -(-macs // _UNPACKED_MACS)
    if pieces > 16:  # a large product: packing pays
        return m
    even = -(-m // pieces)
    step = -(-even // 16) * 16  # even pieces, in whole vectors of rows
    while step * n * k > _UNPACKED_MACS:
        step -= 16
    return step if step > 0 else m


def _gemm_func_script(
    *, a_row, a_shape, a_size, a_stride, b_col, b_shape, b_size, b_stride, by_cols, chunks,
    col_step, flag_a, flag_b, flush, k, lda, ldb, m, n, out_shape, out_size, parallel, row_step,
    set_threads, step, sums, symbol, tasks,
):  # fmt: skip
    """The TVMScript of :func:`gemm_func`, read by :func:`parsed_script` (never called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def gemm(a_handle: T.handle, b_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        a = T.match_buffer(a_handle, a_shape, "float32")
        b = T.match_buffer(b_handle, b_shape, "float32")
        out = T.match_buffer(out_handle, out_shape, "float32")
        a_flat = T.decl_buffer((a_size,), "float32", data=a.data)
        b_flat = T.decl_buffer((b_size,), "float32", data=b.data)
        out_flat = T.decl_buffer((out_size,), "float32", data=out.data)
        T.evaluate(T.call_extern("void", set_threads, 1))
        for task in T.parallel(tasks) if parallel else T.serial(tasks):
            csr = T.decl_buffer((2,), "int32", scope="local")
            if flush:
                T.evaluate(_mxcsr("stmxcsr", csr, 1))
                csr[0] = T.bitwise_or(csr[1], _FTZ_DAZ)
                T.evaluate(_mxcsr("ldmxcsr", csr, 0))
            i = task // chunks
            row = task % chunks * row_step
            col = task % chunks * col_step
            for s in range(sums):
                T.evaluate(
                    T.call_extern(
                        "void", symbol, _ROW_MAJOR, flag_a, flag_b,
                        T.Cast("int32", T.min(step, m - row) if not by_cols else m),
                        T.Cast("int32", T.min(step, n - col) if by_cols else n),
                        T.int32(k),
                        T.float32(1),
                        T.address_of(a_flat[(i * sums + s) * a_stride + row * a_row]),
                        T.int32(lda),
                        T.address_of(b_flat[(i * sums + s) * b_stride + col * b_col]),
                        T.int32(ldb),
                        T.Select(s == 0, T.float32(0), T.float32(1)),
                        T.address_of(out_flat[i * m * n + row * n + col]), T.int32(n),
                    )  # fmt: skip
                )
            if flush:
                T.evaluate(_mxcsr("ldmxcsr", csr, 1))



def gemm_func(
    a_shape, b_shape, out_shape, trans_a: bool, trans_b: bool, threads: int | None = None,
    summed: bool = False,
) -> tirx.PrimFunc:
    """A PrimFunc ``(a, b, out)``: ``out[...] = op(a)[...] @ op(b)[...]``, op a transpose of the
    last two axes where flagged; ``a`` and ``b`` have ``out``'s batch shape or none
    (broadcast). ``threads`` tasks at most (:data:`THREADS` by default).

    ``summed``: 2-D ``out = sum_i op(a[i]) @ op(b[i])`` over the leading axis of 3-D ``a`` and
    ``b``, each task accumulating (``beta = 1``) its rows or columns of ``out`` over the batch."""
    threads = THREADS if threads is None else threads
    m, n = out_shape[-2:]
    k = a_shape[-2] if trans_a else a_shape[-1]
    batch, sums = math.prod(out_shape[:-2]), a_shape[0] if summed else 1
    long_k = k >= 8 * max(m, n) and m * n * k >= _SPLIT_MACS
    if batch == 1 and not summed and m * n <= _SPLIT_K_MAX_OUT and long_k:
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
    if sums * batch * m * n * k >= _SPLIT_MACS and batch < threads:
        chunks = threads
    # Each task takes rows of the result, or columns where it is wider than tall (each task
    # packs its own part of op(b) or op(a) then); or rows that OpenBLAS multiplies unpacked.
    by_cols = n > m
    size = n if by_cols else m
    step = -(-size // chunks)
    rows = m if summed or batch == 1 else unpacked_rows(m, n, k, trans_b)
    if rows < m and (by_cols or rows < step):
        by_cols, size, step = False, m, rows
    chunks = -(-size // step)
    tasks = batch * chunks
    a_size, b_size, out_size = (math.prod(s) for s in (a_shape, b_shape, out_shape))
    parallel = tasks > 1 and sums * batch * m * n * k >= _SPLIT_MACS
    symbol, flush = SGEMM, FLUSH_DENORMALS
    set_threads = _SET_THREADS
    row_step, col_step = (0, step) if by_cols else (step, 0)

    return calling(parsed_script(_gemm_func_script, locals()), symbol)


def _split_k_func_script(
    *, a_shape, a_size, a_step, b_shape, b_size, b_step, flag_a, flag_b, flush, k_total, lda,
    ldb, m, n, out_shape, out_size, per_task, piece, pieces, set_threads, swap, symbol, tasks,
):  # fmt: skip
    """The TVMScript of :func:`_split_k_func`, read by :func:`parsed_script` (never called)."""

    @T.prim_func(private=True, check_well_formed=False)
    def gemm(a_handle: T.handle, b_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        first = T.match_buffer(a_handle if not swap else b_handle, a_shape, "float32")
        second = T.match_buffer(b_handle if not swap else a_handle, b_shape, "float32")
        out = T.match_buffer(out_handle, out_shape, "float32")
        a_flat = T.decl_buffer((a_size,), "float32", data=first.data)
        b_flat = T.decl_buffer((b_size,), "float32", data=second.data)
        out_flat = T.decl_buffer((out_size,), "float32", data=out.data)
        partial = T.decl_buffer((tasks * out_size,), "float32")
        T.evaluate(T.call_extern("void", set_threads, 1))
        for task in T.parallel(tasks) if tasks > 1 else T.serial(tasks):
            csr = T.decl_buffer((2,), "int32", scope="local")
            if flush:
                T.evaluate(_mxcsr("stmxcsr", csr, 1))
                csr[0] = T.bitwise_or(csr[1], _FTZ_DAZ)
                T.evaluate(_mxcsr("ldmxcsr", csr, 0))
            for step in range(per_task):
                index = task * per_task + step
                if index < pieces:
                    T.evaluate(
                        T.call_extern(
                            "void", symbol, _ROW_MAJOR, flag_a, flag_b,
                            T.int32(m), T.int32(n),
                            T.Cast("int32", T.min(piece, k_total - index * piece)),
                            T.float32(1),
                            T.address_of(a_flat[index * a_step]), T.int32(lda),
                            T.address_of(b_flat[index * b_step]), T.int32(ldb),
                            T.Select(step == 0, T.float32(0), T.float32(1)),
                            T.address_of(partial[task * out_size]), T.int32(n),
                        )  # fmt: skip
                    )
            if flush:
                T.evaluate(_mxcsr("ldmxcsr", csr, 1))
        for i, j in T.grid(m, n):
            total = T.float32(0)
            for task in range(tasks):
                total = total + partial[task * out_size + i * n + j]
            if swap:
                out_flat[j * m + i] = total
            else:
                out_flat[i * n + j] = total



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
    symbol, out_size, flush, set_threads = SGEMM, m * n, FLUSH_DENORMALS, _SET_THREADS

    return calling(parsed_script(_split_k_func_script, locals()), symbol)


def _head_gemm(a, b, out, task, symbol, shape, flags, leading, heads, out_batch, column, step):
    """One task's product of :func:`heads_gemm_func`: rows ``piece * step`` on (``step`` of
    them at most) of matrix ``index`` of ``a`` and ``b`` (``task = index * pieces + piece``),
    written at ``column + head * n`` of its batch's rows of ``out`` (a call of ``symbol``)."""
    m, n, k = shape
    pieces = -(-m // step)
    index, row = task // pieces, task % pieces * step
    i32, f32 = (lambda v: tirx.IntImm("int32", v)), (lambda v: tirx.FloatImm("float32", v))
    return tirx.call_extern(
        "void", symbol, i32(_ROW_MAJOR), i32(flags[0]), i32(flags[1]),
        tirx.Cast("int32", tirx.min(step, m - row)), i32(n), i32(k), f32(1),
        tirx.address_of(a[index * m * k + row * (1 if flags[0] == _TRANS else k)]),
        i32(leading[0]), tirx.address_of(b[index * k * n]), i32(leading[1]), f32(0),
        tirx.address_of(
            out[index // heads * out_batch + row * leading[2] + column + index % heads * n]
        ),
        i32(leading[2]),
    )


def heads_gemm_func(parts: list[tuple], out_shape: list[int], rows: int) -> tirx.PrimFunc:
    """A PrimFunc ``(a_1, b_1, ..., a_n, b_n, out)`` that writes the batched products
    ``p_i = op(a_i) @ op(b_i)`` of shape ``(B, H_i, S, D_i)`` (``S = rows``; ``B * H_i``
    matrices, in 3-D or 4-D operands) with their heads side by side:
    ``out = concat([reshape(permute_dims(p_i, [0, 2, 1, 3]), (B, S, H_i * D_i))], -1)``
    (``out_shape``: ``(B, S, W)`` or ``(B * S, W)``), each head's gemm writing its columns of
    ``out`` (``ldc``) instead of a matrix of its own. ``parts``: ``(a_shape, b_shape, trans_a,
    trans_b)``, op a transpose of the last two axes where flagged."""
    width = out_shape[-1]
    batch = math.prod(out_shape[:-1]) // rows
    params, matched, flat, column, start = [], [], [], 0, 0
    extra = {"_head_gemm": _head_gemm}
    for i, (a_shape, b_shape, trans_a, trans_b) in enumerate(parts):
        heads = math.prod(a_shape[:-2]) // batch
        k = a_shape[-2] if trans_a else a_shape[-1]
        n = b_shape[-2] if trans_b else b_shape[-1]
        shape, flags = (rows, n, k), tuple(_TRANS if t else _NO_TRANS for t in (trans_a, trans_b))
        leading = (rows if trans_a else k, k if trans_b else n, width)
        step = unpacked_rows(rows, n, k, trans_b)
        tasks = batch * heads * -(-rows // step)
        params += [f"a{i}_handle: T.handle", f"b{i}_handle: T.handle"]
        for name, shape_i in ((f"a{i}", a_shape), (f"b{i}", b_shape)):
            matched.append(
                f"    {name} = T.match_buffer({name}_handle, {tuple(shape_i)}, 'float32')"
            )
            flat.append(f"    {name}_flat = T.decl_buffer(({math.prod(shape_i)},), 'float32', "
                        f"data={name}.data)")  # fmt: skip
        extra[f"part{i}"] = (shape, flags, leading, heads, rows * width, column, step)
        extra[f"range{i}"] = (start, start + tasks)
        column, start = column + heads * n, start + tasks
    lines = [
        "@T.prim_func",  # not T.prim_func(...): see parsed_script
        f"def heads({', '.join(params)}, out_handle: T.handle):",
        '    T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})',
        *matched,
        f"    out = T.match_buffer(out_handle, {tuple(out_shape)}, 'float32')",
        *flat,
        f"    out_flat = T.decl_buffer(({math.prod(out_shape)},), 'float32', data=out.data)",
        *_task_loop(start),
    ]
    for i in range(len(parts)):
        lines += [
            f"        if range{i}[0] <= task and task < range{i}[1]:",
            f"            T.evaluate(_head_gemm(a{i}_flat, b{i}_flat, out_flat, task - range{i}[0],"
            f" SGEMM, *part{i}))",
        ]
    return _parsed_tasks(lines, extra)


def _task_loop(tasks: int, parallel: bool = True) -> list[str]:
    """The lines of a generated gemm PrimFunc (:func:`heads_gemm_func`,
    :func:`parts_gemm_func`) that open its loop over ``tasks`` (``task``): OpenBLAS
    single-threaded, denormals flushed in each task (closed by :func:`_parsed_tasks`)."""
    return [
        f"    T.evaluate(T.call_extern('void', '{_SET_THREADS}', 1))",
        f"    for task in T.{'parallel' if parallel else 'serial'}({tasks}):",
        "        csr = T.decl_buffer((2,), 'int32', scope='local')",
        *([
            "        T.evaluate(_mxcsr('stmxcsr', csr, 1))",
            "        csr[0] = T.bitwise_or(csr[1], _FTZ_DAZ)",
            "        T.evaluate(_mxcsr('ldmxcsr', csr, 0))",
        ] if FLUSH_DENORMALS else []),
    ]  # fmt: skip


def _parsed_tasks(lines: list[str], extra: dict) -> tirx.PrimFunc:
    """The PrimFunc of a generated gemm's ``lines``, its task loop (:func:`_task_loop`)
    closed; parsed once per text and values (every layer's attention heads are one kind)."""
    lines = lines + (["        T.evaluate(_mxcsr('ldmxcsr', csr, 1))"] if FLUSH_DENORMALS else [])
    extra = {**extra, "T": T, "_mxcsr": _mxcsr, "_FTZ_DAZ": _FTZ_DAZ, "OPAQUE": OPAQUE,
             "SGEMM": SGEMM}  # fmt: skip
    return calling(parsed_text("\n".join(lines) + "\n", extra), SGEMM)


def _part_gemm(a, b, out, task, symbol, step, m, n, k, lda, offset, trans_b, first):
    """One part's product of :func:`parts_gemm_func` for the rows of ``task``: ``op(b) @``
    the part's ``k`` columns of ``a`` from ``offset``, added to ``out`` unless ``first``."""
    i32, f32 = (lambda v: tirx.IntImm("int32", v)), (lambda v: tirx.FloatImm("float32", v))
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    row = tirx.Cast("int64", task) * i64(step)
    rows = tirx.Cast("int32", tirx.min(i64(step), i64(m) - row))
    flag_b, ldb = (_TRANS, k) if trans_b else (_NO_TRANS, n)
    return tirx.call_extern(
        "void", symbol, i32(_ROW_MAJOR), i32(_NO_TRANS), i32(flag_b), rows, i32(n), i32(k),
        f32(1), tirx.address_of(a[row * lda + offset]), i32(lda), tirx.address_of(b[0]),
        i32(ldb), f32(0 if first else 1), tirx.address_of(out[row * n]), i32(n),
    )


def parts_gemm_func(a_shape, parts: list[tuple], threads: int | None = None) -> tirx.PrimFunc:
    """A PrimFunc ``(a, b_1, ..., b_n, out)``: ``out = a @ concat([op(b_i)], 0)`` without the
    concatenation, ``sum_i a[..., K_i] @ op(b_i)`` over the columns ``K_i`` of ``a`` that meet
    ``b_i``'s rows (``a``'s rows stacked over its batch); each task's rows of ``out``
    accumulate the parts' gemms (``beta = 1`` after the first). ``parts``: ``(b_shape,
    trans_b)`` of 2-D ``b_i``, op a transpose where flagged."""
    threads = THREADS if threads is None else threads
    m, lda = math.prod(a_shape[:-1]), a_shape[-1]
    n = parts[0][0][0] if parts[0][1] else parts[0][0][1]
    chunks = threads if m * n * lda >= _SPLIT_MACS else 1
    step = -(-m // chunks)
    tasks = -(-m // step)
    shapes, lines, offset = [("a", a_shape)], [], 0
    extra = {"_part_gemm": _part_gemm}
    for i, (b_shape, trans_b) in enumerate(parts):
        k = b_shape[1] if trans_b else b_shape[0]
        shapes.append((f"b{i}", b_shape))
        extra[f"part{i}"] = (step, m, n, k, lda, offset, trans_b, i == 0)
        lines.append(f"        T.evaluate(_part_gemm(a_flat, b{i}_flat, out_flat, task, SGEMM,"
                     f" *part{i}))")  # fmt: skip
        offset += k
    shapes.append(("out", (*a_shape[:-1], n)))
    head = [
        "@T.prim_func",  # not T.prim_func(...): see parsed_script
        f"def parts({', '.join(f'{name}_handle: T.handle' for name, _ in shapes)}):",
        '    T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})',
    ]
    head += [f"    {name} = T.match_buffer({name}_handle, {tuple(shape)}, 'float32')"
             for name, shape in shapes]  # fmt: skip
    head += [f"    {name}_flat = T.decl_buffer(({math.prod(shape)},), 'float32', data={name}.data)"
             for name, shape in shapes]  # fmt: skip
    head += _task_loop(tasks, parallel=tasks > 1)
    return _parsed_tasks(head + lines, extra)


@tvm.transform.module_pass(opt_level=0, name="MatmulToBLAS")
class MatmulToBLAS:
    """Rewrite large float32 matmuls into OpenBLAS calls (see the module docstring)."""

    def __init__(self, min_macs: int = 1 << 20):
        self.min_macs = min_macs

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        matmul = Op.get("relax.matmul")
        if not available() or not any(
                may_change(func, lambda value: is_op(value, matmul))
                for _, func in mod.functions_items() if isinstance(func, relax.Function)):
            return mod  # no product to rewrite (each rewrite below would walk every function)
        dead_code = relax.transform.DeadCodeElimination()
        mod = dead_code(rewrite_functions(_TransposedProducts(mod), mod))  # products it replaced
        # (the module has no dead code from here on: a rewrite that replaces nothing leaves
        # none, and eliminating it again would only cost a walk of every function)
        concatenated = _ConcatenatedProducts(mod)
        mod = rewrite_functions(concatenated, mod)
        if concatenated.groups:
            mod = dead_code(mod)  # the products it replaced
        heads = _MergedHeads(mod, self.min_macs)
        mod = rewrite_functions(heads, mod)
        if heads.merged:
            mod = dead_code(mod)  # the heads' products and transposes
        mod = rewrite_functions(_SummedProducts(mod, self.min_macs), mod)
        mod = rewrite_functions(_Rewriter(mod, self.min_macs), mod)
        return dead_code(mod)  # the folded permute_dims


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.matmul = Op.get("relax.matmul")
        self.funcs: dict[tuple, relax.GlobalVar] = {}

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, lambda value: self._out_shape(value) is not None):
            return func
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        out_shape = self._out_shape(call)
        return call if out_shape is None else self._gemm(*call.args, out_shape)

    def _out_shape(self, call) -> list[int] | None:
        """The result's shape if ``call`` is a matmul to rewrite, else None."""
        if not is_op(call, self.matmul):
            return None
        shapes = [static_shape(t) for t in (*call.args, call)]
        if any(s is None or len(s) < 2 for s in shapes) or not _float32(*call.args, call):
            return None
        a_shape, b_shape, out_shape = shapes
        batch = out_shape[:-2]
        if any(len(s) > 2 and s[:-2] != batch for s in (a_shape, b_shape)):
            return None  # a broadcast batch: left to TVM
        if math.prod(out_shape) * a_shape[-1] < self.min_macs:
            return None
        return out_shape

    def _gemm(self, a: relax.Expr, b: relax.Expr, out_shape: list[int]) -> relax.Expr:
        (a, trans_a), (b, trans_b) = _untransposed(self, a), _untransposed(self, b)
        parts = self._parts(b) if not trans_a and not trans_b else None
        if parts is not None:
            shapes = [(static_shape(w), trans) for w, trans in parts]
            key = ("parts", tuple(static_shape(a)), *((tuple(s), t) for s, t in shapes))
            if key not in self.funcs:
                func = parts_gemm_func(static_shape(a), shapes)
                self.funcs[key] = self.builder_.add_func(func, "sgemm_parts")
            out_type = relax.TensorType(out_shape, "float32")
            return relax.call_tir(self.funcs[key], [a, *(w for w, _ in parts)], out_type)
        return self._call(a, b, out_shape, trans_a, trans_b)

    def _parts(self, b: relax.Expr) -> list[tuple] | None:
        """``[(b_i, trans_i)]`` when ``b`` is a concatenation of 2-D ``op(b_i)`` along its
        rows (:class:`_ConcatenatedProducts`' weights), else None."""
        bound = self.lookup_binding(b) if isinstance(b, relax.Var) else None
        if not is_op(bound, Op.get("relax.concat")) or not isinstance(bound.args[0], relax.Tuple):
            return None
        fields = bound.args[0].fields
        if bound.attrs.axis is None or int(bound.attrs.axis) != 0:
            return None
        if any(len(static_shape(f) or []) != 2 for f in fields):
            return None
        return [_untransposed(self, f) for f in fields]

    def _call(self, a, b, out_shape, trans_a: bool, trans_b: bool) -> relax.Expr:
        a_shape, b_shape = static_shape(a), static_shape(b)
        key = (tuple(a_shape), tuple(b_shape), tuple(out_shape), trans_a, trans_b)
        if key not in self.funcs:
            func = gemm_func(a_shape, b_shape, out_shape, trans_a, trans_b)
            self.funcs[key] = self.builder_.add_func(func, "sgemm")
        out_type = relax.TensorType(out_shape, "float32")
        return relax.call_tir(self.funcs[key], [a, b], out_type)


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
        self.uses = read_counts(func)
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        product = call.args[0] if is_op(call, self.permute) and call.args else None
        shape = static_shape(product) if product is not None else None
        if shape is None or len(shape) < 2 or not _swaps_last_two(call, len(shape)):
            return super().visit_call_(call)
        if self.uses.get(product, 0) != 1 or not _float32(product):
            return super().visit_call_(call)
        base = _through_batch_views(self.lookup_binding, product, self.uses)  # or what it views
        if self.uses.get(base, 0) != 1:
            return super().visit_call_(call)
        bound = self.lookup_binding(self.visit_expr(base))
        summed = is_op(bound, self.collapse) and base is product
        inner = self.lookup_binding(bound.args[0]) if summed else bound
        if not is_op(inner, self.matmul) or any(static_shape(x) is None for x in inner.args):
            return super().visit_call_(call)
        a, b = inner.args
        swapped = relax.op.matmul(self._transposed(b), self._transposed(a))
        if summed:
            return relax.op.collapse_sum_to(swapped, relax.ShapeExpr(shape[:-2] + shape[-1:-3:-1]))
        if static_shape(base) != shape:  # views regrouping its batch: reshaped likewise
            return relax.op.reshape(self.builder_.emit(swapped), static_shape(call))
        return swapped

    def _transposed(self, x: relax.Expr) -> relax.Expr:
        """``x`` with its last two axes swapped: the operand of its ``permute_dims``, or a new
        one."""
        y, transposed = _untransposed(self, x)
        if transposed:
            return y
        ndim = len(static_shape(x))
        return self.builder_.emit(relax.op.permute_dims(x, _last_two_swapped(ndim)))


class _Column:
    """A term ``matmul(d, w)`` of a sum and the readers of ``d``: the var bound to its bias
    gradient ``collapse_sum_to(d, (K,))`` or None, and to its weight gradient or None, which
    reads ``x`` as ``d^T x`` (``x_first`` False) or ``x^T d``. ``bindings``: those it
    replaces."""

    def __init__(self, term, d, w, rows: tuple):
        self.term, self.d, self.w, self.rows = term, d, w, rows
        self.bias = self.weight = self.x = None
        self.x_first = False
        self.bindings = {term}

    def kind(self) -> tuple:
        return (self.bias is None, self.weight is None, self.x, self.x_first, self.rows)


class _Group:
    """Linear layers' backward over one input, found by :class:`_Block`: ``total``, a sum of
    the ``columns``' products and of ``rest``. ``dropped``: the bindings the group replaces;
    ``last``: the last of them, where the replacement goes."""

    def __init__(self, total, columns: list[_Column], rest: list, dropped: set, last):
        self.total, self.columns, self.rest = total, columns, rest
        self.dropped, self.last = dropped, last


class _Block:
    """Bindings of a dataflow block, their readers, and the groups of
    :class:`_ConcatenatedProducts` among them. ``outside``: how often each var is read
    outside the block's bindings."""

    def __init__(self, block: relax.DataflowBlock, outside: dict):
        self.values, self.pos, self.readers, self.outside = {}, {}, {}, outside
        self._aliases: dict | None = None
        self._first: dict = {}  # a repeated reshape's var -> the first one's (canonical)
        reshapes: dict = {}
        for index, binding in enumerate(block.bindings):
            if isinstance(binding, relax.VarBinding):
                self.values[binding.var], self.pos[binding.var] = binding.value, index
                for var in relax.analysis.free_vars(binding.value):
                    self.readers.setdefault(var, []).append(binding.var)
                target = _target(self.bound(binding.var, "relax.reshape"))
                if target is not None:  # one reshape of a var per shape (from_torch's linear
                    # layers each flatten their input's batch)
                    key = (self.canonical(binding.value.args[0]), tuple(target))
                    self._first[binding.var] = reshapes.setdefault(key, binding.var)

    def groups(self) -> list[_Group]:
        found, taken = [], set()
        for total in self.values:
            if self.bound(total, "relax.add") is None:
                continue
            if self.bound(self.only_reader(total), "relax.add") is not None:
                continue  # inside a larger sum
            group = self._group(total)
            columns = {c.d for c in group.columns} if group is not None else set()
            if group is not None and not (group.dropped | columns) & taken:
                taken |= group.dropped | columns
                found.append(group)
        return found

    def bound(self, var, name: str) -> relax.Call | None:
        value = self.values.get(var) if isinstance(var, relax.Var) else None
        return value if is_op(value, Op.get(name)) else None

    def only_reader(self, var):
        found = self.readers.get(var, [])
        return found[0] if len(found) == 1 and not self.outside.get(var) else None

    def canonical(self, var):
        """``var`` with the bindings of one var to another followed, and a reshape's var the
        first one's of the same reshape of the same var."""
        while isinstance(self.values.get(var), relax.Var):
            var = self.values[var]
        return self._first.get(var, var)

    def aliases(self, var) -> list:
        """The vars some binding reads whose :meth:`canonical` is ``var`` (``var`` too), in
        the order of the first binding reading each; indexed once per block, where a scan of
        every read var per product was quadratic in the block."""
        if self._aliases is None:
            self._aliases = {}
            for read in self.readers:
                self._aliases.setdefault(self.canonical(read), []).append(read)
        return self._aliases.get(var, [])

    def _group(self, total) -> _Group | None:
        terms, inner, stack = [], {total}, [total]
        while stack:
            for arg in self.bound(stack.pop(), "relax.add").args:
                if self.bound(arg, "relax.add") is not None and self.only_reader(arg) is not None:
                    inner.add(arg)
                    stack.append(arg)
                else:
                    terms.append(arg)
        shape = static_shape(total)
        if shape is None or not _float32(total):
            return None
        columns = [c for c in (self._column(t, shape) for t in terms) if c is not None]
        kinds = {}
        for column in columns:
            kinds.setdefault(column.kind(), []).append(column)
        columns = max(kinds.values(), key=len, default=[])  # of one kind: one concatenation
        if len(columns) < 2 or len({c.d for c in columns}) < len(columns):
            return None
        chosen = {c.term for c in columns}
        dropped = inner.union(*(c.bindings for c in columns))
        last = max(dropped, key=self.pos.__getitem__)
        for var in dropped:  # what reads a replaced var must come after the replacement
            if any(r not in dropped and self.pos[r] < self.pos[last]
                   for r in self.readers.get(var, [])):  # fmt: skip
                return None
        return _Group(total, columns, [t for t in terms if t not in chosen], dropped, last)

    def _column(self, term, shape: list[int]) -> _Column | None:
        """``term``'s :class:`_Column` when it is a product ``matmul(d, w)`` (2-D ``w``, of
        ``shape``, or reshaped to it over its rows) read only by the sum and ``d`` only by it
        and its gradients; else None."""
        if self.only_reader(term) is None:
            return None
        inner, product = term, self.bound(term, "relax.matmul")
        view = self.bound(term, "relax.reshape")
        if view is not None and self.only_reader(view.args[0]) is not None:
            inner, product = view.args[0], self.bound(view.args[0], "relax.matmul")
        if product is None:
            return None
        d, w = product.args
        d_shape, w_shape = static_shape(d), static_shape(w)
        if d_shape is None or w_shape is None or len(w_shape) != 2:
            return None
        rows = d_shape[:-1]
        if inner is term:  # the product itself
            fits = rows + w_shape[1:] == shape
        else:  # reshaped over its rows
            fits = w_shape[1] == shape[-1] and math.prod(rows) == math.prod(shape[:-1])
        if not fits or not _float32(d, w):
            return None
        column = _Column(term, self.canonical(d), w, tuple(rows))
        column.bindings.add(inner)
        names = self.aliases(column.d)
        if any(self.outside.get(v) for v in names):
            return None
        k = d_shape[-1]
        for use in {r for v in names for r in self.readers[v] if self.canonical(r) != column.d}:
            if use.same_as(inner):
                continue
            if column.bias is None and _target(self.bound(use, "relax.collapse_sum_to")) == [k]:
                column.bias = use
                column.bindings.add(use)
                continue
            found = self._weight_gradient(use, column.d, k, len(d_shape))
            if found is None or column.weight is not None:
                return None
            column.x, column.x_first, chain = found
            column.weight = chain[-1]
            column.bindings |= set(chain)
        return column

    def _weight_gradient(self, use, d, k: int, ndim: int):
        """``(x, x_first, bindings)`` when ``use`` (a reader of a column ``d`` of width ``k``)
        starts a weight gradient ``collapse_sum_to(matmul(permute(d), x), (k, N))`` or is the
        product of ``collapse_sum_to(matmul(permute(x), d), (N, k))``; else None."""
        permute = self.bound(use, "relax.permute_dims")
        if permute is not None:  # permute(d), then its product with x
            chain = [use, self.only_reader(use)]
            product = self.bound(chain[1], "relax.matmul")
            if not _swaps_last_two(permute, ndim) or product is None:
                return None
            if not product.args[0].same_as(use):
                return None
            x, x_first = product.args[1], False
        else:  # the product of permute(x) and d
            chain, product = [use], self.bound(use, "relax.matmul")
            if product is None or not self.canonical(product.args[1]).same_as(d):
                return None
            transposed = self.bound(product.args[0], "relax.permute_dims")
            if transposed is None or not _swaps_last_two(transposed, ndim):
                return None
            x, x_first = transposed.args[0], True
        shape = static_shape(x)
        if shape is None or len(shape) != ndim or static_shape(product) is None:
            return None
        want = [shape[-1], k] if x_first else [k, shape[-1]]
        if static_shape(product)[:-2] != shape[:-2] or static_shape(product)[-2:] != want:
            return None
        if ndim > 2:  # summed over the batch
            chain.append(self.only_reader(chain[-1]))
            if _target(self.bound(chain[-1], "relax.collapse_sum_to")) != want:
                return None
        return self.canonical(x), x_first, chain


def _target(collapse: relax.Call | None) -> list[int] | None:
    """The static shape a ``collapse_sum_to`` sums to (or a ``reshape`` gives), or None."""
    if collapse is None or not isinstance(collapse.args[1], relax.ShapeExpr):
        return None
    values = collapse.args[1].values
    return [int(v) for v in values] if all(isinstance(v, tirx.IntImm) for v in values) else None


@mutator
class _ConcatenatedProducts(PyExprMutator):
    """Linear layers' backward over one input (an attention's q, k and v projections): a sum
    ``matmul(d_1, w_1) + ... + matmul(d_n, w_n)`` (the input's gradient; 2-D ``w_i`` of one
    width) whose ``d_i`` are read only there, in weight gradients
    ``collapse_sum_to(matmul(permute(d_i), x), (K_i, N))`` of one ``x`` and in bias gradients
    ``collapse_sum_to(d_i, (K_i,))``, becomes the products of ``d = concat(d_i, -1)``: one
    matmul ``d @ concat(w_i, 0)`` for the sum, one ``d^T x`` for the weight gradients and one
    sum for the bias gradients, sliced. Fewer, larger gemms and no adds; ``d_i``'s producers
    (e.g. transposes) fuse into the concatenation, or write into it (:class:`_MergedHeads`),
    and the weights are not copied (:meth:`_Rewriter._parts`).

    As ``from_torch`` builds a linear layer over a 3-D input, a product may be 2-D over the
    flattened rows and reshaped back (its weight gradient then a 2-D product with no sum over
    a batch), and each layer may flatten the input with a reshape of its own: reshapes of one
    var to one shape count as one var (:meth:`_Block.canonical`). BERT-base's q, k and v
    backward: 6 gemms, 3 transposes, 3 bias sums and 3 adds a layer become 2 gemms, the
    heads' gemms writing the concatenation, and one sum."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.groups: dict = {}  # the last dropped var -> its group
        self.dropped: set = set()

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
        inside = read_counts(*(binding.value for block in blocks for binding in block.bindings))
        outside = {v: n - inside.get(v, 0) for v, n in read_counts(func).items()}
        found = [group for block in blocks if isinstance(block, relax.DataflowBlock)
                 for group in _Block(block, outside).groups()]  # fmt: skip
        if not found:
            return func  # nothing to replace: no need to rebuild it binding by binding
        for group in found:
            self.groups[group.last] = group
            self.dropped |= group.dropped
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.dropped:
            return super().visit_var_binding_(binding)
        group = self.groups.get(binding.var)
        if group is not None:
            self._emit(group)
        return None

    def _emit(self, group: _Group) -> None:
        emit, first = self.builder_.emit, group.columns[0]
        ds = [self.visit_expr(c.d) for c in group.columns]
        widths = [static_shape(d)[-1] for d in ds]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        ndim = len(static_shape(ds[0]))
        swap = _last_two_swapped(ndim)
        d = emit(relax.op.concat(ds, axis=-1))
        w = emit(relax.op.concat([self.visit_expr(c.w) for c in group.columns], axis=0))
        total = relax.op.matmul(d, w)
        shape = static_shape(group.total)
        if list(first.rows) != shape[:-1]:  # the products were reshaped over their rows
            total = relax.op.reshape(emit(total), shape)
        for term in group.rest:
            total = relax.op.add(emit(total), self.visit_expr(term))
        rebind(self, group.total, total)

        def sliced(total, axis: int, olds: list) -> None:
            for old, start, width in zip(olds, offsets, widths):
                rebind(self, old, relax.op.strided_slice(total, [axis], [start], [start + width]))

        if first.weight is not None:
            x = self.visit_expr(first.x)
            if first.x_first:  # x^T d: a weight gradient per block of columns
                product = emit(relax.op.matmul(emit(relax.op.permute_dims(x, swap)), d))
                shape, axis = (static_shape(x)[-1], sum(widths)), 1
            else:  # d^T x: per block of rows
                product = emit(relax.op.matmul(emit(relax.op.permute_dims(d, swap)), x))
                shape, axis = (sum(widths), static_shape(x)[-1]), 0
            if ndim > 2:
                product = emit(relax.op.collapse_sum_to(product, shape))
            sliced(product, axis, [c.weight for c in group.columns])
        if first.bias is not None:
            total = emit(relax.op.collapse_sum_to(d, (sum(widths),)))
            sliced(total, 0, [c.bias for c in group.columns])


@mutator
class _MergedHeads(PyExprMutator):
    """Attention heads merged back into rows, ``reshape(permute_dims(p, [0, 2, 1, 3]), (B, S,
    H * D))`` of a product ``p = matmul(a, b)`` of shape ``(B, H, S, D)`` (the attention's
    output; in the backward, the gradients of q, k and v, concatenated along the last axis by
    :class:`_ConcatenatedProducts`), becomes one :func:`heads_gemm_func` call whose gemms write
    each head's columns in place: no transpose and no concatenation afterwards. Each product,
    permute and reshape must be read only there."""

    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.values: dict = {}
        self.uses: dict = {}
        self.claimed: set = set()  # heads merged by a concatenation of them
        self.merged = 0  # the merges replaced, in all functions

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.uses, self.values, self.claimed = read_counts(func), bound_values(func), set()
        found = [value for value in self.values.values() if self._parts(value) is not None]
        for value in found:
            if is_op(value, Op.get("relax.concat")):
                self.claimed |= set(value.args[0].fields)
        nested = any(isinstance(v, relax.If | relax.Function) for v in self.values.values())
        if not found and not nested:
            return func  # nothing to merge: no need to rebuild it binding by binding
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        parts = None if binding.var in self.claimed else self._parts(binding.value)
        if parts is None:
            return super().visit_var_binding_(binding)
        self.merged += 1
        out_shape = static_shape(binding.var)
        shapes = [(static_shape(a), static_shape(b), ta, tb) for a, b, ta, tb, _ in parts]
        func = heads_gemm_func(shapes, out_shape, parts[0][4])
        gvar = self.builder_.add_func(func, "sgemm_heads")
        args = [self.visit_expr(x) for a, b, *_ in parts for x in (a, b)]
        value = relax.call_tir(gvar, args, relax.TensorType(out_shape, "float32"))
        rebind(self, binding.var, value)
        return None

    def _parts(self, value) -> list[tuple] | None:
        """``[(a, b, trans_a, trans_b, S)]`` of the merged heads ``value`` (a merge or a
        concatenation of merges along the last axis, of one ``S``), else None."""
        if is_op(value, Op.get("relax.concat")):
            shape = static_shape(value)
            fields = value.args[0]
            if not isinstance(fields, relax.Tuple) or shape is None or len(shape) not in (2, 3):
                return None
            if int(value.attrs.axis) % len(shape) != len(shape) - 1:
                return None
            parts = [self._merged(self._read_once(f)) for f in fields.fields]
            if not parts or any(p is None for p in parts) or len({p[4] for p in parts}) != 1:
                return None
            return parts
        part = self._merged(value)
        return [part] if part is not None else None

    def _merged(self, value) -> tuple | None:
        """``(a, b, trans_a, trans_b, S)`` of ``reshape(permute_dims(p, [0, 2, 1, 3]), (B, S,
        H * D))`` (or ``(B * S, H * D)``; reshapes of the rows may follow) of a product ``p =
        matmul(op(a), op(b))`` of shape ``(B, H, S, D)``, or ``(B * H, S, D)`` reshaped to it
        (:func:`_through_batch_views`), float32, each value read only there."""
        out = static_shape(value)
        if not is_op(value, Op.get("relax.reshape")) or out is None:
            return None
        permute = self._read_once(value.args[0])
        while is_op(permute, Op.get("relax.reshape")):  # (B, S, H * D) -> (B * S, H * D)
            permute = self._read_once(permute.args[0])
        if not is_op(permute, Op.get("relax.permute_dims")) or permute.attrs.axes is None:
            return None
        if [int(v) for v in permute.attrs.axes] != [0, 2, 1, 3]:
            return None
        heads = static_shape(permute.args[0])  # (B, H, S, D)
        var = _through_batch_views(self.values.get, permute.args[0], self.uses)
        product = self._read_once(var)
        if not is_op(product, Op.get("relax.matmul")) or not _float32(product, *product.args):
            return None
        (a, trans_a), (b, trans_b) = (_untransposed(self, x) for x in product.args)
        shapes = [static_shape(x) for x in (a, b, product.args[0], product)]
        if heads is None or any(s is None or len(s) not in (3, 4) for s in shapes):
            return None
        a_shape, b_shape, op_a, p_shape = shapes
        if a_shape[:-2] != p_shape[:-2] or b_shape[:-2] != p_shape[:-2]:
            return None
        if p_shape[-2:] != heads[2:] or math.prod(p_shape[:-2]) != heads[0] * heads[1]:
            return None
        if math.prod(out[:-1]) != heads[0] * heads[2] or out[-1] != heads[1] * heads[3]:
            return None
        if math.prod(p_shape) * op_a[-1] < self.min_macs:
            return None
        return a, b, trans_a, trans_b, heads[2]

    def _read_once(self, var):
        """The value bound to ``var`` if it is read once, else None."""
        if not isinstance(var, relax.Var) or self.uses.get(var, 0) != 1:
            return None
        return self.values.get(var)


@mutator
class _SummedProducts(PyExprMutator):
    """``collapse_sum_to(matmul(a, b), (M, N))`` over a batch of products, e.g. a shared
    weight's gradient:

    - with ``a = permute(x)``, ``x`` of shape ``(..., S, K)`` and ``b`` of shape ``(..., S, N)``
      and not a transpose (a dense layer's), it becomes
      ``matmul(permute(reshape(x, (-1, K))), reshape(b, (-1, N)))``: one matmul whose ``k``
      runs over the batch too, instead of a batch of them and a sum;
    - with 3-D ``a`` and ``b`` otherwise (a convolution's, ``g[n] @ cols[n]^T``, where ``k``
      is not contiguous across the batch), if it has ``min_macs``: one call that accumulates
      the batch's products, each task into its rows or columns of the result where the
      result is large (:func:`gemm_func` ``summed``: ResNet-50's (256, 1024) at 14x14, 4.3 ->
      2.0 ms on 2 threads), else into a partial result per task (:func:`_split_k_func`), the
      partial results then added; or, for a
      short ``k`` per batch and a large result (a 1x1 convolution at 7x7 or 14x14 with many
      channels), one matmul over the batch's ``k`` stacked, the operands copied into that
      layout where needed (:meth:`_stacked_batch`): there each batch's product is too short
      to pay for reading and writing the partial results again (ResNet-50's (2048, 4096)
      weight gradient from k = 49 per batch: 100 ms summed, 21 ms stacked, copies
      included)."""

    def __init__(self, mod: IRModule, min_macs: int):
        super().__init__(mod)
        self.min_macs = min_macs
        self.matmul, self.permute = Op.get("relax.matmul"), Op.get("relax.permute_dims")
        self.collapse = Op.get("relax.collapse_sum_to")

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, self.collapse):
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
        if k < _STACK_K_BELOW and math.prod(target) >= _STACK_OUT_FROM:
            return self._stacked_batch(a, trans_a, b, trans_b)
        if math.prod(target) > _SPLIT_K_MAX_OUT:  # rows or columns of the result per task
            func = gemm_func(a_shape, b_shape, target, trans_a, trans_b, summed=True)
        else:
            func = _split_k_func(a_shape, b_shape, target, trans_a, trans_b, THREADS, batched=True)
        gvar = self.builder_.add_func(func, "sgemm_sum")
        return relax.call_tir(gvar, [a, b], relax.TensorType(target, "float32"))

    def _stacked_batch(self, a, trans_a: bool, b, trans_b: bool) -> relax.Expr:
        """``sum_i op(a[i]) @ op(b[i])`` as one matmul over ``k`` stacked across the batch:
        ``op(a)`` as ``(M, B * K)``, ``op(b)`` as ``(B * K, N)``, an operand copied (batch and
        row axes swapped) where its ``k`` is not contiguous across the batch."""
        emit = self.builder_.emit

        def stacked(x, k_last: bool):  # x (B, R, K) -> (R, B * K), or (B, K, R) -> (B * K, R)
            batch, rows, cols = static_shape(x)
            if not k_last:
                return emit(relax.op.reshape(x, (batch * rows, cols)))
            swapped = emit(relax.op.permute_dims(x, [1, 0, 2]))
            return emit(relax.op.reshape(swapped, (rows, batch * cols)))

        left = stacked(a, k_last=not trans_a)  # (M, B * K), or (B * K, M) to transpose
        right = stacked(b, k_last=trans_b)  # (B * K, N), or (N, B * K) to transpose
        if trans_a:
            left = emit(relax.op.permute_dims(left))
        if trans_b:
            right = emit(relax.op.permute_dims(right))
        return relax.op.matmul(left, right)

    def _bound(self, expr, op: Op) -> relax.Call | None:
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return bound if is_op(bound, op) else None


def _untransposed(mutator: PyExprMutator, x: relax.Expr) -> tuple[relax.Expr, bool]:
    """``(y, True)`` when ``x`` is bound to ``permute_dims(y)`` swapping only the last two
    axes, also through reshapes regrouping only the axes before them and identities
    (``broadcast_to`` or ``collapse_sum_to`` to the same shape): an attention's keys,
    transposed per head then reshaped to one batch axis, where ``y`` is reshaped likewise
    (which copies nothing). Two such swaps cancel: ``(y, False)`` for the keys transposed back
    in the gradient. Else ``(x, False)``."""
    y, swaps = x, 0
    while True:
        y = _through_batch_views(mutator.lookup_binding, y)
        bound = mutator.lookup_binding(y) if isinstance(y, relax.Var) else None
        if not is_op(bound, Op.get("relax.permute_dims")):
            break
        if not _swaps_last_two(bound, len(static_shape(y))):
            break
        y, swaps = bound.args[0], swaps + 1
    if swaps == 0:
        return x, False
    shape = static_shape(x)[:-2] + static_shape(y)[-2:]
    if static_shape(y) != shape:
        y = mutator.builder_.emit(relax.op.reshape(y, shape))
    return y, swaps % 2 == 1


def _through_batch_views(lookup, x: relax.Expr, uses: dict | None = None):
    """The var that ``x`` is a view of through reshapes keeping its last two axes and
    ``broadcast_to`` / ``collapse_sum_to`` to the same shape (each view read only once where
    ``uses``, read counts, are given); ``lookup``: a var's bound value or None."""
    shape = static_shape(x)
    while shape is not None and len(shape) >= 2 and isinstance(x, relax.Var):
        if uses is not None and uses.get(x, 0) != 1:
            break
        bound = lookup(x)
        if not any(is_op(bound, op) for op in _VIEWS):
            break
        inner = bound.args[0]
        inner_shape = static_shape(inner)
        if inner_shape is None or len(inner_shape) < 2 or inner_shape[-2:] != shape[-2:]:
            break
        if not is_op(bound, _VIEWS[0]) and inner_shape != shape:
            break  # broadcast_to / collapse_sum_to: only as identities
        x, shape = inner, inner_shape
    return x


_VIEWS = tuple(Op.get(f"relax.{name}") for name in ("reshape", "broadcast_to", "collapse_sum_to"))


def _swaps_last_two(permute: relax.Call, ndim: int) -> bool:
    axes = permute.attrs.axes
    order = list(reversed(range(ndim))) if axes is None else [int(v) for v in axes]
    return order == _last_two_swapped(ndim)


def _last_two_swapped(ndim: int) -> list[int]:
    """The axes of ``permute_dims`` that swaps the last two of ``ndim``."""
    return [*range(ndim - 2), ndim - 1, ndim - 2]


def _float32(*exprs) -> bool:
    return all(_ty.dtype_of(e) == "float32" for e in exprs)
