"""Checkpoint policies on deep models: activation memory and adjoint time against none.

Models (``--models``):

- ``mlp``: ``--layers`` (256) x (matmul, add, tanh), width 256, batch 256, then a sum;
- ``transformer``: ``--blocks`` (12) pre-norm blocks (layer_norm, 4-head attention, residual,
  layer_norm, 4x gelu feed-forward, residual) on (8, ``--seq`` (128), 256) inputs, then a sum of
  squares.

Policies (``--policies``): ``none``; ``tvm-markers``, TVM's own pass
(``tvm.relax.transform.Gradient``, the peer) on the model with ``R.grad.start_checkpoint`` /
``end_checkpoint`` markers around every round(sqrt(n)) layers or blocks (on the residual
stream); ``markers``, our pass on that same marked model; ``sqrt``; ``save_dots``; and
``budget:F``, ``policies.budget(B, "live")`` with B = F x ``none``'s activation memory. TVM has
no gradient for ``nn.gelu`` and ``nn.layer_norm``: for ``tvm-markers`` our rules are registered
as its ``FPrimalGradient`` (same contract).

Columns: *activation MiB*, TVM's planned storage of the adjoint other than its outputs
(:func:`relaxgrad.analysis.planned_memory_split`: kept and recomputed activations, adjoints,
temporaries), and its ratio to ``none``; *recomputed*, the number of ``<var>_cp`` bindings (each
forward value is recomputed at most once); *recompute*, their cost (flops-like, as the policies
count it) over the forward pass's; *time ms*, the adjoint's median run time over ``--repeat``
runs, timed round-robin across policies, and its ratio to ``none``.

Run ``python bench/checkpoint.py`` (the issue's full sizes; compiling the 256-layer adjoints
takes minutes) or e.g. ``--layers 16 --width 64 --batch 32 --blocks 2 --seq 32`` for a quick
look; the header of each table says whether it is the full size.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad
from relaxgrad.analysis import planned_memory_split
from relaxgrad.ops import get_gradient
from relaxgrad.pipeline import host_target
from relaxgrad.testing import random_inputs
from relaxgrad.transforms import policies


def _marked(bb, h, i: int, count: int, every: int | None, emit=None):
    """``h`` wrapped in a checkpoint marker when layer/block ``i`` of ``count`` starts (``emit
    = "start"``) or ends (``"end"``) a segment of ``every``; ``h`` itself otherwise."""
    if not every:
        return h
    if emit == "start" and i % every == 0:
        return bb.emit(op.grad.start_checkpoint(h))
    if emit == "end" and ((i + 1) % every == 0 or i + 1 == count):
        return bb.emit(op.grad.end_checkpoint(h))
    return h


def mlp(layers: int, width: int, batch: int, every: int | None = None) -> tvm.IRModule:
    """``layers`` x (matmul, add, tanh), then a sum; TVM's markers around every ``every``
    layers."""
    x = relax.Var("x", relax.TensorType((batch, width), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((width, width), "float32")) for i in range(layers)]
    bs = [relax.Var(f"b{i}", relax.TensorType((width,), "float32")) for i in range(layers)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for i, (w, b) in enumerate(zip(ws, bs)):
                h = _marked(bb, h, i, layers, every, "start")
                h = bb.emit(op.tanh(bb.emit(op.add(bb.emit(op.matmul(h, w)), b))))
                h = _marked(bb, h, i, layers, every, "end")
            gv = bb.emit_output(op.sum(h))
        bb.emit_func_output(gv)
    return bb.get()


def transformer(blocks: int, batch: int = 8, seq: int = 128, dim: int = 256,
                heads: int = 4, every: int | None = None) -> tvm.IRModule:
    """``blocks`` pre-norm encoder blocks, then the sum of squares of the output; TVM's markers
    around every ``every`` blocks (on the residual stream)."""
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
                h = _marked(bb, h, i, blocks, every, "start")
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
                h = _marked(bb, bb.emit(op.add(h, f)), i, blocks, every, "end")
            gv = bb.emit_output(op.sum(op.multiply(h, h)))
        bb.emit_func_output(gv)
    return bb.get()


def lend_rules_to_tvm(mod: tvm.IRModule) -> list[str]:
    """Register relaxgrad's rule as TVM's ``FPrimalGradient`` for the ops of ``mod`` that TVM
    has none for (``nn.gelu``, ``nn.layer_norm``): both use the same contract. Returns their
    names."""
    lent = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            o = getattr(b.value, "op", None)
            if isinstance(o, tvm.ir.Op) and o.get_attr("FPrimalGradient") is None:
                rule = get_gradient(o)
                if rule is not None:
                    tvm.ir.register_op_attr(o.name, "FPrimalGradient", rule)
                    lent.append(o.name)
    return lent




def adjoint_of(models: dict, spec: str, budget_bytes: int | None) -> tvm.IRModule:
    """The adjoint module for ``spec``: TVM's pass (``tvm-markers``) or ours on the marked
    model (``markers``), else ours with ``checkpoint=spec`` on the plain model; ``budget:F``
    is the ``"live"``-model budget of ``budget_bytes``."""
    if spec == "tvm-markers":
        lend_rules_to_tvm(models["marked"])
        return relax.transform.Gradient("main")(models["marked"])
    if spec == "markers":
        return relaxgrad.Gradient("main")(models["marked"])
    if spec.startswith("budget:"):
        return relaxgrad.Gradient("main", checkpoint=policies.budget(budget_bytes, "live"))(
            models["plain"])
    return relaxgrad.Gradient("main", checkpoint=spec)(models["plain"])


def timed_runs(adjoints: dict, target: str, repeat: int) -> dict:
    """The median run time of each adjoint, timed round-robin (one run of each per round) so
    that load from other processes falls on all of them alike."""
    runs = {}
    for spec, mod in adjoints.items():
        vm = relax.VirtualMachine(relaxgrad.compile(mod, target), tvm.cpu())
        args = [tvm.runtime.tensor(a * 0.1) for a in random_inputs(mod["main"], seed=0)]
        vm["main_adjoint"](*args)
        runs[spec] = (vm, args, [])
    for _ in range(repeat):
        for vm, args, times in runs.values():
            start = time.perf_counter()
            vm["main_adjoint"](*args)
            times.append(time.perf_counter() - start)
    return {spec: statistics.median(times) for spec, (_, _, times) in runs.items()}


def recomputation(adjoint: tvm.IRModule) -> tuple[int, float]:
    """The bindings of the adjoint that recompute a forward value (both passes name them
    ``<var>_cp``): their number, and their cost (flops-like, as the policies count it) as a
    fraction of the forward pass's."""
    forward = policies.program_from_function(adjoint["main"], "main")
    backward = policies.program_from_function(adjoint["main_adjoint"], "main_adjoint")
    redone = [n for n in backward.nodes if n.name.endswith("_cp")]
    return len(redone), sum(n.cost for n in redone) / policies.recompute_cost(forward, ())


