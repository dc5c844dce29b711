"""ConvToMatmul (relaxgrad/schedules/conv.py): convolutions and both of their gradients as
im2col/col2im and matmuls give TVM's values, for strides, dilation and uneven padding."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import cpu_pipeline, host_target
from relaxgrad.schedules import conv, onednn
from relaxgrad.schedules.conv import ConvToMatmul
from relaxgrad.testing import FAST_LLVM

CASES = [
    ((2, 3, 6, 6), (4, 3, 3, 3), dict(padding=1)),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(strides=2, padding=(1, 0, 2, 1))),
    ((1, 2, 9, 9), (3, 2, 3, 3), dict(dilation=2, padding=1)),
    ((1, 2, 9, 8), (3, 2, 3, 3), dict(dilation=(2, 1), strides=(1, 3))),
    # stride 3 along the rows, dividing them: col2im by the rows' 3 phases ...
    ((1, 2, 9, 9), (3, 2, 3, 3), dict(dilation=(2, 1), strides=(1, 3), padding=(0, 1))),
    ((2, 3, 8, 8), (4, 3, 3, 3), dict(dilation=(1, 2), strides=2, padding=2)),  # ... not dilated
    ((4, 8, 12, 12), (16, 8, 3, 3), dict(padding=1)),  # matmuls large enough for BLAS
    ((2, 8, 5, 5), (6, 8, 1, 1), {}),  # 1x1: no im2col or col2im, the image is the columns
    ((4, 32, 12, 12), (64, 32, 1, 1), {}),  # ... with BLAS
    ((2, 8, 5, 5), (6, 8, 1, 1), dict(strides=2)),  # a 1x1 with stride: im2col subsamples
    ((2, 8, 6, 6), (6, 8, 1, 1), dict(strides=2)),  # ... its weight gradient cropped (2x2)
]


def _adjoint(x_shape, w_shape, conv_attrs, precision=None) -> tvm.IRModule:
    """``main(x, w) = sum(conv2d(x, w) ** 2)`` and its adjoint (conv2d, conv2d_transpose and
    the weight gradient's CNHW/IOHW conv2d); ``precision="bf16"``: the convolution in
    bfloat16 (mixed precision: bf16 operands, a float32 result; the gradient's convolutions
    read g in bf16)."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(op.nn.conv2d(x, w, **conv_attrs))
            out = bb.emit_output(op.sum(op.multiply(y, y)))
        bb.emit_func_output(out)
    mod = bb.get()
    if precision is not None:
        mod = relaxgrad.transforms.MixedPrecision(precision)(mod)
    return relaxgrad.Gradient("main")(mod)


def _run(executable, inputs):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in inputs])
    return [loss.numpy()] + [g.numpy() for g in grads]


@pytest.mark.parametrize("x_shape, w_shape, conv_attrs", CASES)
def test_conv_gradients_match_tvm(x_shape, w_shape, conv_attrs, monkeypatch):
    """Both forms of the weight gradient (a sum over the batch on the forward's im2col, or one
    matmul on a transposed im2col), each rewritten then built by ``tvm.compile``, and the
    default pipeline (OpenBLAS where found), give TVM's values."""
    mod = _adjoint(x_shape, w_shape, conv_attrs)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype("float32") for s in (x_shape, w_shape)]
    want = _run(tvm.compile(mod, FAST_LLVM), inputs)
    builds = [relaxgrad.compile(mod)]
    # the batch in the matmuls' columns (with BLAS, for outputs under 128 pixels per image,
    # at any size here)
    monkeypatch.setattr(conv, "_COLUMNS_MIN_MACS", 0)
    batch_columns = ConvToMatmul(summed_batches=True, batch_columns_below=1 << 30)(mod)
    assert "collapse_sum_to" not in batch_columns.script()
    builds.append(relaxgrad.compile(batch_columns))
    pointwise = w_shape[2:] == (1, 1) and not conv_attrs
    for summed, funcs in ((True, {"im2col", "col2im"}), (False, {"im2col", "im2col_t", "col2im"})):
        rewritten = ConvToMatmul(summed_batches=summed, batch_columns_below=0)(mod)
        names = {gv.name_hint.rstrip("0123456789") for gv in rewritten.get_global_vars()}
        if pointwise:  # reshapes only (the transposed weight gradient's im2col_t moves axes)
            assert not names & {"im2col", "col2im"}
        else:
            assert names >= funcs
        assert "relax.nn.conv2d" not in rewritten.script()
        assert ("collapse_sum_to" in rewritten.script()) == summed
        builds.append(tvm.compile(rewritten, FAST_LLVM))
    for executable in builds:
        got = _run(executable, inputs)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("x_shape, w_shape, conv_attrs", CASES)
