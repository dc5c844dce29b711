"""Optimizers: compiled steps against closed-form numpy updates and against torch.optim."""

import functools

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxgrad.training import SGD, Adam, AdamW, MomentumSGD, Optimizer

SHAPES = [(5, 3), (3,), ()]
STEPS = 5


def _problem(dtype="float32"):
    """Initial values and one gradient per step for params of SHAPES."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(STEPS)]
    return values, grads


def _run(optimizer: Optimizer, values, grads, fused: bool = False):
    """Parameters after each step of the compiled optimizer function (with the fused update
    kernels a Trainer compiles, ``add_to``, where ``fused``)."""
    params = [relax.Var(f"p{i}", relax.TensorType(v.shape, v.dtype)) for i, v in enumerate(values)]
    optimizer.init(params)
    if fused:
        mod = optimizer.add_to(tvm.IRModule(), "optimizer")
    else:
        mod = tvm.IRModule({"optimizer": optimizer.get_function()})
    step = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["optimizer"]
    current, state, history = [tvm.runtime.tensor(v) for v in values], optimizer.state, []
    controls = [tvm.runtime.tensor(c) for c in optimizer.controls()]  # lr, no clipping, scale 1
    for g in grads:
        args = (current, [tvm.runtime.tensor(x) for x in g], state)
        current, state = step(*args, controls)[:2] if fused else step(*args)
        history.append([p.numpy() for p in current])
    return history, [s.numpy() for s in state]


# Closed-form updates, written from torch.optim's documented algorithms, in float64.
def _sgd(p, g, slots, t, lr, weight_decay=0.0):
    return p - lr * (g + weight_decay * p), []


def _momentum(p, g, slots, t, lr, momentum, dampening=0.0, weight_decay=0.0, nesterov=False):
    g = g + weight_decay * p
    buf = g if t == 1 else momentum * slots[0] + (1 - dampening) * g
    return p - lr * (g + momentum * buf if nesterov else buf), [buf]


def _adam(p, g, slots, t, lr, betas, eps, weight_decay, decoupled):
    (b1, b2), (m, v) = betas, slots
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), [m, v]


def _reference(update, n_slots, values, grads, **hyper):
    params = [v.astype("float64") for v in values]
    slots = [[np.zeros_like(p) for _ in range(n_slots)] for p in params]
    history = []
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            params[i], slots[i] = update(params[i], g.astype("float64"), slots[i], t, **hyper)
        history.append(list(params))
    return history


# id -> (our optimizer, closed form, slots, hyperparameters, torch.optim factory)
CASES = {
    "sgd": (lambda: SGD(0.1), _sgd, 0, {"lr": 0.1}, lambda t, p: t.optim.SGD(p, 0.1)),
    "sgd_wd": (lambda: SGD(0.1, weight_decay=0.3), _sgd, 0, {"lr": 0.1, "weight_decay": 0.3},
               lambda t, p: t.optim.SGD(p, 0.1, weight_decay=0.3)),
    "momentum": (lambda: MomentumSGD(0.1, 0.9, weight_decay=0.1), _momentum, 1,
                 {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
                 lambda t, p: t.optim.SGD(p, 0.1, momentum=0.9, weight_decay=0.1)),
    "dampening": (lambda: MomentumSGD(0.1, 0.8, dampening=0.3), _momentum, 1,
                  {"lr": 0.1, "momentum": 0.8, "dampening": 0.3},
                  lambda t, p: t.optim.SGD(p, 0.1, momentum=0.8, dampening=0.3)),
    "nesterov": (lambda: MomentumSGD(0.1, 0.9, nesterov=True), _momentum, 1,
                 {"lr": 0.1, "momentum": 0.9, "nesterov": True},
                 lambda t, p: t.optim.SGD(p, 0.1, momentum=0.9, nesterov=True)),
    "adam": (lambda: Adam(0.01), _adam, 2,
             {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "decoupled": False},
             lambda t, p: t.optim.Adam(p, 0.01)),
    "adam_l2": (lambda: Adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), _adam, 2,
                {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1,
                 "decoupled": False},
                lambda t, p: t.optim.Adam(p, 0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (lambda: AdamW(0.01, weight_decay=0.1), _adam, 2,
              {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
               "decoupled": True},
              lambda t, p: t.optim.AdamW(p, 0.01, weight_decay=0.1)),
}


@functools.cache
def _ours(case, fused=False):
    """Our optimizer's parameter history and final state on ``_problem()`` (compiled once)."""
    return _run(CASES[case][0](), *_problem(), fused=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_closed_form(case, fused):
    _, update, n_slots, hyper, _ = CASES[case]
    values, grads = _problem()
    got, state = _ours(case, fused)
    expected = _reference(update, n_slots, values, grads, **hyper)
    for step, (g_step, e_step) in enumerate(zip(got, expected), start=1):
        for i, (g, e) in enumerate(zip(g_step, e_step)):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"step {step} p{i}")
    assert state[0] == STEPS  # the step counter
    assert len(state) == 1 + n_slots * len(SHAPES)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch(case, fused):
    torch = pytest.importorskip("torch")
    theirs = CASES[case][4]
    values, grads = _problem()
    got, _ = _ours(case, fused)
    params = [torch.tensor(v, requires_grad=True) for v in values]
    optimizer = theirs(torch, params)
    for step, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g)
        optimizer.step()
        for i, p in enumerate(params):  # float32 both: a few ulps apart
            np.testing.assert_allclose(got[step][i], p.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step + 1} p{i}")


