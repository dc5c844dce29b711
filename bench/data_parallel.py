"""Data parallel throughput: relaxgrad on 1 and 2 processes against PyTorch (DDP) on the same.

The model is an MLP (``--features`` (256) -> ``--hidden`` (512, 512) -> 10, ReLU, float32,
cross-entropy, Adam) with ``--batch`` (64) rows per process; every process runs 1 thread
(``TVM_NUM_THREADS=1``, ``torch.set_num_threads(1)``) and the processes talk over gloo on
loopback, launched with torchrun's environment. For each framework and process count it prints
the samples per second (all processes together) over ``--steps`` timed steps after
``--warmup``, and for relaxgrad on 2 processes the time per step of the gradient reduction
(copy into the flat buffer, ``all_reduce``, views back by DLPack) and of one bare
``all_reduce`` of the gradients' bytes. The ratio line compares relaxgrad with DDP on 2
processes.

Then a model of the scaling to more machines, from the measured compute time per step (1
process) and the gradients' bytes: a ring all-reduce moves ``2 (N-1)/N x bytes`` through each
worker's link, so it takes ``2 (N-1)/N x bytes / bandwidth`` (plus ``2 (N-1)`` latencies of
``--latency-us``); relaxgrad reduces after the whole backward pass (no overlap), so the
efficiency is ``compute / (compute + all-reduce)``.

Run ``python bench/data_parallel.py`` (about a minute on 2 cores).
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
    reduce_times = []
    if trainer.dp is not None:
        mean_gradients = trainer.dp.mean_gradients

        def timed_mean(*a):
            start = time.perf_counter()
            out = mean_gradients(*a)
            reduce_times.append(time.perf_counter() - start)
            return out

        trainer.dp.mean_gradients = timed_mean
    result["seconds"] = timed(trainer.step, args, x, y)
    if reduce_times:
        result["reduce_ms"] = 1e3 * statistics.median(reduce_times[args.warmup:])
        result["all_reduce_ms"] = bare_all_reduce_ms(result["bytes"] // 4)
    return result


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
    rows = []
    for gbits in (10, 100):
        for n in (8, 64):
            seconds = 2 * (n - 1) / n * nbytes / (gbits * 1e9 / 8)
            seconds += 2 * (n - 1) * args.latency_us * 1e-6
            efficiency = compute_s / (compute_s + seconds)
            rows.append(f"| {n} | {gbits} Gb/s | {1e3 * seconds:.2f} | {efficiency:.0%} |")
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
    results = {(f, w): launch(args, f, w) for f in ("relaxgrad", "torch") for w in (1, 2)}
    print(f"MLP {args.features}-{'-'.join(map(str, args.hidden))}-{CLASSES}, float32, Adam, "
          f"{args.batch} rows per process, 1 thread per process, gloo on loopback, "
          f"{args.steps} steps")
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
    print(f"gradients {nbytes / 2**20:.2f} MiB: reduction per step {dp['reduce_ms']:.2f} ms "
          f"(of which one bare all_reduce {dp['all_reduce_ms']:.2f} ms)")
    compute = results["relaxgrad", 1]["seconds"] / args.steps
    print(f"\nscaling model: compute {1e3 * compute:.1f} ms/step per worker, "
          f"{nbytes / 2**20:.2f} MiB of gradients, latency {args.latency_us:.0f} us")
    print("| workers | network | ring all-reduce ms | efficiency |")
    print("|---|---|---|---|")
    print("\n".join(scaling_rows(args, compute, nbytes)))


if __name__ == "__main__":
    main()
