"""relaxgrad's CUDA code on a real GPU: every output against the same program built for the
CPU, then the training step's speed against PyTorch eager on the same weights and batch.

Two halves, because the GPU machine has TVM's runtime but not its compiler (a 259 MB library):

- ``python bench/gpu_check.py build DIR`` (here, with TVM's compiler and no GPU) compiles for
  CUDA (``--arch``, default ``sm_90``) and writes into ``DIR``, with ``plan.json`` listing them:

  * ``adjoint`` cases: the MLP, CNN and transformer adjoints of ``tests/test_pipeline.py`` at
    its sizes and at larger ones (``relaxgrad.compile`` with ``ScheduleGPU``; which dlight rule
    scheduled how many functions is recorded), their random inputs and the outputs of
    ``main`` and ``main_adjoint`` built for llvm;
  * ``trainer`` cases: ``Trainer.export(folder, target=cuda)`` of an MLP (Adam), a CNN
    (momentum SGD) and the zoo's tiny BERT and ResNet from Hugging Face configs (Adam), their
    batches, and the losses and parameters of an llvm ``Trainer`` after ``--steps`` steps;
  * ``speed`` cases: the training step (forward, cross-entropy, backward, Adam) of BERT-base
    (seq 128, batch 32) and ResNet-50 (224x224, batch 64, batch norm in training mode),
    exported without their state (hundreds of MB), which the GPU machine takes from the same
    PyTorch model it times;
  * with ``--traces model:size``: that adjoint's every kernel call on llvm (the GPU pipeline
    without its schedule step), to compare call by call; with ``--kernels model:size[:tvm]``:
    every kernel of that adjoint scheduled by each GPU rule that takes it, and its values on
    llvm (``:tvm``: with TVM's convolutions and pooling gradients instead of relaxgrad's); with
    ``--matmuls``: BERT-base's products under variants of dlight's matmul config, to time.

  CUDA kernels are compiled by ``nvcc`` where one is found (``Trainer.export`` does this),
  so the GPU machine loads machine code instead of compiling source.

  ``DIR/site/tvm`` is TVM's Python package with its runtime libraries and without its
  compiler, for the GPU machine's ``PYTHONPATH`` (beside an ``apache-tvm-ffi`` wheel for its
  Python).

- ``python bench/gpu_check.py run DIR`` (on the GPU machine; ``TVM_USE_RUNTIME_LIB=1``, TVM's
  runtime, numpy, PyTorch and ``transformers``; no relaxgrad) runs every case:

  * an output passes when ``max|gpu - cpu| <= tol * max(1, max|cpu|)`` (``--tol``, default
    1e-4: float32 with other summation orders and fast-math intrinsics stays well under it, a
    wrong kernel does not);
  * speed: relaxgrad's step (``Runner.step``) and PyTorch eager's (``zero_grad``,
    ``cross_entropy``, ``backward``, ``Adam.step``; TF32 off in both matrix products and
    convolutions, so both compute float32) on the same weights and batch, alternately, each
    step ending in a synchronizing read of the loss; medians of ``--steps`` steps after one
    warm-up; the first step's losses side by side, and every step's; correct when the first
    losses agree within 1e-3 and the gradients at the initial weights are as close to float64
    as PyTorch's float32 ones, parameter by parameter (:func:`_gradient_check`); then each
    call of the loss adjoint timed alone (the VM's instrument, the device synchronized around
    it), summed by kernel.

  It prints one table and writes ``results.json``, the profiles and the GPU's buffers of a
  wrong kernel to ``--out``.

Carrying it: ``DIR`` compressed (``tar cJf``, about 7 MB) and the ``apache-tvm-ffi`` wheel of
the GPU machine's Python (``pip download --only-binary=:all: --python-version 3.12
apache-tvm-ffi==<the version here>``), installed there with ``pip install --target``; then
``PYTHONPATH=<wheel target>:DIR/site TVM_USE_RUNTIME_LIB=1 python bench/gpu_check.py run DIR``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
SIZES = {
    "test": {"mlp": {}, "cnn": {}, "transformer": {}},
    "large": {
        "mlp": {"batch": 64, "d_in": 128, "hidden": 256, "classes": 10},
        "cnn": {"batch": 8, "channels": 3, "size": 32, "filters": 16, "classes": 10},
        "transformer": {"batch": 4, "seq": 64, "dim": 64, "ffn": 256},
    },
}
SPEED = {"bert": 32, "resnet50": 64}  # model: batch


def speed_model(name: str, batch: int, rng):
    """``(module, input, targets, label)``: a published-size Hugging Face model (random weights
    from seed 0, dropout 0, eager attention) and one batch. The same code builds it here and on
    the GPU machine."""
    import torch
    import transformers as hf

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import Logits

    torch.manual_seed(0)
    if name == "bert":
        config = hf.BertConfig(num_labels=2, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)  # fmt: skip
        config._attn_implementation = "eager"
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (batch, 128)))
        module = Logits(hf.BertForSequenceClassification(config), "input_ids")
        return module, ids, rng.integers(0, 2, batch), f"BERT-base, seq 128, batch {batch}"
    if name == "resnet50":
        config = hf.ResNetConfig(num_labels=1000)
        images = torch.from_numpy(rng.standard_normal((batch, 3, 224, 224)).astype("float32"))
        module = Logits(hf.ResNetForImageClassification(config), "pixel_values")
        return module, images, rng.integers(0, 1000, batch), f"ResNet-50, 224x224, batch {batch}"
    raise ValueError(f"unknown model {name!r}")


# ------------------------------------------------------------------- build (TVM's compiler)


def build(args) -> None:
    import tvm

    sys.path.insert(0, str(ROOT))
    import relaxgrad
    from relaxgrad.pipeline import resolve_target
    from relaxgrad.training import export, runtime_runner, state

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_target({"kind": "cuda", "arch": args.arch})
    _copy_runtime(Path(tvm.__file__).parent, out / "site" / "tvm")
    # the runner and its state format, for `run`, as Trainer.export copies them
    shutil.copy2(runtime_runner.__file__, out / "runner.py")
    shutil.copy2(state.__file__, out / "state.py")
    plan = {"target": str(target), "arch": args.arch, "cases": []}
    if not runtime_runner.find_nvcc():
        print("no nvcc here: the GPU machine compiles the kernels' source when it loads them")
    for size in args.sizes:
        for name in args.adjoints:
            plan["cases"].append(_build_adjoint(out, name, size, target, tvm, relaxgrad, export))
            print(f"built adjoint {name} ({size})", flush=True)
    if args.matmuls:
        plan["cases"].append(_build_matmuls(out, target))
        print("built matmuls", flush=True)
    for spec in args.traces:
        name, size = spec.split(":")
        plan["cases"].append(_build_trace(out, name, size))
        print(f"built trace {spec}", flush=True)
    for spec in args.kernels:
        name, size, *tvm_convs = spec.split(":")
        plan["cases"].append(_build_kernels(out, name, size, target, bool(tvm_convs)))
        print(f"built kernels {spec}", flush=True)
    for name in args.trainers:
        plan["cases"].append(_build_trainer(out, name, target, args.steps))
        print(f"built trainer {name}", flush=True)
    for name in args.speed:
        for cuda_graph in (False, True) if args.cuda_graph else (False,):
            start = time.perf_counter()
            plan["cases"].append(_build_speed(out, name, target, cuda_graph))
            print(f"built speed {name} in {time.perf_counter() - start:.0f} s", flush=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))


def _copy_runtime(package: Path, to: Path) -> None:
    """TVM's Python package without its compiler: the ``.py`` files and the runtime libraries
    (``libtvm_runtime*.so``, 5 MB, against the compiler's 259 MB)."""
    shutil.rmtree(to, ignore_errors=True)
    for path in package.rglob("*.py"):
        if not {"3rdparty", "src", "include"} & set(path.relative_to(package).parts):
            (to / path.relative_to(package)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to / path.relative_to(package))
    (to / "lib").mkdir(exist_ok=True)
    for path in (package / "lib").glob("libtvm_runtime*.so"):
        shutil.copy2(path, to / "lib" / path.name)


def _outputs(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [leaf for item in value for leaf in _outputs(item)]


def _build_adjoint(out: Path, name: str, size: str, target, tvm, relaxgrad, export) -> dict:
    import collections

    from relaxgrad import _ty
    from relaxgrad.schedules import ScheduleGPU
    from tests.test_pipeline import MODELS

    mod = relaxgrad.Gradient("main")(MODELS[name](**SIZES[size][name]))
    rng = np.random.default_rng(0)
    inputs = {}
    for param in mod["main"].params:  # U(-1, 1); weights w* scaled by 1/sqrt(fan-in)
        shape = _ty.static_shape(param.ty)
        value = rng.uniform(-1.0, 1.0, shape)
        if param.name.startswith("w"):
            value /= np.sqrt(shape[0] if len(shape) == 2 else int(np.prod(shape[1:])))
        inputs[param.name] = value.astype(_ty.dtype_of(param.ty))
    schedule = ScheduleGPU()
    on_device = relaxgrad.compile(mod, target, schedule=schedule)
    stem = f"adjoint_{name}_{size}"
    on_device.export_library(str(out / f"{stem}.so"))
    export.compile_device_code(on_device, target, out)
    reference = relaxgrad.compile(mod, "llvm")
    vm = tvm.relax.VirtualMachine(reference, tvm.cpu())
    args = [tvm.runtime.tensor(inputs[p.name]) for p in mod["main"].params]
    want = {}
    for func in ("main", "main_adjoint"):
        for i, value in enumerate(_outputs(vm[func](*args))):
            want[f"{func}:{i}"] = value
    np.savez(out / f"{stem}_inputs.npz", **inputs)
    np.savez(out / f"{stem}_reference.npz", **want)
    names = ["loss"] + ["d" + p.name for p in mod["main"].params]
    rules = dict(collections.Counter(schedule.choices.values()))
    return {"kind": "adjoint", "name": f"{name} ({size})", "stem": stem, "labels": names,
            "order": [p.name for p in mod["main"].params], "rules": rules}  # fmt: skip


def _build_trace(out: Path, name: str, size: str) -> dict:
    """The adjoint's every kernel call on llvm (the GPU pipeline without its schedule step, so
    the same kernels in the same order): each call's tensor arguments after it ran, with the
    inputs of the ``adjoint`` case."""
    import tvm

    import relaxgrad
    from relaxgrad.pipeline import gpu_pipeline, resolve_target
    from tests.test_pipeline import MODELS

    mod = relaxgrad.Gradient("main")(MODELS[name](**SIZES[size][name]))
    host = resolve_target("llvm")
    built = tvm.compile(mod, host, relax_pipeline=gpu_pipeline(host, tvm.transform.Sequential([])))
    stem = f"adjoint_{name}_{size}"
    inputs = np.load(out / f"{stem}_inputs.npz")
    vm = tvm.relax.VirtualMachine(built, tvm.cpu())
    calls, trace = [], {}

    def instrument(func, symbol, before, ret, *args):
        if not before and not str(symbol).startswith("vm.builtin"):
            for j, arg in enumerate(args):
                if isinstance(arg, tvm.runtime.Tensor):
                    trace[f"{len(calls)}:{j}"] = arg.numpy()
            calls.append(str(symbol))
        return 0

    vm.set_instrument(instrument)
    vm["main_adjoint"](*[tvm.runtime.tensor(inputs[p.name]) for p in mod["main"].params])
    np.savez(out / f"trace_{name}_{size}.npz", **trace)
    return {"kind": "trace", "name": f"{name} ({size}) kernel by kernel", "stem": stem,
            "trace": f"trace_{name}_{size}.npz", "calls": calls,
            "order": [p.name for p in mod["main"].params]}  # fmt: skip


def _build_kernels(out: Path, name: str, size: str, target, tvm_convs: bool = False) -> dict:
    """Every PrimFunc of the model's CUDA adjoint (after fusion, before scheduling), scheduled
    by each GPU rule that takes it, in one CUDA library (``<kernel>__<rule>``); inputs drawn at
    random, and every buffer after the unscheduled PrimFunc ran on llvm, as the reference."""
    import tvm

    import relaxgrad
    from relaxgrad.schedules import ScheduleGPU, step
    from relaxgrad.schedules._common import without_unit_reductions
    from tests.test_pipeline import MODELS

    schedule, seen = ScheduleGPU(), {}

    @tvm.transform.module_pass(opt_level=0, name="CaptureThenSchedule")
    def capture(mod, ctx):
        seen["before"] = mod
        return schedule(mod)

    mod = relaxgrad.Gradient("main")(MODELS[name](**SIZES[size][name]))
    if tvm_convs:  # TVM's own convolution and pooling kernels, not relaxgrad's matmuls
        from relaxgrad import pipeline

        real, pipeline.ConvToMatmul = pipeline.ConvToMatmul, lambda **_: tvm.transform.Sequential()
        try:
            relaxgrad.compile(mod, target, schedule=capture)
        finally:
            pipeline.ConvToMatmul = real
    else:
        relaxgrad.compile(mod, target, schedule=capture)

    variants, reference, kernels, rng = {}, {}, {}, np.random.default_rng(0)
    host = tvm.target.Target("llvm")
    signatures = _call_tir_signatures(seen["before"])
    for gvar, func in seen["before"].functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc) or step.is_scheduled(func):
            continue
        kernel = gvar.name_hint
        shapes = signatures.get(kernel)
        if shapes is None:
            continue
        arrays = [_random(shape, dtype, rng) for shape, dtype in shapes]
        cpu = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), host)
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        cpu["main"](*tensors)
        for i, a in enumerate(arrays):
            reference[f"{kernel}:in{i}"] = a
        for i, t in enumerate(tensors):
            reference[f"{kernel}:out{i}"] = t.numpy()
        kernels[kernel] = []
        for rule in step.default_gpu_rules():
            rule_name = type(rule).__name__
            try:
                with target:
                    sch = rule.apply(without_unit_reductions(func), target, False)
                if sch is None:
                    continue
                scheduled = step._first(sch).mod["main"]
                step._verify(scheduled, kernel, target)
            except Exception:  # noqa: BLE001 - the rule does not take it
                continue
            symbol = f"{kernel}__{rule_name}"
            variants[symbol] = scheduled.with_attr("global_symbol", symbol)
            kernels[kernel].append(rule_name)
    library = tvm.compile(tvm.IRModule(variants), target)
    stem = f"kernels_{name}_{size}" + ("_tvm" if tvm_convs else "")
    library.export_library(str(out / f"{stem}.so"))
    np.savez(out / f"{stem}_reference.npz", **reference)
    label = " (TVM's convolutions)" if tvm_convs else ""
    return {"kind": "kernels", "name": f"{name} ({size}) kernels by rule{label}", "stem": stem,
            "kernels": kernels, "chosen": dict(schedule.choices)}  # fmt: skip


