"""Train from the artifacts of ``Trainer.export`` with TVM's runtime alone.

``Trainer.export(folder)`` copies this file into ``folder`` as ``runner.py``, beside the
compiled library, the state file and ``manifest.json``; there it needs only numpy, TVM's runtime
(``TVM_USE_RUNTIME_LIB=1`` loads no compiler) and its neighbour ``state.py``, the state file
format. As a script::

    TVM_USE_RUNTIME_LIB=1 python folder/runner.py folder --data batches.npz --steps 10

trains ``--steps`` steps on consecutive batches of the arrays in ``batches.npz`` (one per model
input, by name, and ``target``), starting over at the end, printing each loss, and writes the
parameters and optimizer state back to the state file (or ``--out``), which ``Trainer.load``
resumes from. In a program: ``Runner(folder)``, then ``step``, ``predict`` and ``save``.

A training step is the two calls the manifest names under ``functions``::

    out, grads = vm[loss_adjoint](*arguments, target)                # loss and gradients
    params, optim, (norm,) = vm[optimizer](params, grads, optim, controls)   # the update

``controls`` are three 0-d tensors of the parameters' dtype: the learning rate (the manifest's
``controls.lr`` times its ``schedule`` at the step count, see ``schedules.py``), the clipping
norm (``controls.max_norm``, null for none: infinity) and a gradient multiplier; ``norm`` is
the gradients' global norm before clipping. A step whose loss or norm is not finite is not
applied: ``step`` raises ``FloatingPointError``. Artifacts of a ``precision="fp16"`` Trainer
(whose state has a ``loss_scale``) pass the scale as the adjoint's last argument and its inverse
as the multiplier, and scale dynamically as the Trainer does: a step whose gradients overflow
(with a finite loss) is skipped and halves the scale, 2,000 finite steps double it.

``arguments`` are the model function's parameters in order (``manifest["arguments"]``: each an
input, a parameter or a buffer; a buffer no step replaces, a frozen weight, is read from the
file ``manifest["frozen"]`` names, the others from the state); ``out`` is the loss, or ``(loss,
*new buffer values)`` when the manifest lists ``updates``. ``predict`` runs the model function
itself on the same arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

try:  # inside relaxgrad
    from .schedules import from_spec
    from .state import read_state, write_state
except ImportError:  # the copy beside the artifacts, with state.py and schedules.py beside it
    from schedules import from_spec
    from state import read_state, write_state

__all__ = ["CUDA_CODE", "MANIFEST", "Runner", "compile_cuda", "cuda_binary", "main",
           "register_cuda_compiler"]

MANIFEST = "manifest.json"
GROWTH_INTERVAL = 2000  # finite steps after which a float16 loss scale doubles (the Trainer's)
CUDA_CODE = "cuda"
"""The artifacts' folder of compiled CUDA device code, one file per source (its digest)."""


