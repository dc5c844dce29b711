"""relaxgrad.compile(..., cache=True): the same module for the same target is loaded, not built
again, in this process or another; anything that changes the build changes the key."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tvm
from tvm import relax

import relaxgrad
from relaxgrad import cache, pipeline
from relaxgrad.training import SGD, CrossEntropyLoss, mlp
from relaxgrad.training.trainer import training_module


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAXGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RELAXGRAD_CACHE", raising=False)
    return tmp_path


@pytest.fixture
def counted(monkeypatch):
    """Counts the builds relaxgrad.compile does."""
    builds = []
    real = pipeline._compile

    def build(*args):
        builds.append(args)
        return real(*args)

    monkeypatch.setattr(pipeline, "_compile", build)
    return builds


def _adjoint_module(hidden=8):
    model = mlp(4, hidden=(hidden,), seed=1)
    mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1), "main")
    return mod, model


def _run(executable, model):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    x = np.linspace(-1, 1, 4 * 64, dtype="float32").reshape(4, 64)
    args = [tvm.runtime.tensor(x)] + [tvm.runtime.tensor(v) for v in model.params.values()]
    out = vm["main"](*args)
    return out.numpy()


def test_second_compile_is_loaded_and_computes_the_same(cache_dir, counted):
    mod, model = _adjoint_module()
    first = relaxgrad.compile(mod, "llvm", cache=True)
    assert len(counted) == 1 and len(list(cache_dir.glob("*.so"))) == 1
    second = relaxgrad.compile(mod, "llvm", cache=True)
    assert len(counted) == 1, "the second compile built again"
    np.testing.assert_array_equal(_run(first, model), _run(second, model))


def test_another_process_loads_the_entry_even_while_it_is_built(cache_dir, tmp_path):
    # as the ranks of a data-parallel run on one machine, compiling the same step at once: the
    # second process waits for the first's entry (a lock beside it) and loads it
    script = textwrap.dedent("""
        import os, sys, time
        import relaxgrad
        from relaxgrad import pipeline
        from relaxgrad.training import SGD, CrossEntropyLoss, mlp
        from relaxgrad.training.trainer import training_module
        model = mlp(4, hidden=(8,), seed=1)
        mod = training_module(model.mod, list(model.params), CrossEntropyLoss(), SGD(0.1),
                              "main")
        real = pipeline._compile
        building, asking = sys.argv[2], sys.argv[2] + ".asking"
        def build(*args):
            if sys.argv[1] == "load":
                raise SystemExit("built again")
            open(building, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(asking) and time.monotonic() < deadline:
                time.sleep(0.05)  # until the other process asks for the same module
            time.sleep(0.5)
            return real(*args)
        pipeline._compile = build
        if sys.argv[1] == "load":
            open(asking, "w").close()
        relaxgrad.compile(mod, "llvm", cache=True)
        print("ok")
    """)
    env = {**os.environ, "RELAXGRAD_CACHE_DIR": str(cache_dir)}
    building = tmp_path / "building"
    builder = subprocess.Popen([sys.executable, "-c", script, "build", str(building)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not building.exists() and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert building.exists() and not list(cache_dir.glob("*.so"))
        loader = subprocess.run([sys.executable, "-c", script, "load", str(building)], env=env,
                                capture_output=True, text=True, timeout=300)
    finally:
        out, err = builder.communicate(timeout=300)
    assert builder.returncode == 0 and "ok" in out, err[-2000:]
    assert loader.returncode == 0 and "ok" in loader.stdout, loader.stderr[-2000:]


def test_module_target_and_switches_change_the_key(cache_dir, counted, monkeypatch):
    mod, _ = _adjoint_module()
    relaxgrad.compile(mod, "llvm", cache=True)
    relaxgrad.compile(_adjoint_module(hidden=16)[0], "llvm", cache=True)  # another module
    relaxgrad.compile(mod, {"kind": "llvm", "mcpu": "x86-64"}, cache=True)  # another target
    with tvm.transform.PassContext(opt_level=3):  # the default is 2
        relaxgrad.compile(mod, "llvm", cache=True)  # another opt level
    relaxgrad.compile(mod, "llvm")  # cache off: always built
    monkeypatch.setenv("RELAXGRAD_CACHE", "0")
    relaxgrad.compile(mod, "llvm", cache=True)  # off everywhere
    assert len(counted) == 6
    assert len(list(cache_dir.glob("*.so"))) == 4


def test_a_broken_entry_is_built_again(cache_dir, counted, caplog):
    mod, model = _adjoint_module()
    reference = _run(relaxgrad.compile(mod, "llvm", cache=True), model)
    (entry,) = cache_dir.glob("*.so")
    entry.write_bytes(b"not a library")
    again = relaxgrad.compile(mod, "llvm", cache=True)
    assert len(counted) == 2 and "cannot load" in caplog.text
    np.testing.assert_array_equal(_run(again, model), reference)
    cache.clear()
    assert not cache_dir.exists()


def test_a_loaded_executable_exports_its_library(cache_dir, tmp_path):
    mod, model = _adjoint_module()
    built = relaxgrad.compile(mod, "llvm", cache=True)
    loaded = relaxgrad.compile(mod, "llvm", cache=True)
    assert loaded.library is not None
    loaded.export_library(str(tmp_path / "step.so"))
    again = relax.VMExecutable(tvm.runtime.load_module(str(tmp_path / "step.so")))
    np.testing.assert_array_equal(_run(again, model), _run(built, model))
    with pytest.raises(relaxgrad.GradientError, match="cannot be linked again"):
        loaded.export_library(str(tmp_path / "other.so"), options=["-O2"])


def test_no_entry_for_a_target_this_process_cannot_load(cache_dir, counted, caplog):
    """A CUDA library built where TVM has no CUDA runtime (a CPU machine) is not stored: it
    could never be loaded here (it was, and each compile warned and built again)."""
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        pytest.skip("this process can load CUDA libraries")
    mod, _ = _adjoint_module()
    for _ in range(2):
        relaxgrad.compile(mod, {"kind": "cuda", "arch": "sm_90"}, cache=True)
    assert len(counted) == 2 and not list(cache_dir.glob("*.so"))
    assert "cannot load" not in caplog.text


def test_a_trainer_holds_a_loaded_library_not_its_build(monkeypatch):
    """Built without the cache, the Trainer's executable is the library exported and loaded
    back (a build keeps LLVM's module in memory), and it trains as the build does."""
    monkeypatch.setenv("RELAXGRAD_CACHE", "0")
    from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, mlp

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 12)).astype("float32"), rng.integers(0, 3, 8)
    losses = []
    for reload in (True, False):
        if not reload:
            monkeypatch.setattr("relaxgrad.training.trainer.reloaded", lambda e, load: e)
        trainer = Trainer.for_model(mlp(8, in_features=12, hidden=(6,), num_classes=3),
                                    CrossEntropyLoss(), SGD(0.1), cache=False, progress=False)
        assert (trainer.executable.library is not None) == reload
        losses.append([trainer.step(x, y) for _ in range(3)])
    assert losses[0] == losses[1]
