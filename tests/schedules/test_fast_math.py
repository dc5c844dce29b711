"""FastMath (relaxgrad/schedules/fast_math.py): float32 ``exp``, ``tanh``, ``sigmoid`` and
``erf`` as polynomials LLVM vectorizes, within a few ulp of the correctly rounded value, with
the special values of each."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import FastMath

torch = pytest.importorskip("torch")

FUNCS = {  # name: (TE op, float64 reference, max ulp, range checked)
    "exp": (te.exp, np.exp, 2, (-87.3, 88.7)),
    "tanh": (te.tanh, np.tanh, 3, (-12.0, 12.0)),
    "sigmoid": (te.sigmoid, lambda x: 1 / (1 + np.exp(-x)), 3, (-87.0, 40.0)),
    "erf": (te.erf, np.vectorize(math.erf, otypes=["float64"]), 6, (-4.5, 4.5)),
}
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.7228, -87.33, -87.34, -100.0,
                    1e-8, -1e-8, 0.6249, 0.625, 44.0, -44.0, 1000.0], "float32")  # fmt: skip


def _compiled(func, n: int, dtype: str, vectorize: bool):
    x = te.placeholder((n,), dtype)
    y = te.compute(x.shape, lambda i: func(x[i]), name="y")
    mod = FastMath()(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    if vectorize:
        sch = s_tir.Schedule(mod)
        (loop,) = sch.get_loops(sch.get_sblock("y"))
        sch.vectorize(sch.split(loop, [None, 16])[1])
        mod = sch.mod
    return mod


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("name", list(FUNCS))
def test_within_a_few_ulp_and_special_values(name, vectorize):
    func, reference, max_ulp, (low, high) = FUNCS[name]
    xs = np.concatenate([np.linspace(low, high, 100_000, dtype="float32"), SPECIAL])
    xs = np.pad(xs, (0, -len(xs) % 16))
    mod = _compiled(func, len(xs), "float32", vectorize)
    assert f"T.{name}" not in mod.script()
    out = tvm.runtime.tensor(np.zeros_like(xs))
    tvm.compile(mod, target="llvm")(tvm.runtime.tensor(xs), out)
    got = out.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference(xs.astype("float64")).astype("float32")
    normal = np.isfinite(want) & (np.abs(want) >= np.finfo("float32").tiny)
    ulps = np.abs(got[normal].astype("float64") - want[normal]) / np.spacing(np.abs(want[normal]))
    assert ulps.max() <= max_ulp
    special = got[100_000 : 100_000 + len(SPECIAL)]
    assert np.isnan(special[0])
    with np.errstate(over="ignore"):
        expected = reference(SPECIAL[1:].astype("float64"))
    if name == "exp":
        expected[7] = 0.0  # -87.34: below the range, flushed to 0 like a subnormal
    np.testing.assert_allclose(special[1:], expected, rtol=3e-7, atol=1e-38)


def test_other_dtypes_are_left_to_llvm():
    for name, (func, *_) in FUNCS.items():
        assert f"T.{name}" in _compiled(func, 8, "float64", False).script()


@pytest.mark.parametrize("activation", ["softmax", "tanh", "sigmoid", "gelu"])
def test_compiled_models_match_numpy(activation):
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    body = {"softmax": lambda x: op.nn.softmax(x, -1), "tanh": op.tanh, "sigmoid": op.sigmoid,
            "gelu": op.nn.gelu}  # fmt: skip
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body[activation](x))
        bb.emit_func_output(out)
    executable = relaxgrad.compile(bb.get(), "llvm")
    xv = np.random.default_rng(0).standard_normal((4, 64)).astype("float32") * 10
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()
    x64 = xv.astype("float64")
    want = {
        "softmax": np.exp(x64 - x64.max(-1, keepdims=True))
        / np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True),
        "tanh": np.tanh(x64),
        "sigmoid": 1 / (1 + np.exp(-x64)),
        "gelu": x64 * 0.5 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2))),
    }[activation]
    # (GELU of a negative x is x * (1 + erf) / 2 with erf near -1: erf's absolute error, up to
    # 3.6e-7 for fast_erf's (6 ulp near 1), 6e-8 rounded correctly, times |x| / 2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 if activation == "gelu" else 1e-7)


def test_rsqrt_becomes_a_division_tvm_vectorizes():
    """``T.rsqrt`` of any float dtype: ``1 / sqrt``, which TVM's VectorizeLoop vectorizes (it
    scalarizes a loop with ``rsqrt`` in it, leaving the loop to LLVM's vectorizer)."""
    for dtype in ("float32", "float64"):
        mod = _compiled(te.rsqrt, 64, dtype, vectorize=True)
        assert "rsqrt" not in mod.script()
        lib = tvm.compile(mod, "llvm")
        short = "f32" if dtype == "float32" else "f64"
        assert f"llvm.sqrt.v16{short}" in lib.mod.inspect_source("ll")  # 16 lanes: not scalar
        x = np.random.default_rng(0).uniform(0.1, 10, 64).astype(dtype)
        y = tvm.runtime.tensor(np.zeros(64, dtype))
        lib["main"](tvm.runtime.tensor(x), y)
        np.testing.assert_allclose(y.numpy(), 1 / np.sqrt(x), rtol=2e-7 if dtype == "float32"
                                   else 1e-15)


