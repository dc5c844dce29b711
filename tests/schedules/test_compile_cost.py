"""The work of the CPU schedule step grows linearly with the module: FuseRowGroups reads each
binding a bounded number of times however many groups it seeds, and a rule builds no schedule
for a function it cannot apply to; the gradients through them still match PyTorch (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.pipeline import cpu_pipeline, host_target
from relaxgrad.schedules import ScheduleCPU, cpu
from relaxgrad.schedules.groups import _Grouper

from .test_rows import _module, _normalized, _torch_grads

ROWS, WIDTH = 64, 8


def _stack(layers: int) -> tvm.IRModule:
    """``sum(norm(...norm(x)...) * w)``, ``layers`` written-out layer norms over the rows of
    ``x`` (float64), differentiated."""
    params = [("x", (ROWS, WIDTH), "float64"), ("gamma", (WIDTH,), "float64"),
              ("beta", (WIDTH,), "float64"), ("w", (ROWS, WIDTH), "float64")]  # fmt: skip

    def body(x, gamma, beta, w):
        for _ in range(layers):
            x = _normalized(x, gamma, beta, "float64")
        return op.sum(op.multiply(x, w))

    return relaxgrad.Gradient("main")(_module(params, body))


def _before_grouping(mod: tvm.IRModule) -> tvm.IRModule:
    passes = list(cpu_pipeline(host_target()).passes)
    names = [p.info.name for p in passes]
    with host_target():
        return tvm.transform.Sequential(passes[: names.index("FuseRowGroups")])(mod)


class _Counted(list):
    """A list of bindings that counts the items read (a slice: its length)."""

    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.reads += len(range(*index.indices(len(self))))
        else:
            self.reads += 1
        return super().__getitem__(index)

    def __iter__(self):
        self.reads += len(self)
        return super().__iter__()


def _reads_per_binding(layers: int) -> tuple[float, int]:
    """Items of the adjoint's bindings FuseRowGroups reads per binding, and how many groups it
    forms, on a stack of ``layers`` layer norms."""
    mod = _before_grouping(_stack(layers))
    func = mod["main_adjoint"]
    (block,) = [b for b in func.body.blocks if isinstance(b, relax.DataflowBlock)]
    bindings = _Counted(block.bindings)
    step = relaxgrad.schedules.FuseRowGroups()
    with host_target():
        grouper = _Grouper(mod, func, host_target(), step.rules, relax.BlockBuilder(mod),
                           step.min_rows, {})  # fmt: skip
        grouped = grouper._grouped(bindings)
    groups = 0 if grouped is None else sum("fused_rows" in str(b.value) for b in grouped)
    return bindings.reads / len(bindings), groups


def test_fuse_row_groups_reads_each_binding_a_bounded_number_of_times():
    """Each seed reads a window of the bindings after it, not all of them: the reads per
    binding stay flat from 3 to 12 layers (a scan of the later bindings per seed, as
    before, made them grow with the layers)."""
    small, small_groups = _reads_per_binding(3)
    large, large_groups = _reads_per_binding(12)
    assert small_groups >= 2 and large_groups >= 4 * small_groups - 3  # groups grow with it
    assert large <= 1.25 * small, (small, large)


def test_rules_build_no_schedule_for_functions_they_cannot_apply_to(monkeypatch):
    """An elementwise PrimFunc reaches ParallelLoops without RowLocal, ColumnLocal,
    RowColumnLocal or TiledMatmul building a schedule of it (each did, then found no
    reduction); a function with a reduction is still tried by each."""
    built = []
    normalize = cpu.normalize_prim_func
    monkeypatch.setattr(cpu, "normalize_prim_func", lambda sch: built.append(1) or normalize(sch))
    x = relax.Var("x", relax.TensorType((ROWS, WIDTH), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.exp(x))
            z = bb.emit(op.multiply(y, x))
            out = bb.emit_output(op.sum(z, axis=[1]))
        bb.emit_func_output(out)
    with host_target():
        legal = relax.transform.LegalizeOps()(bb.get())
        step = ScheduleCPU()
        step(legal)
    assert list(step.choices.values()) == ["ParallelLoops"] * 3
    # exp and multiply: ParallelLoops only; sum: RowLocal, ColumnLocal and RowColumnLocal
    # find one block, ParallelLoops schedules it
    assert len(built) == 3


@pytest.fixture(scope="module")
def stack_of_four():
    return _stack(4)


def test_stacked_layer_norm_gradients_match_pytorch(stack_of_four):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in [(ROWS, WIDTH), (WIDTH,), (WIDTH,), (ROWS, WIDTH)]]
    vm = relax.VirtualMachine(relaxgrad.compile(stack_of_four), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])

    def reference(x, gamma, beta, w):
        for _ in range(4):
            x = torch.nn.functional.layer_norm(x, (WIDTH,), gamma, beta, 1e-5)
        return (x * w).sum()

    for got, want in zip(grads, _torch_grads(reference, arrays)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-8, atol=1e-10)


def test_each_function_is_normalized_once_for_all_rules(monkeypatch):
    """The rules that try one function (``FuseRowGroups``' trials, then the schedule step's
    rules in turn) start from copies of one normalization of it: as many normalizations as
    distinct functions (each rule normalized it again before)."""
    built = []
    normalize = cpu.normalize_prim_func
    monkeypatch.setattr(cpu, "normalize_prim_func", lambda sch: built.append(1) or normalize(sch))
    mod = _before_grouping(_stack(2))
    passes = list(cpu_pipeline(host_target()).passes)
    names = [p.info.name for p in passes]
    step = ScheduleCPU()
    cpu.forget_inlined()
    with host_target():
        grouped = passes[names.index("FuseRowGroups")](mod)
        before = len(built)
        step(grouped)
    cpu.forget_inlined()
    funcs = [f for _, f in grouped.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    tried = {tvm_ffi.structural_hash(f) for f in funcs}
    assert len(built) - before <= len(tried), (len(built) - before, len(tried))
    assert "RowColumnLocal" in step.choices.values()


def test_scalar_functions_are_not_normalized(monkeypatch):
    """An optimizer's global gradient norm adds one squared norm a parameter, a chain of scalar
    additions that fuses into one function of as many blocks: nothing to schedule there, and
    normalizing it cost time quadratic in its blocks. The step is still right (float64)."""
    from relaxgrad.training import SGD

    sizes = []
    normalize = cpu.normalize_prim_func
    monkeypatch.setattr(cpu, "normalize_prim_func",
                        lambda sch: sizes.append(len(cpu.sblocks(sch.mod["main"])))
                        or normalize(sch))  # fmt: skip
    count = 40
    params = [relax.Var(f"w{i}", relax.TensorType((3,), "float64")) for i in range(count)]
    optimizer = SGD(0.5)
    optimizer.init(params)
    mod = optimizer.add_to(tvm.IRModule(), "opt")
    cpu.forget_inlined()
    vm = relax.VirtualMachine(relaxgrad.compile(mod), tvm.cpu())
    assert sizes and max(sizes) < count, sizes  # the chain of additions was not normalized
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(3) for _ in range(count)]
    grads = [rng.standard_normal(3) for _ in range(count)]
    tensors = [tvm.runtime.tensor(a) for a in (*weights,)]
    new, _, (norm,) = vm["opt"](tensors, [tvm.runtime.tensor(g) for g in grads],
                                [tvm.runtime.tensor(s.numpy()) for s in optimizer.state],
                                [tvm.runtime.tensor(c) for c in optimizer.controls(max_norm=1.0)])
    total = np.sqrt(sum((g * g).sum() for g in grads))
    np.testing.assert_allclose(norm.numpy(), total, rtol=1e-12)
    clip = min(1.0, 1.0 / (total + 1e-6))
    for got, w, g in zip(new, weights, grads):
        np.testing.assert_allclose(got.numpy(), w - 0.5 * clip * g, rtol=1e-12)
