"""Rules on tensors with a symbolic batch dim ``n``: each function is differentiated and compiled
once, then checked against central finite differences at several concrete batch sizes."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.relax import op
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad import GradientError, _ty
from relaxgrad.testing import FAST_LLVM, _default_tolerance
from relaxgrad.transforms import LowerCallTIRWithGrad

N = tirx.Var("n", "int64")
SIZES = (1, 3)


def _dims(shape, n: int) -> list[int]:
    return [n if d == "n" else d for d in shape]


def _type(shape, dtype: str = "float64") -> relax.TensorType:
    return relax.TensorType([N if d == "n" else d for d in shape], dtype)


@dataclass
class SymCase:
    """``fn(*vars)`` of params of ``shapes``, where ``"n"`` is the symbolic batch dim.

    ``inputs(rng, n)`` overrides the random inputs at batch size n; ``wrt`` selects the params
    to check (default: every float param); ``eps``/``tol`` override those of the dtype; the
    check runs at each batch size of ``sizes``.
    """

    id: str
    fn: Callable[..., relax.Expr]
    shapes: Sequence
    dtype: str | Sequence[str] = "float64"
    inputs: Callable | None = None
    wrt: Sequence[int] | None = None
    eps: float | None = None
    tol: float | None = None
    sizes: Sequence[int] = SIZES

    def dtypes(self) -> list[str]:
        return [self.dtype] * len(self.shapes) if isinstance(self.dtype, str) else list(self.dtype)

    def make_inputs(self, rng, n: int) -> list[np.ndarray]:
        if self.inputs is not None:
            return self.inputs(rng, n)
        return [rng.uniform(-1, 1, _dims(s, n)).astype(d)
                for s, d in zip(self.shapes, self.dtypes())]  # fmt: skip


def symbolic_loss_module(fn, types, seed: int = 0) -> tvm.IRModule:
    """``main(x0, x1, ...)`` returning ``sum(w * fn(x0, x1, ...))`` in one dataflow block; ``w`` is
    a random constant over the static trailing dims of the result (broadcast over the others)."""
    rng = np.random.default_rng(seed)
    params = [relax.Var(f"x{i}", ty) for i, ty in enumerate(types)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit(fn(*params))
            dims = _ty.shape_values(out)
            static = len(dims)
            while static and isinstance(dims[static - 1], tirx.IntImm):
                static -= 1
            weight = rng.uniform(0.5, 1.5, [int(d) for d in dims[static:]])
            dtype = _ty.dtype_of(out)
            loss = bb.emit(op.sum(op.multiply(out, relax.const(weight.astype(dtype), dtype))))
            gv = bb.emit_output(loss)
        bb.emit_func_output(gv)
    return bb.get()


def check_at_sizes(mod, wrt, input_sets, *, eps=None, tol=None, seed=0, executable=None):
    """Differentiate ``mod["main"]`` w.r.t. the params ``wrt``, compile it once (or use
    ``executable``, built from ``gradient_module(mod, wrt)``), and compare the adjoint on each
    list of numpy inputs of ``input_sets`` with central finite differences of the forward."""
    if executable is None:
        executable = tvm.compile(gradient_module(mod, wrt), target=FAST_LLVM)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    rng = np.random.default_rng(seed)

    def run(name, values):
        return vm[name](*[tvm.runtime.tensor(np.asarray(v)) for v in values])

    for inputs in input_sets:
        _, grads = run("main_adjoint", inputs)
        for k, i in enumerate(wrt):
            x, grad = inputs[i], grads[k].numpy()
            assert grad.shape == x.shape, f"gradient {i}: shape {grad.shape}, input {x.shape}"
            d_eps, d_tol = _default_tolerance(str(x.dtype))
            step, limit = eps or d_eps, tol or d_tol
            for _ in range(2):
                d = rng.standard_normal(x.shape)
                moved = []
                for sign in (1, -1):
                    values = list(inputs)
                    values[i] = (x.astype("float64") + sign * step * d).astype(x.dtype)
                    moved.append(float(run("main", values).numpy()))
                fd = (moved[0] - moved[1]) / (2 * step)
                ad = float(np.sum(grad.astype("float64") * d))
                err = abs(fd - ad) / max(1.0, abs(fd), abs(ad))
                assert err <= limit, (
                    f"param {i} at shape {x.shape}: finite difference {fd:.6g}, "
                    f"adjoint {ad:.6g}, error {err:.2g}"
                )


def gradient_module(mod, wrt) -> tvm.IRModule:
    params = list(mod["main"].params)
    return LowerCallTIRWithGrad()(relaxgrad.Gradient("main", [params[i] for i in wrt])(mod))


def run_sym_case(case: SymCase) -> None:
    types = [_type(s, d) for s, d in zip(case.shapes, case.dtypes())]
    mod = symbolic_loss_module(case.fn, types)
    wrt = case.wrt
    if wrt is None:
        wrt = [i for i, d in enumerate(case.dtypes()) if d.startswith("float")]
    rng = np.random.default_rng(0)
    input_sets = [case.make_inputs(rng, n) for n in case.sizes]
    check_at_sizes(mod, wrt, input_sets, eps=case.eps, tol=case.tol)


def _nll(pred_shape, weighted=False, first=None):
    """``shapes``/``dtype``/``inputs``/``wrt`` of an nll_loss case over 5 classes (``first``: the
    target of the first position, e.g. an ignored -100)."""
    target_shape = pred_shape[:1] + pred_shape[2:]
    shapes = [pred_shape, target_shape] + [(5,)] * weighted

    def inputs(rng, n):
        pred = rng.uniform(-1, 1, _dims(pred_shape, n))
        targets = rng.integers(0, 5, _dims(target_shape, n)).astype("int64")
        if first is not None:
            targets.reshape(-1)[0] = first
        return [pred, targets] + [rng.uniform(0.5, 1.5, 5)] * weighted

    return {"shapes": shapes, "dtype": ("float64", "int64", "float64"), "inputs": inputs,
            "wrt": [0, 2] if weighted else [0]}  # fmt: skip


def _probs(rng, n):
    return [rng.uniform(-1, 1, (n, 5)), rng.dirichlet(np.ones(5), n)]


def _gather_nd_inputs(rng, n):
    return [rng.uniform(-1, 1, (n, 3)), rng.integers(0, n, (n, 1)).astype("int64")]


def _batched_gather_inputs(rng, n):
    return [rng.uniform(-1, 1, (n, 4, 3)), rng.integers(0, 4, (n, 2, 1)).astype("int64")]


def _batch_norm(x, gamma, beta, mean, var):
    return relax.TupleGetItem(op.nn.batch_norm(x, gamma, beta, mean, var, 1), 0)


def _positive_stats(rng, n):
    return [rng.uniform(-1, 1, (n, 3, 2))] + [rng.uniform(0.5, 1.5, 3) for _ in range(4)]


# resize2d computes in float32 whatever the dtype; it is linear in x, so a large step is exact.
LINEAR = {"eps": 0.1, "tol": 1e-4}
CT1, CT2, CT3 = op.nn.conv1d_transpose, op.nn.conv2d_transpose, op.nn.conv3d_transpose

CASES = [
    # statistical
    SymCase("mean_batch", lambda x: op.mean(x, [0]), [("n", 4)]),
    SymCase("mean_all", lambda x: op.mean(x), [("n", 4)]),
    SymCase("mean_keepdims", lambda x: op.mean(x, [0, 2], keepdims=True), [("n", 3, 2)]),
    SymCase("variance_batch", lambda x: op.variance(x, [0]), [("n", 4)]),
    SymCase("variance_all", lambda x: op.variance(x), [("n", 4)]),
    SymCase("std_batch", lambda x: op.std(x, [0]), [("n", 4)], sizes=(2, 3)),  # 0 at n=1
    SymCase("std_all", lambda x: op.std(x), [("n", 4)]),
    SymCase("max_batch", lambda x: op.max(x, [0]), [("n", 4)]),
    SymCase("cumsum_batch", lambda x: op.cumsum(x, 0), [("n", 3)]),
    SymCase("cumprod", lambda x: op.cumprod(x, 1), [("n", 3)]),
    # losses
    SymCase("cross_entropy_with_logits", op.nn.cross_entropy_with_logits, [("n", 5), ("n", 5)],
            inputs=_probs),
    SymCase("nll_loss_mean", lambda p, t: op.nn.nll_loss(p, t), **_nll(("n", 5))),
    SymCase("nll_loss_none", lambda p, t: op.nn.nll_loss(p, t, reduction="none"),
            **_nll(("n", 5))),
    SymCase("nll_loss_weighted_mean", lambda p, t, w: op.nn.nll_loss(p, t, w),
            **_nll(("n", 5), weighted=True)),
    SymCase("nll_loss_weighted_sum_ignore_index",
            lambda p, t, w: op.nn.nll_loss(p, t, w, "sum", ignore_index=1),
            **_nll(("n", 5), weighted=True)),
    SymCase("nll_loss_weighted_none_ignored_target",
            lambda p, t, w: op.nn.nll_loss(p, t, w, "none"),
            **_nll(("n", 5), weighted=True, first=-100)),
    SymCase("nll_loss_spatial", lambda p, t, w: op.nn.nll_loss(p, t, w),
            **_nll(("n", 5, 2, 3), weighted=True)),
    # convolutions
    SymCase("conv1d", lambda x, w: op.nn.conv1d(x, w, strides=2, padding=1),
            [("n", 2, 7), (3, 2, 3)]),
    SymCase("conv2d", lambda x, w: op.nn.conv2d(x, w, strides=2, padding=1),
            [("n", 2, 6, 6), (3, 2, 3, 3)]),
    SymCase("conv2d_groups", lambda x, w: op.nn.conv2d(x, w, strides=2, groups=2),
            [("n", 4, 7, 7), (4, 2, 3, 3)]),
    SymCase("conv2d_nhwc", lambda x, w: op.nn.conv2d(x, w, data_layout="NHWC",
                                                     kernel_layout="HWIO", padding=1),
            [("n", 5, 5, 2), (3, 3, 2, 3)]),
    SymCase("conv3d", lambda x, w: op.nn.conv3d(x, w, strides=2, padding=1),
            [("n", 2, 5, 5, 4), (3, 2, 3, 3, 3)]),
    SymCase("conv1d_transpose", lambda x, w: CT1(x, w, strides=2), [("n", 2, 4), (2, 3, 3)]),
    SymCase("conv2d_transpose", lambda x, w: CT2(x, w, strides=2, padding=1, output_padding=1),
            [("n", 2, 4, 3), (2, 3, 3, 3)]),
    SymCase("conv2d_transpose_groups", lambda x, w: CT2(x, w, groups=2),
            [("n", 4, 3, 3), (4, 3, 2, 2)]),
    SymCase("conv3d_transpose", lambda x, w: CT3(x, w, strides=2),
            [("n", 2, 2, 3, 2), (2, 2, 2, 2, 2)]),
    # pooling
    SymCase("max_pool2d", lambda x: op.nn.max_pool2d(x, 2, 2), [("n", 2, 6, 6)]),
    SymCase("avg_pool2d", lambda x: op.nn.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
            [("n", 2, 6, 6)]),
    SymCase("adaptive_avg_pool1d", lambda x: op.nn.adaptive_avg_pool1d(x, 3), [("n", 2, 7)]),
    SymCase("adaptive_avg_pool2d", lambda x: op.nn.adaptive_avg_pool2d(x, (3, 2)),
            [("n", 2, 7, 5)]),
    SymCase("adaptive_avg_pool2d_nhwc",
            lambda x: op.nn.adaptive_avg_pool2d(x, (3, 2), layout="NHWC"), [("n", 7, 5, 2)]),
    SymCase("adaptive_avg_pool3d", lambda x: op.nn.adaptive_avg_pool3d(x, (3, 2, 2)),
            [("n", 2, 5, 5, 4)]),
    # others that read static dims
    SymCase("resize2d_linear", lambda x: op.image.resize2d(x, (5, 7), method="linear"),
            [("n", 2, 3, 4)], **LINEAR),
    SymCase("resize2d_nearest_nhwc",
            lambda x: op.image.resize2d(x, (6, 3), method="nearest_neighbor", layout="NHWC"),
            [("n", 3, 4, 2)], **LINEAR),
    SymCase("pad_reflect_spatial", lambda x: op.nn.pad(x, [0, 0, 0, 0, 1, 2, 2, 1], "reflect"),
            [("n", 2, 4, 4)]),
    SymCase("attention_bottom_right",
            lambda q, k, v: op.nn.attention(q, k, v, causal_mask="BottomRight"),
            [("n", 3, 2, 4), ("n", 4, 2, 4), ("n", 4, 2, 4)]),
    SymCase("batch_norm", _batch_norm, [("n", 3, 2), (3,), (3,), (3,), (3,)],
            inputs=_positive_stats, wrt=[0, 1, 2]),
    SymCase("layer_norm", lambda x, g, b: op.nn.layer_norm(x, g, b, [1]),
            [("n", 4), (4,), (4,)], dtype="float32"),
    SymCase("group_norm", lambda x, g, b: op.nn.group_norm(x, g, b, 2, 1, [2]),
            [("n", 4, 3), (4,), (4,)], dtype="float32"),
    SymCase("prelu", op.nn.prelu, [("n", 3), (3,)]),
    SymCase("repeat_flat", lambda x: op.repeat(x, 2), [("n", 3)]),
    SymCase("repeat_batch", lambda x: op.repeat(x, 2, 0), [("n", 3)]),
    SymCase("gather_nd", op.gather_nd, [("n", 3), ("n", 1)], dtype=("float64", "int64"),
            inputs=_gather_nd_inputs),
    SymCase("gather_nd_batch_dims", lambda x, i: op.gather_nd(x, i, 1), [("n", 4, 3), ("n", 2, 1)],
            dtype=("float64", "int64"), inputs=_batched_gather_inputs),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_symbolic_batch(case):
    run_sym_case(case)


@pytest.mark.parametrize(
    "fn, shapes, match",
    [
        (lambda x, w: op.nn.conv2d(x, w), [("n", 2, "n", 5), (3, 2, 3, 3)],
         r"relax.nn.conv2d has no gradient rule for symbolic dims on axes \[2\]"),
        (lambda x, w: CT2(x, w), [("n", 2, 4, "n"), (2, 3, 3, 3)],
         r"relax.nn.conv2d_transpose has no gradient rule for symbolic dims on axes \[3\]"),
        (lambda x: op.nn.adaptive_avg_pool2d(x, (2, 2)), [("n", 2, "n", 4)],
         r"relax.nn.adaptive_avg_pool2d has no gradient rule for symbolic dims on axes \[2\]"),
        (lambda x: op.image.resize2d(x, (4, 4)), [("n", 2, "n", 3)],
         r"relax.image.resize2d has no gradient rule for symbolic dims on axes \[2\]"),
        (lambda x: op.nn.pad(x, [1, 1, 0, 0]), [("n", 3)],
         r"relax.nn.pad has no gradient rule for symbolic dims on axes \[0\]"),
    ],  # fmt: skip
    ids=["conv2d_spatial", "conv2d_transpose_spatial", "adaptive_avg_pool2d_spatial",
         "resize2d_spatial", "pad_batch"],  # fmt: skip
)
def test_symbolic_spatial_dims_refused(fn, shapes, match):
    mod = symbolic_loss_module(fn, [_type(s) for s in shapes])
    with pytest.raises(GradientError, match=match):
        relaxgrad.Gradient("main", [mod["main"].params[0]])(mod)


def _cnn_mlp(x, w1, b1, w2, b2, w3, b3, labels):
    """A conv/relu/max-pool feature extractor and a 2-layer MLP head on 1x8x8 images, batch n."""
    h = op.nn.relu(op.nn.conv2d(x, w1, padding=1) + op.reshape(b1, [1, 4, 1, 1]))
    h = op.nn.max_pool2d(h, 2, 2)
    h = op.reshape(h, [N, 4 * 4 * 4])
    h = op.nn.relu(op.matmul(h, w2) + b2)
    logits = op.matmul(h, w3) + b3
    return op.nn.cross_entropy_with_logits(op.nn.log_softmax(logits), labels)


def _mlp_nll(x, w1, b1, w2, b2, targets):
    h = op.nn.relu(op.matmul(x, w1) + b1)
    return op.nn.nll_loss(op.nn.log_softmax(op.matmul(h, w2) + b2), targets)


def _model_module(fn, shapes, dtypes):
    params = [relax.Var(f"p{i}", _type(s, d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            gv = bb.emit_output(bb.emit(fn(*params)))
        bb.emit_func_output(gv)
    return bb.get()


def test_cnn_mlp_cross_entropy_symbolic_batch():
    """A CNN + MLP classifier, compiled once by relaxgrad.compile, checked at two batch sizes."""
    shapes = [("n", 1, 8, 8), (4, 1, 3, 3), (4,), (64, 16), (16,), (16, 10), (10,), ("n", 10)]
    mod = _model_module(_cnn_mlp, shapes, ["float64"] * len(shapes))
    wrt = list(range(1, 7))
    executable = relaxgrad.compile(gradient_module(mod, wrt), "llvm")
    rng = np.random.default_rng(0)
    input_sets = []
    for n in (2, 5):
        params = [rng.uniform(-1, 1, _dims(s, n)) for s in shapes[:-1]]
        labels = np.eye(10)[rng.integers(0, 10, n)]
        input_sets.append(params + [labels])
    check_at_sizes(mod, wrt, input_sets, executable=executable)


def test_mlp_nll_loss_symbolic_batch():
    shapes = [("n", 6), (6, 8), (8,), (8, 5), (5,), ("n",)]
    dtypes = ["float64"] * 5 + ["int64"]
    mod = _model_module(_mlp_nll, shapes, dtypes)
    wrt = list(range(5))
    executable = relaxgrad.compile(gradient_module(mod, wrt), "llvm")
    rng = np.random.default_rng(0)
    input_sets = [
        [rng.uniform(-1, 1, _dims(s, n)) for s in shapes[:-1]]
        + [rng.integers(0, 5, n).astype("int64")]
        for n in (1, 4)
    ]
    check_at_sizes(mod, wrt, input_sets, executable=executable)


@I.ir_module
class SymbolicSlice:
    @R.function
    def main(x: R.Tensor(("n", 6), "float64")):
        with R.dataflow():
            y = R.strided_slice(x, axes=[1], begin=[5], end=[0], strides=[-2])
            gv = R.sum(R.multiply(y, y))
            R.output(gv)
        return gv


def test_strided_slice_symbolic_batch():
    ex = relaxgrad.compile(relaxgrad.Gradient("main")(SymbolicSlice), "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 6))
        _, (g,) = vm["main_adjoint"](tvm.runtime.tensor(x))
        expect = np.zeros_like(x)
        expect[:, 5:0:-2] = 2 * x[:, 5:0:-2]
        np.testing.assert_allclose(g.numpy(), expect, rtol=1e-12)
