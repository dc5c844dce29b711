"""Deployed training steps: relaxgrad's exported artifacts on TVM's runtime alone vs ONNX
Runtime's on-device training artifacts.

The same PyTorch modules, weights and batches on both sides, SGD (lr 0.01) on a mean
cross-entropy (the loss and optimizer both offer; ONNX Runtime's artifacts offer the losses
MSE, cross-entropy, BCE-with-logits and L1, and the optimizers SGD and AdamW):

- ``mlp``: 1024 -> 1024 -> 1024 -> 10, relu, batch 64;
- ``cnn``: two ``conv3x3 -> relu -> 2x2 pooling`` stages (max, then average; 16 and 32
  channels) and a dense head, on 3x32x32 images, batch 32.

relaxgrad: ``from_torch``, ``Trainer.export``, then ``runner.py`` from the artifacts folder in
a fresh process with ``TVM_USE_RUNTIME_LIB=1`` (which the bench checks loaded no compiler).
ONNX Runtime: ``torch.onnx.export``, ``onnxruntime.training.artifacts.generate_artifacts``, then
``onnxruntime.training.api`` (``CheckpointState``, ``Module``, ``Optimizer``) in a fresh process.
Both use ``--threads`` threads (``TVM_NUM_THREADS``; ``intra_op_num_threads``), and the same
batches: 10 steps whose losses are printed side by side (they must agree up to float32
rounding), then ``--steps`` timed steps (median, and the spread of ``--runs`` runs, which
alternate between the two). Sizes: the artifacts (library, weights and optimizer state,
manifest; ONNX Runtime's training, eval and optimizer models and checkpoint), and the runtime a
device needs (``libtvm_runtime`` and ``libtvm_ffi``, plus the shipped OpenBLAS where the library
calls it; ONNX Runtime's Python extension, which holds its training runtime).

Needs ``pip install onnxruntime-training "onnx<1.18"`` (not relaxgrad dependencies;
onnxruntime-training 1.19, the last release, loads models of ONNX IR version 10 at most). Run
from the repository root: ``python bench/deploy.py [--models mlp cnn] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LR = 0.01
CHECK_STEPS = 10

# the steps both runner scripts take: ``check`` steps for the losses, then ``runs`` runs of
# ``steps`` timed steps (each run's median), with ``step(x, y)`` and ``batches`` defined
TIMED = """
losses = [step(*batches[i]) for i in range(check)]
times = []
for _ in range(runs):
    run = []
    for i in range(steps):
        x, y = batches[i % check]
        start = time.perf_counter()
        step(x, y)
        run.append(time.perf_counter() - start)
    times.append(sorted(run)[len(run) // 2])
"""

TVM_STEPS = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import runner
data = dict(np.load(sys.argv[2]))  # in memory: an NpzFile reads the file at each access
check, steps, runs = (int(a) for a in sys.argv[3:6])
r = runner.Runner(sys.argv[1])
b = r.manifest["batch_size"]
batches = [(data["x"][i * b:(i + 1) * b], data["target"][i * b:(i + 1) * b]) for i in range(check)]
step = r.step
""" + TIMED + """
maps = open("/proc/self/maps").read()
print(json.dumps({"losses": losses, "times": times, "compiler": "libtvm_compiler" in maps}))
"""

ORT_STEPS = """
import json, sys, time
import numpy as np
import onnxruntime as ort
from onnxruntime.training.api import CheckpointState, Module, Optimizer
ort.set_default_logger_severity(3)
folder, data = sys.argv[1], dict(np.load(sys.argv[2]))
check, steps, runs, threads = (int(a) for a in sys.argv[3:7])
options = ort.SessionOptions()
options.intra_op_num_threads = threads
options.log_severity_level = 3
state = CheckpointState.load_checkpoint(f"{folder}/checkpoint")
module = Module(f"{folder}/training_model.onnx", state, f"{folder}/eval_model.onnx",
                session_options=options)
optimizer = Optimizer(f"{folder}/optimizer_model.onnx", module)
optimizer.set_learning_rate(float(sys.argv[7]))
module.train()
b = int(sys.argv[8])
batches = [(data["x"][i * b:(i + 1) * b], data["target"][i * b:(i + 1) * b]) for i in range(check)]
def step(x, y):
    loss = module(x, y)
    optimizer.step()
    module.lazy_reset_grad()
    return float(loss)
""" + TIMED + """
print(json.dumps({"losses": losses, "times": times}))
"""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per framework")
    return parser.parse_args()


def build(name: str):
    """``(module, batch shape)`` with seeded weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                            nn.Linear(1024, 10))  # fmt: skip
        return net, (64, 1024)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip
    return net, (32, 3, 32, 32)


def export_relaxgrad(net, x, folder: Path) -> None:
    from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, from_torch

    trainer = Trainer.for_model(from_torch(net, (x,)), CrossEntropyLoss(), SGD(LR))
    trainer.export(folder)


def export_onnxruntime(net, x, folder: Path) -> None:
    import onnx
    import onnxruntime
    import torch
    from onnxruntime.training import artifacts

    onnxruntime.set_default_logger_severity(3)

    path = folder / "model.onnx"
    warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
    torch.onnx.export(net, (x,), str(path), input_names=["x"], output_names=["logits"],
                      export_params=True, do_constant_folding=False, dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING)  # fmt: skip
    model = onnx.load(str(path))
    names = [p.name for p in model.graph.initializer]
    artifacts.generate_artifacts(
        model, requires_grad=names, loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.SGD, artifact_directory=str(folder),
    )  # fmt: skip
    path.unlink()  # the artifacts hold the weights


def size(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def runtime_sizes(tvm_folder: Path) -> tuple[int, int, int]:
    """``(TVM runtime, its OpenBLAS or 0, ONNX Runtime)`` in bytes."""
    import onnxruntime
    import tvm
    import tvm_ffi

    tvm_lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime.so"
    ffi_lib = Path(tvm_ffi.__file__).parent / "lib" / "libtvm_ffi.so"
    manifest = json.loads((tvm_folder / "manifest.json").read_text())
    blas = size([tvm_folder / manifest["blas"]]) if manifest["blas"] else 0
    capi = Path(onnxruntime.__file__).parent / "capi"
    ort = size(list(capi.glob("onnxruntime_pybind11_state*.so")))
    return size([tvm_lib, ffi_lib]), blas, ort


def run(code: str, args: list, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(name: str, args, root: Path) -> dict:
    import torch

    net, shape = build(name)
    rng = np.random.default_rng(0)
    rows = CHECK_STEPS * shape[0]
    data = {"x": rng.standard_normal((rows, *shape[1:])).astype("float32"),
            "target": rng.integers(0, 10, rows)}  # fmt: skip
    x = torch.from_numpy(data["x"][: shape[0]])
    tvm_dir, ort_dir = root / f"{name}_tvm", root / f"{name}_ort"
    ort_dir.mkdir()
    export_relaxgrad(net, x, tvm_dir)
    export_onnxruntime(net, x, ort_dir)
    np.savez(root / f"{name}.npz", **data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tvm_env = {**env, "TVM_USE_RUNTIME_LIB": "1", "TVM_NUM_THREADS": str(args.threads)}
    tvm_times, ort_times = [], []
    for _ in range(args.runs):  # alternate, so that other load falls on both
        tvm = run(TVM_STEPS, [tvm_dir, root / f"{name}.npz", CHECK_STEPS, args.steps, 1], tvm_env)
        ort = run(ORT_STEPS, [ort_dir, root / f"{name}.npz", CHECK_STEPS, args.steps, 1,
                              args.threads, LR, shape[0]], env)  # fmt: skip
        tvm_times += tvm["times"]
        ort_times += ort["times"]
    assert not tvm["compiler"], "the runner's process loaded TVM's compiler"
    manifest = json.loads((tvm_dir / "manifest.json").read_text())
    tvm_files = [tvm_dir / manifest[k] for k in ("library", "state")] + [tvm_dir / "manifest.json"]
    ort_files = [p for p in ort_dir.rglob("*") if p.is_file()]
    return {"tvm_losses": tvm["losses"], "ort_losses": ort["losses"], "tvm_times": tvm_times,
            "ort_times": ort_times, "tvm_size": size(tvm_files), "ort_size": size(ort_files),
            "library": size([tvm_dir / manifest["library"]]), "sizes": runtime_sizes(tvm_dir),
            "blas": bool(manifest["blas"])}


def main() -> None:
    args = parse_args()
    mb = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: bench(name, args, Path(tmp)) for name in args.models}
    for name, r in results.items():
        print(f"\n{name}: losses over {CHECK_STEPS} steps (relaxgrad / ONNX Runtime)")
        for i, (a, b) in enumerate(zip(r["tvm_losses"], r["ort_losses"])):
            print(f"  step {i + 1:2d}: {a:.6f}  {b:.6f}  rel. diff {abs(a - b) / abs(b):.1e}")
    print("\n| model | step, relaxgrad (TVM runtime) | step, ONNX Runtime | ratio | artifacts, "
          "relaxgrad | artifacts, ONNX Runtime | max rel. loss diff | calls OpenBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        tvm_ms = statistics.median(r["tvm_times"]) * 1e3
        ort_ms = statistics.median(r["ort_times"]) * 1e3
        spread = (f"({min(r['tvm_times']) * 1e3:.2f}-{max(r['tvm_times']) * 1e3:.2f})",
                  f"({min(r['ort_times']) * 1e3:.2f}-{max(r['ort_times']) * 1e3:.2f})")
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["tvm_losses"], r["ort_losses"]))
        print(f"| {name} | {tvm_ms:.2f} ms {spread[0]} | {ort_ms:.2f} ms {spread[1]} | "
              f"{tvm_ms / ort_ms:.2f} | {r['tvm_size'] / mb:.1f} MB (library "
              f"{r['library'] / mb:.2f} MB) | {r['ort_size'] / mb:.1f} MB | {diff:.1e} | "
              f"{'yes' if r['blas'] else 'no'} |")
    runtime, _, ort = next(iter(results.values()))["sizes"]
    blas = max(r["sizes"][1] for r in results.values())
    print(f"\nruntime: TVM {runtime / mb:.1f} MB (libtvm_runtime + libtvm_ffi), plus OpenBLAS "
          f"{blas / mb:.1f} MB where the library calls it; ONNX Runtime {ort / mb:.1f} MB "
          f"(its Python extension, training included)")


if __name__ == "__main__":
    main()
