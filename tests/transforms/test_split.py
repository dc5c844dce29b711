"""Split mode: Gradient(..., split=True) emits <f>_fwd and <f>_bwd; the residuals follow the
checkpoint policy. Every gradient is checked against finite differences on compiled code."""

import functools

import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
import relaxgrad.testing
from relaxgrad import GradientError
from relaxgrad.cli import main as cli_main

from ._numeric import compiled, fd_gradient, tensor
from .test_programs import Calls  # main -> block -> layer: nested calls of functions


def _split_grads(mod, inputs, seeds=()):
    vm = compiled(mod)
    out, residuals = vm["main_fwd"](*[tensor(a) for a in inputs])
    grads = vm["main_bwd"](*list(residuals), *[tensor(s) for s in seeds])
    return out, [g.numpy() for g in grads], vm


def _check_split(mod, inputs, seeds=(), value=lambda out: float(out.numpy())):
    """main_fwd then main_bwd give the finite-difference gradient of ``value(main(inputs))``
    with respect to every input; returns main_fwd's result and the VM."""
    out, grads, vm = _split_grads(mod, inputs, seeds)

    def f(*args):
        return value(vm["main"](*[tensor(a) for a in args]))

    for i, g in enumerate(grads):
        np.testing.assert_allclose(g, fd_gradient(f, inputs, i), rtol=1e-6, atol=1e-8)
    return out, vm


@I.ir_module
class MLP:
    @R.function
    def main(
        x: R.Tensor((4, 3), "float64"),
        w1: R.Tensor((3, 5), "float64"),
        w2: R.Tensor((5, 2), "float64"),
    ):
        with R.dataflow():
            h = R.tanh(R.matmul(x, w1))
            s = R.sigmoid(R.matmul(h, w2))
            e = R.exp(s)
            loss = R.sum(R.multiply(e, e))
            R.output(loss)
        return loss


@I.ir_module
class Marked:
    @R.function
    def main(x: R.Tensor((3, 4), "float64"), w: R.Tensor((4, 4), "float64")):
        with R.dataflow():
            a = R.grad.start_checkpoint(x)
            b = R.tanh(R.matmul(a, w))
            c = R.sin(b)
            d = R.grad.end_checkpoint(c)
            e = R.exp(d)
            loss = R.sum(R.multiply(e, e))
            R.output(loss)
        return loss


@I.ir_module
class Vector:  # a non-scalar target: seed="param" makes <f>_bwd take its output gradient
    @R.function
    def main(x: R.Tensor((3,), "float64"), w: R.Tensor((3, 3), "float64")):
        with R.dataflow():
            y = R.tanh(R.matmul(w, x))
            z = R.multiply(y, x)
            R.output(z)
        return z


def _inputs(func, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, [int(d) for d in p.ty.shape]) for p in func.params]


@pytest.mark.parametrize("checkpoint", ["markers", "sqrt", "save_dots", []])
def test_split_mlp_matches_finite_differences(checkpoint):
    mod = relaxgrad.Gradient("main", split=True, checkpoint=checkpoint)(MLP)
    inputs = _inputs(MLP["main"])
    out, vm = _check_split(mod, inputs)
    assert np.isclose(float(out.numpy()), float(vm["main"](*map(tensor, inputs)).numpy()))


def test_split_equals_the_adjoint_and_adds_no_adjoint():
    mod = relaxgrad.Gradient("main", split=True)(MLP)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert names == {"main", "main_fwd", "main_bwd"}
    relax.analysis.well_formed(mod)
    inputs = _inputs(MLP["main"], seed=1)
    _, grads, _ = _split_grads(mod, inputs)
    adj = compiled(relaxgrad.Gradient("main")(MLP))["main_adjoint"]
    _, ref = adj(*[tensor(a) for a in inputs])
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-12)


