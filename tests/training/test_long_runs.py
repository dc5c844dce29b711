"""Long runs: learning-rate schedules and clipping against PyTorch and Hugging Face, non-finite
steps (raised or skipped, never applied), SIGTERM/SIGINT during fit, and checkpoint files
(truncated, corrupt, leftovers, a full disk, the last K kept)."""

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from relaxgrad.training import (
    SGD,
    AdamW,
    CrossEntropyLoss,
    NonFiniteError,
    Trainer,
    from_torch,
    mlp,
    schedules,
)
from relaxgrad.training.resilience import checkpoints
from relaxgrad.training.runtime_runner import Runner
from relaxgrad.training.state import StateFileError, read_state, write_state

torch = pytest.importorskip("torch")

BATCH = 8


def _data(rows=48, seed=2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 8)).astype("float32"), rng.integers(0, 10, rows)


def _trainer(**kwargs):
    return Trainer.for_model(mlp(BATCH, in_features=8, hidden=(8,), seed=4), CrossEntropyLoss(),
                             kwargs.pop("optimizer", SGD(0.1)), **kwargs)


def _same_params(a, b):
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value, err_msg=name)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedules_match_hugging_face(kind):
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], 1.0)
    if kind == "constant":
        ours = schedules.constant(3)
        theirs = transformers.get_constant_schedule_with_warmup(opt, 3)
    else:
        ours = getattr(schedules, kind)(3, 10)
        theirs = getattr(transformers, f"get_{kind}_schedule_with_warmup")(opt, 3, 10)
    for t in range(11 if kind == "cosine" else 14):  # Hugging Face's cosine rises after total
        assert ours(t) == pytest.approx(theirs.lr_lambdas[0](t), abs=1e-12), t
    if kind == "cosine":
        assert ours(13) == 0.0  # ours stays at min_ratio
    assert schedules.from_spec(schedules.spec(ours)) == ours
    with pytest.raises(ValueError, match="total must be an int > warmup"):
        schedules.linear(5, 5)


