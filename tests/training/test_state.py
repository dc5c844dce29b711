import os

import numpy as np
import pytest

from relaxgrad.training.state import META_KEY, read_state, write_state


def test_round_trip_keeps_values_dtypes_and_meta(tmp_path):
    arrays = {"w": np.arange(6, dtype="float32").reshape(2, 3), "step": np.array(7, "int64"),
              "scalar": np.float32(2.5), "key": np.array([1, 2], "uint32")}
    path = tmp_path / "ckpt.params"
    write_state(path, arrays, {"step": 7, "names": ["w"]})
    got, meta = read_state(path)
    assert meta == {"step": 7, "names": ["w"]}
    assert set(got) == set(arrays)
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype and got[name].shape == np.shape(value)
        np.testing.assert_array_equal(got[name], value)


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.params"
    write_state(path, {"w": np.ones(3, "float32")}, {"step": 1})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_state(path, {"w": np.zeros(3, "float32")}, {"step": 2})
    monkeypatch.undo()
    got, meta = read_state(path)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(got["w"], np.ones(3, "float32"))
    assert os.listdir(tmp_path) == ["ckpt.params"]


def test_reserved_name_and_foreign_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_state(tmp_path / "a", {META_KEY: np.zeros(1)}, {})
    import tvm

    (tmp_path / "b").write_bytes(bytes(tvm.runtime.save_param_dict(
        {"w": tvm.runtime.tensor(np.zeros(1, "float32"))})))
    with pytest.raises(ValueError, match="not a relaxgrad state file"):
        read_state(tmp_path / "b")


def test_trainer_save_then_load_resumes_the_same_run(tmp_path):
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, load_digits, mlp

    data = load_digits()
    x, y = data.x_train[:96], data.y_train[:96]

    def trainer():
        model = mlp(32, hidden=(16,), seed=3)
        return Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-2))

    straight = trainer()
    for i in range(3):
        straight.step(x[32 * i: 32 * i + 32], y[32 * i: 32 * i + 32])

    first = trainer()
    first.step(x[:32], y[:32])
    first.save(tmp_path / "ckpt")
    resumed = trainer()  # a fresh Trainer, as in a new process
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps == 1
    for i in range(1, 3):
        resumed.step(x[32 * i: 32 * i + 32], y[32 * i: 32 * i + 32])
    assert resumed.steps == 3
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value)
    fresh = trainer()
    fresh.step(x[:32], y[:32])
    assert any(not np.array_equal(fresh.params[n], v) for n, v in straight.params.items())


def test_trainer_load_refuses_another_models_state(tmp_path):
    from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, mlp

    small = Trainer.for_model(mlp(8, hidden=(16,)), CrossEntropyLoss(), SGD(0.1))
    small.save(tmp_path / "ckpt")
    wide = Trainer.for_model(mlp(8, hidden=(32,)), CrossEntropyLoss(), SGD(0.1))
    with pytest.raises(ValueError, match="Trainer.load: .*param:"):
        wide.load(tmp_path / "ckpt")


def test_fit_resumes_mid_epoch_from_its_checkpoint(tmp_path):
    """fit checkpoints its position (epoch, batch, shuffling state); a fresh Trainer that loads
    the checkpoint of step 4 (mid-epoch 2) and fits again takes steps 5..9 of the whole run."""
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, mlp

    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((30, 64)).astype("float32"), rng.integers(0, 10, 30)

    def trainer():
        return Trainer.for_model(mlp(8, hidden=(8,), seed=4), CrossEntropyLoss(), Adam(1e-2))

    straight = trainer()
    losses = straight.fit(x, y, epochs=3, seed=7, progress=False)
    assert len(losses) == 9

    interrupted, ckpt = trainer(), tmp_path / "ckpt"
    step = interrupted.step

    def failing_step(*args):
        if interrupted.steps == 5:
            raise KeyboardInterrupt
        return step(*args)

    interrupted.step = failing_step
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(x, y, epochs=3, seed=7, progress=False, checkpoint=ckpt,
                        checkpoint_every=2)
    _, meta = read_state(ckpt)
    assert meta["steps"] == 4 and (meta["fit"]["epoch"], meta["fit"]["batch"]) == (1, 1)

    resumed = trainer()
    resumed.load(ckpt)
    with pytest.raises(ValueError, match="cannot resume the loaded run, which had seed 7"):
        resumed.fit(x, y, epochs=3, seed=8, progress=False)
    resumed.load(ckpt)
    assert resumed.fit(x, y, epochs=3, seed=7, progress=False) == losses[4:]
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value)
    # without a load, fit starts a new run (not at the saved end of epoch 3, which has none)
    assert len(resumed.fit(x, y, epochs=1, seed=7, progress=False)) == 3
