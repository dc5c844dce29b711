"""Checkpoint policies on deep models: memory and adjoint time against no checkpointing.

Models (``--models``):

- ``mlp``: ``--layers`` (256) x (matmul, add, tanh), width 256, batch 256, then a sum;
- ``transformer``: ``--blocks`` (12) pre-norm blocks (layer_norm, 4-head attention, residual,
  layer_norm, 4x gelu feed-forward, residual) on (8, 128, 256) inputs, then a sum of squares.

For each policy (``--policies``; ``budget:F`` is a byte budget of F times what ``none`` keeps)
it prints the policy model's figures (:mod:`relaxgrad.transforms.policies`: kept bytes, peak of
kept + recomputed bytes, recompute cost as a fraction of the forward cost), TVM's planned
storage of the adjoint other than its outputs (:func:`relaxgrad.analysis.planned_memory_split`,
activations and temporaries) and the liveness estimate before lowering, and, unless
``--no-time``, the adjoint's median run time; ratios are against ``none``.

Run ``python bench/checkpoint.py [--models mlp] [--policies none sqrt save_dots]``. Compiling a
256-layer adjoint takes minutes on a few cores: ``--layers 32 --width 64`` for a quick look.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.analysis import estimate_activation_bytes, planned_memory_split
from relaxgrad.testing import random_inputs
from relaxgrad.transforms import policies


def mlp(layers: int, width: int, batch: int) -> tvm.IRModule:
    """``layers`` x (matmul, add, tanh), then a sum."""
    x = relax.Var("x", relax.TensorType((batch, width), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((width, width), "float32")) for i in range(layers)]
    bs = [relax.Var(f"b{i}", relax.TensorType((width,), "float32")) for i in range(layers)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for w, b in zip(ws, bs):
                h = bb.emit(op.tanh(bb.emit(op.add(bb.emit(op.matmul(h, w)), b))))
            gv = bb.emit_output(op.sum(h))
        bb.emit_func_output(gv)
    return bb.get()


def transformer(blocks: int, batch: int = 8, seq: int = 128, dim: int = 256,
                heads: int = 4) -> tvm.IRModule:
    """``blocks`` pre-norm encoder blocks, then the sum of squares of the output."""
    head = dim // heads

    def var(name, *shape):
        return relax.Var(name, relax.TensorType(shape, "float32"))

    x = var("x", batch, seq, dim)
    params = []
    for i in range(blocks):
        params += [var(f"ln1_g{i}", dim), var(f"ln1_b{i}", dim),
                   *(var(f"w{n}{i}", dim, dim) for n in "qkvo"),
                   var(f"ln2_g{i}", dim), var(f"ln2_b{i}", dim),
                   var(f"w1_{i}", dim, 4 * dim), var(f"w2_{i}", 4 * dim, dim)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            h = x
            for i in range(blocks):
                g1, b1, wq, wk, wv, wo, g2, b2, w1, w2 = params[10 * i:10 * i + 10]
                n = bb.emit(op.nn.layer_norm(h, g1, b1, axes=[-1]))

                def split(w, n=n):
                    t = bb.emit(op.reshape(bb.emit(op.matmul(n, w)), (batch, seq, heads, head)))
                    return bb.emit(op.permute_dims(t, [0, 2, 1, 3]))

                q, k, v = split(wq), split(wk), split(wv)
                s = bb.emit(op.matmul(q, bb.emit(op.permute_dims(k, [0, 1, 3, 2]))))
                s = bb.emit(op.multiply(s, relax.const(1.0 / head**0.5, "float32")))
                a = bb.emit(op.matmul(bb.emit(op.nn.softmax(s, axis=-1)), v))
                a = bb.emit(op.reshape(bb.emit(op.permute_dims(a, [0, 2, 1, 3])),
                                       (batch, seq, dim)))
                h = bb.emit(op.add(h, bb.emit(op.matmul(a, wo))))
                n = bb.emit(op.nn.layer_norm(h, g2, b2, axes=[-1]))
                f = bb.emit(op.matmul(bb.emit(op.nn.gelu(bb.emit(op.matmul(n, w1)))), w2))
                h = bb.emit(op.add(h, f))
            gv = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(gv)
    return bb.get()


def policy_of(spec: str, program: policies.Program):
    """The ``checkpoint=`` value for ``spec`` (``budget:F`` -> bytes)."""
    if spec.startswith("budget:"):
        kept = policies.saved_bytes(program, policies.none(program))
        return int(float(spec.split(":", 1)[1]) * kept)
    return spec


def adjoint_time(mod: tvm.IRModule, target: str, repeat: int) -> float:
    vm = relax.VirtualMachine(relaxgrad.compile(mod, target), tvm.cpu())
    args = [tvm.runtime.tensor(a * 0.1) for a in random_inputs(mod["main"], seed=0)]
    vm["main_adjoint"](*args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        vm["main_adjoint"](*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(mod: tvm.IRModule, spec: str, args) -> dict:
    program = policies.program_from_function(mod["main"], "main")
    checkpoint = policy_of(spec, program)
    saved = policies.resolve(checkpoint)(program)
    adjoint = relaxgrad.Gradient("main", checkpoint=checkpoint)(mod)
    row = {
        "kept": policies.saved_bytes(program, saved),
        "peak": policies.peak_bytes(program, saved),
        "recompute": policies.recompute_cost(program, saved)
        / policies.recompute_cost(program, ()),
        "planned": planned_memory_split(adjoint, "main_adjoint", args.target)["other"],
        "estimate": estimate_activation_bytes(adjoint["main_adjoint"]),
    }
    if not args.no_time:
        row["time"] = adjoint_time(adjoint, args.target, args.repeat)
    return row


def report(name: str, rows: dict) -> None:
    base = rows.get("none")
    print(f"\n{name}")
    print(f"{'policy':>14} {'kept MiB':>9} {'peak MiB':>9} {'recompute':>9} "
          f"{'planned MiB':>11} {'ratio':>6} {'estimate MiB':>12} {'time ms':>8} {'ratio':>6}")
    for spec, r in rows.items():
        ratio = f"{r['planned'] / base['planned']:6.3f}" if base else "     -"
        t = r.get("time")
        t_ratio = f"{t / base['time']:6.3f}" if base and t and base.get("time") else "     -"
        print(f"{spec:>14} {r['kept'] / 2**20:9.2f} {r['peak'] / 2**20:9.2f} "
              f"{r['recompute']:9.3f} {r['planned'] / 2**20:11.2f} {ratio} "
              f"{r['estimate'] / 2**20:12.2f} {t * 1e3 if t else float('nan'):8.1f} {t_ratio}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["mlp", "transformer"],
                        default=["mlp", "transformer"])
    parser.add_argument("--policies", nargs="+",
                        default=["none", "sqrt", "save_dots", "budget:0.1"])
    parser.add_argument("--layers", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per adjoint")
    parser.add_argument("--no-time", action="store_true", help="memory figures only")
    args = parser.parse_args()
    if "checkpoint" not in inspect.signature(relaxgrad.Gradient).parameters:
        print("bench/checkpoint.py: this relaxgrad.Gradient has no checkpoint= option yet; "
              "it needs the pass to call relaxgrad.transforms.policies", file=sys.stderr)
        return 2
    np.random.seed(0)
    models = {"mlp": lambda: mlp(args.layers, args.width, args.batch),
              "transformer": lambda: transformer(args.blocks)}
    for name in args.models:
        mod = models[name]()
        rows = {}
        for spec in args.policies:
            rows[spec] = measure(mod, spec, args)
        report(name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