def test_schedule_clipping_and_groups_train_as_pytorch():
    """AdamW with a cosine schedule (Hugging Face's), clipping to a global norm of 0.5 and no
    weight decay on biases and LayerNorm: the parameters after 8 steps and every step's norm
    match PyTorch's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 10))
    model = from_torch(net, (torch.randn(BATCH, 8),))
    trainer = Trainer.for_model(model, CrossEntropyLoss(),
                                AdamW(0.05, weight_decay=0.1, no_decay=("bias", "1.weight")),
                                schedule=schedules.cosine(2, 8), max_grad_norm=0.5)
    exempt = {name for name, _ in net.named_parameters() if name.endswith("bias")} | {"1.weight"}
    plain = [p for name, p in net.named_parameters() if name not in exempt]
    others = [p for name, p in net.named_parameters() if name in exempt]
    assert len(plain) == 2 and len(others) == 4
    opt = torch.optim.AdamW([{"params": plain}, {"params": others, "weight_decay": 0.0}], 0.05,
                            weight_decay=0.1)
    sched = transformers.get_cosine_schedule_with_warmup(opt, 2, 8)
    x, y = _data()
    for t in range(8):
        rows = slice(BATCH * (t % 6), BATCH * (t % 6 + 1))
        trainer.step(x[rows], y[rows])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x[rows])),
                                          torch.from_numpy(y[rows])).backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        sched.step()
        assert trainer.grad_norm == pytest.approx(float(norm), rel=1e-5), t
    assert trainer.lr == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
    for key, value in trainer.state_dict().items():
        np.testing.assert_allclose(value.numpy(), net.state_dict()[key].numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=key)


def test_a_nan_batch_raises_naming_the_step_and_changes_nothing():
    """The issue's case: NaN in one input batch (relu would hide it from the loss) raises,
    naming the step, fit's batch and the parameters; nothing is updated; training goes on as if
    the batch had not been there."""
    x, y = _data()
    x[BATCH * 2 + 3, 5] = np.nan
    trainer, clean = _trainer(optimizer=AdamW(1e-2)), _trainer(optimizer=AdamW(1e-2))
    trainer.step(x[:BATCH], y[:BATCH])
    clean.step(x[:BATCH], y[:BATCH])
    with pytest.raises(NonFiniteError, match=r"step 4 \(epoch 1, batch 3\).*fc0_weight.*not "
                                             r"applied") as err:
        trainer.fit(x, y, epochs=1, shuffle=False, progress=False)
    assert isinstance(err.value, FloatingPointError)
    # fit stepped batches 1-2 (from step 1's state), then batch 3 raised
    for name, value in trainer.state_arrays()[0].items():
        assert np.isfinite(value).all(), name
    assert trainer.steps == 3
    clean.step(x[:BATCH], y[:BATCH])
    clean.step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
    _same_params(clean, trainer)
    with pytest.raises(NonFiniteError, match="input x has 1 non-finite values"):
        _trainer(check_inputs=True).step(x[2 * BATCH:3 * BATCH], y[:BATCH])


def test_skip_counts_the_step_and_resumes(tmp_path, caplog):
    x, y = _data()
    x[BATCH * 3, 0] = np.inf
    skipping = _trainer(on_nonfinite="skip")
    with caplog.at_level(logging.WARNING, logger="relaxgrad"):
        losses = skipping.fit(x, y, epochs=1, shuffle=False, progress=False,
                              checkpoint=tmp_path / "ckpt")
    assert skipping.skipped_steps == 1 and skipping.steps == 5 and len(losses) == 6
    assert [r.message for r in caplog.records if "not applied" in r.message] and \
        "epoch 1, batch 4" in caplog.text
    clean = _trainer()
    for k in (0, 1, 2, 4, 5):
        clean.step(x[BATCH * k: BATCH * (k + 1)], y[BATCH * k: BATCH * (k + 1)])
    _same_params(clean, skipping)
    resumed = _trainer(on_nonfinite="skip")
    resumed.load(tmp_path / "ckpt")
    assert resumed.skipped_steps == 1 and resumed.steps == 5


def test_a_skipped_step_keeps_batch_norm_statistics():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 10))
    trainer = Trainer.for_model(from_torch(net, (torch.randn(BATCH, 8),)), CrossEntropyLoss(),
                                SGD(0.1), on_nonfinite="skip")
    x, y = _data()
    trainer.step(x[:BATCH], y[:BATCH])
    buffers, params = trainer.buffers, trainer.params
    x[BATCH + 1, 2] = np.nan
    trainer.step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
    assert trainer.skipped_steps == 1
    for name, value in {**buffers, **params}.items():
        np.testing.assert_array_equal({**trainer.buffers, **trainer.params}[name], value)


def _interrupt_at(step, signum):
    """A schedule (factor 1) that sends ``signum`` to this process at ``step``, once."""
    sent = []

    def schedule(t):
        if t == step and not sent:
            sent.append(t)
            os.kill(os.getpid(), signum)
        return 1.0

    return schedule


def test_sigint_finishes_the_step_checkpoints_then_raises(tmp_path):
    x, y = _data()
    straight = _trainer(optimizer=AdamW(1e-2))
    straight.fit(x, y, epochs=2, seed=1, progress=False)
    stopped = _trainer(optimizer=AdamW(1e-2), schedule=_interrupt_at(3, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        stopped.fit(x, y, epochs=2, seed=1, progress=False, checkpoint=tmp_path / "ckpt",
                    checkpoint_every=5)
    assert read_state(tmp_path / "ckpt")[1]["steps"] == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed = _trainer(optimizer=AdamW(1e-2))
    resumed.load(tmp_path / "ckpt")
    resumed.fit(x, y, epochs=2, seed=1, progress=False)
    _same_params(straight, resumed)


def test_sigterm_goes_to_the_handler_that_was_there(tmp_path):
    class Stopped(Exception):
        pass

    def handler(signum, frame):
        raise Stopped(signum)

    x, y = _data()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        trainer = _trainer(schedule=_interrupt_at(1, signal.SIGTERM))
        with pytest.raises(Stopped):
            trainer.fit(x, y, epochs=1, progress=False, checkpoint=tmp_path / "ckpt")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert read_state(tmp_path / "ckpt")[1]["steps"] == 2


SIGTERM_RUN = """
import os, signal, sys
import numpy as np
from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, mlp
def schedule(t):
    if t == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return 1.0
x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
trainer = Trainer.for_model(mlp(8, in_features=8, hidden=(8,)), CrossEntropyLoss(), SGD(0.1),
                            schedule=schedule, progress=False)