def test_gpu_form_gives_tvms_values(x_shape, w_shape, conv_attrs, monkeypatch):
    """The rewrite for a GPU target: gather and scatter kernels left unscheduled (for dlight),
    col2im a plain gather of the taps, and the weight gradient's product split along K (the
    slices made short here, so that every case splits) and summed. Built for llvm, it gives
    TVM's values."""
    monkeypatch.setattr(conv, "_MIN_DEPTH", 2)
    mod = _adjoint(x_shape, w_shape, conv_attrs)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        rewritten = ConvToMatmul(summed_batches=False, batch_columns_below=0)(mod)
    kernels = [f for _, f in rewritten.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels or w_shape[2:] == (1, 1)
    assert not any(f.attrs and "tirx.is_scheduled" in f.attrs for f in kernels)
    assert re.search(r"R\.sum\([^)]*axis=\[0\]", rewritten.script()), "K was not split"
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(s).astype("float32") for s in (x_shape, w_shape)]
    want = _run(tvm.compile(mod, FAST_LLVM), inputs)
    for g, w in zip(_run(tvm.compile(rewritten, FAST_LLVM), inputs), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_weight_gradient_computes_its_im2col_again():
    """In the CPU pipeline the weight gradient computes its im2col of ``x`` again rather than
    keep the forward's alive until the backward pass (``KH*KW`` times ``x``'s size):
    ``EliminateCommonSubexpr`` after the rewrite does not merge them; with
    ``recompute_columns=False`` it does (the values: the tests above)."""
    mod = _adjoint(*CASES[-1])
    passes = list(cpu_pipeline(host_target()).passes)
    names = [p.info.name for p in passes]
    with host_target():
        rewritten = tvm.transform.Sequential(passes[: names.index("LegalizeOpsOnce")])(mod)
    calls = re.findall(r"R\.call_tir\((\w+)", rewritten["main_adjoint"].script())
    columns = sorted(c for c in calls if c.startswith("im2col"))
    assert len(columns) == 2 and "col2im" in calls
    assert ["relaxgrad.recomputed" in rewritten[c].script() for c in columns] == [False, True]
    shared = ConvToMatmul(recompute_columns=False)(mod)
    with host_target():
        shared = relax.transform.EliminateCommonSubexpr()(shared)
    calls = re.findall(r"R\.call_tir\((\w+)", shared["main_adjoint"].script())
    assert calls.count("im2col") == 1


@pytest.mark.parametrize("x_shape, w_shape", [((2, 4, 8, 8), (5, 4, 3, 3)),
                                              ((2, 4, 8, 8), (5, 4, 1, 1))])  # fmt: skip
def test_strided_weight_gradient_has_the_kernels_taps_only(x_shape, w_shape):
    """The rule's weight gradient of a stride-2 convolution reaches past the kernel (4x4 for
    3x3, 2x2 for 1x1) and is cropped; rewritten, it computes the kernel's taps only: an
    im2col of the forward's shape (the values: the CASES above)."""
    mod = _adjoint(x_shape, w_shape, dict(strides=2, padding=w_shape[2] // 2))
    assert "R.strided_slice" in mod["main_adjoint"].script()  # the rule's crop
    rewritten = ConvToMatmul(summed_batches=True, batch_columns_below=0)(mod)
    script = rewritten["main_adjoint"].script()
    assert "R.strided_slice" not in script and "R.nn.conv2d" not in script
    names = [gv.name_hint for gv in rewritten.get_global_vars()]
    columns = [n for n in names if n.startswith("im2col")]
    if w_shape[2] == 3:  # the forward's and the gradient's own (recomputed)
        assert len(columns) == 2
        assert all("(2, 4, 3, 3, 4, 4)" in rewritten[n].script() for n in columns)
    else:  # a 1x1 kernel: the forward's im2col subsamples x, and so does the gradient's
        assert len(columns) == 2
        assert all("(2, 4, 1, 1, 4, 4)" in rewritten[n].script() for n in columns)


def test_grouped_conv_is_left_to_legalization():
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    w = relax.Var("w", relax.TensorType((4, 2, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        out = bb.emit(op.nn.conv2d(x, w, groups=2))
        bb.emit_func_output(out)
    mod = bb.get()
    assert ConvToMatmul()(mod).script() == mod.script()


@pytest.mark.parametrize(
    "x_shape, window, relu",
    [((2, 3, 8, 8), 2, True), ((2, 3, 9, 7), 2, False), ((1, 2, 9, 9), 3, True),
     ((1, 2, 8, 6), (2, 3), False), ((1, 2, 9, 7), 2, True)],
)  # fmt: skip
def test_max_pool_gradient_matches_tvm_with_ties(x_shape, window, relu):
    """Each window's gradient goes to its first maximum, as TVM's: relu's zeros and a window of
    equal values tie; rows and columns past the last window get none."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pooled = bb.emit(op.nn.max_pool2d(op.nn.relu(x) if relu else x, window, window))
            out = bb.emit_output(op.sum(op.multiply(pooled, pooled)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    rewritten = relax.transform.DeadCodeElimination()(ConvToMatmul()(mod))
    assert "max_unpool" in {gv.name_hint for gv in rewritten.get_global_vars()}
    windows = (window, window) if isinstance(window, int) else window
    tiles = all(size % w == 0 for size, w in zip(x_shape[2:], windows))
    # relu's gradient, where(x < 0, 0, dx), in the unpooling kernel where the windows tile x
    assert ("R.where" in rewritten["main_adjoint"].script()) == (relu and not tiles)
    data = np.random.default_rng(0).standard_normal(x_shape).astype("float32")
    data[0, 0, :3, :3] = 0.5
    got = _run(relaxgrad.compile(mod), [data])
    want = _run(tvm.compile(mod, FAST_LLVM), [data])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("kernel", ["onednn", "float32"])
@pytest.mark.parametrize("x_shape, w_shape, conv_attrs", [CASES[i] for i in (0, 1, 6, 8)])
def test_bf16_conv_gradients_are_matmuls_with_tvms_values(x_shape, w_shape, conv_attrs, kernel,
                                                          monkeypatch):
    """Mixed-precision convolutions (bf16 operands, float32 result) become im2col / col2im and
    bf16 matmuls accumulating in float32 (oneDNN's GEMM, or sgemm of the conversions, as
    ``RELAXGRAD_BF16_GEMM`` picks), with the values of TVM's own bf16 convolutions to a bf16
    rounding of the gradients."""
    monkeypatch.setenv("RELAXGRAD_BF16_GEMM", kernel)
    mod = _adjoint(x_shape, w_shape, conv_attrs, precision="bf16")
    rewritten = ConvToMatmul()(mod)
    assert "relax.nn.conv2d" not in rewritten.script()
    assert 'out_dtype="float32"' in rewritten.script()
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(s).astype("float32") for s in (x_shape, w_shape)]
    want = _run(tvm.compile(mod, FAST_LLVM), inputs)
    executable = relaxgrad.compile(mod, cache=False)
    macs = x_shape[0] * int(np.prod(w_shape)) * x_shape[2] * x_shape[3]  # ~ the forward's
    if macs >= 4 * onednn._MIN_MACS or macs < onednn._MIN_MACS // 4:  # (oneDNN's smallest)
        big = macs >= onednn._MIN_MACS
        assert executable.onednn_linked == (kernel == "onednn" and onednn.available() and big)
    for g, w in zip(_run(executable, inputs), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2 * np.abs(w).max())
