"""``concat`` legalized as one copy block per part (relaxgrad.schedules.concat), compiled:
values against numpy and ``tvm.compile``, alone, fused with its producers and consumers, and
with empty parts."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.schedules import _common, concat


def _module(shapes, axis: int, transposed: bool = False, summed: bool = False) -> tvm.IRModule:
    """``concat(parts, axis)`` of params of ``shapes`` (each transposed first where
    ``transposed``; summed over its first axis after where ``summed``)."""
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            parts = [bb.emit(op.permute_dims(p)) if transposed else p for p in params]
            out = bb.emit(op.concat(parts, axis=axis))
            if summed:
                out = bb.emit(op.sum(out, axis=0))
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


def _check(mod, shapes, axis, transposed=False, summed=False) -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(s).astype("float32") for s in shapes]
    args = [tvm.runtime.tensor(v) for v in inputs]
    got = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main"](*args).numpy()
    parts = [v.T if transposed else v for v in inputs]
    want = np.concatenate(parts, axis)
    want = want.sum(0) if summed else want
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    theirs = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](*args).numpy()
    np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shapes", "axis"),
    [
        ([(768, 768)] * 3, 0),  # an attention's q, k and v weights
        ([(1024, 148), (1024, 100), (1024, 8)], 1),
        ([(3, 5, 7), (3, 2, 7)], -2),  # small: TVM's legalization
        ([(4, 3), (0, 3), (2, 3)], 0),  # an empty part
        ([(1 << 18,), (17,)], 0),
    ],
)
def test_concat_copies_each_part_into_its_slice(shapes, axis):
    _check(_module(shapes, axis), shapes, axis)


@pytest.mark.parametrize("axis", [0, 1])
def test_concat_fuses_its_producers_and_consumers(axis):
    """Transposes fused into the copies, and a sum over the result after them, in one kernel
    or not: the values are the same."""
    shapes = [(40, 4096), (24, 4096), (8, 4096)]  # 72 x 4096: copies from 2 ** 18 elements
    shapes = shapes if axis == 1 else [s[::-1] for s in shapes]
    _check(_module(shapes, axis, transposed=True, summed=True), shapes, axis, True, True)
    _check(_module(shapes, axis, transposed=True), shapes, axis, True)


def test_concat_func_has_a_block_per_non_empty_part():
    func = concat.concat_func([[4, 3], [0, 3], [2, 3]], 0, "float32")
    script = func.script()
    assert "part0" in script and "part2" in script and "part1" not in script
    assert "if_then_else" not in script


def test_concatenations_of_one_kind_share_one_parse_and_one_kernel(monkeypatch):
    # as a rotary embedding's halves in every layer: parsed once, one PrimFunc, each call
    # concatenating its own parts
    shapes = [(512, 384), (512, 384)]
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            first = bb.emit(op.concat(params, axis=1))
            second = bb.emit(op.concat([op.negative(params[1]), params[0]], axis=1))
            result = bb.emit_output(op.add(first, second))
        bb.emit_func_output(result)
    mod = bb.get()
    parses = []
    real = _common.parse
    monkeypatch.setattr(_common, "parse", lambda *a, **k: parses.append(1) or real(*a, **k))
    monkeypatch.setattr(_common, "_PARSED", type(_common._PARSED)())
    legalized = relaxgrad.pipeline.LegalizeOpsOnce(
        {"relax.concat": concat.legalize_concat})(mod)
    assert len(parses) == 1
    kernels = [gv.name_hint for gv, f in legalized.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith("concatenate")]
    assert kernels == ["concatenate"]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype("float32") for s in shapes)
    got = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())["main"](
        tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_allclose(got, np.concatenate([a, b], 1) + np.concatenate([-b, a], 1),
                               rtol=1e-6)
