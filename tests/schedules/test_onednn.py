"""Bf16MatmulToOneDNN: bfloat16 products with a float32 result as oneDNN calls or as sgemm on
the converted operands (as the CPU's features choose), against numpy's float64 product of the
same bfloat16 values (transposes folded into flags, batches, stacked rows), and TVM's own code
where neither library is available."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import onednn

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="no oneDNN wheel or AVX-512")


@pytest.fixture(params=["onednn", "float32"])
def kernel(request, monkeypatch):
    """Each way of computing bf16 products, whichever this CPU would choose."""
    monkeypatch.setenv("RELAXGRAD_BF16_GEMM", request.param)
    return request.param


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (to nearest even), as float32."""
    bits = a.astype("float32").view("uint32")
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype("uint32").view("float32")


def _product(a_shape, b_shape, trans_a=False, trans_b=False):
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            x, y = op.astype(a, "bfloat16"), op.astype(b, "bfloat16")
            if trans_a:
                x = op.permute_dims(x, [*range(len(a_shape) - 2), len(a_shape) - 1,
                                        len(a_shape) - 2])
            if trans_b:
                y = op.permute_dims(y, [*range(len(b_shape) - 2), len(b_shape) - 1,
                                        len(b_shape) - 2])
            out = bb.emit_output(op.matmul(x, y, out_dtype="float32"))
        bb.emit_func_output(out)
    return bb.get()


CASES = {
    "plain": ((96, 64), (64, 80), False, False),
    "trans_b": ((96, 64), (80, 64), False, True),  # a linear layer: x @ w^T
    "trans_a": ((64, 96), (64, 80), True, False),  # a weight's gradient: x^T @ g
    "stacked": ((4, 24, 64), (64, 80), False, False),  # a batch of rows, one weight
    "batched": ((3, 40, 32), (3, 32, 48), False, False),  # attention's products
    "batched_trans": ((3, 40, 32), (3, 48, 32), False, True),
    "wide": ((40, 64), (64, 200), False, False),  # wider than tall: tasks take columns
    "wide_trans_b": ((64, 128), (520, 128), False, True),  # ... and large enough for threads
    "broadcast_a": ((40, 96), (3, 96, 48), False, False),  # a convolution: W @ im2col[n]
    "broadcast_a_trans": ((96, 40), (3, 96, 48), True, False),  # its data gradient: W^T @ g[n]
}


def test_kernel_follows_the_cpus_bf16_units():
    """oneDNN where bf16 dot products outrun float32 (AMX, or AVX512_BF16 as on AMD's Zen 4),
    sgemm of the conversions elsewhere (an Intel AVX512_FP16 CPU with AMX hidden, AVX2)."""
    assert onednn.faster_bf16({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert onednn.faster_bf16({"avx512f", "avx512_bf16"})
    assert not onednn.faster_bf16({"avx512f", "avx512_bf16", "avx512_fp16"})
    assert not onednn.faster_bf16({"avx2", "fma"})


@needs_onednn
def test_isa_names_the_cpus_bf16_units():
    """oneDNN's effective ISA, by its name, has bf16 arithmetic exactly where the CPU's flags
    show AVX512_BF16 or AMX-BF16."""
    name = onednn.isa()
    flags = onednn.cpu_flags()
    bf16 = name in ("avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx")
    assert bf16 == bool(flags & {"avx512_bf16", "amx_bf16"}), (name, flags)


@pytest.mark.parametrize("case", [*CASES, "large"])
def test_products_match_float64(case, kernel):
    """oneDNN's bf16 GEMM, or OpenBLAS's sgemm on the operands converted (from a million
    multiply-adds, as float32 products; smaller ones are TVM's): the same products.
    (The conversions were never made: the bf16 products of a CPU without bf16 units ran as
    TVM's kernels, GPT-2's LM head at 3 GFLOP/s.)"""
    if kernel == "onednn" and not onednn.available():
        pytest.skip("no oneDNN wheel or AVX-512")
    a_shape, b_shape, trans_a, trans_b = CASES.get(case, ((256, 512), (384, 512), False, True))
    mod = _product(a_shape, b_shape, trans_a, trans_b)
    ex = relaxgrad.compile(mod, "llvm", cache=False)
    assert ex.onednn_linked == (kernel == "onednn")
    macs = np.prod(a_shape) * b_shape[-2 if trans_b else -1]
    assert ex.blas_linked == (kernel == "float32" and macs >= 1 << 20)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype("float32") for s in (a_shape, b_shape))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a),
                                                     tvm.runtime.tensor(b)).numpy()
    x, y = _bf16(a).astype("float64"), _bf16(b).astype("float64")
    if trans_a:
        x = np.swapaxes(x, -1, -2)
    if trans_b:
        y = np.swapaxes(y, -1, -2)
    expected = x @ y
    assert got.dtype == np.float32
    k = a_shape[-2 if trans_a else -1]  # float32 sums of k terms of about 1
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * max(1, k / 64))


def test_falls_back_to_tvm_without_onednn_and_openblas(monkeypatch):
    from relaxgrad.schedules import blas

    monkeypatch.setattr(onednn, "available", lambda target=None: False)
    monkeypatch.setattr(blas, "available", lambda target=None: False)
    mod = _product((32, 16), (16, 8))
    ex = relaxgrad.compile(mod, "llvm", cache=False)
    assert not ex.onednn_linked
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((32, 16)).astype("float32"), rng.standard_normal((16, 8))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a),
                                                     tvm.runtime.tensor(b.astype("float32")))
    expected = _bf16(a).astype("float64") @ _bf16(b).astype("float64")
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_exported_library_loads_with_onednn_linked(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAXGRAD_BF16_GEMM", "onednn")
    ex = relaxgrad.compile(_product((96, 64), (64, 80)), "llvm", cache=False)
    ex.export_library(str(tmp_path / "gemm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "gemm.so"))
    a = np.ones((96, 64), "float32")
    out = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(a),
                                                      tvm.runtime.tensor(np.ones((64, 80),
                                                                                 "float32")))
    np.testing.assert_array_equal(out.numpy(), np.full((96, 80), 64.0, "float32"))