@pytest.mark.parametrize("times", [1, 3])
@pytest.mark.parametrize("vectorize", [False, True])
def test_round_trips_through_bf16_are_rounded_on_bits(vectorize, times):
    """``Cast(float32, Cast(bfloat16, x))`` becomes rounding on x's bits (no bfloat16 left):
    nearest, ties to even, the largest values to infinity, NaN kept, as ml_dtypes' and TVM's
    casts round; checked against numpy's rounding of the same bits. Round trips of a rounded
    value (``times`` in a row) are the one rounding: one ``Let`` left."""

    def round_trip(x):
        for _ in range(times):
            x = x.astype("bfloat16").astype("float32")
        return x

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 50_000, dtype="uint64").astype("uint32")
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000,
                     0x00018000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000000, 0x80000000],
                    "uint32")  # fmt: skip
    xs = np.concatenate([bits, ties]).view("float32")
    xs = np.pad(xs, (0, -len(xs) % 16))
    mod = _compiled(round_trip, len(xs), "float32", vectorize)
    assert "bfloat16" not in mod.script()
    assert mod.script().count("T.Let(") == 1
    out = tvm.runtime.tensor(np.zeros_like(xs))
    tvm.compile(mod, target="llvm")(tvm.runtime.tensor(xs), out)
    got = out.numpy()
    x_bits = xs.view("uint32").astype("uint64")
    want = (((x_bits + 0x7FFF + ((x_bits >> 16) & 1)) & 0xFFFF0000).astype("uint32")
            .view("float32"))  # fmt: skip
    nan = np.isnan(xs)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view("uint32"), want[~nan].view("uint32"))
    special = got[len(bits) : len(bits) + len(ties)]
    assert special[3] == np.inf  # float32's largest: past bfloat16's largest finite value