class Runner:
    """A training loop over exported artifacts: parameters, buffers and optimizer state live
    on the device as tensors between steps, as in ``Trainer``.

    Parameters
    ----------
    folder : str or os.PathLike
        The folder ``Trainer.export`` wrote.
    state : str or os.PathLike, optional
        A state file to start from instead of the folder's (e.g. a later checkpoint).
    """

    def __init__(self, folder, state=None):
        self.folder = os.fspath(folder)
        with open(os.path.join(self.folder, MANIFEST)) as f:
            self.manifest = json.load(f)
        self.device = tvm.device(self.manifest["device"], 0)
        _load_device_runtime(self.manifest["device"])
        if self.manifest["device"] == "cuda":
            register_cuda_compiler(os.path.join(self.folder, CUDA_CODE))
        library = tvm.runtime.load_module(os.path.join(self.folder, self.manifest["library"]))
        self.vm = VirtualMachine(library, self.device)
        self.frozen = self._read_frozen()
        self.load(state if state is not None else self.state_path)

    @property
    def state_path(self) -> str:
        """The folder's state file."""
        return os.path.join(self.folder, self.manifest["state"])

    def load(self, path) -> None:
        """Take parameters, buffers, optimizer state and step count from a state file (the
        frozen weights stay those of the folder's ``frozen.params``)."""
        arrays, self.meta = read_state(path)
        trained = [n for n in self.manifest["buffers"] if n not in self.frozen]
        names = ([f"param:{n}" for n in self.manifest["params"]] + self.manifest["optim"]
                 + [f"buffer:{n}" for n in trained])  # fmt: skip
        missing = [n for n in names if n not in arrays]
        if missing:
            raise ValueError(f"Runner: {os.fspath(path)} lacks {missing}")
        tensor = self._tensor
        self.params = [tensor(arrays[f"param:{n}"]) for n in self.manifest["params"]]
        self.buffers = {n: self.frozen[n] if n in self.frozen else tensor(arrays[f"buffer:{n}"])
                        for n in self.manifest["buffers"]}  # fmt: skip
        self.optim_state = [tensor(arrays[n]) for n in self.manifest["optim"]]
        self.steps = int(self.meta["steps"])

    def _read_frozen(self) -> dict:
        """The frozen weights (buffers no step replaces) from the folder's file, by name."""
        name = self.manifest.get("frozen")
        if not name:
            return {}
        arrays, _ = read_state(os.path.join(self.folder, name))
        return {n: self._tensor(arrays[f"buffer:{n}"]) for n in self.manifest["buffers"]
                if n not in self.manifest["updates"]}  # fmt: skip

    def step(self, inputs, target: np.ndarray) -> float:
        """One optimizer step on one batch; returns the loss before the update."""
        functions = self.manifest["functions"]
        arguments = self._arguments(inputs)
        target = self._checked(target, self.manifest["target_input"])
        scaler = self.meta.get("loss_scale")
        seed = [] if scaler is None else [self._tensor(np.array(scaler["scale"], "float32"))]
        out, grads = self.vm[functions["loss_adjoint"]](*arguments, target, *seed)
        new_params, new_state, (norm,) = self.vm[functions["optimizer"]](
            self.params, grads, self.optim_state, self.controls()
        )
        updates = self.manifest["updates"]
        loss = float((out[0] if updates else out).numpy())
        norm = float(norm.numpy())
        if scaler is not None and np.isfinite(loss) and not np.isfinite(norm):  # overflow
            scaler.update(scale=scaler["scale"] / 2, finite_steps=0)
            return loss
        if not (np.isfinite(loss) and np.isfinite(norm)):
            raise FloatingPointError(f"Runner: step {self.steps + 1}: the loss is {loss} and "
                                     f"the gradients' norm {norm}; the step was not applied")
        self.params, self.optim_state = list(new_params), list(new_state)
        if updates:  # out is (loss, *new buffer values)
            self.buffers.update(zip(updates, list(out)[1:]))
        self.steps += 1
        if scaler is not None:
            scaler["finite_steps"] += 1
            if scaler["finite_steps"] == GROWTH_INTERVAL:
                scaler.update(scale=scaler["scale"] * 2, finite_steps=0)
        return loss

    def controls(self) -> list:
        """The optimizer's controls for the next step: ``(lr, max_norm, grad_scale)``."""
        controls = self.manifest["controls"]
        lr = controls["lr"] * from_spec(controls["schedule"])(self.steps)
        max_norm = np.inf if controls["max_norm"] is None else controls["max_norm"]
        scaler = self.meta.get("loss_scale")
        unscale = 1.0 if scaler is None else 1.0 / scaler["scale"]
        dtype = self.manifest["controls"]["dtype"]
        return [self._tensor(np.array(v, dtype)) for v in (lr, max_norm, unscale)]

    def predict(self, inputs) -> np.ndarray:
        """The model's result on one batch (field 0 of a tuple result)."""
        out = self.vm[self.manifest["functions"]["predict"]](*self._arguments(inputs))
        return (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """The state as ``Trainer.state_arrays`` has it, named arrays and metadata, less the
        frozen weights (in the folder's ``frozen.params``, which the metadata names)."""
        arrays = {f"param:{n}": p.numpy() for n, p in zip(self.manifest["params"], self.params)}
        arrays.update({f"buffer:{n}": b.numpy() for n, b in self.buffers.items()
                       if n not in self.frozen})  # fmt: skip
        arrays.update({n: s.numpy() for n, s in zip(self.manifest["optim"], self.optim_state)})
        return arrays, {**self.meta, "steps": self.steps}

    def save(self, path=None) -> None:
        """Write the state (to the folder's state file by default), atomically."""
        write_state(self.state_path if path is None else path, *self.state_arrays())

    def _arguments(self, inputs) -> list:
        """The model function's arguments: inputs, parameters and buffers in its order."""
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        specs = [a for a in self.manifest["arguments"] if a["kind"] == "input"]
        if len(inputs) != len(specs):
            raise ValueError(f"Runner: the model takes {len(specs)} inputs, got {len(inputs)}")
        given = iter(self._checked(x, spec) for x, spec in zip(inputs, specs))
        params = dict(zip(self.manifest["params"], self.params))
        values = {"input": lambda _: next(given), "param": params.get, "buffer": self.buffers.get}
        return [values[a["kind"]](a["name"]) for a in self.manifest["arguments"]]

    def _checked(self, value, spec: dict) -> tvm.runtime.Tensor:
        """``value`` on the device, with the dtype and (static) shape of ``spec``."""
        value = np.asarray(value)
        shape = spec["shape"]
        if len(value.shape) != len(shape) or any(
            isinstance(d, int) and d != n for d, n in zip(shape, value.shape)
        ):
            raise ValueError(f"Runner: {spec['name']} must have shape {shape}, got {value.shape}")
        return self._tensor(value.astype(spec["dtype"], copy=False))

    def _tensor(self, value: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.array(value, order="C"), self.device)  # (keeps 0-d)


def _load_device_runtime(device: str) -> None:
    """Load TVM's runtime for a GPU (``libtvm_runtime_cuda.so``), which registers the loader
    of the library's device code and which ``TVM_USE_RUNTIME_LIB=1`` does not load."""
    path = os.path.join(os.path.dirname(tvm.__file__), "lib", f"libtvm_runtime_{device}.so")
    if device != "cpu" and os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


_TVMS_CALLBACK: list | None = None  # [the callback before ours (or None)], once looked up


def register_cuda_compiler(cache_dir=None, arch: str | None = None) -> None:
    """Let TVM's CUDA runtime load device code that was built as CUDA source.

    TVM's wheel from PyPI has no CUDA compiler in its build, so a CUDA library it exports
    holds its kernels as CUDA source; the runtime compiles them when it loads the library,
    through the global function ``tvm_callback_cuda_compile``, which a process with TVM's
    runtime alone does not have. This registers one: it returns the compiled code that
    ``cache_dir`` holds for the source (``<sha256 of the source>.fatbin``, as
    ``Trainer.export`` writes it where it finds ``nvcc``), else compiles the source with
    :func:`compile_cuda` for ``arch`` (default: GPU 0's) and keeps the result there. Where no
    ``nvcc`` is found, the callback registered before the first call of this function (TVM's
    own, in a process with TVM's compiler: NVRTC through ``cuda-bindings``) compiles instead.
    """
    global _TVMS_CALLBACK
    if _TVMS_CALLBACK is None:
        _TVMS_CALLBACK = [tvm.get_global_func("tvm_callback_cuda_compile", allow_missing=True)]
    fallback = _TVMS_CALLBACK[0]

    def compile_source(code, *rest):
        code = str(code)
        if fallback is not None and _stored(code, cache_dir) is None and find_nvcc() is None:
            return fallback(code, *rest)
        gpu_arch = arch or "sm_" + tvm.cuda(0).compute_version.replace(".", "")
        return cuda_binary(code, cache_dir, gpu_arch)

    tvm.register_global_func("tvm_callback_cuda_compile", compile_source, override=True)


def cuda_binary(code: str, cache_dir, arch: str) -> bytes:
    """``code``'s fatbin from ``cache_dir`` (``<sha256 of the source>.fatbin``), else compiled
    by :func:`compile_cuda` for ``arch`` and kept there (unless ``cache_dir`` is None or
    read-only)."""
    path = _stored(code, cache_dir)
    if path:
        with open(path, "rb") as f:
            return f.read()
    binary = compile_cuda(code, arch)
    if cache_dir is not None:
        path = os.path.join(cache_dir, cuda_code_name(code))
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(binary)
            os.replace(path + ".tmp", path)
        except OSError:  # a read-only folder: compiled again next time
            pass
    return binary


def _stored(code: str, cache_dir) -> str | None:
    """The path of ``code``'s fatbin in ``cache_dir``, where there is one."""
    if cache_dir is None:
        return None
    path = os.path.join(cache_dir, cuda_code_name(code))
    return path if os.path.exists(path) else None


def cuda_code_name(code: str) -> str:
    """The file name of ``code``'s compiled device code in :data:`CUDA_CODE`."""
    return hashlib.sha256(code.encode()).hexdigest() + ".fatbin"


def find_nvcc() -> str | None:
    """CUDA's compiler: on ``PATH``, in ``$CUDA_PATH/bin`` or ``$CUDA_HOME/bin``, else the
    newest ``/usr/local/cuda*/bin/nvcc``; None where there is none."""
    found = shutil.which("nvcc")
    homes = [os.environ.get(v) for v in ("CUDA_PATH", "CUDA_HOME")]
    candidates = [os.path.join(h, "bin", "nvcc") for h in homes if h]
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    return found or next((c for c in candidates if os.access(c, os.X_OK)), None)


def compile_cuda(code: str, arch: str) -> bytes:
    """CUDA source compiled by ``nvcc`` into a fatbin: machine code for ``arch`` (e.g.
    ``sm_90``) and its PTX, which newer GPUs compile when they load it; the options of TVM's
    own ``nvcc`` build (``-O3``, fast math)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("compile_cuda: no nvcc found (PATH, $CUDA_PATH/bin, /usr/local/cuda*) "
                           "to compile the library's CUDA kernels")
    number = arch.split("_", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        source, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
        with open(source, "w") as f:
            f.write(code)
        command = [nvcc, "--fatbin", "-O3", "--use_fast_math", "--expt-relaxed-constexpr",
                   "-gencode", f"arch=compute_{number},code=sm_{number}",
                   "-gencode", f"arch=compute_{number},code=compute_{number}",
                   "-o", out, source]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compile_cuda: nvcc failed:\n{done.stdout}{done.stderr}"[-4000:])
        with open(out, "rb") as f:
            return f.read()


def main(argv=None) -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Train from Trainer.export's artifacts.")
    parser.add_argument("folder")
    parser.add_argument("--data", required=True, help=".npz: the inputs by name, and target")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", help="state file to write (default: the folder's)")
    args = parser.parse_args(argv)
    runner = Runner(args.folder)
    data = np.load(args.data)
    names = [a["name"] for a in runner.manifest["arguments"] if a["kind"] == "input"]
    rows = len(data["target"])
    batch = runner.manifest["batch_size"] or rows
    for i in range(args.steps):
        start = i * batch % rows
        index = np.arange(start, start + batch) % rows
        loss = runner.step([data[n][index] for n in names], data["target"][index])
        print(f"step {runner.steps}: loss {loss:.6f}")
    runner.save(args.out)


if __name__ == "__main__":
    main()
