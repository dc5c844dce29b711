"""The Gradient pass as a user sees it: API, module handling, tuples, targets, require_grads.

Every behaviour is checked numerically on compiled code (``check_gradients``) where a gradient
is produced.
"""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad.testing import FAST_LLVM, check_gradients


@I.ir_module
class MLP:
    @R.function
    def main(
        x: R.Tensor((4, 6), "float32"),
        w0: R.Tensor((6, 5), "float32"),
        b0: R.Tensor((5,), "float32"),
        w1: R.Tensor((5, 3), "float32"),
        label: R.Tensor((4, 3), "float32"),
    ):
        with R.dataflow():
            lv0 = R.matmul(x, w0)
            lv1 = R.add(lv0, b0)
            lv2 = R.nn.relu(lv1)
            lv3 = R.matmul(lv2, w1)
            logits = R.nn.log_softmax(lv3)
            loss = R.nn.cross_entropy_with_logits(logits, label)
            R.output(loss)
        return loss


def test_returns_named_module_pass():
    pass_ = relaxgrad.Gradient("main")
    assert isinstance(pass_, tvm.ir.transform.Pass)
    assert pass_.info.name == "Gradient"
    assert relaxgrad.transforms.Gradient is relaxgrad.Gradient


def test_adds_adjoint_and_keeps_module():
    before_script = MLP.script()
    after = relaxgrad.Gradient("main")(MLP)
    assert MLP.script() == before_script, "the input module was mutated"
    assert len(MLP.get_global_vars()) == 1
    tvm.ir.assert_structural_equal(after["main"], MLP["main"])
    adjoint = after["main_adjoint"]
    assert adjoint.attrs["global_symbol"] == "main_adjoint"
    assert [p.name for p in adjoint.params] == [p.name for p in MLP["main"].params]
    assert not any(p.same_as(q) for p, q in zip(adjoint.params, MLP["main"].params))
    assert relax.analysis.check_well_formed(after)


def test_composes_in_sequential():
    seq = tvm.ir.transform.Sequential(
        [relaxgrad.Gradient("main", MLP["main"].params[1:4]), relax.transform.LegalizeOps()]
    )
    after = seq(MLP)
    assert "main_adjoint" in [gv.name_hint for gv in after.get_global_vars()]
    ex = tvm.compile(after, FAST_LLVM)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    args = [rng.uniform(-1, 1, [int(d) for d in p.ty.shape]).astype("float32")
            for p in MLP["main"].params]
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
    assert len(grads) == 3 and np.isfinite(loss.numpy())


def test_mlp_numeric():
    result = check_gradients(MLP, wrt=[0, 1, 2, 3])
    assert result.ok, str(result)


def test_reapplying_replaces_adjoint():
    once = relaxgrad.Gradient("main")(MLP)
    twice = relaxgrad.Gradient("main")(once)
    names = sorted(gv.name_hint for gv in twice.get_global_vars())
    assert names == ["main", "main_adjoint"]


@I.ir_module
class TupleModel:
    @R.function
    def main(
        x: R.Tensor((3,), "float32"),
        t: R.Tuple(R.Tensor((3,), "float32"), R.Tuple(R.Tensor((3,), "float32"),
                                                      R.Tensor((3,), "float32"))),
    ):
        with R.dataflow():
            a = t[0]
            inner = t[1]
            b = inner[1]
            pair = (x, (a, b))
            p1 = pair[1]
            c = p1[0]
            d = R.multiply(c, x)
            e = R.multiply(d, b)
            parts = R.split(e, 3)
            f = R.concat(parts)
            g = R.add(f, R.const(np.ones(3, "float32")))
            gv = R.sum(R.multiply(g, g))
            other = R.sum(x)
            R.output(gv, other)
        return (other, gv)


def test_tuples_numeric():
    """Nested tuple params, tuple literals, getitems and split/concat; target_index picks gv."""
    result = check_gradients(TupleModel, target_index=1)
    assert result.ok, str(result)


def test_zero_adjoint_for_unused_inputs():
    mod = relaxgrad.Gradient("main", target_index=0)(TupleModel)
    vm = relax.VirtualMachine(tvm.compile(mod, FAST_LLVM), tvm.cpu())
    x = tvm.runtime.tensor(np.ones(3, "float32"))
    t = (x, (x, x))
    _, (gx, gt) = vm["main_adjoint"](x, t)
    np.testing.assert_allclose(gx.numpy(), np.ones(3))
    for leaf in (gt[0], gt[1][0], gt[1][1]):
        np.testing.assert_allclose(leaf.numpy(), np.zeros(3))


def test_intermediate_require_grads_numeric():
    """d loss / d lv for an intermediate lv equals what finite differences give when lv is fed
    in directly as a parameter."""
    x = relax.Var("x", relax.TensorType((3, 3), "float32"))
    y = relax.Var("y", relax.TensorType((3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            lv0 = bb.emit(relax.op.tanh(x))
            lv1 = bb.emit(relax.op.multiply(lv0, y))
            gv = bb.emit_output(relax.op.sum(relax.op.multiply(lv1, lv1)))
        bb.emit_func_output(gv)
    mod = relaxgrad.Gradient("main", [lv1, x])(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, FAST_LLVM), tvm.cpu())
    rng = np.random.default_rng(0)
    xv, yv = (rng.uniform(-1, 1, (3, 3)).astype("float32") for _ in range(2))
    _, (g_lv1, g_x) = vm["main_adjoint"](tvm.runtime.tensor(xv), tvm.runtime.tensor(yv))
    lv1v = np.tanh(xv) * yv
    np.testing.assert_allclose(g_lv1.numpy(), 2 * lv1v, rtol=1e-5)
    np.testing.assert_allclose(g_x.numpy(), 2 * lv1v * yv * (1 - np.tanh(xv) ** 2), rtol=1e-4)


def test_float16_numeric():
    @I.ir_module
    class Half:
        @R.function
        def main(x: R.Tensor((4,), "float16"), w: R.Tensor((4,), "float16")):
            with R.dataflow():
                gv = R.sum(R.multiply(R.tanh(x), w))
                R.output(gv)
            return gv

    result = check_gradients(Half)
    assert result.ok, str(result)
