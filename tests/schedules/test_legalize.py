"""LegalizeOpsOnce (relaxgrad/schedules/legalize.py): TVM's LegalizeOps with each legalization
reused for the later calls of the same kind; the module it writes is LegalizeOps' own."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import relax as R

from relaxgrad.schedules import LegalizeOpsOnce


def _both(mod: tvm.IRModule) -> tuple[tvm.IRModule, LegalizeOpsOnce]:
    """``mod`` legalized by LegalizeOpsOnce, checked equal to LegalizeOps' module."""
    once = LegalizeOpsOnce()
    with tvm.target.Target("llvm"):
        expected = relax.transform.LegalizeOps()(mod)
        got = once(mod)
    tvm.ir.assert_structural_equal(got, expected)
    return got, once


@tvm.script.ir_module
class Repeated:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32"),
             w: R.Tensor((8, 8), "float32")) -> R.Tensor((4, 8), "float32"):  # fmt: skip
        with R.dataflow():
            a = R.add(x, y)
            b = R.add(a, x)  # the kind of add(x, y): reused, on its own operands
            c = R.add(b, b)  # one var twice: a kind of its own
            d = R.add(c, c)  # ... reused as such
            e = R.matmul(d, w)
            f = R.matmul(e, w)
            g = R.reshape(f, R.shape([8, 4]))  # a shape operand: by value
            h = R.reshape(g, R.shape([4, 8]))
            i = R.reshape(e, R.shape([8, 4]))  # reused (g's kind)
            j = R.reshape(e, R.shape([2, 16]))  # another shape: another kind
            k = R.concat((h, a), axis=1)  # a tuple operand: legalized as LegalizeOps does
            out = R.sum(k, axis=[1], keepdims=True)
            result = R.multiply(out, x)  # broadcast: another kind than add's
            p = R.add(x, R.const(1.0, "float32"))  # a constant operand: by value
            q = R.add(y, R.const(1.0, "float32"))  # reused (p's kind)
            r = R.add(x, R.const(2.0, "float32"))  # another value: another kind
            R.output(result, i, j, p, q, r)
        return result


def test_same_module_as_legalize_ops_with_reuse():
    _, once = _both(Repeated)
    assert once.reused == 5  # b (as a), d (as c), f (as e), i (as g), q (as p)


@tvm.script.ir_module
class TwiceFirst:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            a = R.subtract(x, x)  # one var twice first, then two vars: two kinds
            b = R.subtract(a, y)
            R.output(b)
        return b


def test_one_var_twice_is_not_two_vars():
    _, once = _both(TwiceFirst)
    assert once.reused == 0


@tvm.script.ir_module
class Dynamic:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor(("n", 8), "float32")):
        with R.dataflow():
            a = R.add(x, y)
            b = R.add(a, y)  # symbolic shapes: legalized as LegalizeOps does
            R.output(b)
        return b


def test_symbolic_shapes_are_legalized_each():
    _, once = _both(Dynamic)
    assert once.reused == 0
