"""Run MLP, CNN and transformer adjoints compiled by relaxgrad.compile on a GPU and on llvm.

For each model (at the sizes of tests/test_compile.py and at larger ones), compiles the module
with ``main_adjoint`` for the GPU and for llvm, runs ``main`` and ``main_adjoint`` on both with
the same random inputs, and prints the max abs difference of every output (the loss and each
gradient), and which dlight rule scheduled how many GPU functions.

Tolerance: an output passes when ``max|gpu - cpu| <= tol * max(1, max|cpu|)``, with
``tol = 1e-4`` by default (float32; different summation orders and fast-math intrinsics stay
well under it, a wrong kernel does not). Exits 1 on any mismatch, 2 when there is no GPU.

Then the deployed path: a small MLP's and CNN's training artifacts, ``Trainer.export(folder,
target)``, trained for 10 steps by their ``runner.py`` in a fresh process with TVM's runtime
only (``TVM_USE_RUNTIME_LIB=1``), against an llvm Trainer's 10 steps: the losses and the
parameters, with the same tolerance.

Run from the repository root: ``python bench/gpu_check.py`` (``--target llvm`` is a dry run
of the script itself on a machine without a GPU; ``--models`` with no names checks only the
artifacts).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import relaxgrad  # noqa: E402
from relaxgrad import _ty  # noqa: E402
from relaxgrad.pipeline import resolve_target  # noqa: E402
from relaxgrad.schedules import ScheduleGPU  # noqa: E402
from tests.test_pipeline import CNN_OPS, MODELS  # noqa: E402

SIZES = {
    "test": {"mlp": {}, "cnn": {}, "transformer": {}},
    "large": {
        "mlp": {"batch": 64, "d_in": 128, "hidden": 256, "classes": 10},
        "cnn": {"batch": 8, "channels": 3, "size": 32, "filters": 16, "classes": 10},
        "transformer": {"batch": 4, "seq": 64, "dim": 64, "ffn": 256},
    },
}


def make_inputs(mod: tvm.IRModule, seed: int) -> list[np.ndarray]:
    """Uniform(-1, 1) data; weights ``w*`` scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    inputs = []
    for param in mod["main"].params:
        shape = _ty.static_shape(param.ty)
        value = rng.uniform(-1.0, 1.0, shape)
        if param.name.startswith("w"):
            fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
            value /= np.sqrt(fan_in)
        inputs.append(value.astype(_ty.dtype_of(param.ty)))
    return inputs


def leaves(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [leaf for item in value for leaf in leaves(item)]


def run(executable, device, func_name: str, inputs) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable, device)
    return leaves(vm[func_name](*[tvm.runtime.tensor(a, device) for a in inputs]))


def output_names(mod: tvm.IRModule, func_name: str) -> list[str]:
    if func_name == "main":
        return ["loss"]
    return ["loss"] + ["d" + p.name for p in mod["main"].params]


def check_model(name: str, sizes: dict, target, device, tol: float, seed: int) -> bool:
    """Compare one model on ``target`` against llvm; print one line per output."""
    mod = relaxgrad.Gradient("main")(MODELS[name](**sizes))
    inputs = make_inputs(mod, seed)
    schedule = ScheduleGPU()
    start = time.perf_counter()
    on_device = relaxgrad.compile(mod, target, schedule=schedule)
    compile_s = time.perf_counter() - start
    reference = relaxgrad.compile(mod, "llvm")
    rules = collections.Counter(schedule.choices.values())
    shapes = ", ".join(f"{p.name}{_ty.static_shape(p.ty)}" for p in mod["main"].params)
    print(f"{name} [{shapes}]: compiled for {target.kind.name} in {compile_s:.1f}s; rules: "
          f"{dict(rules) or 'none (not a GPU target)'}")  # fmt: skip
    ok = True
    for func_name in ("main", "main_adjoint"):
        got = run(on_device, device, func_name, inputs)
        want = run(reference, tvm.cpu(), func_name, inputs)
        for label, g, w in zip(output_names(mod, func_name), got, want, strict=True):
            diff = float(np.max(np.abs(g.astype("float64") - w))) if g.size else 0.0
            scale = max(1.0, float(np.max(np.abs(w))) if w.size else 0.0)
            good = g.shape == w.shape and np.all(np.isfinite(g)) and diff <= tol * scale
            ok = ok and bool(good)
            print(f"  {'ok  ' if good else 'FAIL'} {func_name:>12} {label:<6} "
                  f"shape {str(w.shape):<18} max|gpu-cpu| {diff:.3g}  "
                  f"(limit {tol * scale:.3g})")  # fmt: skip
    return ok


