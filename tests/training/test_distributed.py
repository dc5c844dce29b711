"""Data parallel training: 2 gloo processes on loopback (tests/training/dp_worker.py), compared
with one process on the whole batch, with PyTorch DDP, and with themselves after a kill and a
resume; a dead, a hung or a mismatched rank is a clear error."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")
#: one worker runs them all under pytest-xdist, so each module fixture (a 2-rank launch) runs once
pytestmark = pytest.mark.xdist_group("distributed")

from relaxgrad.training.state import read_state  # noqa: E402

from .dp_worker import data, mlp_trainer  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "dp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 90  # seconds a launch may take before the test fails


def _env(rank: int | None = None, port: int | None = None) -> dict:
    env = {**os.environ, "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, out, wait_for: tuple[int, ...] = (0, 1)) -> dict:
    """Run 2 ranks of ``scenario`` with torchrun's environment; ``{rank: (returncode, stderr)}``
    for the ranks in ``wait_for`` (the others are killed once those end)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(out)], env=_env(r, port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        return {r: (procs[r].wait(LIMIT), procs[r].stderr.read()) for r in wait_for}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()


def result(out, rank: int, ext: str = "json"):
    """What ``rank`` wrote: ``rank<r>.npz`` as a dict of arrays, or ``rank<r>.json``."""
    path = os.path.join(out, f"rank{rank}.{ext}")
    if ext == "npz":
        return dict(np.load(path))
    with open(path) as f:
        return json.load(f)


def ranks(out, ext: str) -> list:
    return [result(out, r, ext) for r in range(2)]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """The MLP scenario under torchrun itself."""
    out = tmp_path_factory.mktemp("mlp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), WORKER, "mlp",
           str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference():
    """One process on the whole batches (16 rows) of the same epochs."""
    x, y = data()
    trainer = mlp_trainer(batch=16, distributed=False)
    losses = trainer.fit(x, y, epochs=2, progress=False)
    return trainer, losses


def test_two_ranks_take_the_steps_of_one_process_on_the_whole_batch(mlp_run, reference):
    trainer, losses = reference
    first, second = ranks(mlp_run, "npz")
    assert len(first["losses"]) == 6
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-12)
    for name, value in trainer.params.items():
        np.testing.assert_array_equal(first[f"param:{name}"], second[f"param:{name}"])
        np.testing.assert_allclose(first[f"param:{name}"], value, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(first[f"accumulate:{name}"], value, rtol=1e-10, atol=1e-12)
        assert not np.allclose(value, mlp_trainer(distributed=False).params[name])


def test_uneven_and_empty_shards_are_weighted_by_rows(mlp_run):
    """33 rows in batches of 2 x 8 (symbolic batch): the last batch is 1 row on rank 0 and
    none on rank 1; the steps are those of one process on batches of 16, 16 and 1 rows."""
    x, y = data()
    single = mlp_trainer(batch="n", distributed=False)
    losses = single.fit(x[:33], y[:33], batch_size=16, progress=False)
    for arrays in ranks(mlp_run, "npz"):
        np.testing.assert_allclose(arrays["symbolic_losses"], losses, rtol=1e-12)
        for name, value in single.params.items():
            np.testing.assert_allclose(arrays[f"symbolic:{name}"], value, rtol=1e-10,
                                       atol=1e-12)


def test_evaluate_reduces_over_ranks(mlp_run, reference):
    trainer, _ = reference
    x, y = data()
    expected = trainer.evaluate(x[:-1], y[:-1])
    for got in ranks(mlp_run, "json"):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-12)


def test_rank_0_writes_the_checkpoint(mlp_run, reference):
    trainer, _ = reference
    arrays, meta = read_state(mlp_run / "ckpt")
    assert meta["steps"] == 6 and meta["fit"]["world_size"] == 2
    assert (meta["fit"]["epoch"], meta["fit"]["batch"]) == (1, 3)
    for name, value in trainer.params.items():
        np.testing.assert_allclose(arrays[f"param:{name}"], value, rtol=1e-10, atol=1e-12)


def test_batchnorm_matches_pytorch_ddp(tmp_path):
    results = launch("batchnorm", tmp_path)
    assert all(code == 0 for code, _ in results.values()), results
    for rank, arrays in enumerate(ranks(tmp_path, "npz")):
        keys = [k.split(":", 1)[1] for k in arrays if k.startswith("ddp:")]
        assert "1.running_mean" in keys and "1.num_batches_tracked" in keys
        for key in keys:
            np.testing.assert_allclose(arrays[f"ours:{key}"], arrays[f"ddp:{key}"], rtol=1e-5,
                                       atol=1e-6, err_msg=f"rank {rank}: {key}")


def test_a_run_killed_after_step_3_resumes_to_the_uninterrupted_parameters(tmp_path, mlp_run):
    results = launch("killed", tmp_path, wait_for=(0, 1))
    (code0, err0), (code1, _) = results[0], results[1]
    assert code1 == 3 and code0 == 1, err0[-3000:]
    failure = result(tmp_path, 0)
    assert "rank 0 of 2" in failure["error"] and "all-reduce of gradients" in failure["error"]
    assert failure["steps"] == 3 and failure["seconds"] < 30  # the connection closes: no wait
    _, meta = read_state(tmp_path / "ckpt")
    assert meta["steps"] == 3 and (meta["fit"]["epoch"], meta["fit"]["batch"]) == (0, 3)

    results = launch("resumed", tmp_path)
    assert all(code == 0 for code, _ in results.values()), results
    uninterrupted = ranks(mlp_run, "npz")[0]
    for state, resumed in zip(ranks(tmp_path, "json"), ranks(tmp_path, "npz")):
        assert state == {"loaded": 3, "steps": 6}
        np.testing.assert_array_equal(resumed["losses"], uninterrupted["losses"][3:])
        for key in (k for k in resumed if k.startswith("param:")):
            np.testing.assert_array_equal(resumed[key], uninterrupted[key])


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The faults scenario: three mismatches, then rank 1 hangs (killed once rank 0 ends)."""
    out = tmp_path_factory.mktemp("faults")
    start = time.perf_counter()
    code, err = launch("faults", out, wait_for=(0,))[0]
    return out, code, err, time.perf_counter() - start


def test_a_nan_on_one_rank_is_the_same_decision_on_every_rank(tmp_path):
    """The norm the ranks check is of the averaged gradients: a NaN in rank 1's shard makes
    both ranks skip the step (the same parameters after), or both raise at it."""
    done = launch("nonfinite", tmp_path)
    assert all(code == 0 for code, _ in done.values()), done
    first, second = ranks(tmp_path, "json")
    assert first["skipped"] == second["skipped"] == 1 and first["steps"] == second["steps"] == 2
    assert first["raised"] and second["raised"] and "epoch 1, batch 3" in first["raised"]
    params = ranks(tmp_path, "npz")
    for key, value in params[0].items():
        np.testing.assert_array_equal(params[1][key], value)
        assert np.isfinite(value).all()


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    from relaxgrad.training.state import read_state

    done = launch("preempted", tmp_path)
    assert done[1][0] == -signal.SIGTERM and done[0][0] == 1, done
    stopped = result(tmp_path, 0)
    assert "another rank was stopped" in stopped["error"] and stopped["steps"] == 2
    assert read_state(tmp_path / "ckpt")[1]["steps"] == 2


def test_mismatched_ranks_are_refused_at_start(faults):
    out = faults[0]
    for rank in range(2):
        batch, hidden, seed = result(out, rank)["errors"]
        assert f"rank {rank} of 2" in batch
        assert "differ in the Trainer: batch size: rank 0 8, rank 1 4" in batch
        assert "parameters" in hidden and "(5, 6)" in hidden and "(4, 6)" in hidden
        assert "differ in the arguments of fit: seed: rank 0 0, rank 1 1" in seed


def test_a_hung_rank_fails_the_others_after_the_timeout(faults):
    out, code, err, seconds = faults
    assert code == 1, err[-3000:]
    failure = result(out, 0)
    assert "all-reduce of gradients failed" in failure["error"]
    assert 9 < failure["seconds"] < 30
    assert seconds < LIMIT


def test_demo_under_torchrun_trains_data_parallel():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m",
           "relaxgrad.cli", "demo", "--epochs", "5"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("data parallel on 2 processes") == 1  # rank 0 alone prints
    assert done.stdout.count("test accuracy") == 1
    assert done.stderr.count("\n  0%|") == 1  # one progress bar (110 steps of 2 x 32 rows)
    assert "epoch 5/5: 100%|██████████| 110/110" in done.stderr


def test_without_a_group_or_torchrun_the_error_says_what_to_do(monkeypatch):
    from relaxgrad.training import DataParallel

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="run under torchrun.*lacks RANK, WORLD_SIZE"):
        DataParallel().attach(trainer=None)


def test_buckets_are_aligned_views_that_round_trip():
    import torch
    import tvm

    from relaxgrad.training.distributed import _buckets, _unbucket

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)), rng.integers(0, 9, 7), rng.standard_normal(1),
              rng.standard_normal((2, 2, 3)).astype("float32")]
    tensors = [torch.from_dlpack(tvm.runtime.tensor(a)) for a in arrays]
    extra = torch.tensor([1.0, 2.0], dtype=torch.float64)
    buckets = _buckets(tensors, scale=1, extra=extra)
    assert [flat.dtype for flat, _ in buckets] == [torch.float64, torch.int64, torch.float32]
    assert len(buckets[0][0]) == 16 + 8 + 2  # 15 and 1 float64s, padded to 64 bytes; the extra
    out = _unbucket(buckets, len(arrays))
    for array, tensor in zip(arrays, out):
        assert isinstance(tensor, tvm.runtime.Tensor)
        np.testing.assert_array_equal(tensor.numpy(), array)
    buckets[0][0][16] = 42.0  # a view, not a copy
    assert out[2].numpy()[0] == 42.0
    scaled = _unbucket(_buckets(tensors[:1], scale=3.0), 1)[0].numpy()
    np.testing.assert_array_equal(scaled, 3 * arrays[0])
