"""Random Relax programs for differential tests of the Gradient pass.

Programs are single dataflow blocks over a few (3, 3) float tensors, mixing elementwise ops,
matmul/transposes, reductions, tuples (construction, indexing, nesting), constants, assignment
and gradient-checkpoint markers, ending in a float scalar.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

SHAPE = (3, 3)
T = relax.TensorType(SHAPE, "float32")


def random_program(seed: int, n_bindings: int = 12, checkpoints: bool = True) -> tvm.IRModule:
    rng = np.random.default_rng(seed)
    n_params = int(rng.integers(1, 4))
    params = [relax.Var(f"x{i}", T) for i in range(n_params)]
    tup_param = None
    if rng.random() < 0.3:
        tup_param = relax.Var("tp", relax.TupleType([T, T]))
        params.append(tup_param)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            tensors = list(params[:n_params])
            tuples = [tup_param] if tup_param is not None else []

            def pick():
                return tensors[int(rng.integers(len(tensors)))]

            for _ in range(n_bindings):
                kind = rng.choice(
                    ["binary", "unary", "matmul", "permute", "tuple", "getitem", "assign",
                     "const", "split_concat", "reduce", "checkpoint"],
                    p=[0.22, 0.12, 0.1, 0.08, 0.08, 0.1, 0.05, 0.05, 0.06, 0.06, 0.08],
                )
                if kind == "binary":
                    fn = [op.add, op.subtract, op.multiply][int(rng.integers(3))]
                    tensors.append(bb.emit(fn(pick(), pick())))
                elif kind == "unary":
                    fn = [op.tanh, op.sigmoid, op.negative, op.sin][int(rng.integers(4))]
                    tensors.append(bb.emit(fn(pick())))
                elif kind == "matmul":
                    tensors.append(bb.emit(op.matmul(pick(), pick())))
                elif kind == "permute":
                    tensors.append(bb.emit(op.permute_dims(pick())))
                elif kind == "tuple":
                    if rng.random() < 0.3 and tuples:
                        tuples.append(bb.emit(relax.Tuple([pick(), tuples[-1]])))
                    else:
                        tuples.append(bb.emit(relax.Tuple([pick(), pick()])))
                elif kind == "getitem" and tuples:
                    tup = tuples[int(rng.integers(len(tuples)))]
                    item = bb.emit(relax.TupleGetItem(tup, int(rng.integers(2))))
                    (tuples if isinstance(item.ty, relax.TupleType) else tensors).append(item)
                elif kind == "assign":
                    tensors.append(bb.emit(pick()))
                elif kind == "const":
                    c = relax.const(rng.uniform(-1, 1, SHAPE).astype("float32"))
                    tensors.append(bb.emit(op.add(pick(), c)))
                elif kind == "split_concat":
                    parts = bb.emit(op.split(pick(), 3, 1))
                    tensors.append(bb.emit(op.concat(parts, 1)))
                elif kind == "reduce":
                    s = bb.emit(op.sum(pick(), 1, keepdims=True))
                    tensors.append(bb.emit(op.multiply(pick(), s)))
                elif kind == "checkpoint":
                    start = rng.random() < 0.5
                    marker = op.grad.start_checkpoint if start else op.grad.end_checkpoint
                    tensors.append(bb.emit(marker(pick())))
            total = bb.emit(op.sum(tensors[-1]))
            for t in tensors[n_params:-1]:
                if rng.random() < 0.3:
                    total = bb.emit(op.add(total, op.sum(t)))
            gv = bb.emit_output(total)
        bb.emit_func_output(gv)
    return bb.get()