def _call_tir_signatures(mod) -> dict[str, list]:
    """``(shape, dtype)`` of each argument of each PrimFunc, its inputs then its outputs, from
    the ``call_tir`` that calls it."""
    import tvm
    from tvm import relax

    call_tir, found = tvm.ir.Op.get("relax.call_tir"), {}

    def shape_dtype(ty) -> tuple:
        return [int(d) for d in ty.shape.values], str(ty.dtype)

    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                call = binding.value
                if isinstance(call, relax.Call) and call.op.same_as(call_tir):
                    outs = call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
                    found[call.args[0].name_hint] = [shape_dtype(a.ty) for a in call.args[1].fields]
                    found[call.args[0].name_hint] += [shape_dtype(t) for t in outs]
    return found


# dlight's CUDA matmul config (its block of 8 x 16 threads, each a 4 x 4 micro tile: 32 x 64
# outputs per block) and variants, timed on the products of BERT-base's step at batch 32
MATMUL_CONFIGS = {
    "dlight": {},
    "64x64": dict(block_size_x=16, block_size_y=16),
    "64x128 v4": dict(block_size_x=16, block_size_y=16, micro_size_y=8, vector_size=4),
    "128x64": dict(block_size_x=16, block_size_y=16, micro_size_x=8),
    "32x64 k8": dict(micro_size_k=8),
    "32x64 v4": dict(vector_size=4),
    "64x64 k8 v4": dict(block_size_x=16, block_size_y=16, micro_size_k=8, vector_size=4),
}
MATMUL_SHAPES = {  # name: (batch, m, k, n); C = A @ B
    "qkv/out 4096x768x768": (1, 4096, 768, 768),
    "ffn up 4096x768x3072": (1, 4096, 768, 3072),
    "ffn down 4096x3072x768": (1, 4096, 3072, 768),
    "dW 768x4096x3072": (1, 768, 4096, 3072),
    "scores 384x128x64x128": (384, 128, 64, 128),
}


