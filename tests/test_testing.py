"""relaxgrad.testing's peer compile: TVM's codegen noise dropped from stderr, the rest kept."""

import os

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

from relaxgrad import testing


def test_stderr_filter_drops_only_the_noise_lines(capfd):
    with testing._stderr_without(testing.TVM_CODEGEN_NOISE):
        os.write(2, b"[12:00:00] codegen_cpu.cc:1183: Warning: Unknown pragma pragma_scope\n")
        os.write(2, b"a warning a user must see\n")
    err = capfd.readouterr().err
    assert "pragma_scope" not in err and "a warning a user must see" in err


def test_tvm_compile_quietly_drops_tvms_pow_warning(capfd):
    """TVM's legalization of ``x ** 3`` warns (GPT-2's GELU); the peer compile drops that."""
    x = relax.Var("x", relax.TensorType((8,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(op.power(x, relax.const(3.0, "float32"))))
    mod = bb.get()
    capfd.readouterr()
    tvm.compile(mod, "llvm")
    assert "Detected pow" in capfd.readouterr().err  # what tvm.compile prints
    vm = relax.VirtualMachine(testing.tvm_compile_quietly(mod, "llvm"), tvm.cpu())
    assert "Detected pow" not in capfd.readouterr().err
    value = np.array([0.5, 1.0, -2.0, 3.0, 0.0, 1.5, -1.0, 2.0], "float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(value)).numpy(), value**3,
                               rtol=1e-6)


def test_tvm_compile_quietly_builds_what_tvm_compile_builds():
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(op.exp(x)))
    vm = relax.VirtualMachine(testing.tvm_compile_quietly(bb.get(), "llvm"), tvm.cpu())
    value = np.array([0.0, 1.0, -2.0], "float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(value)).numpy(), np.exp(value),
                               rtol=1e-6)
