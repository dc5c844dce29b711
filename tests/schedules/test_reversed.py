"""KeepReversedReadsApart (relaxgrad/schedules/reversed.py): a flip stays a kernel of its own,
since TVM 0.27 builds a fused flip's divided index one element off; other kernels fuse as
before."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import KeepReversedReadsApart
from relaxgrad.testing import tvm_compile_quietly

W = np.array([0.7, -1.3, 2.1, 0.4])


def _flipped_outer() -> tvm.IRModule:
    """The program of ``bench/fuzz.py --compiled`` seed 177 that found it, cut down: an outer
    product flattened, its sigmoid plus 0.5 flipped, and read by other terms (its mean, its
    sigmoid, an rsqrt: the chain is duplicated into the flip's kernel), float64."""
    x = relax.Var("x", relax.TensorType((2,), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            flat = bb.emit(op.reshape(op.outer(x, x), (4,)))
            sig = bb.emit(op.sigmoid(flat))
            shifted = bb.emit(op.add(sig, relax.const(0.5, "float64")))
            root = bb.emit(op.rsqrt(shifted))
            flipped = bb.emit(op.flip(shifted, axis=0))
            mean = bb.emit(op.mean(flat, axis=[0], keepdims=True))
            terms = [op.sum(op.multiply(t, relax.const(w, "float64")))
                     for t, w in ((mean, W[:1]), (sig, W), (root, W[::-1]), (flipped, W))]
            loss = bb.emit_output(op.add(op.add(terms[0], terms[1]), op.add(terms[2], terms[3])))
        bb.emit_func_output(loss)
    return bb.get()


def _numpy(x: np.ndarray) -> float:
    flat = np.outer(x, x).reshape(-1)
    sig = 1 / (1 + np.exp(-flat))
    shifted = sig + 0.5
    return float(flat.mean() * W[0] + (sig * W).sum() + (W[::-1] / np.sqrt(shifted)).sum()
                 + (shifted[::-1] * W).sum())


def test_a_flip_fused_with_a_reshape_gives_its_values():
    """The loss and its gradient, from ``relaxgrad.compile`` and ``tvm.compile``: the loss
    against NumPy's, the gradients against each other."""
    mod = relaxgrad.Gradient("main")(_flipped_outer())
    x = np.array([0.11700143, -0.97632703])
    results = []
    for executable in (relaxgrad.compile(mod, "llvm"), tvm_compile_quietly(mod, "llvm")):
        loss, (grad,) = relax.VirtualMachine(executable, tvm.cpu())["main_adjoint"](
            tvm.runtime.tensor(x))
        np.testing.assert_allclose(float(loss.numpy()), _numpy(x), rtol=1e-12)
        results.append(grad.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-10)


def test_the_fuzzed_program_that_found_it():
    """``bench/fuzz.py --compiled`` seed 177, as generated: its loss was 1.3% off (9.9027
    against 10.0283) where the chain ``outer``, ``flatten``, ``sigmoid``, ``add``, duplicated
    into the flip's kernel, read the flipped index through a ``floordiv``."""
    from ..transforms import fuzz_programs as fp

    prog = fp.program_from_seed(177, 10, fp.KNOWN_BUGS | fp.FOUND_BUGS, None)
    outcome = fp.check_compiled(prog, 1)
    assert outcome.status == "ok", (outcome.kind, outcome.detail[-500:])


def test_only_kernels_reading_a_decreasing_index_are_marked():
    """The flip's kernel (and the flip in its gradient) are marked opaque; the outer product,
    the reshape, sigmoid and the sums are not."""
    mod = relaxgrad.Gradient("main")(_flipped_outer())
    with tvm.target.Target("llvm"):
        legal = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
    step = KeepReversedReadsApart()
    marked = step(legal)
    names = {g.name_hint for g, f in marked.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
             and f.attrs.get("op_pattern", None) is not None
             and int(f.attrs["op_pattern"]) != int(legal[g].attrs["op_pattern"])}
    assert names and all(name.startswith("flip") for name in names), names
    assert step.marked == len(names)
