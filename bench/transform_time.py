"""Time of relaxgrad's Gradient pass vs TVM's C++ pass on deep MLPs.

Prints, for MLPs of about 300, 3,000 and 9,000 forward bindings, both times and the ratio
relaxgrad / TVM, and how each grows from 3k to 9k bindings. Run: ``python bench/transform_time.py``.
"""

from __future__ import annotations

import argparse
import time

import tvm
from tvm import relax
from tvm.relax import op

import relaxgrad


def deep_mlp(layers: int, width: int = 16, batch: int = 4) -> tvm.IRModule:
    """``layers`` x (matmul, add, relu), then sum: 3 * layers + 1 forward bindings."""
    x = relax.Var("x", relax.TensorType((batch, width), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType((width, width), "float32")) for i in range(layers)]
    bs = [relax.Var(f"b{i}", relax.TensorType((width,), "float32")) for i in range(layers)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws, *bs]):
        with bb.dataflow():
            h = x
            for w, b in zip(ws, bs):
                h = bb.emit(op.nn.relu(bb.emit(op.add(bb.emit(op.matmul(h, w)), b))))
            gv = bb.emit_output(op.sum(h))
        bb.emit_func_output(gv)
    return bb.get()


def best_time(pass_fn, mod, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        pass_fn(mod)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="*", default=[100, 1000, 3000])
    args = parser.parse_args()
    ours_pass, tvm_pass = relaxgrad.Gradient("main"), relax.transform.Gradient("main")
    rows = []
    print(f"{'bindings':>9} {'relaxgrad s':>12} {'TVM C++ s':>10} {'ratio':>7}")
    for layers in args.layers:
        mod = deep_mlp(layers)
        n = 3 * layers + 1
        ours = best_time(ours_pass, mod, args.repeat)
        theirs = best_time(tvm_pass, mod, args.repeat)
        rows.append((n, ours, theirs))
        print(f"{n:>9} {ours:>12.3f} {theirs:>10.3f} {ours / theirs:>7.2f}", flush=True)
    if len(rows) >= 2:
        (n0, o0, t0), (n1, o1, t1) = rows[-2], rows[-1]
        print(
            f"growth {n0} -> {n1} bindings ({n1 / n0:.1f}x): relaxgrad {o1 / o0:.2f}x, "
            f"TVM {t1 / t0:.2f}x"
        )


if __name__ == "__main__":
    main()
