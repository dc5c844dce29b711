"""relaxgrad.compile on functions with ``If``: TVM 0.27's StaticPlanBlockMemory hands a storage
bound inside a branch to tensors outside it, and the VM segfaults (relaxgrad/transforms/
plan_memory.py); relaxgrad's pipeline plans with PlanBlockMemory instead."""

import functools

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relaxgrad
from relaxgrad.testing import check_gradients
from relaxgrad.transforms.plan_memory import PlanBlockMemory, escaping_storages


@I.ir_module
class Branches:
    @R.function
    def main(x: R.Tensor((3,), "float64"), w: R.Tensor((3,), "float64"), c: R.Tensor((), "bool")):
        y = R.multiply(x, w)
        if c:
            z = R.multiply(y, y)
            t = R.add(z, w)
        else:
            t = R.sin(x)
        loss = R.sum(R.multiply(t, y))
        return loss


@I.ir_module
class Nested:
    @R.function
    def main(
        x: R.Tensor((4,), "float64"),
        w: R.Tensor((4,), "float64"),
        c: R.Tensor((), "bool"),
        d: R.Tensor((), "bool"),
    ):
        y = R.multiply(x, w)
        if c:
            z = R.multiply(y, y)
            if d:
                u = R.exp(z)
                t = R.add(u, w)
            else:
                u = R.cos(z)
                t = R.multiply(u, x)
        else:
            z = R.sin(x)
            t = R.add(z, y)
        loss = R.sum(R.multiply(t, y))
        return loss


X = np.array([0.3, -1.2, 2.0])
W = np.array([1.5, 0.7, -0.4])


def branches_ref(x, w, c):
    y = x * w
    t = y * y + w if c else np.sin(x)
    return float(np.sum(t * y))


def nested_ref(x, w, c, d):
    y = x * w
    if c:
        z = y * y
        t = np.exp(z) + w if d else np.cos(z) * x
    else:
        t = np.sin(x) + y
    return float(np.sum(t * y))


def _planned(mod, plan):
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
            plan,
        ]
    )
    return seq(mod)


@pytest.mark.parametrize("mod", [Branches, Nested], ids=["branches", "nested"])
def test_plan_block_memory_hoists_escaping_storage(mod):
    # The TVM bug itself: a storage bound in a branch, used after the If.
    stock = _planned(mod, relax.transform.StaticPlanBlockMemory())["main"]
    assert escaping_storages(stock)
    fixed = _planned(mod, PlanBlockMemory())["main"]
    assert not escaping_storages(fixed)
    # still planned: the same storages (tokens), the escaping one moved to the top
    first = fixed.body.blocks[0].bindings[0]
    assert first.value.op.name == "relax.memory.alloc_storage"
    count = lambda f: f.script().count("R.memory.alloc_storage(")  # noqa: E731
    assert count(fixed) == count(stock) >= 1


@pytest.fixture(scope="module")
def branches_vm():
    return relax.VirtualMachine(relaxgrad.compile(Branches, "llvm"), tvm.cpu())


@pytest.mark.parametrize("c", [True, False])
def test_branches_forward(branches_vm, c):
    args = [tvm.runtime.tensor(a) for a in (X, W, np.array(c))]
    out = branches_vm["main"](*args).numpy()
    np.testing.assert_allclose(out, branches_ref(X, W, c), rtol=1e-12)


def test_nested_forward():
    vm = relax.VirtualMachine(relaxgrad.compile(Nested, "llvm"), tvm.cpu())
    x, w = np.linspace(-1.0, 1.2, 4), np.array([0.5, -0.3, 1.1, 0.8])
    for c in (True, False):
        for d in (True, False):
            args = [tvm.runtime.tensor(a) for a in (x, w, np.array(c), np.array(d))]
            out = vm["main"](*args).numpy()
            np.testing.assert_allclose(out, nested_ref(x, w, c, d), rtol=1e-12)


@pytest.mark.parametrize("c", [True, False])
def test_branches_gradients(c):
    result = check_gradients(
        Branches,
        inputs=[X, W, np.array(c)],
        wrt=[0, 1],
        grad_pass=functools.partial(relaxgrad.Gradient, strict=False),
        target="llvm",
        compile=relaxgrad.compile,
    )
    assert result.ok, str(result)
