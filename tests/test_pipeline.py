"""relaxgrad.compile (relaxgrad/pipeline.py): llvm results equal tvm.compile's; CUDA builds
(without a GPU) where the stock pipeline fails; per-function rule choice and its errors, on GPU
and CPU; TiledMatmul against numpy.

The model builders here are shared with bench/gpu_check.py, which runs them on a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, s_tir, te
from tvm.relax import op
from tvm.s_tir import dlight as dl
from tvm.tirx import ForKind

import relaxgrad
from relaxgrad.pipeline import DEFAULT_CUDA_ARCH, cpu_pipeline, host_target, resolve_target
from relaxgrad.schedules import (
    FullReduction,
    ParallelLoops,
    ScheduleCPU,
    ScheduleGPU,
    TiledMatmul,
    cpu,
    default_cpu_rules,
)
from relaxgrad.schedules.cpu import MAX_INLINED_LOADS, inlined_loads
from relaxgrad.testing import FAST_LLVM, random_inputs
from relaxgrad.training.export import cuda_sources
from relaxgrad.training.runtime_runner import compile_cuda, find_nvcc

CUDA = {"kind": "cuda", "arch": "sm_90"}


# --- models: (name, params), body -> scalar loss; every one ends in a reduction to a scalar ---


def _module(params: list[tuple[str, tuple]], body, dtype: str = "float32") -> tvm.IRModule:
    """``main(*params) = body(*vars)`` in one dataflow block."""
    args = [relax.Var(name, relax.TensorType(shape, dtype)) for name, shape in params]
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            loss = bb.emit_output(body(bb, *args))
        bb.emit_func_output(loss)
    return bb.get()


def mlp(batch: int = 8, d_in: int = 16, hidden: int = 32, classes: int = 10) -> tvm.IRModule:
    """Two dense layers, cross entropy plus a mean-square penalty on the logits."""
    params = [("x", (batch, d_in)), ("w0", (d_in, hidden)), ("b0", (hidden,)),
              ("w1", (hidden, classes)), ("b1", (classes,)), ("y", (batch, classes))]  # fmt: skip

    def body(bb, x, w0, b0, w1, b1, y):
        h = bb.emit(op.nn.relu(op.add(op.matmul(x, w0), b0)))
        logits = bb.emit(op.add(op.matmul(h, w1), b1))
        ce = bb.emit(op.nn.cross_entropy_with_logits(op.nn.log_softmax(logits), y))
        return op.add(ce, op.mean(op.multiply(logits, logits)))

    return _module(params, body)


CNN_OPS = ["relax.nn.conv2d", "relax.nn.max_pool2d", "relax.nn.avg_pool2d"]


def cnn(batch: int = 2, channels: int = 3, size: int = 8, filters: int = 8, classes: int = 10):
    """conv-relu-maxpool, strided conv-relu-avgpool, dense, cross entropy."""
    flat = filters * (size // 8) ** 2
    params = [("x", (batch, channels, size, size)), ("w1", (filters, channels, 3, 3)),
              ("b1", (1, filters, 1, 1)), ("w2", (filters, filters, 3, 3)),
              ("wf", (flat, classes)), ("y", (batch, classes))]  # fmt: skip

    def body(bb, x, w1, b1, w2, wf, y):
        c1 = op.nn.relu(op.add(op.nn.conv2d(x, w1, padding=1), b1))
        p1 = op.nn.max_pool2d(c1, 2, strides=2)
        c2 = op.nn.relu(op.nn.conv2d(p1, w2, strides=2, padding=1))
        p2 = bb.emit(op.nn.avg_pool2d(c2, 2, strides=2))
        logits = op.matmul(op.reshape(p2, (batch, flat)), wf)
        return op.nn.cross_entropy_with_logits(op.nn.log_softmax(logits), y)

    return _module(params, body)


def transformer(batch: int = 2, seq: int = 8, dim: int = 16, ffn: int = 32) -> tvm.IRModule:
    """One attention block with residuals and a relu feed-forward; mean-square loss."""
    params = [("x", (batch, seq, dim)), ("wq", (dim, dim)), ("wk", (dim, dim)),
              ("wv", (dim, dim)), ("wo", (dim, dim)), ("w1", (dim, ffn)), ("w2", (ffn, dim)),
              ("y", (batch, seq, dim))]  # fmt: skip

    def body(bb, x, wq, wk, wv, wo, w1, w2, y):
        q, k, v = (bb.emit(op.matmul(x, w)) for w in (wq, wk, wv))
        scores = op.multiply(op.matmul(q, op.permute_dims(k, [0, 2, 1])), relax.const(dim**-0.5))
        attn = op.matmul(op.matmul(op.nn.softmax(scores, axis=-1), v), wo)
        h = bb.emit(op.add(x, attn))
        out = bb.emit(op.add(h, op.matmul(op.nn.relu(op.matmul(h, w1)), w2)))
        diff = bb.emit(op.subtract(out, y))
        return op.mean(op.multiply(diff, diff))

    return _module(params, body)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def adjoint_module(name: str, **sizes) -> tvm.IRModule:
    """The model with ``main_adjoint`` added (skipped when a rule it needs is missing)."""
    if name == "cnn":
        missing = [o for o in CNN_OPS if relaxgrad.get_gradient(o) is None]
        if missing:
            pytest.skip(f"no gradient rule yet for {', '.join(missing)}")
    return relaxgrad.Gradient("main")(MODELS[name](**sizes))


# --- llvm ---


def _run(executable, func_name: str, inputs, device=None):
    device = device or tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    out = vm[func_name](*[tvm.runtime.tensor(a, device) for a in inputs])
    return _flatten(out)


def _flatten(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [leaf for item in value for leaf in _flatten(item)]


@pytest.mark.parametrize("name", list(MODELS))
def test_llvm_matches_tvm_compile(name):
    """Fused and scheduled by ScheduleCPU, the same values as TVM's unfused naive loops (up to
    float32 rounding: vectorized reductions add in another order, so the tolerance is relative
    to each output's scale)."""
    mod = adjoint_module(name)
    inputs = random_inputs(mod["main"], seed=3)
    schedule = ScheduleCPU()
    ours = relaxgrad.compile(mod, "llvm", schedule=schedule)
    stock = tvm.compile(mod, FAST_LLVM)
    assert "TiledMatmul" in schedule.choices.values() and not schedule.errors
    for func in ("main", "main_adjoint"):
        got, want = _run(ours, func, inputs), _run(stock, func, inputs)
        assert len(got) == len(want) == (1 if func == "main" else len(inputs) + 1)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(w).max()))