def test_state_layout_and_function_signature():
    params = [relax.Var("w", relax.TensorType((2, 3), "float32")),
              relax.Var("b", relax.TensorType((3,), "float32"))]
    opt = Adam().init(params)
    assert [tuple(s.shape) for s in opt.state] == [(), (2, 3), (3,), (2, 3), (3,)]
    func = opt.get_function()
    assert [p.name for p in func.params] == ["params", "gradients", "optim_states"]
    assert len(func.ret_ty.fields) == 2
    assert len(func.ret_ty.fields[1].fields) == 5


def test_init_rejects_bad_parameters():
    w = relax.Var("w", relax.TensorType((2,), "float32"))
    with pytest.raises(RuntimeError, match="call init"):
        SGD(0.1).get_function()
    with pytest.raises(ValueError, match="appears more than once"):
        SGD(0.1).init([w, w])
    with pytest.raises(ValueError, match="one dtype"):
        SGD(0.1).init([w, relax.Var("v", relax.TensorType((2,), "float64"))])
    with pytest.raises(ValueError, match="float tensor"):
        SGD(0.1).init([relax.Var("i", relax.TensorType((2,), "int32"))])
    with pytest.raises(ValueError, match="symbolic shape"):
        SGD(0.1).init([relax.Var("s", relax.TensorType((tirx.Var("n", "int64"),), "float32"))])
    with pytest.raises(ValueError, match="lr > 0"):
        Adam(lr=0.0)
    with pytest.raises(ValueError, match="nesterov"):
        MomentumSGD(0.1, momentum=0.9, dampening=0.1, nesterov=True)


def test_float64_parameters():
    values, grads = _problem("float64")
    got, _ = _run(AdamW(0.01, weight_decay=0.1), values, grads)
    expected = _reference(_adam, 2, values, grads, lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.1, decoupled=True)
    np.testing.assert_allclose(got[-1][0], expected[-1][0], rtol=1e-12)


def test_adam_update_is_one_kernel_per_parameter():
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(SHAPES)]
    mod = Adam().init(params).add_to(tvm.IRModule(), "optimizer")
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == len(SHAPES) and all(k.startswith("adam_update") for k in kernels)
    with pytest.raises(ValueError, match="already has a function named 'optimizer'"):
        Adam().init(params).add_to(mod, "optimizer")


def test_trainer_module_with_fused_adam_builds_for_cuda():
    """The fused update kernels get GPU schedules too (a build needs no GPU)."""
    import relaxgrad
    from relaxgrad.training import CrossEntropyLoss
    from relaxgrad.training.models import mlp
    from relaxgrad.training.trainer import training_module

    model = mlp(16, 64, (32,), 10)
    mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), Adam(1e-3))
    assert any(gv.name_hint.startswith("adam_update") for gv in mod.get_global_vars())
    relaxgrad.compile(mod, {"kind": "cuda", "arch": "sm_90"})


def _controlled(optimizer: Optimizer, values):
    """``add_to``'s compiled function with its run-time controls, on params ``p0, p1, ...``."""
    params = [relax.Var(f"p{i}", relax.TensorType(v.shape, v.dtype)) for i, v in enumerate(values)]
    mod = optimizer.init(params).add_to(tvm.IRModule(), "optimizer")
    return relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["optimizer"]


def test_runtime_lr_clipping_and_no_decay_match_torch():
    """The learning rate changes every step without a recompile, gradients are unscaled and
    clipped to a global norm as ``clip_grad_norm_`` does (reporting the norm before clipping),
    and ``no_decay`` parameters form a parameter group without weight decay."""
    torch = pytest.importorskip("torch")
    values, grads = _problem()
    optimizer = AdamW(0.01, weight_decay=0.1, no_decay=("p1",))
    step = _controlled(optimizer, values)
    theirs = [torch.tensor(v, requires_grad=True) for v in values]
    torch_opt = torch.optim.AdamW([{"params": [theirs[0], theirs[2]]},
                                   {"params": [theirs[1]], "weight_decay": 0.0}], 0.01,
                                  weight_decay=0.1)
    current, state = [tvm.runtime.tensor(v) for v in values], optimizer.state
    for t, (lr, g) in enumerate(zip([0.01, 0.05, 0.0, 0.02, 0.03], grads)):
        controls = [tvm.runtime.tensor(c) for c in optimizer.controls(lr, 1.0, grad_scale=0.5)]
        current, state, (norm,) = step(current, [tvm.runtime.tensor(x) for x in g], state,
                                       controls)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for p, x in zip(theirs, g):
            p.grad = torch.tensor(x) * 0.5
        torch_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        torch_opt.step()
        assert torch_norm > 1.0  # clipping is on
        np.testing.assert_allclose(norm.numpy(), torch_norm.numpy(), rtol=1e-6)
        for i, p in enumerate(theirs):
            np.testing.assert_allclose(current[i].numpy(), p.detach().numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {t + 1} p{i}")


def test_norm_reports_a_nonfinite_gradient():
    values, grads = _problem()
    optimizer = SGD(0.1)
    step = _controlled(optimizer, values)
    bad = [g.copy() for g in grads[0]]
    bad[1][2] = np.nan
    controls = [tvm.runtime.tensor(c) for c in optimizer.controls()]
    _, _, (norm,) = step([tvm.runtime.tensor(v) for v in values],
                         [tvm.runtime.tensor(x) for x in bad], optimizer.state, controls)
    assert np.isnan(norm.numpy())
    with pytest.raises(ValueError, match="no_decay must be a sequence of str"):
        AdamW(0.1, no_decay="bias")