@pytest.mark.parametrize("broadcast", [False, True])
def test_float32_values_stored_as_bf16_are_rounded_bits(broadcast):
    """``Cast(bfloat16, x)`` stored into a bf16 buffer becomes the rounding's bits stored into
    a uint16 view, vectorized: nearest, ties to even, overflow to infinity, NaN kept; also a
    value the same in every lane (``broadcast``: a row's value along it), on which TVM's bf16
    legalization failed."""
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 4096, dtype="uint64").astype("uint32")
    bits[:8] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                0x7F800001, 0xFFFFFFFF]
    xs = bits.view("float32")
    n, lanes = (len(xs), 16) if broadcast else (len(xs) // 16, 16)
    x = te.placeholder((n,) if broadcast else (n, lanes), "float32")
    y = te.compute((n, lanes), lambda i, j: (x[i] if broadcast else x[i, j]).astype("bfloat16"),
                   name="y")
    mod = FastMath()(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    sch = s_tir.Schedule(mod)
    sch.vectorize(sch.get_loops(sch.get_sblock("y"))[1])
    out = tvm.runtime.empty((int(n), lanes), "bfloat16")
    given = xs if broadcast else xs.reshape(n, lanes)
    tvm.compile(sch.mod, target="llvm")(tvm.runtime.tensor(given), out)
    got = np.frombuffer(out.numpy().tobytes(), "uint16").reshape(n, lanes)
    wide = bits.astype("uint64")
    want = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype("uint16")
    want = np.broadcast_to(want[:, None], (n, lanes)) if broadcast else want.reshape(n, lanes)
    nan = np.isnan(xs if broadcast else xs.reshape(n, lanes))
    nan = np.broadcast_to(nan[:, None], (n, lanes)) if broadcast else nan
    assert ((got[nan] & 0x7FFF) > 0x7F80).all()  # NaN, of the same sign
    sign = (bits >> 31).astype("uint16")
    sign = np.broadcast_to(sign[:, None], (n, lanes)) if broadcast else sign.reshape(n, lanes)
    np.testing.assert_array_equal(got[nan] >> 15, sign[nan])
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "erf"])
def test_functions_of_bf16_inputs_read_their_bits(name):
    """``f(astype(x, float32))`` of a bfloat16 ``x`` (a value mixed precision holds in bf16):
    TVM's bf16 legalization skips the values of ``Let`` bindings, where the polynomials bind
    their operand, and read the element's ``uint16`` bits as a number (``exp``: ``inf``); the
    element is widened on its bits first. Compiled, against PyTorch on the same bf16 values,
    and with an output rounded to bf16 too."""
    import ml_dtypes

    x = relax.Var("x", relax.TensorType((16, 64), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(getattr(relax.op, name)(relax.op.astype(x, "float32")))
            out = bb.emit_output(relax.Tuple([y, bb.emit(relax.op.astype(y, "bfloat16"))]))
        bb.emit_func_output(out)
    xs = np.random.default_rng(0).standard_normal((16, 64)).astype("float32") * 3
    vm = relax.VirtualMachine(relaxgrad.compile(bb.get(), "llvm", cache=False), tvm.cpu())
    wide, low = vm["main"](tvm.runtime.tensor(xs.astype(ml_dtypes.bfloat16)))
    want = getattr(torch, name)(torch.tensor(xs).bfloat16().float())
    np.testing.assert_allclose(wide.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low.numpy().astype("float32"), want.bfloat16().float().numpy(),
                               rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("held", [False, True])
def test_stores_of_values_that_tvm_scalarizes_stay_per_lane(held):
    """A float32 value stored into a bf16 buffer whose expression TVM's ``VectorizeLoop``
    cannot vectorize (an ``if_then_else`` whose condition differs per lane: a rotary
    embedding's ``cat([-x2, x1])`` and its gradient's pads) is stored lane by lane: bound in a
    statement of its own, TVM scalarized that statement alone and stored its last lane's value
    in all sixteen (0.42 relative error in a grouped-query attention's forward). ``held``: the
    input is a bf16 value read back in float32 (rounded again, as mixed precision writes: a
    rounding FastMath drops)."""
    import ml_dtypes

    n, d = 64, 8
    x = te.placeholder((n, d), "bfloat16" if held else "float32")

    def wide(i, j):
        v = x[i, j].astype("float32")
        return v.astype("bfloat16").astype("float32") if held else v

    half = d // 2
    y = te.compute((n, d), lambda i, j: tvm.tirx.if_then_else(
        j < half, -wide(i, tvm.tirx.min(j + half, d - 1)), wide(i, tvm.tirx.max(j - half, 0))
    ).astype("bfloat16"), name="y")  # fmt: skip
    mod = FastMath()(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    if held:  # a bf16 value widened is not rounded again
        assert str(0xFFFF0000) not in mod.script()
    sch = s_tir.Schedule(mod)
    i, j = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(sch.fuse(i, j), [None, 16])[1])
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, d)).astype("float32")
    given = xs.astype(ml_dtypes.bfloat16) if held else xs
    out = tvm.runtime.empty((n, d), "bfloat16")
    tvm.compile(sch.mod, target="llvm")(tvm.runtime.tensor(given), out)
    source = given.astype("float32")
    want = np.concatenate([-source[:, half:], source[:, :half]], 1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.numpy().astype("float32"), want.astype("float32"))


def test_chains_of_held_values_round_once_per_kernel():
    """BLOOM's GELU, ``y * 0.5 * (1 + tanh(0.79788456 * y * (1 + 0.044715 * y * y)))`` of a
    product's result, every op's result held in bf16: fused into one kernel, each rounding
    nested in the next was copied four times by TVM's simplifier (one kernel held 633
    roundings, another 126 copies of one inside ``tanh``, and LLVM took more than ten minutes).
    A fused chain computes in float32 and rounds once; the gradients stay as close to float64
    as autocast's."""
    from relaxgrad import pipeline
    from relaxgrad.transforms import MixedPrecision

    x = relax.Var("x", relax.TensorType((16, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(op.matmul(x, w))
            inner = bb.emit(op.add(relax.const(1.0), op.multiply(
                op.multiply(relax.const(0.044715), y), y)))
            t = bb.emit(op.tanh(op.multiply(op.multiply(relax.const(0.79788456), y), inner)))
            z = bb.emit(op.multiply(op.multiply(y, relax.const(0.5)),
                                    op.add(relax.const(1.0), t)))
            loss = bb.emit_output(op.sum(op.multiply(z, z)))
        bb.emit_func_output(loss)
    mod = relaxgrad.Gradient("main")(MixedPrecision("bf16")(bb.get()))
    target = pipeline.cpu_target(pipeline.host_target())
    with tvm.transform.PassContext(config=pipeline.KERNEL_CONFIG), target:
        lowered = pipeline.cpu_pipeline(target)(pipeline.LowerCallTIRWithGrad()(mod))
    roundings = [f.script().count(str(0xFFFF0000)) for f in lowered.functions.values()
                 if isinstance(f, tvm.tirx.PrimFunc)]  # fmt: skip
    assert 0 < max(roundings) <= 4, roundings

    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((16, 32)).astype("float32"), rng.standard_normal(
        (32, 64)).astype("float32") * 0.2
    vm = relax.VirtualMachine(relaxgrad.compile(mod, cache=False), tvm.cpu())
    _, grads = vm["main_adjoint"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ws))

    def torch_grads(dtype, autocast):
        tx, tw = (torch.tensor(a, dtype=dtype, requires_grad=True) for a in (xs, ws))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = tx @ tw
            z = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1.0 + 0.044715 * y * y)))
        (z.float() * z.float()).sum().backward()
        return [tx.grad.double().numpy(), tw.grad.double().numpy()]

    exact, autocast = torch_grads(torch.float64, False), torch_grads(torch.float32, True)
    for got, want, theirs in zip(grads, exact, autocast):
        distance = np.linalg.norm(got.numpy() - want) / np.linalg.norm(want)
        assert distance <= 2 * np.linalg.norm(theirs - want) / np.linalg.norm(want) + 1e-6


