"""LowerCallTIRWithGrad: ``call_tir_with_grad`` becomes a plain ``call_tir``, as Before/Expected
pairs (the TE gradient name only matters to the Gradient pass, so none is registered here)."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxgrad.transforms import LowerCallTIRWithGrad
from relaxgrad.transforms.lower import lower_call_tir_with_grad


@I.ir_module
class Before:
    @T.prim_func(private=True)
    def square(a: T.Buffer((3,), "float32"), out: T.Buffer((3,), "float32")):
        for i in range(3):
            out[i] = a[i] * a[i]

    @R.function
    def main(x: R.Tensor((3,), "float32")):
        cls = Before
        with R.dataflow():
            lv = R.call_tir_with_grad(
                cls.square,
                (x,),
                out_ty=R.Tensor((3,), "float32"),
                te_grad_name="square_grad",
                te_grad_kwargs={"k": 2.0},
            )
            gv = R.sum(lv)
            R.output(gv)
        return gv

    @R.function
    def other(x: R.Tensor((3,), "float32")):
        cls = Before
        lv = R.call_tir(cls.square, (x,), out_ty=R.Tensor((3,), "float32"))
        return lv

    @R.function
    def branchy(x: R.Tensor((3,), "float32"), cond: R.Tensor((), "bool")):
        cls = Before
        if cond:
            r = R.call_tir_with_grad(
                cls.square, (x,), out_ty=R.Tensor((3,), "float32"), te_grad_name="g"
            )
        else:
            r = R.exp(x)
        with R.dataflow():
            s = R.call_tir_with_grad(
                cls.square, (r,), out_ty=R.Tensor((3,), "float32"), te_grad_name="g"
            )
            R.output(s)
        return s


@I.ir_module
class Expected:
    @T.prim_func(private=True)
    def square(a: T.Buffer((3,), "float32"), out: T.Buffer((3,), "float32")):
        for i in range(3):
            out[i] = a[i] * a[i]

    @R.function
    def main(x: R.Tensor((3,), "float32")):
        cls = Expected
        with R.dataflow():
            lv = R.call_tir(cls.square, (x,), out_ty=R.Tensor((3,), "float32"))
            gv = R.sum(lv)
            R.output(gv)
        return gv

    @R.function
    def other(x: R.Tensor((3,), "float32")):
        cls = Expected
        lv = R.call_tir(cls.square, (x,), out_ty=R.Tensor((3,), "float32"))
        return lv

    @R.function
    def branchy(x: R.Tensor((3,), "float32"), cond: R.Tensor((), "bool")):
        cls = Expected
        if cond:
            r = R.call_tir(cls.square, (x,), out_ty=R.Tensor((3,), "float32"))
        else:
            r = R.exp(x)
        with R.dataflow():
            s = R.call_tir(cls.square, (r,), out_ty=R.Tensor((3,), "float32"))
            R.output(s)
        return s


def test_module_pass():
    after = LowerCallTIRWithGrad()(Before)
    tvm.ir.assert_structural_equal(after, Expected)


def test_module_pass_keeps_functions_without_it():
    after = LowerCallTIRWithGrad()(Before)
    assert after["other"].same_as(Before["other"])
    assert after["square"].same_as(Before["square"])


def test_module_without_it_is_returned_as_is():
    assert LowerCallTIRWithGrad()(Expected).same_as(Expected)


def test_function_with_blocks_and_branches():
    lowered = lower_call_tir_with_grad(Before["branchy"])
    tvm.ir.assert_structural_equal(lowered, Expected["branchy"], map_free_vars=True)