def test_residuals_follow_the_checkpoint_policy():
    saved_all = relaxgrad.split_info(relaxgrad.Gradient("main", split=True)(MLP), "main")
    names = [r.name for r in saved_all.residuals if not r.is_param]
    assert "h" in names and "e" in names
    sqrt = relaxgrad.split_info(relaxgrad.Gradient("main", split=True, checkpoint="sqrt")(MLP))
    assert sqrt.total_bytes < saved_all.total_bytes
    nothing = relaxgrad.split_info(  # save no name: recompute everything
        relaxgrad.Gradient("main", split=True, checkpoint=[])(MLP), "main"
    )
    assert [r.is_param for r in nothing.residuals] == [True] * len(nothing.residuals)
    assert nothing.total_bytes == 0
    assert saved_all.total_bytes == sum(r.nbytes for r in saved_all.residuals if not r.is_param)
    assert saved_all.total_bytes > 0
    h = next(r for r in saved_all.residuals if r.name == "h")
    assert (h.shape, h.dtype, h.nbytes) == ((4, 5), "float64", 4 * 5 * 8)
    assert "saved:" in str(saved_all)


def test_markers_save_only_checkpointed_values_and_recompute_the_rest():
    mod = relaxgrad.Gradient("main", split=True)(Marked)
    info = relaxgrad.split_info(mod, "main")
    saved = {r.name for r in info.residuals if not r.is_param}
    assert "b" not in saved  # between the markers: recomputed inside main_bwd
    assert "e" in saved  # reads only the end of the segment: kept
    bwd_names = {b.var.name for b in mod["main_bwd"].body.blocks[0].bindings}
    assert "b_cp" in bwd_names
    _check_split(mod, _inputs(Marked["main"], seed=2))


def test_seed_param_bwd_takes_the_output_gradient():
    mod = relaxgrad.Gradient("main", split=True, seed="param")(Vector)
    bwd = mod["main_bwd"]
    assert bwd.params[-1].name == "z_grad"
    inputs = _inputs(Vector["main"], seed=3)
    seed = np.random.default_rng(4).uniform(-1, 1, 3)
    out, vm = _check_split(mod, inputs, [seed], lambda out: float(np.dot(seed, out.numpy())))
    np.testing.assert_allclose(out.numpy(), vm["main"](*[tensor(a) for a in inputs]).numpy())


@I.ir_module
class Targets:  # two targets of a tuple result, one output gradient each
    @R.function
    def main(x: R.Tensor((3,), "float64"), w: R.Tensor((3,), "float64")):
        with R.dataflow():
            a = R.tanh(R.multiply(x, w))
            b = R.exp(a)
            gv = (a, R.sum(b), b)
            R.output(gv)
        return gv


def test_seed_param_with_two_targets():
    mod = relaxgrad.Gradient(
        "main", target_index=[0, 2], seed="param", split=True, strict=False
    )(Targets)
    assert [p.name for p in mod["main_bwd"].params][-2:] == ["a_grad", "b_grad"]
    rng = np.random.default_rng(7)
    x, w, ga, gb = (rng.uniform(-1, 1, 3) for _ in range(4))

    def value(out):  # <(ga, gb), (a, b)>
        return float(np.dot(ga, out[0].numpy()) + np.dot(gb, out[2].numpy()))

    _check_split(mod, [x, w], [ga, gb], value)


@I.ir_module
class Symbolic:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor((4, 2), "float32")):
        with R.dataflow():
            h = R.tanh(R.matmul(x, w))
            loss = R.sum(R.multiply(h, h))
            R.output(loss)
        return loss


def test_split_info_with_a_symbolic_batch():
    info = relaxgrad.split_info(relaxgrad.Gradient("main", split=True)(Symbolic))
    h = next(r for r in info.residuals if r.name == "h")
    assert h.shape == ("n", 2) and h.nbytes is None
    assert info.total_bytes is None and info.param_bytes is None
    assert "h: (n, 2) float32, ?" in str(info)


def test_split_through_calls_of_functions():
    mod = relaxgrad.Gradient("main", split=True)(Calls)
    assert {"layer_vjp", "block_vjp"} <= {gv.name_hint for gv in mod.get_global_vars()}
    _check_split(mod, _inputs(Calls["main"], seed=5))


