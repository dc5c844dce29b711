"""Soak: what a long run meets, many times over, on the digits MLP and a small transformer with
dropout (``--models``); prints a count per case and ``all cases passed`` or ``FAILED``.

Cases:

- ``kill``: ``--rounds`` rounds per model and signal (SIGKILL, SIGTERM): a worker process runs
  ``Trainer.fit`` for ``--steps`` steps with a checkpoint every 10 steps (``keep=2``), is sent
  the signal at a random moment, and a new worker resumes (``Trainer.load(..., fallback=True)``)
  and finishes. Its final state (parameters, optimizer state, step and key counters) must be
  bitwise equal to an uninterrupted run's; SIGTERM must end the worker with status -15 after a
  checkpoint; no temporary file may be left.
- ``bad files``: the final checkpoint cut at ``--rounds`` random lengths and with ``--rounds``
  random bytes flipped: each must be refused with a ``StateFileError`` naming the file, or (a
  byte of a reserved header field) load exactly the same state.
- ``nan``: batches with a NaN or an infinity: ``on_nonfinite="skip"`` skips exactly those steps
  (counted), the parameters stay finite and equal a run without those batches;
  ``on_nonfinite="raise"`` raises at the first.
- ``failing write``: a checkpoint write that fails for lack of room (``RLIMIT_FSIZE``, which
  fails a write as a full disk's ``ENOSPC`` does, without needing a small file system): the
  error names the file, the previous checkpoint is intact, no temporary file is left.
- ``memory``: RSS after ``--memory-steps`` steps against after 100 (``fit`` without
  checkpoints), per model.

Run ``python bench/soak.py`` (50 rounds, 2,000 steps, 10,000 for memory: tens of minutes) or
e.g. ``--rounds 1 --steps 200 --memory-steps 400 --models mlp`` (what the suite runs).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

CHECKPOINT_EVERY = 10


def build(model: str, **options):
    """``(trainer, x, y)`` for ``model`` ("mlp" or "transformer")."""
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_torch, load_digits, mlp

    data = load_digits()
    x, y = data.x_train.astype("float32"), data.y_train
    if model == "mlp":
        return Trainer.for_model(mlp(32, seed=0), CrossEntropyLoss(), Adam(1e-3), progress=False,
                                 **options), x, y
    import torch

    torch.manual_seed(0)

    class Tokens(torch.nn.Module):  # 8 rows of 8 pixels as tokens, a 1-block encoder, dropout
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(8, 32)
            self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1,
                                                          batch_first=True)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, pixels):
            return self.head(self.block(self.embed(pixels.reshape(-1, 8, 8))).mean(1))

    model = from_torch(Tokens(), (torch.randn(32, 64),))
    return Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3), progress=False,
                             **options), x, y


def epochs_for(steps: int, rows: int) -> int:
    return max(1, round(steps / (rows // 32)))


def worker(args) -> None:
    """Train ``args.model`` to the end, resuming from ``args.ckpt`` when there is one."""
    from relaxgrad.training.resilience import checkpoints

    trainer, x, y = build(args.model)
    if checkpoints(args.ckpt):
        trainer.load(args.ckpt, fallback=True)
    print("READY", flush=True)
    trainer.fit(x, y, epochs=epochs_for(args.steps, len(y)), seed=1, progress=False,
                checkpoint=args.ckpt, checkpoint_every=CHECKPOINT_EVERY, keep=2)
    trainer.save(args.out)


def run_worker(model: str, folder: str, ckpt: str, out: str, steps: int, kill=None,
               delay: float = 0.0):
    """Run a worker; with ``kill`` (a signal), send it ``delay`` seconds after it is ready.
    Returns ``(returncode, seconds from ready to exit)``."""
    command = [sys.executable, __file__, "--worker", model, "--ckpt", ckpt, "--out", out,
               "--steps", str(steps), "--folder", folder]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"worker did not start: {line}{proc.stderr.read()[-3000:]}")
    ready = time.perf_counter()
    if kill is not None:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(kill)
    _, err = proc.communicate(timeout=1800)
    if kill is None and proc.returncode != 0:
        raise RuntimeError(f"worker failed: {err[-3000:]}")
    return proc.returncode, time.perf_counter() - ready


def same_state(a: str, b: str) -> bool:
    from relaxgrad.training.state import read_state

    (arrays_a, meta_a), (arrays_b, meta_b) = read_state(a), read_state(b)
    keys = ("steps", "key_counter", "skipped_steps")
    return (sorted(arrays_a) == sorted(arrays_b)
            and all(np.array_equal(arrays_a[k], arrays_b[k]) for k in arrays_a)
            and all(meta_a.get(k) == meta_b.get(k) for k in keys))  # fmt: skip


def leftovers(folder: str) -> list[str]:
    return [f for f in os.listdir(folder) if f.startswith(".tmp-")]


def kill_case(model: str, rounds: int, steps: int, folder: str, rng, counts: dict) -> None:
    reference = os.path.join(folder, f"{model}-reference.params")
    _, seconds = run_worker(model, folder, os.path.join(folder, f"{model}-ref-ckpt"), reference,
                            steps)
    print(f"  {model}: an uninterrupted run takes {seconds:.1f} s after start-up")
    for sig in (signal.SIGKILL, signal.SIGTERM):
        name = signal.Signals(sig).name
        equal = status_ok = 0
        for r in range(rounds):
            run = os.path.join(folder, f"{model}-{name}-{r}")
            os.makedirs(run)
            ckpt, out = os.path.join(run, "ckpt"), os.path.join(run, "final.params")
            code, _ = run_worker(model, run, ckpt, out, steps, kill=sig,
                                 delay=rng.uniform(0, seconds))
            status_ok += code in (-sig, 0)  # 0: it finished before the signal
            run_worker(model, run, ckpt, out, steps)
            ok = same_state(out, reference) and not leftovers(run)
            equal += ok
            if not ok:
                print(f"  FAILED: {model} {name} round {r}: not equal to the uninterrupted run"
                      f" (or leftovers {leftovers(run)})")
        counts[f"kill {model} {name}: resumed bitwise equal"] = (equal, rounds)
        counts[f"kill {model} {name}: exit status of the signal"] = (status_ok, rounds)


def bad_files_case(model: str, rounds: int, folder: str, rng, counts: dict) -> None:
    from relaxgrad.training.state import StateFileError, read_state

    trainer, _, _ = build(model)
    source = os.path.join(folder, f"{model}-reference.params")
    data = open(source, "rb").read()
    original, meta = read_state(source)
    refused = identical = 0
    bad = os.path.join(folder, "bad.params")
    damages = [("cut", data[: rng.randrange(len(data))]) for _ in range(rounds)]
    for _ in range(rounds):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        damages.append(("flip", bytes(flipped)))
    for kind, damaged in damages:
        with open(bad, "wb") as f:
            f.write(damaged)
        try:
            arrays, got_meta = read_state(bad)
            trainer.load(bad)
        except StateFileError as err:
            refused += bad in str(err)
            continue
        except Exception as err:  # noqa: BLE001 - what the bench is looking for
            print(f"  FAILED: a {kind} file raised {type(err).__name__}: {err}")
            continue
        if (got_meta == meta and sorted(arrays) == sorted(original)
                and all(np.array_equal(arrays[k], original[k]) for k in original)):  # fmt: skip
            identical += 1
        else:
            print(f"  FAILED: a {kind} file loaded a different state")
    counts["bad files: refused naming the file, or the same state"] = (refused + identical,
                                                                       len(damages))
    print(f"  bad files: {refused} refused, {identical} loaded the same state (a reserved "
          f"field hit)")


def nan_case(model: str, rounds: int, rng, counts: dict) -> None:
    from relaxgrad.training import NonFiniteError

    skipping, x, y = build(model, on_nonfinite="skip")
    x = x[: 32 * 20].copy()
    y = y[: 32 * 20]
    poisoned = sorted(rng.sample(range(20), max(1, min(rounds, 10))))
    for batch in poisoned:
        x[32 * batch + rng.randrange(32), rng.randrange(64)] = rng.choice([np.nan, np.inf])
    skipping.fit(x, y, epochs=1, shuffle=False, progress=False)
    clean, _, _ = build(model)
    for batch in range(20):
        if batch not in poisoned:
            rows = slice(32 * batch, 32 * batch + 32)
            clean.key_counter = batch  # the key the skipping run drew for this batch
            clean.step(x[rows], y[rows])
    finite = all(np.isfinite(v).all() for v in skipping.params.values())
    same = all(np.array_equal(clean.params[k], v) for k, v in skipping.params.items())
    counts[f"nan {model}: skipped exactly the bad batches"] = (
        int(skipping.skipped_steps == len(poisoned) and finite and same), 1)
    raising, _, _ = build(model)
    try:
        raising.fit(x, y, epochs=1, shuffle=False, progress=False)
        raised = False
    except NonFiniteError as err:
        raised = f"batch {poisoned[0] + 1})" in str(err)
    counts[f"nan {model}: raised at the first bad batch"] = (int(raised), 1)


def failing_write_case(model: str, folder: str, counts: dict) -> None:
    from relaxgrad.training.state import read_state

    trainer, x, y = build(model)
    path = os.path.join(folder, f"{model}-full.params")
    trainer.step(x[:32], y[:32])
    trainer.save(path)
    trainer.step(x[32:64], y[32:64])
    size = os.path.getsize(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
    try:
        trainer.save(path)
        message = "no error"
    except OSError as err:
        message = " ".join([str(err), *getattr(err, "__notes__", [])])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    intact = read_state(path)[1]["steps"] == 1
    ok = intact and path in message and not leftovers(folder)
    print(f"  failing write: {message}")
    counts[f"failing write {model}: clear error, previous intact, no leftovers"] = (int(ok), 1)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_case(model: str, steps: int, counts: dict) -> None:
    trainer, x, y = build(model)
    per_epoch = len(y) // 32
    trainer.fit(x, y, epochs=max(1, 100 // per_epoch), progress=False)
    early, first = rss_mib(), trainer.steps
    trainer.fit(x, y, epochs=max(1, steps // per_epoch), progress=False)
    late = rss_mib()
    print(f"  memory {model}: RSS {early:.1f} MiB after {first} steps, {late:.1f} MiB after "
          f"{trainer.steps} ({late - early:+.1f} MiB)")
    counts[f"memory {model}: flat (within 8 MiB)"] = (int(late - early < 8), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--memory-steps", type=int, default=10000)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--folder", help="where the runs write (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.model = args.worker
        worker(args)
        return 0
    from _common import cpu_model  # (bench/ is first on sys.path: run as a script)

    print(f"soak on {cpu_model()}, {os.cpu_count()} CPUs: {args.rounds} rounds, {args.steps} "
          f"steps, memory over {args.memory_steps}")
    rng = random.Random(args.seed)
    counts: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or scratch
        os.makedirs(folder, exist_ok=True)
        for model in args.models.split(","):
            kill_case(model, args.rounds, args.steps, folder, rng, counts)
            bad_files_case(model, args.rounds, folder, rng, counts)
            nan_case(model, args.rounds, rng, counts)
            failing_write_case(model, folder, counts)
            memory_case(model, args.memory_steps, counts)
    width = max(map(len, counts))
    for case, (good, total) in counts.items():
        print(f"{case:<{width}}  {good}/{total}{'' if good == total else '  FAILED'}")
    failed = [case for case, (good, total) in counts.items() if good != total]
    print("FAILED: " + ", ".join(failed) if failed else "all cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
