"""One rank of the data parallel tests (tests/training/test_distributed.py): run as
``python dp_worker.py SCENARIO OUT`` under torchrun or with its environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Each rank writes ``OUT/rank<r>.npz`` (arrays) and/or
``OUT/rank<r>.json`` for the test to compare."""

import json
import os
import sys
import time

import numpy as np

ROWS, FEATURES, CLASSES, BATCH = 48, 6, 3, 8  # BATCH rows per rank
TIMEOUT = 30.0


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((ROWS, FEATURES)), rng.integers(0, CLASSES, ROWS)


def mlp_trainer(batch=BATCH, hidden=(5,), distributed=True, **kwargs):
    """The tests' MLP (float64) with Adam; the single-process reference uses it too."""
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, mlp

    model = mlp(batch, in_features=FEATURES, hidden=hidden, num_classes=CLASSES,
                dtype="float64", seed=1)
    return Trainer.for_model(model, CrossEntropyLoss(), Adam(0.05), distributed=distributed,
                             **kwargs)


def dp(timeout=TIMEOUT):
    from relaxgrad.training.distributed import DataParallel

    return DataParallel(timeout=timeout)


def mlp_run(out, rank):
    """fit 2 epochs (6 steps of 2 x 8 rows), evaluate, checkpoint; the same with accumulate=2
    on a model compiled for 4 rows; a symbolic batch whose last batch leaves rank 1 no rows."""
    x, y = data()
    trainer = mlp_trainer(distributed=dp())
    losses = trainer.fit(x, y, epochs=2)
    evaluation = trainer.evaluate(x[:-1], y[:-1])  # 47 rows: uneven shards
    trainer.save(os.path.join(out, "ckpt"))
    accumulating = mlp_trainer(batch=BATCH // 2, accumulate=2, distributed=True)
    accumulating.fit(x, y, epochs=2, progress=False)
    symbolic = mlp_trainer(batch="n", distributed=True)  # batches of 16, 16, 1 rows: 1 and 0
    symbolic_losses = symbolic.fit(x[:33], y[:33], batch_size=BATCH, progress=False)
    np.savez(os.path.join(out, f"rank{rank}.npz"), losses=losses,
             symbolic_losses=symbolic_losses,
             **{f"symbolic:{k}": v for k, v in symbolic.params.items()},
             **{f"param:{k}": v for k, v in trainer.params.items()},
             **{f"accumulate:{k}": v for k, v in accumulating.params.items()})
    _write_json(out, rank, evaluation)


def batchnorm_run(out, rank):
    """5 steps of a from_torch model with BatchNorm, against PyTorch DDP on the same shards
    (float32: TVM 0.27's importer mixes float32 into a float64 Linear)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, from_torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 5), torch.nn.BatchNorm1d(5),
                              torch.nn.ReLU(), torch.nn.Linear(5, CLASSES))
    model = from_torch(net, (torch.zeros(BATCH, FEATURES),))
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.2), distributed=dp())
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    x, y = data()
    x = x.astype("float32")
    order = np.random.default_rng(5).permutation(ROWS)
    for k in range(5):
        idx = order[16 * (k % 3): 16 * (k % 3) + 16][rank::2]
        trainer.step(x[idx], y[idx])
        optimizer.zero_grad()
        F.cross_entropy(ddp(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])).backward()
        optimizer.step()
    ours = {k: v.numpy() for k, v in trainer.state_dict().items()}
    theirs = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    np.savez(os.path.join(out, f"rank{rank}.npz"), **{f"ours:{k}": v for k, v in ours.items()},
             **{f"ddp:{k}": v for k, v in theirs.items()})


def killed_run(out, rank):
    """Checkpoint every step; rank 1 dies (os._exit) when step 4 begins, and rank 0 must fail
    with a DistributedError (its message goes to OUT/rank0.json)."""
    from relaxgrad.training.distributed import DistributedError

    x, y = data()
    trainer = mlp_trainer(distributed=dp())
    step = trainer.step

    def dying_step(*args):
        if trainer.steps == 3 and rank == 1:
            os._exit(3)
        return step(*args)

    trainer.step = dying_step
    start = time.perf_counter()
    try:
        trainer.fit(x, y, epochs=2, checkpoint=os.path.join(out, "ckpt"), checkpoint_every=1)
    except DistributedError as err:
        _write_json(out, rank, {"error": str(err), "seconds": time.perf_counter() - start,
                                "steps": trainer.steps})
        sys.exit(1)


def resumed_run(out, rank):
    """Load the killed run's checkpoint and finish its fit."""
    x, y = data()
    trainer = mlp_trainer(distributed=dp())
    trainer.load(os.path.join(out, "ckpt"))
    loaded = trainer.steps
    losses = trainer.fit(x, y, epochs=2)
    np.savez(os.path.join(out, f"rank{rank}.npz"), losses=losses,
             **{f"param:{k}": v for k, v in trainer.params.items()})
    _write_json(out, rank, {"loaded": loaded, "steps": trainer.steps})


def faults_run(out, rank):
    """Rank 1 builds another batch size, then other hidden sizes, then fits with another seed:
    both ranks must refuse each. Then rank 1 stops answering (sleeps) and rank 0's step must
    fail after the 10 s timeout."""
    from relaxgrad.training.distributed import DistributedError

    errors = []
    for kwargs in ({"batch": BATCH if rank == 0 else 4}, {"hidden": (5,) if rank == 0 else (4,)}):
        try:
            mlp_trainer(distributed=dp(timeout=10), **kwargs)
        except ValueError as err:
            errors.append(str(err))
    x, y = data()
    trainer = mlp_trainer(distributed=True)
    try:
        trainer.fit(x, y, seed=rank)
    except ValueError as err:
        errors.append(str(err))
    _write_json(out, rank, {"errors": errors})
    if rank == 1:
        time.sleep(120)
        return
    start = time.perf_counter()
    try:
        trainer.step(x[:BATCH], y[:BATCH])
    except DistributedError as err:
        _write_json(out, rank, {"errors": errors, "error": str(err),
                                "seconds": time.perf_counter() - start})
        sys.exit(1)


def _write_json(out, rank, value):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(value, f)


def nonfinite_run(out, rank):
    """A NaN in one row of the third batch, which only rank 1's shard holds: with "skip" both
    ranks skip that step and end with the same parameters; with "raise" both raise at it."""
    from relaxgrad.training import NonFiniteError

    x, y = data()
    x = x.copy()
    x[2 * 2 * BATCH + 1, 0] = np.nan  # batch 3 (rows 32-47), row 33: rank 1's (odd rows)
    skipping = mlp_trainer(distributed=dp(), on_nonfinite="skip")
    skipping.fit(x, y, epochs=1, shuffle=False, progress=False)
    raised = None
    try:
        mlp_trainer(distributed=dp()).fit(x, y, epochs=1, shuffle=False, progress=False)
    except NonFiniteError as err:
        raised = str(err)
    np.savez(os.path.join(out, f"rank{rank}.npz"),
             **{f"param:{k}": v for k, v in skipping.params.items()})
    _write_json(out, rank, {"skipped": skipping.skipped_steps, "steps": skipping.steps,
                            "raised": raised})


def preempted_run(out, rank):
    """Rank 1 gets SIGTERM during step 2: both ranks finish it, rank 0 writes the checkpoint,
    then rank 1 ends as SIGTERM ends a process and rank 0 raises DistributedError."""
    import signal

    from relaxgrad.training.distributed import DistributedError

    x, y = data()
    sent = []

    def schedule(t):
        if t == 1 and rank == 1 and not sent:
            sent.append(t)
            os.kill(os.getpid(), signal.SIGTERM)
        return 1.0

    trainer = mlp_trainer(distributed=dp(), schedule=schedule)
    try:
        trainer.fit(x, y, epochs=2, checkpoint=os.path.join(out, "ckpt"), checkpoint_every=5,
                    progress=False)
    except DistributedError as err:
        _write_json(out, rank, {"error": str(err), "steps": trainer.steps})
        sys.exit(1)
    _write_json(out, rank, {"finished": trainer.steps})


SCENARIOS = {"mlp": mlp_run, "batchnorm": batchnorm_run, "killed": killed_run,
             "resumed": resumed_run, "faults": faults_run, "nonfinite": nonfinite_run,
             "preempted": preempted_run}

if __name__ == "__main__":
    scenario, out = sys.argv[1], sys.argv[2]
    SCENARIOS[scenario](out, int(os.environ["RANK"]))
