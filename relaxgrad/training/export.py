"""Training artifacts that run with TVM's runtime alone (:meth:`Trainer.export`).

A folder holds the compiled library (``train.so``: the loss adjoint, the optimizer step, the
model function and the per-sample loss), the parameters, buffers and optimizer state in
:mod:`relaxgrad.training.state`'s format (``state.params``, the file ``Trainer.save`` writes and
``Trainer.load`` reads), ``manifest.json`` (function names, the model function's arguments with
their names, shapes and dtypes, the loss target's, the state's array order, optimizer, loss and
target), ``frozen.params`` where the model has frozen weights (buffers no step replaces: a LoRA
base's), in the same format, apart from the state so that an inference deployment can share that
file and a checkpoint stays the size of what trains, and ``runner.py`` with ``state.py``, a
training loop that needs only numpy and TVM's runtime
(:mod:`relaxgrad.training.runtime_runner`), and ``schedules.py``, the learning-rate schedules it
computes (a schedule that is a function of the user's is not exported: the runner then trains at
the optimizer's learning rate, with a warning here). A CPU library calling OpenBLAS gets the
``scipy-openblas32`` wheel's library beside it, which it finds by its run path ``$ORIGIN``, and
one calling oneDNN (bfloat16 products) the ``onednn-cpu-gomp`` wheel's."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import tvm

from .. import _ty
from ..pipeline import Executable, resolve_target, target_device
from ..schedules import blas, onednn
from . import runtime_runner, schedules, state

__all__ = ["FROZEN", "LIBRARY", "STATE", "compile_device_code", "cuda_sources", "export_trainer"]

LIBRARY = "train.so"
STATE = "state.params"
FROZEN = "frozen.params"


def export_trainer(trainer, folder, target=None) -> dict:
    """Write ``trainer``'s training artifacts to ``folder`` (see the module docstring).

    Parameters
    ----------
    trainer : Trainer
        Its current parameters and optimizer state are exported.
    folder : str or os.PathLike
        Created if missing; files of the same names are replaced.
    target : str, dict or tvm.target.Target, optional
        Build for this target (e.g. ``"cuda"``, which needs no GPU to build) instead of
        reusing the Trainer's compiled code.

    Returns
    -------
    dict
        The manifest.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if target is None:
        executable, target = trainer.executable, resolve_target(trainer.target)
    else:
        target = resolve_target(target)
        executable = trainer.compile_for(target)
    library = os.path.join(folder, LIBRARY)
    executable.export_library(library, **_linker(target))
    shipped = _ship(folder, isinstance(executable, Executable) and executable.blas_linked,
                    blas.library_path)
    dnnl = _ship(folder, isinstance(executable, Executable) and executable.onednn_linked,
                 onednn.library_path)
    arrays, meta = trainer.state_arrays()
    frozen = frozen_names(trainer.buffer_names, trainer.updates)
    if frozen:
        weights = {name: arrays.pop(name) for name in frozen}
        state.write_state(os.path.join(folder, FROZEN), weights, {"format": 1})
        meta["frozen"] = FROZEN
    state.write_state(os.path.join(folder, STATE), arrays, meta)
    device_code = compile_device_code(executable, target, folder)
    shutil.copy2(runtime_runner.__file__, os.path.join(folder, "runner.py"))
    shutil.copy2(state.__file__, os.path.join(folder, "state.py"))
    shutil.copy2(schedules.__file__, os.path.join(folder, "schedules.py"))
    manifest = _manifest(trainer, target, shipped)
    manifest["onednn"] = dnnl
    manifest["frozen"] = FROZEN if frozen else None
    manifest["device_code"] = device_code
    with open(os.path.join(folder, runtime_runner.MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def frozen_names(buffers, updates) -> list[str]:
    """The state-array names (``buffer:<name>``) of the buffers no step replaces."""
    return [f"buffer:{n}" for n in buffers if n not in updates]


def _ship(folder: str, linked: bool, library_path) -> str | None:
    """Copy the library at ``library_path()`` into ``folder`` where the code links it; its name
    (the exported library finds it there by its run path ``$ORIGIN``), else None."""
    if not linked:
        return None
    name = os.path.basename(library_path())
    shutil.copy2(library_path(), os.path.join(folder, name))
    return name


def cuda_sources(executable) -> list[str]:
    """The CUDA source of each device module of ``executable`` (TVM's wheel builds CUDA
    libraries holding source, which the runtime compiles when it loads them)."""

    def modules(mod):
        yield mod
        for imported in mod.imports:
            yield from modules(imported)

    return [m.inspect_source() for m in modules(executable.mod) if m.kind == "cuda"]


def compile_device_code(executable, target: tvm.target.Target, folder) -> list[str]:
    """For a CUDA target, where ``nvcc`` is found: each device module's source compiled for
    the target's arch into ``folder/cuda/<digest>.fatbin``, which the runner hands TVM's
    runtime instead of compiling at load. Returns those files' names (none without nvcc:
    then the runner compiles at load, with the nvcc of the machine it runs on)."""
    if target.kind.name != "cuda" or runtime_runner.find_nvcc() is None:
        return []
    arch = str(target.attrs.get("arch", ""))
    if not arch.startswith("sm_"):
        return []
    names = []
    for code in cuda_sources(executable):
        runtime_runner.cuda_binary(code, os.path.join(folder, runtime_runner.CUDA_CODE), arch)
        names.append(f"{runtime_runner.CUDA_CODE}/{runtime_runner.cuda_code_name(code)}")
    return names


def _linker(target: tvm.target.Target) -> dict:
    """``export_library``'s arguments for ``target``: for another CPU architecture (an ``llvm``
    target with its ``mtriple``), its GNU cross compiler ``<mtriple>-gcc``."""
    if target.kind.name != "llvm" or blas.native_arch(target):
        return {}
    compiler = f"{target.attrs['mtriple']}-gcc"
    if shutil.which(compiler) is None:
        raise ValueError(f"Trainer.export: linking for {target.attrs['mtriple']} needs the cross "
                         f"compiler {compiler} (e.g. Debian's gcc-aarch64-linux-gnu)")
    from tvm.support import cc

    return {"fcompile": cc.cross_compiler(compiler)}


def _manifest(trainer, target: tvm.target.Target, shipped: str | None) -> dict:
    loss_func = trainer.mod[f"{trainer.func_name}_loss"]
    kinds = {i: "input" for i in trainer._input_pos}
    kinds.update({i: "param" for i in trainer._param_pos})
    kinds.update({i: "buffer" for i in trainer._buffer_pos})
    arguments = [{"kind": kinds[i], **_spec(p)} for i, p in enumerate(loss_func.params[:-1])]
    name = trainer.func_name
    loss = trainer.loss
    return {
        "format": 1,
        "library": LIBRARY,
        "state": STATE,
        "blas": shipped,
        "target": str(target),
        "device": target_device(target).type,
        "functions": {"loss_adjoint": f"{name}_loss_adjoint", "optimizer": f"{name}_optimizer",
                      "predict": trainer.eval_func, "sample_loss": f"{name}_sample_loss"},
        "arguments": arguments,
        "target_input": _spec(trainer._target),
        "batch_size": trainer.batch_size,
        "params": trainer.param_names,
        "buffers": trainer.buffer_names,
        "updates": list(trainer.updates),
        "optim": trainer._optim_names(),
        "optimizer": repr(trainer.optimizer),
        "loss": f"{type(loss).__name__}(reduction={loss.reduction!r})",
        "controls": _controls(trainer),
    }  # fmt: skip


def _controls(trainer) -> dict:
    """The manifest's ``controls``: the optimizer's learning rate, the Trainer's schedule
    (:func:`schedules.spec`) and clipping norm, and their dtype."""
    schedule = schedules.spec(trainer.schedule)
    if trainer.schedule is not None and schedule is None:
        warnings.warn(f"Trainer.export: the schedule {trainer.schedule!r} is a function, which "
                      f"the artifacts cannot carry: the runner trains at the optimizer's "
                      f"learning rate {trainer.optimizer.lr}", stacklevel=3)
    return {"lr": trainer.optimizer.lr, "schedule": schedule,
            "max_norm": trainer.max_grad_norm, "dtype": trainer.optimizer.dtype,
            "loss_scale": trainer.loss_scale is not None}


def _spec(var) -> dict:
    """Name, shape (ints, or the names of symbolic dims) and dtype of a parameter var."""
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in _ty.shape_values(var)]
    return {"name": var.name, "shape": shape, "dtype": _ty.dtype_of(var)}