trainer.fit(x, np.arange(64) % 10, epochs=1, progress=False, checkpoint=sys.argv[1])
print("NOT STOPPED")
"""


def test_sigterm_ends_the_process_as_sigterm_does_after_a_checkpoint(tmp_path):
    run = subprocess.run([sys.executable, "-c", SIGTERM_RUN, str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGTERM, run.stderr[-2000:]
    assert "NOT STOPPED" not in run.stdout
    assert read_state(tmp_path / "ckpt")[1]["steps"] == 3


def test_keep_rotates_and_fallback_skips_broken_files(tmp_path, caplog):
    x, y = _data()
    trainer = _trainer()
    path = tmp_path / "ckpt"
    trainer.fit(x, y, epochs=1, progress=False, checkpoint=path, checkpoint_every=1, keep=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.1", "ckpt.2"]
    assert [read_state(f"{path}{s}")[1]["steps"] for s in ("", ".1", ".2")] == [6, 5, 4]

    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short
    with pytest.raises(StateFileError, match=f"{path}.*cut short"):
        _trainer().load(path)
    corrupt = bytearray((tmp_path / "ckpt.1").read_bytes())
    weight = read_state(tmp_path / "ckpt.1")[0]["param:fc0_weight"].tobytes()
    corrupt[corrupt.find(weight) + 10] ^= 0xFF  # one flipped byte in a tensor
    (tmp_path / "ckpt.1").write_bytes(bytes(corrupt))
    with pytest.raises(StateFileError, match="ckpt.1.*corrupt"):
        _trainer().load(tmp_path / "ckpt.1")
    resumed = _trainer()
    with caplog.at_level(logging.WARNING, logger="relaxgrad"):
        assert resumed.load(path, fallback=True) == f"{path}.2"
    assert resumed.steps == 4 and "passed over" in caplog.text
    (tmp_path / "ckpt.2").write_bytes(b"not a checkpoint")
    with pytest.raises(StateFileError, match="no intact checkpoint"):
        _trainer().load(path, fallback=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _trainer().load(tmp_path / "none", fallback=True)
    # a run's first start, in a folder it has not made yet: nothing to resume, said as much
    assert checkpoints(tmp_path / "new" / "ckpt") == []
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _trainer().load(tmp_path / "new" / "ckpt", fallback=True)


def test_leftovers_go_and_a_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    write_state(path, {"w": np.ones(3, "float32")}, {"step": 1})
    (tmp_path / ".tmp-abcd1234ckpt").write_bytes(b"half a file")  # a killed write's
    (tmp_path / ".tmp-abcd1234other").write_bytes(b"another file's")
    write_state(path, {"w": np.ones(3, "float32")}, {"step": 2})
    assert sorted(os.listdir(tmp_path)) == [".tmp-abcd1234other", "ckpt"]

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left") as err:
        write_state(path, {"w": np.zeros(3, "float32")}, {"step": 3})
    monkeypatch.undo()
    assert any(str(path) in note for note in err.value.__notes__)
    assert read_state(path)[1]["step"] == 2
    assert sorted(os.listdir(tmp_path)) == [".tmp-abcd1234other", "ckpt"]


def test_exported_runner_follows_the_schedule_and_clipping(tmp_path):
    x, y = _data()
    options = {"optimizer": AdamW(0.05), "schedule": schedules.linear(2, 6),
               "max_grad_norm": 0.3}
    trainer = _trainer(**options)
    trainer.export(tmp_path)
    runner = Runner(tmp_path)
    for k in range(5):
        rows = slice(BATCH * k, BATCH * (k + 1))
        assert runner.step(x[rows], y[rows]) == pytest.approx(trainer.step(x[rows], y[rows]),
                                                              rel=1e-6)
    for name, value in zip(trainer.param_names, runner.params):
        np.testing.assert_allclose(value.numpy(), trainer.params[name], rtol=1e-5, atol=1e-7)
    bad = x[:BATCH].copy()
    bad[0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="step 6"):
        runner.step(bad, y[:BATCH])
    with pytest.warns(UserWarning, match="cannot carry"):
        _trainer(schedule=lambda t: 0.5).export(tmp_path / "other")


def test_controls_are_checked():
    with pytest.raises(ValueError, match="max_grad_norm must be a number > 0"):
        _trainer(max_grad_norm=0)
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'skip'"):
        _trainer(on_nonfinite="ignore")
    trainer = _trainer(schedule=lambda t: float("nan"))
    x, y = _data()
    with pytest.raises(ValueError, match="the schedule gave nan at step 0"):
        trainer.step(x[:BATCH], y[:BATCH])
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        trainer.save("unused", keep=0)


def test_soak_bench_runs_one_round_of_each_case(tmp_path):
    """bench/soak.py's cases, one round each (the bench runs 50 and more; each round of a kill
    case starts a worker process or two)."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "soak.py")
    run = subprocess.run([sys.executable, bench, "--rounds", "1", "--steps", "200",
                          "--memory-steps", "400", "--models", "mlp", "--folder",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout and "all cases passed" in run.stdout, run.stdout
    print(textwrap.indent(run.stdout, "  "))