@I.ir_module
class Blocks:  # strict=False: several blocks, match_cast and If
    @R.function
    def main(
        x: R.Tensor((3, 4), "float64"), w: R.Tensor((4, 2), "float64"), c: R.Tensor((), "bool")
    ):
        with R.dataflow():
            a = R.tanh(R.matmul(x, w))
            R.output(a)
        b = R.multiply(a, a)
        m = R.match_cast(b, R.Tensor((3, 2), "float64"))
        if c:
            d = R.sin(m)
        else:
            d = R.exp(m)
        with R.dataflow():
            loss = R.sum(R.multiply(d, a))
            R.output(loss)
        return loss


@pytest.mark.parametrize("cond", [True, False])
def test_split_several_blocks_and_if(cond):
    mod = relaxgrad.Gradient("main", ["x", "w"], split=True, strict=False)(Blocks)
    relax.analysis.well_formed(mod)
    kinds = [type(b).__name__ for b in mod["main_fwd"].body.blocks]
    assert kinds[:2] == ["DataflowBlock", "BindingBlock"]
    rng = np.random.default_rng(6)
    x, w = rng.uniform(-1, 1, (3, 4)), rng.uniform(-1, 1, (4, 2))
    c = np.array(cond)
    vm = compiled(mod)
    out, residuals = vm["main_fwd"](tensor(x), tensor(w), tensor(c))
    gx, gw = (g.numpy() for g in vm["main_bwd"](*list(residuals)))

    def f(x, w):
        return float(vm["main"](tensor(x), tensor(w), tensor(c)).numpy())

    assert np.isclose(float(out.numpy()), f(x, w))
    np.testing.assert_allclose(gx, fd_gradient(f, [x, w], 0), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gw, fd_gradient(f, [x, w], 1), rtol=1e-6, atol=1e-8)


def test_split_must_be_a_bool():
    with pytest.raises(GradientError, match="split must be True or False"):
        relaxgrad.Gradient("main", split="yes")


def test_split_info_without_split_mode():
    with pytest.raises(GradientError, match="split=True"):
        relaxgrad.split_info(MLP, "main")


def test_cli_split_prints_residuals(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text(
        "from tvm.script import ir as I\n"
        "from tvm.script import relax as R\n\n"
        "@I.ir_module\n"
        "class M:\n"
        "    @R.function\n"
        "    def main(x: R.Tensor((3,), 'float32')):\n"
        "        with R.dataflow():\n"
        "            y = R.tanh(x)\n"
        "            loss = R.sum(R.multiply(y, y))\n"
        "            R.output(loss)\n"
        "        return loss\n"
    )
    assert cli_main(["grad", str(path), "--split"]) == 0
    out = capsys.readouterr().out
    assert "main_fwd" in out and "main_bwd" in out
    assert "y: (3,) float32, 12 bytes" in out


def _model_module(fn, shapes, dtype):
    types = [relax.TensorType(s, dtype) for s in shapes]
    return relaxgrad.testing.loss_module(fn, types)


@functools.cache
def _model_and_gradients(model: str):
    """A test model as a loss module, its inputs, and its gradients by the compiled adjoint
    without checkpointing (the reference of every split)."""
    from tests.ops import test_models as models

    fn, shapes, dtype = {
        "cnn": (models.cnn, models.CNN_SHAPES, "float64"),
        "transformer_block": (models.transformer_block, models.BLOCK_SHAPES, "float32"),
    }[model]
    mod = _model_module(fn, shapes, dtype)
    inputs = relaxgrad.testing.random_inputs(mod["main"], seed=2)
    adj = compiled(relaxgrad.Gradient("main", checkpoint="none")(mod))["main_adjoint"]
    _, ref = adj(*[tensor(a) for a in inputs])
    assert len(ref) == len(shapes)
    return mod, inputs, [r.numpy() for r in ref]


@pytest.mark.parametrize("checkpoint", ["markers", "none", "sqrt"])
@pytest.mark.parametrize("model", ["cnn", "transformer_block"])
def test_split_equals_the_adjoint_on_models(model, checkpoint):
    mod, inputs, ref = _model_and_gradients(model)
    _, grads, _ = _split_grads(relaxgrad.Gradient("main", split=True, checkpoint=checkpoint)(mod),
                               inputs)
    assert len(grads) == len(ref)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