def _build_matmuls(out: Path, target) -> dict:
    """Each of :data:`MATMUL_SHAPES` scheduled by dlight's Matmul rule under each of
    :data:`MATMUL_CONFIGS`, in one CUDA library, for ``run`` to time and check."""
    import tvm
    from tvm.s_tir import dlight as dl

    funcs, built = {}, {}
    for shape_name, shape in MATMUL_SHAPES.items():
        func = _batch_matmul(*shape)
        for config_name, changes in MATMUL_CONFIGS.items():
            rule = dl.gpu.Matmul()
            config = dataclasses.replace(rule.get_configs(target), **changes)
            rule.get_configs = lambda _target, config=config: config
            with target:
                sch = rule.apply(func, target, False)
            symbol = f"mm{len(funcs)}"
            funcs[symbol] = sch.mod["main"].with_attr("global_symbol", symbol)
            built.setdefault(shape_name, {})[config_name] = symbol
    from relaxgrad.training import export

    library = tvm.compile(tvm.IRModule(funcs), target)
    library.export_library(str(out / "matmuls.so"))
    export.compile_device_code(library, target, out)
    return {"kind": "matmuls", "name": "BERT-base's matmuls by dlight config", "stem": "matmuls",
            "symbols": built, "shapes": MATMUL_SHAPES}  # fmt: skip


