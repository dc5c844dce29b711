"""relaxgrad.compile prints no code-generation warnings: TIR builders' ``pragma_scope`` markers
(an embedding gradient's kernel has one) are dropped before LLVM sees them."""

import numpy as np
import tvm
from tvm import relax

import relaxgrad
from relaxgrad.schedules.scopes import SEQ_SCOPE


def _embedding_loss():
    bb = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType((10, 4), "float32"))
    ids = relax.Var("ids", relax.TensorType((6,), "int64"))
    with bb.function("main", [table, ids]):
        with bb.dataflow():
            rows = bb.emit(relax.op.take(table, ids, axis=0, mode="wrap"))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(rows, rows)))
        bb.emit_func_output(out)
    return relaxgrad.Gradient("main", require_grads=[table])(bb.get())


def test_embedding_gradient_compiles_quietly_and_right(capfd):
    mod = _embedding_loss()
    legalized = relax.transform.LegalizeOps()(mod)
    assert any(SEQ_SCOPE in f.script() for f in legalized.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc)), "the marker this test is about is gone"
    capfd.readouterr()
    ex = relaxgrad.compile(mod, "llvm")
    captured = capfd.readouterr()
    assert "Warning" not in captured.err + captured.out, captured.err
    vm = relax.VirtualMachine(ex, tvm.cpu())
    table = np.arange(40, dtype="float32").reshape(10, 4) / 10
    ids = np.array([1, 3, 3, 0, 9, 1])
    _, (grad,) = vm["main_adjoint"](tvm.runtime.tensor(table), tvm.runtime.tensor(ids))
    expected = np.zeros_like(table)
    np.add.at(expected, ids, 2 * table[ids])  # d/dtable sum(table[ids]^2)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6)