# --- CUDA, built without a GPU ---


def _cuda_source(executable) -> str:
    """The CUDA source of every kernel in the executable's device modules."""
    return "".join(cuda_sources(executable))


@pytest.mark.parametrize("name", ["cnn", "transformer"])  # the mlp: in the next test
def test_cuda_builds(name):
    mod = adjoint_module(name)
    schedule = ScheduleGPU()
    executable = relaxgrad.compile(mod, CUDA, schedule=schedule)

    assert "main_adjoint" in executable.as_text()
    source = _cuda_source(executable)
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert schedule.choices and all(f + "_kernel" in kernels for f in schedule.choices)
    # Every loss ends in a reduction to a scalar with an epilogue (mean's divide, cross
    # entropy's scale): dlight's Reduction raises there and our FullReduction takes over.
    full = [f for f, rule in schedule.choices.items() if rule == "FullReduction"]
    assert full and all(f in schedule.errors for f in full), schedule.choices
    assert {"Matmul", "Fallback"} <= set(schedule.choices.values())

    if find_nvcc() is None:
        pytest.skip("nvcc not found: CUDA source generated but not compiled")
    assert len(compile_cuda(source, "sm_90")) > 0  # what Trainer.export ships


def test_stock_cuda_pipeline_fails_on_mean_loss():
    """The reason this module exists: TVM 0.27's default CUDA pipeline raises on a mean loss."""
    mod = adjoint_module("mlp")
    target = tvm.target.Target(CUDA)
    with pytest.raises(tvm.error.InternalError, match="block_realize"):
        tvm.compile(mod, target=target)
    assert "main_adjoint" in relaxgrad.compile(mod, target).as_text()


def test_cuda_string_target_defaults_arch():
    target = resolve_target("cuda")
    assert target.kind.name == "cuda"
    if not tvm.cuda(0).exist:
        assert target.attrs["arch"] == DEFAULT_CUDA_ARCH
    assert resolve_target({"kind": "cuda"}).attrs["arch"] == target.attrs["arch"]
    assert resolve_target({"kind": "cuda", "arch": "sm_80"}).attrs["arch"] == "sm_80"
    explicit = tvm.target.Target({"kind": "cuda", "arch": "sm_75"})
    assert resolve_target(explicit).same_as(explicit)
    assert resolve_target("llvm").kind.name == "llvm"


@pytest.mark.parametrize("bad", [42, "no-such-target"])
def test_bad_target_raises(bad):
    with pytest.raises(relaxgrad.GradientError, match="compile: .*target"):
        relaxgrad.compile(mlp(), bad)