def _batch_matmul(batch: int, m: int, k: int, n: int):
    from tvm import te

    a = te.placeholder((batch, m, k), "float32", "A")
    b = te.placeholder((batch, k, n), "float32", "B")
    r = te.reduce_axis((0, k), "k")
    c = te.compute((batch, m, n), lambda z, i, j: te.sum(a[z, i, r] * b[z, r, j], axis=r))
    return te.create_prim_func([a, b, c])


def _random(shape, dtype: str, rng) -> np.ndarray:
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.uniform(-1, 1, shape).astype(dtype)


def _trainer(name: str, optimizer=None):
    """``(trainer, x, y)``: an llvm Trainer of model ``name`` and its first batch."""
    from relaxgrad.training import (
        Adam,
        CrossEntropyLoss,
        MomentumSGD,
        Trainer,
        cnn,
        from_torch,
        mlp,  # fmt: skip
    )

    rng = np.random.default_rng(0)
    if name in ("mlp", "cnn"):
        model, opt = {"mlp": (mlp(32, in_features=256, hidden=(128,)), Adam(1e-2)),
                      "cnn": (cnn(8, image=(1, 8, 8), channels=(4, 8)), MomentumSGD(0.05, 0.9))
                      }[name]  # fmt: skip
        from relaxgrad import _ty

        shape = _ty.static_shape(model.mod[model.func_name].params[0].ty)
        return (Trainer.for_model(model, CrossEntropyLoss(), opt, progress=False),
                rng.standard_normal(shape).astype("float32"), rng.integers(0, 10, shape[0]))
    from tests.zoo.models import ZOO

    module, inputs, y = ZOO[name](rng)
    model = from_torch(module, inputs)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), optimizer or Adam(1e-3),
                                progress=False)  # fmt: skip
    return trainer, inputs[0].numpy(), y


def _build_trainer(out: Path, name: str, target, steps: int) -> dict:
    trainer, x, y = _trainer(name)
    folder = out / f"trainer_{name}"
    trainer.export(folder, target=target)
    np.savez(folder / "data.npz", x=x, target=y)
    losses = [trainer.step(x, y) for _ in range(steps)]
    arrays, _ = trainer.state_arrays()
    params = {k: v for k, v in arrays.items() if k.startswith(("param:", "buffer:"))}
    np.savez(folder / "reference.npz", losses=np.array(losses), **params)
    return {"kind": "trainer", "name": f"{name} trainer", "folder": folder.name, "steps": steps}