def test_stores_left_to_tvms_legalization_bind_no_rounding_twice():
    """A ReLU's gradient in bf16 whose mask reads a held (rounded) value and whose gradient is
    a sum of two bf16 values: the store computes in bf16, so TVM legalizes it, and it copies
    the value it rounds; the rounding's ``Let`` was then bound twice ("Let cannot bind the same
    var to two different values", RegNet and MobileViT in bf16). Vectorized, compiled, against
    NumPy's rounding of the same values."""
    import ml_dtypes

    n = 256
    x, a, b = (te.placeholder((n,), "float32", name=name) for name in "xab")
    zero = tvm.tirx.const(0.0, "float32")

    def grad(i):
        held = x[i].astype("bfloat16").astype("float32")
        total = (a[i].astype("bfloat16") + b[i].astype("bfloat16")).astype("float32")
        return tvm.tirx.Select(held <= zero, zero, total).astype("bfloat16")

    y = te.compute((n,), grad, name="y")
    mod = FastMath()(tvm.IRModule({"main": te.create_prim_func([x, a, b, y])}))
    sch = s_tir.Schedule(mod)
    (loop,) = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(loop, [None, 16])[1])
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    xs = rng.standard_normal(n).astype("float32")
    # bf16 values already: TVM's legalization adds the float32 values it is given, unrounded
    as_, bs = (rng.standard_normal(n).astype(bf16).astype("float32") for _ in range(2))
    out = tvm.runtime.empty((n,), "bfloat16")
    tvm.compile(sch.mod, target="llvm")(*(tvm.runtime.tensor(v) for v in (xs, as_, bs)), out)
    total = (as_ + bs).astype(bf16).astype("float32")
    want = np.where(xs.astype(bf16).astype("float32") <= 0, 0, total)
    np.testing.assert_array_equal(out.numpy().astype("float32"), want)