def test_non_module_input_raises():
    with pytest.raises(relaxgrad.GradientError, match="expected an IRModule, got Function"):
        relaxgrad.compile(mlp()["main"], "llvm")


# --- the schedule step ---


def _fused(mod: tvm.IRModule) -> tvm.IRModule:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]  # fmt: skip
    return tvm.transform.Sequential(passes)(mod)


class _Raises(dl.ScheduleRule):
    def apply(self, func, target, tunable):
        raise RuntimeError("this rule always fails")


def test_rule_that_raises_falls_through_per_function():
    schedule = ScheduleGPU([_Raises(), dl.gpu.Fallback()])
    mod = _fused(mlp())
    with tvm.target.Target(CUDA):
        schedule(mod)
    prim_funcs = [
        gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert sorted(schedule.choices) == sorted(prim_funcs)
    assert set(schedule.choices.values()) == {"Fallback"}
    assert schedule.errors["mean"] == ["_Raises raised RuntimeError: this rule always fails"]


class _Unbound(dl.ScheduleRule):
    """Accepts every function and binds no threads, which TIR lowering then rejects."""

    def apply(self, func, target, tunable):
        return s_tir.Schedule(func)


def test_schedule_that_fails_verification_falls_through():
    mod = _fused(mlp())
    checked, unchecked = (
        ScheduleGPU([_Unbound(), dl.gpu.Fallback()]),
        ScheduleGPU([_Unbound()], verify=False),
    )
    with tvm.target.Target(CUDA):
        checked(mod)
        unchecked(mod)
    assert set(checked.choices.values()) == {"Fallback"}
    assert sorted(checked.errors) == sorted(checked.choices)
    assert all(
        "_Unbound raised GradientError" in e[0] and "bind" in e[0] for e in checked.errors.values()
    )
    assert set(unchecked.choices.values()) == {"_Unbound"}


def test_unschedulable_primfunc_names_it():
    mod = _fused(mlp())
    with tvm.target.Target(CUDA), pytest.raises(relaxgrad.GradientError) as info:
        ScheduleGPU([dl.gpu.Matmul(), _Raises()])(mod)
    message = str(info.value)
    assert "could schedule PrimFunc" in message and "_Raises raised RuntimeError" in message
    assert any(f"PrimFunc {gv.name_hint} " in message for gv in mod.get_global_vars())


def test_cpu_primfuncs_are_left_alone():
    mod = _fused(mlp())
    with tvm.target.Target("llvm"):
        after = ScheduleGPU()(mod)
    tvm.ir.assert_structural_equal(after, mod)


def test_full_reduction_is_one_kernel():
    """FullReduction puts the whole mean in one launch; GeneralReduction, the rule TVM would
    fall back to, leaves the reduction loops on the host around a one-thread kernel."""
    func = _fused(mlp())["mean"]
    target = tvm.target.Target(CUDA)
    ours = FullReduction().apply(func, target, False)
    general = dl.gpu.GeneralReduction().apply(func, target, False)

    def outer_loops(sch):
        return [sch.get(sch.get_loops(b)[0]) for b in sch.get_child_blocks(sch.get_sblock("root"))]

    assert all(loop.thread_binding.thread_tag == "blockIdx.x" for loop in outer_loops(ours))
    assert any(loop.thread_binding is None for loop in outer_loops(general))
    assert FullReduction().apply(_fused(mlp())["multiply"], target, False) is None


# --- the CPU schedule step ---


LLVM = tvm.target.Target("llvm")


def _scheduled(mod: tvm.IRModule, schedule) -> tvm.IRModule:
    with LLVM:
        return schedule(mod)


def _prim_funcs(mod: tvm.IRModule) -> list[str]:
    return sorted(
        gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_cpu_matmuls_get_tiled_matmul(name):
    """Every matmul (fused with bias, relu, relu's adjoint, a scale; batched in attention)
    and every convolution is scheduled by TiledMatmul; every other PrimFunc with a loop by
    some rule (one of scalars only, such as the mean's division, is built as it is)."""
    mod = _fused(adjoint_module(name))
    schedule = ScheduleCPU()
    _scheduled(mod, schedule)
    scalar = {f for f in _prim_funcs(mod) if all(cpu._scalar(b) for b in cpu.sblocks(mod[f]))}
    assert sorted(schedule.choices) == sorted(set(_prim_funcs(mod)) - scalar)
    assert not schedule.errors
    tiled = {f for f, rule in schedule.choices.items() if rule == "TiledMatmul"}
    assert {f for f in schedule.choices if "matmul" in f or "conv2d" in f} <= tiled
    assert any(f.startswith("fused_") for f in tiled)  # with its epilogue


def _loop_kinds(func: tvm.tirx.PrimFunc) -> set:
    kinds = set()
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, lambda loop: kinds.add(loop.kind))])
    return kinds