# The artifacts' runner in a fresh runtime-only process: the losses of the steps, the state
# written back, and whether TVM's compiler library was loaded.
RUNTIME_ONLY = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import runner
r, data, steps = runner.Runner(sys.argv[1]), np.load(sys.argv[2]), int(sys.argv[3])
b = r.manifest["batch_size"]
losses = [r.step(data["x"][i * b:(i + 1) * b], data["target"][i * b:(i + 1) * b])
          for i in range(steps)]
r.save()
maps = open("/proc/self/maps").read()
print(json.dumps({"losses": losses, "compiler": "libtvm_compiler" in maps}))
"""


def check_artifacts(target, tol: float, seed: int, steps: int = 10) -> bool:
    """Exported training artifacts for ``target`` run by the runtime-only runner vs an llvm
    Trainer, ``steps`` steps; one line per model."""
    from relaxgrad.training import Adam, CrossEntropyLoss, MomentumSGD, Trainer, cnn, mlp
    from relaxgrad.training.state import read_state

    models = {"mlp": (mlp(32, in_features=256, hidden=(128,)), Adam(1e-2)),
              "cnn": (cnn(8, image=(1, 8, 8), channels=(4, 8)), MomentumSGD(0.05, 0.9))}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TVM_USE_RUNTIME_LIB"] = "1"
    ok = True
    for name, (model, optimizer) in models.items():
        trainer = Trainer.for_model(model, CrossEntropyLoss(), optimizer, target="llvm")
        with tempfile.TemporaryDirectory() as tmp:
            manifest = trainer.export(tmp, target=target)
            b, *shape = manifest["arguments"][0]["shape"]
            rng = np.random.default_rng(seed)
            x = rng.standard_normal((steps * b, *shape)).astype("float32")
            y = rng.integers(0, 10, steps * b)
            np.savez(f"{tmp}/data.npz", x=x, target=y)
            command = [sys.executable, "-c", RUNTIME_ONLY, tmp, f"{tmp}/data.npz", str(steps)]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  FAIL artifacts {name}: the runner failed\n{done.stderr[-2000:]}")
                ok = False
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            state, _ = read_state(f"{tmp}/{manifest['state']}")
        want = [trainer.step(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(steps)]
        diffs = [abs(g - w) / max(1.0, abs(w)) for g, w in zip(result["losses"], want)]
        for key, value in trainer.params.items():
            scale = max(1.0, float(np.max(np.abs(value))))
            diffs.append(float(np.max(np.abs(state[f"param:{key}"] - value))) / scale)
        good = max(diffs) <= tol and not result["compiler"]
        ok = ok and good
        print(f"  {'ok  ' if good else 'FAIL'} artifacts {name}: {steps} steps on TVM's runtime "
              f"alone (compiler loaded: {result['compiler']}), max rel. diff of losses and "
              f"parameters {max(diffs):.3g} (limit {tol:g})")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="cuda", help="cuda (default) or llvm (dry run)")
    parser.add_argument("--arch", help="CUDA arch, e.g. sm_90; default: the local GPU's")
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()

    spec = {"kind": args.target} if args.target != "llvm" else "llvm"
    if args.arch:
        spec["arch"] = args.arch
    target = resolve_target(spec)
    device = tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name, 0)
    if not device.exist:
        print(f"no {target.kind.name} device here: nothing to compare", file=sys.stderr)
        return 2
    print(f"target {target}; tolerance max|gpu-cpu| <= {args.tol:g} * max(1, max|cpu|)")

    failed = []
    for size in args.sizes:
        for name in args.models:
            missing = [op for op in CNN_OPS if relaxgrad.get_gradient(op) is None]
            if name == "cnn" and missing:
                print(f"cnn: skipped, no gradient rule for {', '.join(missing)}")
                continue
            if not check_model(name, SIZES[size][name], target, device, args.tol, args.seed):
                failed.append(f"{name} ({size})")
    print(f"training artifacts for {target.kind.name}, run by TVM's runtime alone:")
    if not check_artifacts(target, args.tol, args.seed):
        failed.append("training artifacts")
    print("FAILED: " + ", ".join(failed) if failed else "all outputs match")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
