"""Long fuzz run of relaxgrad's Gradient pass over random programs (one per seed).

    python bench/fuzz.py --seeds 0:2000 [--max-steps 10] [--chunk 25] [--timeout 120]
                         [--all-bugs] [--ops exp,matmul,...] [--no-peer] [--out failures.json]
                         [--compiled [--min-rows N]]

Programs come from ``tests/transforms/fuzz_programs.py`` (``program_from_seed``). Each chunk of
seeds runs in a fresh worker process, one worker at a time: a crash (segfault, "double free",
abort) or a hang kills only that worker; the seed it was on is recorded as ``crash`` / ``timeout``
and the rest of the chunk goes on in a new worker. By default the generator avoids the bugs
listed in ``KNOWN_BUGS`` and ``FOUND_BUGS`` (``--all-bugs`` generates them too).

Prints a summary: ok / refused (``GradientError``: documented refusals) / mismatch /
exception / crash / timeout / invalid (a generator error: the forward program does not compile),
by kind, with the first seeds of each kind.

``--compiled`` fuzzes the compiler instead: each program's adjoint built by
``relaxgrad.compile`` (fusion, relaxgrad's schedules, OpenBLAS calls) against the same adjoint
built by ``tvm.compile`` (``check_compiled``); ``--min-rows 1`` applies the CPU pipeline's row and
column rewrites (from 64 rows by default) to these small programs too.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(seeds, queue, max_steps, avoid_all, ops, peer, compiled=False, min_rows=None):
    sys.path.insert(0, ROOT)
    from tests.transforms import fuzz_programs as fp

    avoid = frozenset() if avoid_all else fp.KNOWN_BUGS | fp.FOUND_BUGS
    for seed in seeds:
        try:
            prog = fp.program_from_seed(seed, max_steps, avoid, ops)
            queue.put(("start", seed, prog.build()[0].script()))
            if compiled:
                outcome = fp.check_compiled(prog, min_rows)
            else:
                outcome = fp.check_program(prog, peer=peer)
            res = {"status": outcome.status, "kind": outcome.kind,
                   "detail": outcome.detail[-3000:], "script": outcome.script[:20000],
                   "ops": sorted(prog.ops())}
        except BaseException as e:  # noqa: BLE001 (RecursionError, generator bugs, ...)
            queue.put(("start", seed, ""))
            res = {"status": "exception", "kind": f"harness: {type(e).__name__}: "
                   f"{str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}",
                   "detail": "", "script": "", "ops": []}
        queue.put(("done", seed, res))
    queue.put(("exit", None, None))


def run(seeds, max_steps=10, chunk=25, timeout=120.0, avoid_all=False, ops=None, peer=True,
        verbose=True, time_limit=None, compiled=False, min_rows=None):
    t0 = time.time()
    ctx = mp.get_context("fork")
    results = {}
    todo = list(seeds)
    while todo:
        if time_limit is not None and time.time() - t0 > time_limit:
            print(f"time limit: stopped before seed {todo[0]}", flush=True)
            break
        batch, todo = todo[:chunk], todo[chunk:]
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker,
                           args=(batch, queue, max_steps, avoid_all, ops, peer, compiled,
                                 min_rows))
        proc.start()
        current, script, pending = None, "", list(batch)
        while True:
            try:
                msg, seed, res = queue.get(timeout=timeout)
            except Exception:  # noqa: BLE001 (queue.Empty: hung, or died)
                if proc.is_alive():
                    proc.kill()
                    status, kind = "timeout", f"no result in {timeout:.0f} s"
                else:
                    status, kind = "crash", f"worker exit code {proc.exitcode}"
                proc.join()
                if current is not None:
                    results[current] = {"status": status, "kind": kind, "detail": "",
                                        "script": script, "ops": []}
                    pending.remove(current)
                    if verbose:
                        print(f"seed {current}: {status} ({kind})", flush=True)
                todo = pending + todo
                break
            if msg == "start":
                current, script = seed, res
            elif msg == "done":
                results[seed] = res
                pending.remove(seed)
                current = None
                if verbose and res["status"] not in ("ok", "refused", "peer_disagrees"):
                    print(f"seed {seed}: {res['status']} [{res['kind']}]", flush=True)
            else:
                proc.join()
                break
    return results


def summary(results) -> str:
    by_status = collections.Counter(r["status"] for r in results.values())
    lines = [f"{len(results)} programs: " + ", ".join(
        f"{s} {by_status[s]}" for s in ("ok", "refused", "mismatch", "exception", "crash",
                                        "timeout", "invalid", "peer_disagrees") if by_status[s])]
    kinds = collections.defaultdict(list)
    for seed, r in sorted(results.items()):
        if r["status"] != "ok":
            kinds[(r["status"], r["kind"])].append(seed)
    for (status, kind), seeds in sorted(kinds.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        lines.append(f"  {status:9} {len(seeds):4}  {kind}   seeds {seeds[:6]}")
    ops = collections.Counter(o for r in results.values() for o in r["ops"])
    lines.append(f"op coverage: {len(ops)} ops")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:200", help="start:stop")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--all-bugs", action="store_true", help="also generate the known bugs")
    ap.add_argument("--ops", default=None, help="comma-separated op kinds of the generator")
    ap.add_argument("--no-peer", action="store_true", help="skip TVM's pass as a peer")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="start no new chunk after this many seconds")
    ap.add_argument("--out", default=None, help="write every non-ok result to this JSON file")
    ap.add_argument("--compiled", action="store_true",
                    help="relaxgrad.compile vs tvm.compile on each adjoint (not the pass)")
    ap.add_argument("--min-rows", type=int, default=None,
                    help="with --compiled: the CPU pipeline's min_rows")
    args = ap.parse_args(argv)
    start, stop = (int(x) for x in args.seeds.split(":"))
    ops = args.ops.split(",") if args.ops else None
    t0 = time.time()
    results = run(range(start, stop), args.max_steps, args.chunk, args.timeout, args.all_bugs,
                  ops, not args.no_peer, time_limit=args.time_limit, compiled=args.compiled,
                  min_rows=args.min_rows)
    print(summary(results))
    print(f"{time.time() - t0:.0f} s, {(time.time() - t0) / max(1, len(results)):.2f} s/program")
    if args.out:
        bad = {s: r for s, r in results.items() if r["status"] != "ok"}
        with open(args.out, "w") as f:
            json.dump(bad, f, indent=1)


if __name__ == "__main__":
    main()