def measure(adjoint: tvm.IRModule, target: str) -> dict:
    """The memory and recomputation figures of one adjoint (see the module docstring)."""
    row = {"planned": planned_memory_split(adjoint, "main_adjoint", target)["other"]}
    row["recomputed"], row["recompute"] = recomputation(adjoint)
    return row


def report(name: str, rows: dict, budget_bytes: int | None) -> None:
    base = rows["none"]
    print(f"\n{name}")
    print(f"{'policy':>12} {'activation MiB':>14} {'ratio':>6} {'recomputed':>10} "
          f"{'recompute':>9} {'time ms':>9} {'ratio':>6}")
    for spec, r in rows.items():
        t = r.get("time")
        t_ratio = f"{t / base['time']:6.3f}" if t and base.get("time") else "     -"
        ms = t * 1e3 if t else float("nan")
        print(f"{spec:>12} {r['planned'] / 2**20:14.2f} {r['planned'] / base['planned']:6.3f} "
              f"{r['recomputed']:10d} {r['recompute']:9.3f} {ms:9.1f} {t_ratio}")
    if budget_bytes is not None:
        print(f"  budget:F is F x none's activation memory = {budget_bytes / 2**20:.2f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["mlp", "transformer"],
                        default=["mlp", "transformer"])
    parser.add_argument("--policies", nargs="+", default=[
        "none", "tvm-markers", "markers", "sqrt", "save_dots", "budget:0.25"])
    parser.add_argument("--layers", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--target", default="native",
        help="TVM target of the timed runs: 'native' (this CPU, relaxgrad's default) or e.g. "
             "'llvm'; memory is planned for 'llvm' (the plan does not depend on the CPU)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed runs per adjoint (median), round-robin")
    parser.add_argument("--no-time", action="store_true", help="memory figures only")
    args = parser.parse_args()
    if args.policies[0] != "none":
        args.policies.insert(0, "none")
    every = {"mlp": max(1, round(math.sqrt(args.layers))),
             "transformer": max(1, round(math.sqrt(args.blocks)))}
    build = {"mlp": lambda k=None: mlp(args.layers, args.width, args.batch, every=k),
             "transformer": lambda k=None: transformer(args.blocks, seq=args.seq, every=k)}
    config = {"mlp": f"{args.layers} layers, width {args.width}, batch {args.batch}, tanh",
              "transformer": f"{args.blocks} pre-norm blocks, seq {args.seq}, d 256, 4 heads, "
                             "batch 8"}
    full = {"mlp": (args.layers, args.width, args.batch) == (256, 256, 256),
            "transformer": (args.blocks, args.seq) == (12, 128)}
    for name in args.models:
        models = {"plain": build[name](), "marked": build[name](every[name])}
        rows, adjoints, budget_bytes = {}, {}, None
        for spec in args.policies:
            if spec.startswith("budget:"):
                budget_bytes = int(float(spec.split(":", 1)[1]) * rows["none"]["planned"])
            adjoints[spec] = adjoint_of(models, spec, budget_bytes)
            rows[spec] = measure(adjoints[spec], "llvm" if args.target == "native" else args.target)
        if not args.no_time:
            target = host_target() if args.target == "native" else args.target
            for spec, seconds in timed_runs(adjoints, target, args.repeat).items():
                rows[spec]["time"] = seconds
        size = "full size" if full[name] else "REDUCED configuration (not the issue's full size)"
        report(f"{name}: {config[name]} ({size}); markers every {every[name]}", rows,
               budget_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