def _build_speed(out: Path, name: str, target, cuda_graph: bool = False) -> dict:
    import tvm

    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_torch

    module, x, y, label = speed_model(name, SPEED[name], np.random.default_rng(0))
    model = from_torch(module, (x,))
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3), progress=False)
    folder = out / (f"speed_{name}" + ("_graph" if cuda_graph else ""))
    # TVM's RewriteCUDAGraph (in the GPU pipeline) captures static regions as CUDA graphs
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": cuda_graph}):
        trainer.export(folder, target=target)
    arrays, meta = trainer.state_arrays()
    (folder / "state.params").unlink()  # the GPU machine takes the weights from PyTorch
    optim = {k: {"shape": list(v.shape), "dtype": str(v.dtype),
                 "value": v.tolist() if v.size == 1 else None}
             for k, v in arrays.items() if k.startswith("optim:")}  # fmt: skip
    (folder / "optim.json").write_text(json.dumps({"optim": optim, "meta": meta}))
    return {"kind": "speed", "name": label + (" [CUDA graph]" if cuda_graph else ""),
            "model": name, "batch": SPEED[name], "folder": folder.name}  # fmt: skip


# ------------------------------------------------------------------ run (TVM's runtime only)


def _load_cuda_runtime() -> None:
    """``libcudart.so.13`` (which TVM's CUDA runtime links) from CUDA's or PyTorch's wheels."""
    import site

    roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/lib", *site.getsitepackages()]
    for root in roots:
        for path in sorted(glob.glob(f"{root}/**/libcudart.so.1[0-9]*", recursive=True)):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> tuple[bool, float, float]:
    diff = float(np.max(np.abs(got.astype("float64") - want))) if want.size else 0.0
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 0.0)
    good = got.shape == want.shape and bool(np.all(np.isfinite(got))) and diff <= tol * scale
    return good, diff, tol * scale


def run(args) -> int:
    directory = Path(args.dir).resolve()
    sys.path.insert(0, str(directory))
    _load_cuda_runtime()
    import tvm
    from runner import Runner, _load_device_runtime, register_cuda_compiler

    _load_device_runtime("cuda")  # TVM's CUDA device API, and the loader of device code
    device = tvm.cuda(0)
    if not device.exist:
        print("no CUDA device here", file=sys.stderr)
        return 2
    register_cuda_compiler(directory / "cuda")
    plan = json.loads((directory / "plan.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {device.device_name}, compute {device.compute_version}; built for "
          f"{plan['arch']}; tolerance max|gpu-cpu| <= {args.tol:g} * max(1, max|cpu|)")
    results, failed = [], []
    for case in plan["cases"]:
        if args.only and not any(word in case["name"] for word in args.only):
            continue
        start = time.perf_counter()
        try:
            result = CASES[case["kind"]](case, directory, device, args, tvm, Runner)
        except Exception as error:  # noqa: BLE001 - reported as a failed case, the others run
            result = {"ok": False, "error": f"{type(error).__name__}: {error}"[-3000:]}
        result.update(name=case["name"], kind=case["kind"], seconds=time.perf_counter() - start)
        results.append(result)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(_line(result), flush=True)
        if not result["ok"]:
            failed.append(case["name"])
    print("\n" + _table(results))
    print("FAILED: " + ", ".join(failed) if failed else "all outputs match")
    return 1 if failed else 0


def _run_adjoint(case, directory: Path, device, args, tvm, Runner) -> dict:
    library = tvm.runtime.load_module(str(directory / f"{case['stem']}.so"))
    vm = tvm.runtime.vm.VirtualMachine(library, device)
    inputs = np.load(directory / f"{case['stem']}_inputs.npz")
    reference = np.load(directory / f"{case['stem']}_reference.npz")
    values = [tvm.runtime.tensor(inputs[n], device) for n in case["order"]]
    worst, rows = 0.0, []
    for func in ("main", "main_adjoint"):
        got = _outputs(vm[func](*values))
        for i, value in enumerate(got):
            good, diff, limit = _close(value, reference[f"{func}:{i}"], args.tol)
            worst = max(worst, diff / limit)
            rows.append({"output": f"{func} {case['labels'][i]}", "ok": good, "diff": diff})
    return {"ok": all(r["ok"] for r in rows), "outputs": rows, "worst": worst,
            "rules": case["rules"]}  # fmt: skip


def _run_trainer(case, directory: Path, device, args, tvm, Runner) -> dict:
    folder = directory / case["folder"]
    runner = Runner(folder)
    data, reference = np.load(folder / "data.npz"), np.load(folder / "reference.npz")
    losses = np.array([runner.step(data["x"], data["target"]) for _ in range(case["steps"])])
    rows = [{"output": "losses", **dict(zip(("ok", "diff"), _close(losses,
                                                                    reference["losses"],
                                                                    args.tol)[:2]))}]
    arrays, _ = runner.state_arrays()
    for key in reference.files:
        if key != "losses":
            good, diff, _ = _close(arrays[key], reference[key], args.tol)
            rows.append({"output": key, "ok": good, "diff": diff})
    worst = max(r["diff"] for r in rows)
    return {"ok": all(r["ok"] for r in rows), "outputs": rows, "worst": worst,
            "losses": losses.tolist()}  # fmt: skip


def _run_speed(case, directory: Path, device, args, tvm, Runner) -> dict:
    import torch
    from runner import write_state

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = directory / case["folder"]
    rng = np.random.default_rng(0)
    module, x, y, _ = speed_model(case["model"], case["batch"], rng)
    manifest = json.loads((folder / "manifest.json").read_text())
    extra = json.loads((folder / "optim.json").read_text())
    weights = {k: v.detach().numpy() for k, v in [*module.named_parameters(),
                                                   *module.named_buffers()]}  # fmt: skip
    arrays = {f"param:{n}": weights[n] for n in manifest["params"]}
    arrays.update({f"buffer:{n}": weights[n] for n in manifest["buffers"]})
    for key, spec in extra["optim"].items():
        value = spec["value"] if spec["value"] is not None else 0
        arrays[key] = np.full(spec["shape"], value, dtype=spec["dtype"])
    write_state(folder / "state.params", arrays, extra["meta"])
    runner = Runner(folder)
    x_np = x.numpy()

    module = module.cuda().train()
    from _common import torch_adam_step  # (bench/ is on the path: speed_model put it there)

    torch_step = torch_adam_step(module, x.cuda(), torch.from_numpy(y).cuda())
    gradients = _gradient_check(runner, module, x_np, y, torch)
    steps = {"relaxgrad": lambda: runner.step(x_np, y), "pytorch": torch_step}
    losses = {who: [step()] for who, step in steps.items()}  # the warm-up step
    times = {"relaxgrad": [], "pytorch": []}
    for _ in range(args.steps):
        for who, step in steps.items():
            start = time.perf_counter()
            losses[who].append(step())
            times[who].append(time.perf_counter() - start)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    profile = _profile(runner, folder, device, x_np, y, tvm)
    (Path(args.out) / f"profile_{case['folder'].replace('/', '_')}.txt").write_text(profile["text"])
    first = {who: values[0] for who, values in losses.items()}
    rel = abs(first["relaxgrad"] - first["pytorch"]) / max(1.0, abs(first["pytorch"]))
    # every step's loss, reported: Adam's first update is lr * sign(gradient), so gradients
    # near 0 that differ in sign by summation order move weights 2 * lr apart, and a batch-norm
    # network amplifies that over the steps (PyTorch's own two runs differ by 0.4% at step 3)
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(*losses.values(), strict=True))
    return {"ok": rel <= 1e-3 and gradients["ok"], "first_loss": first, "loss_rel_diff": rel,
            "gradients": gradients,
            "worst_step_loss_rel_diff": worst, "losses": losses, "ms": median,
            "ratio": median["relaxgrad"] / median["pytorch"], "steps_ms": times,
            "slowest": profile["slowest"]}  # fmt: skip


