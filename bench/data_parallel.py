"""Data parallel throughput: relaxgrad on 1 and 2 processes against PyTorch (DDP) on the same.

The model is an MLP (``--features`` (256) -> ``--hidden`` (512, 512) -> 10, ReLU, float32,
cross-entropy, Adam) with ``--batch`` (64) rows per process; every process runs 1 thread
(``TVM_NUM_THREADS=1``, ``torch.set_num_threads(1)``) and the processes talk over gloo on
loopback, launched with torchrun's environment. For each framework and process count it prints
the samples per second (all processes together) over ``--steps`` timed steps after
``--warmup`` (the fastest of ``--rounds`` interleaved runs); for relaxgrad on 2 processes, the
time per step of the gradient reduction: the ``all_reduce`` (waiting for the slower rank
included), the copies into the flat buffer and the DLPack views back, and one ``all_reduce`` of
the gradients' bytes after a barrier. The ratio line compares relaxgrad with DDP on 2
processes.

Then a model of the scaling to more machines, from the measured compute time per step (1
process) and the gradients' bytes: a ring all-reduce moves ``2 (N-1)/N x bytes`` through each
worker's link, so it takes ``2 (N-1)/N x bytes / bandwidth`` (plus ``2 (N-1)`` latencies of
``--latency-us``); relaxgrad reduces after the whole backward pass (no overlap), so the
efficiency is ``compute / (compute + all-reduce)``, shown for the measured rows per worker and
for 8 times as many (8 times the compute for the same bytes).

Run ``python bench/data_parallel.py`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

CLASSES = 10


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    parser.add_argument("--batch", type=int, default=64, help="rows per process")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each configuration, interleaved; the fastest is shown")
    parser.add_argument("--latency-us", type=float, default=50.0,
                        help="per-message network latency of the scaling model")
    parser.add_argument("--worker", choices=["relaxgrad", "torch"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def data(args, rank: int):
    rng = np.random.default_rng(rank)
    n = args.batch * 8
    return (rng.standard_normal((n, args.features)).astype("float32"),
            rng.integers(0, CLASSES, n))


def timed(step, args, x, y) -> float:
    """Seconds of ``args.steps`` steps, after ``args.warmup``, cycling over the data."""
    batches = [slice(i, i + args.batch) for i in range(0, len(y), args.batch)]
    for i in range(args.warmup):
        step(x[batches[i % len(batches)]], y[batches[i % len(batches)]])
    start = time.perf_counter()
    for i in range(args.steps):
        step(x[batches[i % len(batches)]], y[batches[i % len(batches)]])
    return time.perf_counter() - start


def relaxgrad_worker(args, world: int, rank: int) -> dict:
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, mlp

    model = mlp(args.batch, args.features, tuple(args.hidden), CLASSES, seed=0)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3), distributed=world > 1)
    x, y = data(args, rank)
    result = {"bytes": sum(p.nbytes for p in trainer.params.values())}
    times: dict[str, list[float]] = {"mean_gradients": [], "_collective": []}
    if trainer.dp is not None:
        for name, spent in times.items():
            setattr(trainer.dp, name, _timing(getattr(trainer.dp, name), spent))
    result["seconds"] = timed(trainer.step, args, x, y)
    if trainer.dp is not None:
        steps = len(times["mean_gradients"])  # one all-reduce (float32) per step
        total, collective = (1e3 * sum(times[n][args.warmup:]) / (steps - args.warmup)
                             for n in times)
        result.update(reduce_ms=total, collective_ms=collective,
                      all_reduce_ms=bare_all_reduce_ms(result["bytes"] // 4))
    return result


def _timing(fn, spent: list):
    """``fn``, appending the seconds of each call to ``spent``."""

    def timed_fn(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return timed_fn


def torch_worker(args, world: int, rank: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    sizes = [args.features, *args.hidden, CLASSES]
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        net = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = data(args, rank)
    x, y = torch.from_numpy(x), torch.from_numpy(y)

    def step(xb, yb):
        optimizer.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        optimizer.step()
        return loss.item()

    return {"seconds": timed(step, args, x, y)}


def bare_all_reduce_ms(numel: int, repeat: int = 30) -> float:
    """Median milliseconds of one gloo ``all_reduce`` of ``numel`` float32s."""
    import torch
    import torch.distributed as dist

    flat = torch.zeros(numel)
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def launch(args, framework: str, world: int) -> dict:
    """Rank 0's result of ``world`` worker processes of ``framework``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = list(sys.argv[1:])
    procs = []
    for rank in range(world):
        env = {**os.environ, "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port),
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--worker", framework],
                                      env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{framework} on {world} processes failed")
    return json.loads(outputs[0].strip().splitlines()[-1])


def scaling_rows(args, compute_s: float, nbytes: int) -> list[str]:
    """Table rows: workers, network, ring all-reduce time, efficiency at the measured rows per
    worker and at 8 times as many (8 times the compute, the same bytes)."""
    rows = []
    for gbits in (10, 100):
        for n in (8, 64):
            seconds = 2 * (n - 1) / n * nbytes / (gbits * 1e9 / 8)
            seconds += 2 * (n - 1) * args.latency_us * 1e-6
            efficiency = [c / (c + seconds) for c in (compute_s, 8 * compute_s)]
            rows.append(f"| {n} | {gbits} Gb/s | {1e3 * seconds:.2f} | {efficiency[0]:.0%} | "
                        f"{efficiency[1]:.0%} |")
    return rows


def main() -> None:
    args = parse()
    if args.worker:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        worker = relaxgrad_worker if args.worker == "relaxgrad" else torch_worker
        import torch

        torch.set_num_threads(1)
        print(json.dumps(worker(args, world, rank)))
        return
    results: dict = {}
    for _ in range(args.rounds):  # interleaved, so a burst of load on the machine hits all
        for key in [(f, w) for w in (1, 2) for f in ("relaxgrad", "torch")]:
            result = launch(args, *key)
            if key not in results or result["seconds"] < results[key]["seconds"]:
                results[key] = result
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"MLP {args.features}-{'-'.join(map(str, args.hidden))}-{CLASSES}, float32, Adam, "
          f"{args.batch} rows per process, 1 thread per process, gloo on loopback, "
          f"{args.steps} steps, fastest of {args.rounds} rounds; load average {load}")
    print("| framework | processes | samples/s | ms/step |")
    print("|---|---|---|---|")
    rate = {}
    for (framework, world), result in results.items():
        rate[framework, world] = world * args.batch * args.steps / result["seconds"]
        name = "relaxgrad" if framework == "relaxgrad" else "PyTorch" + (" DDP" * (world > 1))
        print(f"| {name} | {world} | {rate[framework, world]:.0f} | "
              f"{1e3 * result['seconds'] / args.steps:.1f} |")
    dp = results["relaxgrad", 2]
    print(f"relaxgrad 2 processes / PyTorch DDP 2 processes: "
          f"{rate['relaxgrad', 2] / rate['torch', 2]:.2f}x; 2 processes / 1: relaxgrad "
          f"{rate['relaxgrad', 2] / rate['relaxgrad', 1]:.2f}x, PyTorch "
          f"{rate['torch', 2] / rate['torch', 1]:.2f}x")
    nbytes = dp["bytes"]
    print(f"gradients {nbytes / 2**20:.2f} MiB; reduction per step {dp['reduce_ms']:.2f} ms: "
          f"all_reduce {dp['collective_ms']:.2f} ms (waiting for the slower rank included), "
          f"copies and views {dp['reduce_ms'] - dp['collective_ms']:.2f} ms; one all_reduce "
          f"after a barrier {dp['all_reduce_ms']:.2f} ms")
    compute = results["relaxgrad", 1]["seconds"] / args.steps
    print(f"\nscaling model: compute {1e3 * compute:.1f} ms/step per worker, "
          f"{nbytes / 2**20:.2f} MiB of gradients, latency {args.latency_us:.0f} us")
    print(f"| workers | network | ring all-reduce ms | efficiency, {args.batch} rows | "
          f"efficiency, {8 * args.batch} rows |")
    print("|---|---|---|---|---|")
    print("\n".join(scaling_rows(args, compute, nbytes)))


if __name__ == "__main__":
    main()
