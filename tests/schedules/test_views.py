"""ReshapeOutputs (relaxgrad/schedules/views.py): a function result that is a reshape of a
kernel's output becomes a view of it; the values stay, including after later kernels reuse
the planned storage, and reshapes of parameters or of tensors written in place stay copies."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.ir.instrument import pass_instrument
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relaxgrad
from relaxgrad.schedules.views import ReshapeOutputs


@I.ir_module
class Kernels:
    @T.prim_func(private=True, s_tir=True)
    def add_one(a: T.Buffer((4, 6), "float32"), b: T.Buffer((4, 6), "float32")):
        for i, j in T.grid(4, 6):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def double(a: T.Buffer((4, 6), "float32")):
        for i, j in T.grid(4, 6):
            with T.sblock("a"):
                vi, vj = T.axis.remap("SS", [i, j])
                a[vi, vj] = a[vi, vj] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def flat(a: T.Buffer((4, 6), "float32"), b: T.Buffer((24,), "float32")):
        for i in range(24):
            with T.sblock("b"):
                vi = T.axis.spatial(24, i)
                b[vi] = a[vi // 6, vi % 6]

    @R.function
    def main(a: R.Tensor((4, 6), "float32")):
        cls = Kernels
        with R.dataflow():
            x = R.call_tir(cls.add_one, (a,), out_ty=R.Tensor((4, 6), "float32"))
            t = R.call_tir(cls.add_one, (x,), out_ty=R.Tensor((4, 6), "float32"))
            t2 = R.call_tir(cls.add_one, (t,), out_ty=R.Tensor((4, 6), "float32"))
            y = R.call_tir(cls.flat, (x,), out_ty=R.Tensor((24,), "float32"))
            p = R.call_tir(cls.flat, (a,), out_ty=R.Tensor((24,), "float32"))
            w = R.call_tir(cls.add_one, (t2,), out_ty=R.Tensor((4, 6), "float32"))
            v = R.call_tir(cls.flat, (w,), out_ty=R.Tensor((24,), "float32"))
            w2 = R.call_tir_inplace(cls.double, (w,), inplace_indices=[0],
                                    out_ty=R.Tensor((4, 6), "float32"))
            z = R.call_tir(cls.add_one, (t,), out_ty=R.Tensor((4, 6), "float32"))
            R.output(y, p, v, w2, z)
        return (y, p, v, w2, z)


def _values(bindings) -> dict:
    return {b.var.name: b.value for block in bindings for b in block.bindings}


def test_only_a_fresh_kernel_output_becomes_a_view():
    values = _values(ReshapeOutputs()(Kernels)["main"].body.blocks)
    reshape = tvm.ir.Op.get("relax.reshape")
    assert values["y"].op.same_as(reshape)  # a kernel's output, read by no in-place call
    assert values["p"].op.name == "relax.call_tir"  # a parameter: a copy, not its alias
    assert values["v"].op.name == "relax.call_tir"  # the in-place call writes its source
    assert not values["z"].op.same_as(reshape)


def test_views_keep_their_values_when_the_storage_is_reused():
    a = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    vm = relax.VirtualMachine(relaxgrad.compile(Kernels, "llvm"), tvm.cpu())
    y, p, v, w2, z = (r.numpy() for r in vm["main"](tvm.runtime.tensor(a)))
    one = np.float32(1)
    x = a + one
    t = x + one
    w = t + one + one
    np.testing.assert_array_equal(y, x.reshape(-1))
    np.testing.assert_array_equal(p, a.reshape(-1))
    np.testing.assert_array_equal(v, w.reshape(-1))  # read before the in-place doubling
    np.testing.assert_array_equal(w2, w * 2)
    np.testing.assert_array_equal(z, t + one)


def _conv_gradient() -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((2, 8, 10, 10), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(loss)
    return relaxgrad.Gradient("main", require_grads=[w])(bb.get())


def test_a_convolution_weight_gradient_is_the_gemm_output_itself():
    """The weight's gradient, a matmul's ``(16, 72)`` reshaped to ``(16, 8, 3, 3)``, is a view
    in the compiled adjoint, and equals PyTorch's."""
    mod, seen = _conv_gradient(), {}

    @pass_instrument
    class Grab:
        def run_after_pass(self, module, info):
            if info.name == "ReshapeOutputs":
                seen["mod"] = module

    with tvm.transform.PassContext(instruments=[Grab()]):
        executable = relaxgrad.compile(mod, "llvm")
    result = seen["mod"]["main_adjoint"].body.blocks[-1].bindings
    grad = next(b for b in result if b.var.name == "w_adjoint_out")
    assert grad.value.op.same_as(tvm.ir.Op.get("relax.reshape"))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 10, 10)).astype("float32")
    w = rng.standard_normal((16, 8, 3, 3)).astype("float32")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    _, (dw,) = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), wt, padding=1)
    (y * y).sum().backward()
    np.testing.assert_allclose(dw.numpy(), wt.grad.numpy(), rtol=1e-4, atol=1e-3)


def test_a_leading_slice_stays_a_copy():
    """TVM's reshape pattern also holds for a kernel that copies the leading rows of its input
    (the first part of a split, a slice from row 0; BERT's q, k and v weight gradients from
    their concatenation's): not a reshape, its result stays a copy."""
    x = relax.Var("x", relax.TensorType((96, 512), "float32"))
    w = relax.Var("w", relax.TensorType((512, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))  # an OpenBLAS call: fuses with nothing
            parts = bb.emit(relax.op.split(y, 3, axis=0))
            first = bb.emit_output(relax.TupleGetItem(parts, 0))
            head = bb.emit_output(relax.op.strided_slice(y, axes=[0], begin=[0], end=[8]))
        bb.emit_func_output(relax.Tuple([first, head]))
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype("float32") for s in ((96, 512), (512, 32)))
    vm = relax.VirtualMachine(relaxgrad.compile(bb.get(), "llvm"), tvm.cpu())
    first, head = (r.numpy() for r in vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)))
    np.testing.assert_allclose(first, (a @ b)[:32], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(head, (a @ b)[:8], rtol=1e-4, atol=1e-4)
