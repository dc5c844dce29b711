"""MixedPrecision: products in bfloat16 / float16 with float32 accumulation, their gradients
against PyTorch's autocast and float64 (at least as close to float64 as autocast's), one cast
per operand, float32 parameter gradients."""

import copy

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.analysis import count_bindings
from relaxgrad.transforms import MixedPrecision

torch = pytest.importorskip("torch")


def _mlp():
    """``main(x, w1, b1, w2) = sum(tanh(x @ w1 + b1) @ w2 ** 2)`` and its arrays."""
    x = relax.Var("x", relax.TensorType((16, 32), "float32"))
    w1 = relax.Var("w1", relax.TensorType((32, 64), "float32"))
    b1 = relax.Var("b1", relax.TensorType((64,), "float32"))
    w2 = relax.Var("w2", relax.TensorType((64, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w1, b1, w2]):
        with bb.dataflow():
            h = bb.emit(op.tanh(op.add(op.matmul(x, w1), b1)))
            y = bb.emit(op.matmul(h, w2))
            loss = bb.emit_output(op.sum(op.multiply(y, y)))
        bb.emit_func_output(loss)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float32") * 0.3 for s in [(16, 32), (32, 64), (64,),
                                                                        (64, 8)]]
    return bb.get(), arrays


def _torch_mlp(arrays, dtype=None, autocast=False):
    x, w1, b1, w2 = (torch.tensor(a, dtype=dtype or torch.float32, requires_grad=True)
                     for a in arrays)  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = torch.tanh(x @ w1 + b1) @ w2
        loss = (y.float() * y.float()).sum()
    loss.backward()
    return [t.grad.double().numpy() for t in (x, w1, b1, w2)]


def _grads(mod, arrays, target="llvm"):
    vm = relax.VirtualMachine(relaxgrad.compile(mod, target), tvm.cpu())
    _, grads = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in arrays))
    return [g.numpy() for g in grads]


def _distance(got, reference):
    return np.linalg.norm(got - reference) / np.linalg.norm(reference)


def test_bf16_mlp_gradients_are_as_close_as_autocasts():
    mod, arrays = _mlp()
    mixed = relaxgrad.Gradient("main")(MixedPrecision("bf16")(mod))
    ours = _grads(mixed, arrays)
    exact = _torch_mlp(arrays, torch.float64)
    autocast = _torch_mlp(arrays, autocast=True)
    fp32 = _grads(relaxgrad.Gradient("main")(mod), arrays)
    for name, g, e, a, f in zip(["x", "w1", "b1", "w2"], ours, exact, autocast, fp32):
        assert g.dtype == np.float32, name
        assert np.isfinite(g).all(), name
        ours_d, theirs_d = _distance(g, e), _distance(a, e)
        print(f"{name}: ours {ours_d:.2e}, autocast {theirs_d:.2e}, fp32 {_distance(f, e):.1e}")
        assert ours_d <= 2 * theirs_d + 1e-6, name
        assert ours_d > 10 * _distance(f, e), name  # bf16 for real: far less exact than fp32


def test_each_operand_is_cast_once_and_products_accumulate_in_float32():
    mod, _ = _mlp()
    mixed = MixedPrecision("bf16")(mod)
    adjoint = relaxgrad.Gradient("main")(mixed)["main_adjoint"]
    casts, products = {}, []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.astype"):
            arg = expr.args[0]
            if isinstance(arg, relax.Var) and arg.name in ("x", "w1", "w2"):
                casts[arg.name] = casts.get(arg.name, 0) + 1
        if isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.matmul"):
            products.append(expr)

    relax.analysis.post_order_visit(adjoint.body, visit)
    assert casts == {"x": 1, "w1": 1, "w2": 1}  # the backward reads the forward's copies
    assert len(products) == 6
    for product in products:
        assert [a.ty.dtype for a in product.args] == ["bfloat16", "bfloat16"]
        assert product.ty.dtype == "float32"
    assert count_bindings(adjoint) > 0


def _cnn_module():
    from relaxgrad.training import from_torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 3 * 3, 5))
    return net, from_torch(net, (torch.randn(4, 3, 8, 8),))


def test_bf16_cnn_trains_like_autocast():
    """A CNN from PyTorch (convolutions and a linear layer in bfloat16) through the Trainer:
    the first gradients as close to float64 as autocast's, then the loss goes down."""
    from relaxgrad.training import SGD, CrossEntropyLoss, Trainer

    net, model = _cnn_module()
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.05), precision="bf16")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 8, 8)).astype("float32")
    y = rng.integers(0, 5, 4)
    _, ours = trainer.gradients(x, y)

    def torch_grads(dtype, autocast):
        twin = copy.deepcopy(net).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = twin(torch.from_numpy(x).to(dtype))
        torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(y)).backward()
        return {k: p.grad.double().numpy() for k, p in twin.named_parameters()}

    exact, autocast = torch_grads(torch.float64, False), torch_grads(torch.float32, True)
    assert sorted(ours) == sorted(exact)
    for name, g in ours.items():
        assert g.dtype == np.float32 and np.isfinite(g).all(), name
        ours_d, theirs_d = _distance(g, exact[name]), _distance(autocast[name], exact[name])
        print(f"{name}: ours {ours_d:.2e}, autocast {theirs_d:.2e}")
        assert ours_d <= 2 * theirs_d + 1e-6, name
    losses = [trainer.step(x, y) for _ in range(8)]
    assert losses[-1] < losses[0]


def test_bad_dtype_and_function_are_refused():
    mod, _ = _mlp()
    with pytest.raises(relaxgrad.GradientError, match="dtype must be one of"):
        MixedPrecision("int8")
    with pytest.raises(relaxgrad.GradientError, match="no Relax function nope"):
        MixedPrecision("bf16", "nope")(mod)
    assert MixedPrecision("fp16")(mod)["main"] is not mod["main"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_builds_for_cuda(dtype):
    """The same adjoint builds for a GPU (no GPU needed to build; running it is the GPU
    bench's)."""
    mod, _ = _mlp()
    mixed = relaxgrad.Gradient("main")(MixedPrecision(dtype)(mod))
    ex = relaxgrad.compile(mixed, {"kind": "cuda", "arch": "sm_90"}, cache=False)
    assert ex is not None