def _gradient_check(runner, module, x: np.ndarray, y: np.ndarray, torch) -> dict:
    """The loss adjoint's gradients at the initial weights against PyTorch's, as the zoo's
    tests judge them: per parameter, relaxgrad's distance to PyTorch's float64 gradient (the
    module in float64, on the same device) at most twice PyTorch float32's, plus 1e-7 of its
    norm (2-norms). A deep batch-norm network at its random initialization is ill-conditioned
    in float32: ResNet-50's float32 gradients, PyTorch's and relaxgrad's alike, are about 2%
    from float64."""
    import copy

    functions = runner.manifest["functions"]
    target = runner._checked(y, runner.manifest["target_input"])
    _, grads = runner.vm[functions["loss_adjoint"]](*runner._arguments(x), target)
    got = dict(zip(runner.manifest["params"], (g.numpy() for g in grads), strict=True))
    device = next(module.parameters()).device
    inputs, labels = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    want = {}
    for dtype, net in ((torch.float32, module), (torch.float64, copy.deepcopy(module).double())):
        net.zero_grad()
        data = inputs.to(dtype) if inputs.is_floating_point() else inputs
        torch.nn.functional.cross_entropy(net(data), labels).backward()
        params = dict(net.named_parameters())
        want[dtype] = {n: params[n].grad.double().cpu().numpy() for n in got}
        net.zero_grad()
    exact, theirs = want[torch.float64], want[torch.float32]
    ours = {n: float(np.linalg.norm(got[n] - exact[n])) for n in got}
    limit = {n: 2 * float(np.linalg.norm(theirs[n] - exact[n])) + 1e-7 * np.linalg.norm(exact[n])
             for n in got}  # fmt: skip
    ratio = {n: ours[n] / limit[n] if limit[n] > 0 else 0.0 for n in got}
    worst = max(ratio, key=ratio.get)
    relative = {n: ours[n] / max(float(np.linalg.norm(exact[n])), 1e-30) for n in got}
    return {"ok": bool(ratio[worst] <= 1.0), "worst": worst, "worst_ratio": float(ratio[worst]),
            "median_error": statistics.median(relative.values()),
            "pytorch_median_error": statistics.median(
                float(np.linalg.norm(theirs[n] - exact[n]) / max(np.linalg.norm(exact[n]), 1e-30))
                for n in got),
            "params": len(got)}  # fmt: skip