def test_tiled_matmul_parallelizes_and_vectorizes_large_matmuls():
    mod = _fused(mlp(batch=64, d_in=128, hidden=256))
    after = _scheduled(mod, ScheduleCPU())
    kinds = _loop_kinds(after["fused_matmul_add_relu"])
    assert {ForKind.PARALLEL, ForKind.VECTORIZED, ForKind.UNROLLED} <= kinds
    # The digits-sized matmuls of mlp() stay on one thread: a launch would cost more.
    small = _scheduled(_fused(mlp()), ScheduleCPU())["fused_matmul_add_relu"]
    assert ForKind.PARALLEL not in _loop_kinds(small)
    assert ForKind.VECTORIZED in _loop_kinds(small)


def _matmul_func(a_shape, b_shape, a_t: bool, b_t: bool, epilogue: bool) -> tvm.tirx.PrimFunc:
    """``C = op(A) @ op(B)`` (+ relu of C + 1 when ``epilogue``) as a TE PrimFunc; ``op``
    transposes the last two dims where asked, inside the matmul's reads."""
    a, b = te.placeholder(a_shape, name="A"), te.placeholder(b_shape, name="B")
    m, k = (a_shape[-1], a_shape[-2]) if a_t else a_shape[-2:]
    n = b_shape[-2] if b_t else b_shape[-1]
    batch = a_shape[:-2]
    r = te.reduce_axis((0, k), name="k")

    def compute(*idx):
        *s, i, j = idx
        lhs = a[(*s, r, i)] if a_t else a[(*s, i, r)]
        rhs = (
            b[(*s[len(s) - len(b_shape) + 2 :], j, r)]
            if b_t
            else b[(*s[len(s) - len(b_shape) + 2 :], r, j)]
        )
        return te.sum(lhs * rhs, axis=r)

    c = te.compute((*batch, m, n), compute, name="C")
    if epilogue:
        c = te.compute(c.shape, lambda *idx: te.max(c(*idx), 0.0) + 1.0, name="E")
    return te.create_prim_func([a, b, c])


