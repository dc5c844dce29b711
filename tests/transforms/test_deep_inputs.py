"""Inputs as long or as deep as real models make them never kill the process: the pass and
relaxgrad.compile run on a thread with a deep stack (relaxgrad._stack). Each case runs in a
child process at Python's default stack and recursion limit, so a segfault fails the test
instead of ending the suite."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELUDE = """
import numpy as np
import tvm
from tvm import relax
import relaxgrad
from relaxgrad.analysis import count_bindings
"""


def _run(body: str, timeout: int = 300) -> str:
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # the repository root: tests.chains
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


def test_ten_thousand_bindings():
    """A chain of 10,000 bindings (``v * c`` and ``v + x`` in turn): the gradient is built at
    the default stack with a bounded size, and compiles with relaxgrad.compile to the closed
    form ``d/dx sum(v_n)`` (float64)."""
    out = _run("""
        from tests.chains import chain, closed_form
        mod = relaxgrad.Gradient("main")(chain(10_000, 1.0001))
        ratio = count_bindings(mod["main_adjoint"]) / count_bindings(mod["main"])
        assert ratio <= 3, ratio
        ex = relaxgrad.compile(mod, "llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(np.ones(4)))
        expected = np.full(4, closed_form(10_000, 1.0001))
        np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-9)
        print("ok")
    """, timeout=600)
    assert "ok" in out


def test_tuples_nested_500_deep():
    """``t_{i+1} = (t_i, t_i[1] * c)``, 500 levels: the walk over the nested tuple types and
    TVM's visitors over them stay within the stack, and the gradient is ``c^500``."""
    out = _run("""
        n, c = 500, 1.001
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((4,), "float64"))
        with bb.function("main", [x]):
            with bb.dataflow():
                t = bb.emit(relax.Tuple([x, x]))
                for _ in range(n):
                    item = bb.emit(relax.TupleGetItem(t, 1))
                    scaled = relax.op.multiply(item, relax.const(c, "float64"))
                    t = bb.emit(relax.Tuple([t, scaled]))
                out = bb.emit_output(relax.op.sum(bb.emit(relax.TupleGetItem(t, 1))))
            bb.emit_func_output(out)
        mod = relaxgrad.Gradient("main")(bb.get())
        ratio = count_bindings(mod["main_adjoint"]) / count_bindings(mod["main"])
        assert ratio <= 6, ratio
        ex = relaxgrad.compile(mod, {"kind": "llvm", "opt-level": 0})
        vm = relax.VirtualMachine(ex, tvm.cpu())
        _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(np.ones(4)))
        np.testing.assert_allclose(grad.numpy(), np.full(4, c ** n), rtol=1e-9)
        print("ok")
    """, timeout=600)
    assert "ok" in out


@pytest.mark.parametrize("depth", [3000])
def test_deep_python_recursion_is_no_recursion_error(depth):
    """A RecursionError raised by our own walkers on the caller's thread would be a crash: the
    limit is raised on the worker, and restored after."""
    out = _run(f"""
        import sys
        from relaxgrad._stack import with_deep_stack
        def down(k):
            return 0 if k == 0 else 1 + down(k - 1)
        limit = sys.getrecursionlimit()
        assert with_deep_stack(down, {depth}) == {depth}
        assert sys.getrecursionlimit() == limit
        try:
            with_deep_stack(lambda: 1 / 0)
        except ZeroDivisionError:
            print("ok")
    """)
    assert "ok" in out