def _profile(runner, folder: Path, device, x: np.ndarray, y: np.ndarray, tvm) -> dict:
    """Each call of the loss adjoint timed alone (the VM's instrument, the device synchronized
    before and after the call), summed by kernel over one step: the 12 slowest, and the text
    of all of them."""
    totals: dict[str, list] = {}
    clock = {}

    def instrument(func, symbol, before, ret, *args):
        device.sync()
        if before:
            clock["start"] = time.perf_counter()
        else:
            entry = totals.setdefault(str(symbol), [0.0, 0])
            entry[0] += (time.perf_counter() - clock["start"]) * 1e6
            entry[1] += 1
        return 0

    arguments = runner._arguments(x)
    target = runner._checked(y, runner.manifest["target_input"])
    vm = runner.vm
    vm.set_instrument(instrument)
    try:
        vm[runner.manifest["functions"]["loss_adjoint"]](*arguments, target)
    finally:
        vm.set_instrument(lambda *a: 0)
    total = sum(t for t, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    text = "\n".join(f"{t / 1e3:10.3f} ms {c:5d}x {100 * t / total:5.1f}%  {name}"
                     for name, (t, c) in ranked)  # fmt: skip
    return {"text": f"total {total / 1e3:.1f} ms (synchronized calls)\n{text}\n",
            "slowest": [{"kernel": n, "us": t, "calls": c, "share": t / total}
                        for n, (t, c) in ranked[:12]]}  # fmt: skip


def _run_trace(case, directory: Path, device, args, tvm, Runner) -> dict:
    """The CUDA adjoint's kernel calls against the llvm trace, matched by kernel name and
    occurrence (fusion may differ where a kernel is missing on one side): the first calls
    whose arguments differ point at the wrong kernel."""
    library = tvm.runtime.load_module(str(directory / f"{case['stem']}.so"))
    vm = tvm.runtime.vm.VirtualMachine(library, device)
    inputs = np.load(directory / f"{case['stem']}_inputs.npz")
    want = np.load(directory / case["trace"])
    cpu_calls = {}
    for i, symbol in enumerate(case["calls"]):
        cpu_calls.setdefault(symbol, []).append(i)
    seen, rows = {}, []

    def instrument(func, symbol, before, ret, *call_args):
        symbol = str(symbol)
        if before or symbol.startswith("vm.builtin"):
            return 0
        k = seen.get(symbol, 0)
        seen[symbol] = k + 1
        if k >= len(cpu_calls.get(symbol, [])):
            rows.append({"output": f"{symbol} #{k} (not on llvm)", "ok": True, "diff": 0.0})
            return 0
        i = cpu_calls[symbol][k]
        diffs = [_close(a.numpy(), want[f"{i}:{j}"], args.tol) for j, a in enumerate(call_args)
                 if isinstance(a, tvm.runtime.Tensor) and f"{i}:{j}" in want.files]  # fmt: skip
        rows.append({"output": f"{symbol} #{k}", "ok": all(d[0] for d in diffs),
                     "diff": max((d[1] for d in diffs), default=0.0)})  # fmt: skip
        return 0

    vm.set_instrument(instrument)
    vm["main_adjoint"](*[tvm.runtime.tensor(inputs[n], device) for n in case["order"]])
    return {"ok": all(r["ok"] for r in rows), "outputs": rows,
            "worst": max((r["diff"] for r in rows), default=0.0)}  # fmt: skip


def _run_matmuls(case, directory: Path, device, args, tvm, Runner) -> dict:
    library = tvm.runtime.load_module(str(directory / f"{case['stem']}.so"))
    rng, rows, table = np.random.default_rng(0), [], {}
    for shape_name, symbols in case["symbols"].items():
        batch, m, k, n = case["shapes"][shape_name]
        a = rng.uniform(-1, 1, (batch, m, k)).astype("float32")
        b = rng.uniform(-1, 1, (batch, k, n)).astype("float32")
        want = np.matmul(a.astype("float64"), b)
        for config_name, symbol in symbols.items():
            c = tvm.runtime.tensor(np.full((batch, m, n), np.nan, "float32"), device)
            ta, tb = tvm.runtime.tensor(a, device), tvm.runtime.tensor(b, device)
            library[symbol](ta, tb, c)
            good, diff, _ = _close(c.numpy(), want, args.tol)
            timer = library.time_evaluator(symbol, device, number=20, repeat=3)
            ms = min(timer(ta, tb, c).results) * 1e3
            tflops = 2 * batch * m * k * n / ms / 1e9
            rows.append({"output": f"{shape_name} {config_name}", "ok": good, "diff": diff,
                         "ms": ms, "tflops": tflops})  # fmt: skip
            table.setdefault(shape_name, {})[config_name] = round(tflops, 1)
    print("TFLOP/s by config: " + json.dumps(table, indent=1))
    return {"ok": all(r["ok"] for r in rows), "outputs": rows,
            "worst": max(r["diff"] for r in rows), "tflops": table}  # fmt: skip


def _run_kernels(case, directory: Path, device, args, tvm, Runner) -> dict:
    library = tvm.runtime.load_module(str(directory / f"{case['stem']}.so"))
    reference = np.load(directory / f"{case['stem']}_reference.npz")
    rows = []
    for kernel, rules in case["kernels"].items():
        count = sum(1 for k in reference.files if k.startswith(f"{kernel}:in"))
        for rule in rules:
            tensors = [tvm.runtime.tensor(reference[f"{kernel}:in{i}"], device)
                       for i in range(count)]  # fmt: skip
            library[f"{kernel}__{rule}"](*tensors)
            device.sync()
            got = [t.numpy() for t in tensors]
            diffs = [_close(g, reference[f"{kernel}:out{i}"], args.tol) for i, g in enumerate(got)]
            rows.append({"output": f"{kernel} by {rule}"
                         + (" (chosen)" if case["chosen"].get(kernel) == rule else ""),
                         "ok": all(d[0] for d in diffs), "diff": max(d[1] for d in diffs),
                         "arguments": [d[1] for d in diffs]})  # fmt: skip
            if not rows[-1]["ok"]:  # the GPU's buffers, to compare with the reference here
                np.savez(Path(args.out) / f"wrong_{kernel}_{rule}.npz", *got)
    return {"ok": all(r["ok"] for r in rows), "outputs": rows,
            "worst": max(r["diff"] for r in rows)}  # fmt: skip


CASES = {"matmuls": _run_matmuls, "trace": _run_trace, "kernels": _run_kernels,
         "adjoint": _run_adjoint, "trainer": _run_trainer, "speed": _run_speed}  # fmt: skip


def _line(result: dict) -> str:
    mark = "ok  " if result["ok"] else "FAIL"
    if "error" in result:
        return f"{mark} {result['name']}: {result['error']}"
    if result["kind"] == "speed":
        ms = result["ms"]
        grads = result["gradients"]
        return (f"{mark} {result['name']}: relaxgrad {ms['relaxgrad']:.1f} ms, PyTorch eager "
                f"{ms['pytorch']:.1f} ms (ratio {result['ratio']:.2f}); first losses "
                f"{result['first_loss']['relaxgrad']:.6f} / {result['first_loss']['pytorch']:.6f}"
                f"; gradients of {grads['params']} parameters vs float64: median rel. error "
                f"{grads['median_error']:.1e} (PyTorch float32: "
                f"{grads['pytorch_median_error']:.1e}), worst / limit {grads['worst_ratio']:.2f} "
                f"({grads['worst']}); losses over the steps within "
                f"{result['worst_step_loss_rel_diff']:.1e}"
                f"\n    slowest: " + "; ".join(f"{k['kernel']} {k['us'] / 1e3:.1f} ms"
                                              for k in result["slowest"][:5]))  # fmt: skip
    bad = [r["output"] for r in result["outputs"] if not r["ok"]]
    return (f"{mark} {result['name']}: {len(result['outputs'])} outputs, worst diff/limit "
            f"{result['worst']:.3g}" + (f"; mismatched: {bad}" if bad else ""))


def _table(results: list[dict]) -> str:
    lines = ["| case | correct | relaxgrad ms | PyTorch eager ms | ratio |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        if r["kind"] == "speed" and "ms" in r:
            lines.append(f"| {r['name']} | {'yes' if r['ok'] else 'no'} (first loss rel. diff "
                         f"{r['loss_rel_diff']:.1e}, gradients vs float64 "
                         f"{r['gradients']['median_error']:.1e}) | {r['ms']['relaxgrad']:.1f} | "
                         f"{r['ms']['pytorch']:.1f} | {r['ratio']:.2f} |")
        else:
            lines.append(f"| {r['name']} | {'yes' if r['ok'] else 'no'} | | | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile here (TVM's compiler, no GPU needed)")
    b.add_argument("dir")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    b.add_argument("--adjoints", nargs="*", default=["mlp", "cnn", "transformer"])
    b.add_argument("--trainers", nargs="*", default=["mlp", "cnn", "bert", "resnet"])
    b.add_argument("--speed", nargs="*", default=list(SPEED), choices=list(SPEED))
    b.add_argument("--steps", type=int, default=10, help="trainer steps checked")
    b.add_argument("--cuda-graph", action="store_true",
                   help="also each speed case built with relax.backend.use_cuda_graph")
    b.add_argument("--matmuls", action="store_true",
                   help="time BERT-base's matmuls under dlight configs (MATMUL_CONFIGS)")
    b.add_argument("--traces", nargs="*", default=[],
                   help="model:size (an adjoint built above) compared kernel call by call")
    b.add_argument("--kernels", nargs="*", default=[],
                   help="model:size whose kernels are checked under every rule that takes them "
                        "(model:size:tvm: with TVM's convolutions instead of relaxgrad's matmuls)")
    r = sub.add_parser("run", help="run on the GPU machine (TVM's runtime only)")
    r.add_argument("dir")
    r.add_argument("--out", default=".")
    r.add_argument("--tol", type=float, default=TOL)
    r.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    r.add_argument("--only", nargs="*", help="cases whose name contains one of these words")
    args = parser.parse_args()
    if args.command == "build":
        build(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