@pytest.mark.parametrize(
    "a_shape, b_shape, a_t, b_t, epilogue",
    [
        ((37, 29), (29, 70), False, False, True),  # tails in every tile
        ((29, 37), (70, 29), True, True, False),  # both operands transposed
        ((3, 16, 8), (8, 33), False, False, False),  # batched left, shared right
        ((2, 5, 12), (2, 9, 12), False, True, True),  # batched, B^T (attention scores)
    ],
)
def test_tiled_matmul_matches_numpy(a_shape, b_shape, a_t, b_t, epilogue):
    func = _matmul_func(a_shape, b_shape, a_t, b_t, epilogue)
    sch = TiledMatmul(parallel_macs=0).apply(func, LLVM, False)
    assert sch is not None
    assert ForKind.PARALLEL in _loop_kinds(sch.mod["main"])
    rng = np.random.default_rng(0)
    a = rng.standard_normal(a_shape).astype("float32")
    b = rng.standard_normal(b_shape).astype("float32")
    want = (np.swapaxes(a, -1, -2) if a_t else a) @ (np.swapaxes(b, -1, -2) if b_t else b)
    want = np.maximum(want, 0) + 1 if epilogue else want
    lib = tvm.tirx.build(sch.mod, target=LLVM)
    out = tvm.runtime.tensor(np.zeros(want.shape, "float32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_tiled_matmul_tiles_stay_boxes_in_convolutions():
    """conv2d is matmul-like with I = (n, y, x) fused; on a 3x3 output a 4-row tile would span
    two image rows, and the write-back of such a tile read values not yet computed."""
    mod = _module([("x", (2, 4, 5, 5)), ("w", (6, 4, 3, 3))], lambda bb, x, w: op.nn.conv2d(x, w))
    func = relax.transform.LegalizeOps()(mod)["conv2d"]
    sch = TiledMatmul(parallel_macs=0).apply(func, LLVM, False)
    assert sch is not None
    rng = np.random.default_rng(1)
    args = [rng.standard_normal([int(d) for d in b.shape]).astype("float32") for b in func.params]
    outs = []
    for f in (func, sch.mod["main"]):
        lib = tvm.tirx.build(f.with_attr("global_symbol", "main"), target=LLVM)
        tensors = [tvm.runtime.tensor(a) for a in args]
        lib["main"](*tensors)
        outs.append(tensors[-1].numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_tiled_matmul_does_not_apply_elsewhere():
    mod = _fused(mlp())
    for name in ("mean", "log_softmax", "transpose"):
        if name in _prim_funcs(mod):
            assert TiledMatmul().apply(mod[name], LLVM, False) is None, name
    assert TiledMatmul().apply(mod["fused_matmul_add_relu"], tvm.target.Target(CUDA), False) is None


def test_cpu_rule_that_raises_falls_through_per_function():
    mod = _fused(mlp())
    schedule = ScheduleCPU([_Raises(), ParallelLoops()])
    _scheduled(mod, schedule)
    assert sorted(schedule.choices) == _prim_funcs(mod)
    assert set(schedule.choices.values()) == {"ParallelLoops"}
    assert schedule.errors["mean"] == ["_Raises raised RuntimeError: this rule always fails"]


def test_cpu_primfunc_no_rule_schedules_is_left_as_it_was():
    mod = _fused(mlp())
    schedule = ScheduleCPU([_Raises(), TiledMatmul()])
    after = _scheduled(mod, schedule)
    assert set(schedule.choices.values()) == {"TiledMatmul"}
    for name in set(_prim_funcs(mod)) - set(schedule.choices):
        tvm.ir.assert_structural_equal(after[name], mod[name])
    assert sorted(schedule.errors) == _prim_funcs(mod)


def test_gpu_primfuncs_are_left_alone_by_schedule_cpu():
    mod = _fused(mlp())
    with tvm.target.Target(CUDA):
        after = ScheduleCPU()(mod)
    tvm.ir.assert_structural_equal(after, mod)


def test_host_target_builds():
    target = host_target()
    assert target.kind.name == "llvm" and target.attrs["mcpu"]
    mod = adjoint_module("mlp")
    inputs = random_inputs(mod["main"], seed=5)
    got = _run(relaxgrad.compile(mod, target), "main_adjoint", inputs)
    want = _run(tvm.compile(mod, FAST_LLVM), "main_adjoint", inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _argument_checks(executable) -> int:
    """How many error exits the kernels' LLVM IR has (each wrapper's argument checks)."""
    return executable.mod.imports[0].inspect_source("ll").count("ErrorSetRaised")


def test_kernels_are_built_without_argument_checks_and_the_vm_still_checks():
    """relaxgrad.compile builds the kernels without their wrappers' argument checks
    (KERNEL_CONFIG); a caller's own ``tirx.disable_assert`` wins; the results are the same and
    a wrong argument still raises, naming the parameter (the VM checks the Relax function's
    parameters against their annotations)."""
    mod = adjoint_module("mlp")
    inputs = random_inputs(mod["main"], seed=5)
    lean = relaxgrad.compile(mod)
    with tvm.transform.PassContext(config={"tirx.disable_assert": False}):
        checked = relaxgrad.compile(mod)
    assert _argument_checks(lean) == 0 < _argument_checks(checked)
    for g, w in zip(_run(lean, "main_adjoint", inputs), _run(checked, "main_adjoint", inputs),
                    strict=True):
        np.testing.assert_array_equal(g, w)
    wrong = [inputs[0][:, :-1], *inputs[1:]]
    with pytest.raises((RuntimeError, ValueError), match=r"param=x\b"):
        _run(lean, "main_adjoint", wrong)
    wrong = [inputs[0].astype("float64"), *inputs[1:]]
    with pytest.raises((RuntimeError, ValueError), match=r"param=x\b"):
        _run(lean, "main_adjoint", wrong)


def test_gpu_kernels_from_legalization_are_kept():
    """scatter_elements legalizes to TVM's own CUDA kernel (threads bound, not marked
    scheduled): the schedule step leaves it as it is instead of failing on it."""
    x = relax.Var("x", relax.TensorType((4, 5), "float32"))
    idx = relax.Var("i", relax.TensorType((2, 5), "int64"))
    u = relax.Var("u", relax.TensorType((2, 5), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, idx, u]):
        with bb.dataflow():
            s = bb.emit(relax.op.scatter_elements(x, idx, u, 0))
            gv = bb.emit_output(relax.op.sum(relax.op.gather_elements(s, idx, 0)))
        bb.emit_func_output(gv)
    mod = relaxgrad.Gradient("main", [x, u])(bb.get())
    schedule = ScheduleGPU()
    relaxgrad.compile(mod, CUDA, schedule=schedule)
    assert not any(name.startswith("scatter_elements") for name in schedule.choices)
    assert schedule.choices  # the other kernels were scheduled by rules


def test_default_target_is_this_cpu():
    """``relaxgrad.compile`` builds for this machine's CPU unless told ``"llvm"`` (a portable
    build), which keeps working."""
    assert str(resolve_target(None)) == str(host_target())
    mod = adjoint_module("mlp")
    inputs = random_inputs(mod["main"], seed=1)
    native = _run(relaxgrad.compile(mod), "main", inputs)
    portable = _run(relaxgrad.compile(mod, "llvm"), "main", inputs)
    np.testing.assert_allclose(native[0], portable[0], rtol=1e-5, atol=1e-6)


REDUCTIONS = {
    # name: (input shapes, body, numpy reference)
    "softmax": ([(2, 3, 16, 64)], lambda x: op.nn.softmax(x, -1),
                lambda x: np.exp(x - x.max(-1, keepdims=True))
                / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
    "sum_nhw": ([(4, 8, 6, 32), (4, 8, 6, 32)],
                lambda x, y: op.sum(op.multiply(x, y), axis=[0, 2, 3]),
                lambda x, y: (x * y).sum((0, 2, 3))),
    "mean_rows": ([(64, 48)], lambda x: op.mean(x, axis=[1], keepdims=True),
                  lambda x: x.mean(1, keepdims=True)),
    # batch norm's sums in ResNet's 14x14 and 7x7 stages: the rows of h and w, fused, in
    # vectors of a divisor of 196 (28) and of 49 (7); scalar adds ran at a fifth of the speed
    "sum_nhw_14x14": ([(2, 8, 14, 14)], lambda x: op.sum(x, axis=[0, 2, 3], keepdims=True),
                      lambda x: x.sum((0, 2, 3), keepdims=True)),
    "sum_nhw_7x7": ([(2, 8, 7, 7), (2, 8, 7, 7)],
                    lambda x, y: op.sum(op.multiply(x, y), axis=[0, 2, 3]),
                    lambda x, y: (x * y).sum((0, 2, 3))),
    "max_rows_odd": ([(32, 27)], lambda x: op.max(x, axis=[1]), lambda x: x.max(1)),
    "max_last_prime": ([(32, 37)], lambda x: op.max(x, axis=[1]), lambda x: x.max(1)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_along_the_innermost_axis_accumulate_vectors(name):
    """A reduction over the innermost axis of what it reads (softmax's, batch-norm's over N, H
    and W) sums vectors of partial results (an ``_rf`` buffer, a vectorized loop), where that
    axis's extent, or that of H and W fused, has a divisor from 4 lanes to two registers; the
    values are numpy's."""
    shapes, body, reference = REDUCTIONS[name]
    mod = _module([(f"x{i}", s) for i, s in enumerate(shapes)], lambda bb, *xs: body(*xs))
    after = _scheduled(_fused(mod), ScheduleCPU())
    scripts = [f.script() for _, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    vectorized = any("_rf" in s and "T.vectorized" in s for s in scripts)
    assert vectorized == (name != "max_last_prime")  # 37: no divisor from 4 to 2 vectors
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    (got,) = _run(relaxgrad.compile(mod, "llvm"), "main", xs)
    np.testing.assert_allclose(got, reference(*xs), rtol=1e-5, atol=1e-5)


def test_sum_over_rows_with_a_per_row_scale_vectorizes_the_columns():
    """``collapse_sum_to(a * b * r, (C,))`` with ``r`` broadcast along the columns (layer
    norm's ``dgamma = sum(g * c * rstd)``) keeps the columns innermost and vectorized, like a
    plain bias gradient, and gives numpy's values."""
    shapes = [(4, 32, 64), (4, 32, 64), (4, 32, 1)]

    def body(bb, a, b, r):
        return op.collapse_sum_to(op.multiply(op.multiply(a, b), r), (64,))

    mod = _module([(f"x{i}", s) for i, s in enumerate(shapes)], body)
    after = _scheduled(_fused(mod), ScheduleCPU())
    (func,) = [f for _, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tvm.tirx.ForKind.VECTORIZED in _loop_kinds(func)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    (got,) = _run(relaxgrad.compile(mod, "llvm"), "main", xs)
    np.testing.assert_allclose(got, (xs[0] * xs[1] * xs[2]).sum((0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True], ids=["per_channel", "transpose"])
def test_per_channel_values_are_not_tiled_as_a_transpose(transposed):
    """An elementwise kernel over ``(N, C, HW)`` reading a per-channel vector (``w[c]``, as a
    batch norm's scale) runs plain vector rows: that vector's innermost index is the channel,
    but it is not a transpose (tiled as one, a batch norm's kernels read 32 channels' rows at
    once). A real transpose keeps its square tiles (serial loops inside the parallel one)."""
    shapes = [(8, 64, 1024), (64,)] if not transposed else [(8, 64, 1024), (8, 1024, 64)]

    def body(bb, x, w):
        if transposed:
            return op.add(x, op.permute_dims(w, [0, 2, 1]))
        return op.multiply(x, op.reshape(w, (1, 64, 1)))

    mod = _module([(f"x{i}", s) for i, s in enumerate(shapes)], body)
    after = _scheduled(_fused(mod), ScheduleCPU())
    (func,) = [f for _, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert (tvm.tirx.ForKind.SERIAL in _loop_kinds(func)) == transposed
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    (got,) = _run(relaxgrad.compile(mod, "llvm"), "main", xs)
    want = xs[0] + xs[1].transpose(0, 2, 1) if transposed else xs[0] * xs[1][None, :, None]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _fused_kernel(mod, word: str):
    """The PrimFunc of ``mod``'s CPU pipeline, up to FuseTIR, whose name has ``word``."""
    passes = list(cpu_pipeline(host_target()).passes)
    names = [p.info.name for p in passes]
    with host_target():
        fused = tvm.transform.Sequential(passes[: names.index("FuseTIR") + 1])(mod)
    (kernel,) = [f for g, f in fused.functions_items() if word in g.name_hint]
    return kernel


def test_kernel_that_would_inline_exponentially_is_built_as_it_is():
    """A chain of elementwise ops each reading the one before twice (``a = a * a + a``), fused
    into one kernel: inlining its blocks would grow one expression exponentially (dlight's
    inlining took minutes). The CPU rules leave it unscheduled, and it computes numpy's
    values."""
    x = relax.Var("x", relax.TensorType((4, 4), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = x
            for _ in range(12):
                a = bb.emit(op.add(op.multiply(a, a), a))
            out = bb.emit_output(op.tanh(a))
        bb.emit_func_output(out)
    mod = bb.get()
    chain = _fused_kernel(mod, "multiply")
    assert inlined_loads(chain) > MAX_INLINED_LOADS
    assert all(rule.apply(chain, host_target(), False) is None for rule in default_cpu_rules())
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    value = np.random.default_rng(0).uniform(-0.05, 0.05, (4, 4))
    expected = value
    for _ in range(12):
        expected = expected * expected + expected
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(value)).numpy(), np.tanh(expected),
                               rtol=1e-12)


def test_overlapping_max_pool_gradient_is_two_scheduled_kernels():
    """The gradient of an overlapping 3x3 max-pool is two kernels of linear size, unfused: the
    first argmax of each window, which the CPU rules schedule, and each window's ``g`` added
    at it (fused, the argmax ran once per read, four times a position), the gather written as
    a scatter (``WindowScatter``, scheduled as written); the gradient is PyTorch's."""
    x = relax.Var("x", relax.TensorType((1, 1, 4, 4), "float64"))
    w = relax.Var("w", relax.TensorType((1, 1, 4, 4), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            pooled = op.nn.max_pool2d(x, pool_size=[3, 3], strides=[1, 1], padding=[1, 1, 1, 1])
            out = bb.emit_output(op.sum(op.multiply(pooled, w)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    kernel = _fused_kernel(mod, "window_argmax")
    assert inlined_loads(kernel) <= MAX_INLINED_LOADS
    assert any(rule.apply(kernel, host_target(), False) is not None
               for rule in default_cpu_rules())
    scatter = _fused_kernel(mod, "window_gather")
    assert scatter.attrs["tirx.is_scheduled"] and "first_flat" in scatter.script()
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, 1, 4, 4)) for _ in range(2)]
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in xs])
    tx = torch.tensor(xs[0], requires_grad=True)
    (torch.nn.functional.max_pool2d(tx, 3, 1, 1) * torch.tensor(xs[1])).sum().backward()
    np.testing.assert_allclose(grads[0].numpy(), tx.grad.numpy(), rtol=1e-12)


def test_a_build_failing_with_unchecked_schedules_is_built_again_with_checked_ones(monkeypatch):
    """``relaxgrad.compile`` takes the default rules' schedules unchecked; should that build
    fail (here: a pass raising as a schedule TVM cannot lower would), it builds again with
    each schedule checked, and the result computes the function."""
    import relaxgrad.pipeline as pipeline

    made = []

    @tvm.transform.module_pass(opt_level=0, name="FailsUnchecked")
    def fails(mod, ctx):
        raise tvm.error.InternalError("a schedule TVM cannot lower")

    real = pipeline.cpu_pipeline

    def recording(target, schedule=None, min_rows=64):
        made.append(None if schedule is None else schedule.verify)
        built = real(target, schedule, min_rows)
        return tvm.transform.Sequential([fails, built]) if made[-1] is False else built

    monkeypatch.setattr(pipeline, "cpu_pipeline", recording)
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(op.exp(x)))
    vm = relax.VirtualMachine(relaxgrad.compile(bb.get(), "llvm"), tvm.cpu())
    assert made == [False, None]  # unchecked, then the default ScheduleCPU (verify=True)
    value = np.arange(32, dtype="float32").reshape(4, 8) / 32
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(value)).numpy(), np.exp(value),
                               rtol=1e-6)


def test_cuda_refuses_tvms_max_pool_gradient_kernel():
    """TVM's max_pool2d_backward kernel, as dlight's Fallback schedules it, gave wrong values on
    an H200 (bench/gpu_check.py's kernel check): a pool relaxgrad cannot take (padding: not
    tiling, not overlapping) is refused with its name, not built wrong. A tiling pool (the CNN
    above) goes through relaxgrad's argmax and gather instead."""
    x = relax.Var("x", relax.TensorType((2, 3, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.max_pool2d(x, 2, strides=2, padding=1))
            out = bb.emit_output(op.sum(op.multiply(y, y)))
        bb.emit_func_output(out)
    mod = relaxgrad.Gradient("main")(bb.get())
    with pytest.raises(relaxgrad.GradientError, match="max_pool2d_backward is TVM's"):
        relaxgrad.compile(mod, CUDA)
    assert "maxpool_grad_argmax" not in _cuda_source(relaxgrad.compile(adjoint_module("cnn"), CUDA))


# A kernel of the form relaxgrad's schedules give a fused reshape: 16 lanes over a loop whose
# index restarts every 4 (``i % 4``), reading a per-row value; TVM scalarizes the loop (rsqrt),
# and LLVM 22's loop vectorizer loaded ``a[4 * v0 + i]`` for ``a[4 * v0 + i % 4]``, past the end
# of ``a`` (MobileViT's layer norm over one patch: a NaN weight gradient).
_PERIODIC_KERNEL = """
# from tvm.script import tirx as T
@T.prim_func(s_tir=True)
def kernel(a: T.Buffer((8, 1, 1), "float32"), b: T.Buffer((8, 1, 32), "float32"),
           out: T.Buffer((2, 32, 4), "float32")):
    T.func_attr({"tirx.noalias": True})
    for f0 in range(4):
        for f1 in T.unroll(4):
            for f2 in T.vectorized(16):
                with T.sblock("out"):
                    v0 = T.axis.spatial(2, (f0 * 64 + f1 * 16 + f2) // 128)
                    v1 = T.axis.spatial(32, (f0 * 64 + f1 * 16 + f2) % 128 // 4)
                    v2 = T.axis.spatial(4, (f0 * 64 + f1 * 16 + f2) % 4)
                    out[v0, v1, v2] = b[v0 * 4 + v2, 0, v1] * T.rsqrt(a[v0 * 4 + v2, 0, 0])
"""


def test_cpu_target_builds_periodic_indices_right():
    """relaxgrad's CPU builds turn LLVM's loop vectorizer off (``cpu_target``): the kernel
    above gives numpy's values, for this machine's CPU and for a generic AVX2 one."""
    from relaxgrad.pipeline import cpu_target

    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 2, (8, 1, 1)).astype("float32")
    b = rng.standard_normal((8, 1, 32)).astype("float32")
    rows = np.arange(2)[:, None] * 4 + np.arange(4)[None, :]
    want = (b[rows, 0, :] / np.sqrt(a[rows, 0, 0])[..., None]).transpose(0, 2, 1)
    for base in (host_target(), tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})):
        target = cpu_target(base)
        assert "-vectorize-loops:bool=false" in target.attrs["cl-opt"]
        name = f"periodic_{base.attrs.get('mcpu', 'generic')}".replace("-", "_")
        func = tvm.script.from_source(_PERIODIC_KERNEL).with_attr("global_symbol", name)
        lib = tvm.compile(tvm.IRModule({name: func}), target)
        out = tvm.runtime.tensor(np.zeros((2, 32, 4), "float32"))
        lib[name](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
