"""Trainer.export: artifacts that train with TVM's runtime alone (a Python process that loads
no compiler, and the C++ example) to the parameters the in-process Trainer reaches."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi

from relaxgrad.training import (
    Adam,
    CrossEntropyLoss,
    MomentumSGD,
    Trainer,
    cnn,
    export,
    lora,
    mlp,
    runtime_runner,
)
from relaxgrad.training.runtime_runner import Runner
from relaxgrad.training.state import read_state

STEPS = 10
CPP_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpp_train"

# In a fresh process with TVM_USE_RUNTIME_LIB=1: the runner's command line from the artifacts
# folder, then a report of what the process loaded.
RUNTIME_ONLY = """
import sys
sys.path.insert(0, sys.argv[1])
import runner
runner.main(sys.argv[1:])
maps = open("/proc/self/maps").read()
print("COMPILER", "libtvm_compiler" in maps, "RELAXGRAD", "relaxgrad" in sys.modules)
"""


def _model(name):
    """A small MLP whose first layer's matmuls go to OpenBLAS (32 x 256 x 128), the same with
    LoRA adapters on both layers (its weights frozen), and the small CNN."""
    if name == "mlp":
        return mlp(32, in_features=256, hidden=(128,), seed=1), Adam(1e-2), (256,)
    if name == "lora":
        model = lora(mlp(32, in_features=256, hidden=(128,), seed=1), ["fc0", "fc1"], r=4,
                     alpha=8, seed=3)  # fmt: skip
        return model, Adam(1e-2), (256,)
    return cnn(8, image=(1, 8, 8), channels=(4, 8), seed=2), MomentumSGD(0.05, 0.9), (1, 8, 8)


@pytest.fixture(scope="module", params=["mlp", "cnn", "lora"])
def exported(request, tmp_path_factory):
    """``(trainer, folder, data)``: the trainer exported at step 0, then trained in process
    for STEPS steps on consecutive batches of ``data`` (the runner's order)."""
    model, optimizer, shape = _model(request.param)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), optimizer)
    folder = tmp_path_factory.mktemp(request.param)
    trainer.export(folder / "artifacts")
    rng = np.random.default_rng(0)
    rows = 3 * trainer.batch_size  # not a multiple of the steps' rows: the runner wraps around
    data = {"x": rng.standard_normal((rows, *shape)).astype("float32"),
            "target": rng.integers(0, 10, rows)}  # fmt: skip
    np.savez(folder / "data.npz", **data)
    tvm.runtime.save_param_dict_to_file(
        {k: tvm.runtime.tensor(v) for k, v in data.items()}, str(folder / "data.params"))
    for i in range(STEPS):
        index = np.arange(i * trainer.batch_size, (i + 1) * trainer.batch_size) % rows
        trainer.step(data["x"][index], data["target"][index])
    return trainer, folder, data


def _assert_state_matches(trainer, path, steps=STEPS):
    """The state file at ``path`` holds ``trainer``'s state after ``steps`` steps, less the
    frozen weights."""
    arrays, meta = read_state(path)
    expected, expected_meta = trainer.state_arrays()
    for name in export.frozen_names(trainer.buffer_names, trainer.updates):
        del expected[name]
    assert meta["steps"] == steps and meta["params"] == expected_meta["params"]
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():  # the same kernels, maybe other thread splits
        np.testing.assert_allclose(arrays[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_manifest_names_what_the_runner_needs(exported):
    trainer, folder, _ = exported
    art = folder / "artifacts"
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["device"] == "cpu" and manifest["batch_size"] == trainer.batch_size
    assert manifest["params"] == trainer.param_names
    assert manifest["optim"][0] == "optim:step"
    kinds = [a["kind"] for a in manifest["arguments"]]
    buffers = ["buffer"] * len(trainer.buffer_names)
    assert sorted(kinds) == sorted(["input", *buffers] + ["param"] * len(trainer.param_names))
    # The frozen weights (the LoRA model's) in their own file, the state without them.
    state, _ = read_state(art / manifest["state"])
    assert not [n for n in state if n.startswith("buffer:")]
    if trainer.buffer_names:
        frozen, _ = read_state(art / manifest["frozen"])
        assert manifest["frozen"] == "frozen.params" and manifest["updates"] == []
        assert sorted(frozen) == sorted(f"buffer:{n}" for n in trainer.buffer_names)
        for name, value in trainer.buffers.items():
            np.testing.assert_array_equal(frozen[f"buffer:{name}"], value)
    else:
        assert manifest["frozen"] is None and not (art / "frozen.params").exists()
    assert manifest["arguments"][0]["shape"] == [trainer.batch_size, *_model_shape(manifest)]
    assert manifest["target_input"]["dtype"] == "int64"
    for name in (manifest["library"], manifest["state"], "runner.py", "state.py"):
        assert (art / name).is_file()
    library = (art / manifest["library"]).read_bytes()
    if "fc0_weight" in trainer.param_names + trainer.buffer_names:  # the OpenBLAS beside it
        assert (art / manifest["blas"]).is_file() and b"scipy_cblas_sgemm" in library


def _model_shape(manifest):
    return manifest["arguments"][0]["shape"][1:]


def test_runtime_only_process_trains_like_the_trainer(exported, tmp_path):
    trainer, folder, _ = exported
    art = tmp_path / "artifacts"
    shutil.copytree(folder / "artifacts", art)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TVM_USE_RUNTIME_LIB"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME_ONLY, str(art), "--data", str(folder / "data.npz"),
         "--steps", str(STEPS)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "COMPILER False RELAXGRAD False" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if "loss" in line]
    np.testing.assert_allclose(losses, trainer.history[:STEPS], rtol=1e-5)
    _assert_state_matches(trainer, art / "state.params")

    # The Trainer resumes from what the runner wrote (the frozen weights from their file).
    before = trainer.state_arrays()[0]
    trainer.load(art / "state.params")
    assert trainer.steps == STEPS
    for name, value in trainer.state_arrays()[0].items():
        np.testing.assert_allclose(value, before[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if trainer.buffer_names:  # a state moved away from its frozen weights
        shutil.copy(art / "state.params", tmp_path / "alone.params")
        with pytest.raises(ValueError, match="frozen weights in frozen.params beside it"):
            trainer.load(tmp_path / "alone.params")


def test_runner_in_process_predicts_and_checks_inputs(exported):
    trainer, folder, data = exported
    runner = Runner(folder / "artifacts")
    runner.params = [tvm.runtime.tensor(v) for v in trainer.params.values()]
    batch = data["x"][: trainer.batch_size]
    np.testing.assert_allclose(runner.predict(batch), trainer.predict(batch), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="x must have shape"):
        runner.step(data["x"][:1], data["target"][:1])
    with pytest.raises(ValueError, match="takes 1 inputs"):
        runner.predict([batch, batch])


@pytest.fixture(scope="module")
def cpp_train(tmp_path_factory):
    """The C++ example, built with CMake against the wheels' runtime."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("the C++ example needs cmake and a C++ compiler")
    build = tmp_path_factory.mktemp("cpp_build")
    for command in (["cmake", "-S", str(CPP_EXAMPLE), "-B", str(build),
                     f"-DPython3_EXECUTABLE={sys.executable}"],
                    ["cmake", "--build", str(build)]):  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return build / "train"


def test_cpp_example_trains_like_the_trainer(exported, cpp_train, tmp_path):
    trainer, folder, _ = exported
    out = tmp_path / "state.params"
    done = subprocess.run(
        [str(cpp_train), str(folder / "artifacts"), str(folder / "data.params"), str(STEPS),
         str(out)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if "loss" in line]
    np.testing.assert_allclose(losses, trainer.history[:STEPS], rtol=1e-5)
    _assert_state_matches(trainer, out)


@pytest.mark.parametrize("exported", ["mlp"], indirect=True)
def test_cuda_artifacts_build_without_a_gpu(exported, tmp_path):
    trainer = exported[0]
    manifest = trainer.export(tmp_path, target={"kind": "cuda", "arch": "sm_90"})
    assert manifest == json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["device"] == "cuda" and json.loads(manifest["target"])["kind"] == "cuda"
    assert manifest["blas"] is None and not list(tmp_path.glob("*openblas*"))
    assert manifest["params"] == trainer.param_names
    library = (tmp_path / manifest["library"]).read_bytes()
    assert b"main_loss_adjoint" in library and b"adam_update_kernel" in library
    arrays, meta = read_state(tmp_path / manifest["state"])
    assert meta["steps"] == trainer.steps and sorted(arrays) == sorted(trainer.state_arrays()[0])
    # TVM's wheel builds CUDA kernels as source, which the runtime compiles when it loads them;
    # with nvcc here, the export ships them compiled, one fatbin per source, named by its digest
    if runtime_runner.find_nvcc() is None:
        assert manifest["device_code"] == []
        return
    sources = export.cuda_sources(trainer.compile_for({"kind": "cuda", "arch": "sm_90"}))
    names = [f"cuda/{runtime_runner.cuda_code_name(code)}" for code in sources]
    assert manifest["device_code"] == names and len(names) == 1
    fatbin = (tmp_path / names[0]).read_bytes()
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # a fatbin's magic number


def test_runner_hands_tvm_the_shipped_device_code(tmp_path):
    """The runner's ``tvm_callback_cuda_compile`` (which TVM's CUDA runtime calls with each
    module's source as it loads a library) returns the file shipped for that source, without
    compiling; another source it would compile (with the nvcc found) and keep there."""
    code = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n"
    folder = tmp_path / runtime_runner.CUDA_CODE
    folder.mkdir()
    (folder / runtime_runner.cuda_code_name(code)).write_bytes(b"shipped")
    before = tvm.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    runtime_runner.register_cuda_compiler(folder, arch="sm_90")
    try:
        callback = tvm.get_global_func("tvm_callback_cuda_compile")
        assert bytes(callback(code)) == b"shipped"
        if runtime_runner.find_nvcc() is None:
            return
        other = code.replace("1.0f", "2.0f")
        binary = bytes(callback(other))
        assert binary[:4] == bytes.fromhex("50ed55ba")
        assert (folder / runtime_runner.cuda_code_name(other)).read_bytes() == binary
    finally:
        if before is not None:
            tvm.register_global_func("tvm_callback_cuda_compile", before, override=True)


def test_runner_falls_back_to_tvms_compiler_without_nvcc(tmp_path, monkeypatch):
    """Without nvcc and without a shipped file, the callback that was registered before the
    runner's (TVM's own, with its compiler: NVRTC) compiles; the runner does not take it away."""
    before = tvm.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    calls = []

    def tvms(code, *rest):
        calls.append(code)
        return b"from TVM's callback"

    monkeypatch.setattr(runtime_runner, "_TVMS_CALLBACK", [tvm_ffi.convert(tvms)])
    monkeypatch.setattr(runtime_runner, "find_nvcc", lambda: None)
    try:
        runtime_runner.register_cuda_compiler(tmp_path, arch="sm_90")
        callback = tvm.get_global_func("tvm_callback_cuda_compile")
        assert bytes(callback("__global__ void k() {}")) == b"from TVM's callback"
        assert calls == ["__global__ void k() {}"]
    finally:
        if before is not None:
            tvm.register_global_func("tvm_callback_cuda_compile", before, override=True)


AARCH64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="no aarch64 cross compiler (Debian: gcc-aarch64-linux-gnu, "
                           "libc6-dev-arm64-cross)")  # fmt: skip
@pytest.mark.parametrize("exported", ["mlp"], indirect=True)
def test_aarch64_artifacts_cross_compile_without_openblas(exported, tmp_path):
    manifest = exported[0].export(tmp_path, target=AARCH64)
    library = (tmp_path / manifest["library"]).read_bytes()
    assert library[:4] == b"\x7fELF" and int.from_bytes(library[18:20], "little") == 183  # arm64
    assert manifest["blas"] is None and b"scipy_cblas_sgemm" not in library  # TVM's own gemms
    assert manifest["device"] == "cpu" and json.loads(manifest["target"])["mtriple"] == (
        "aarch64-linux-gnu")


def test_cross_export_without_a_cross_compiler_says_which(monkeypatch):
    from relaxgrad.training import export

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="aarch64-linux-gnu-gcc"):
        export._linker(tvm.target.Target(AARCH64))


def test_runner_updates_buffers_like_the_trainer(tmp_path):
    """A model with buffers the step replaces (train-mode BatchNorm's running statistics): the
    runner passes them as arguments and keeps the loss function's new values."""
    torch = pytest.importorskip("torch")
    from relaxgrad.training import SGD, from_torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                              torch.nn.ReLU(), torch.nn.Linear(16, 4))  # fmt: skip
    trainer = Trainer.for_model(from_torch(net, (torch.zeros(8, 8),)), CrossEntropyLoss(),
                                SGD(0.1), target="llvm")  # fmt: skip
    manifest = trainer.export(tmp_path)
    assert manifest["updates"] and [a["kind"] for a in manifest["arguments"]].count("buffer") == 3
    runner = Runner(tmp_path)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.standard_normal((8, 8)).astype("float32"), rng.integers(0, 4, 8)
        np.testing.assert_allclose(runner.step(x, y), trainer.step(x, y), rtol=1e-5)
    runner.save()
    _assert_state_matches(trainer, tmp_path / manifest["state"], steps=3)
    assert not np.allclose(trainer.buffers["1.running_mean"], 0)  # the statistics moved
