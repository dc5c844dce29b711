"""Numeric gradient checks on compiled code: the primitive every relaxgrad test builds on.

``check_gradients`` differentiates a function with :func:`relaxgrad.Gradient`, compiles the
module, runs the adjoint, and compares each gradient against central finite differences of the
compiled forward function along random directions.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from . import _ty
from .transforms import Gradient, LowerCallTIRWithGrad

__all__ = [
    "FAST_LLVM",
    "GradCheck",
    "assert_gradients_close",
    "check_gradients",
    "loss_module",
    "random_inputs",
    "tvm_compile_quietly",
]

FAST_LLVM = tvm.target.Target({"kind": "llvm", "opt-level": 0})
"""A target for builds that only evaluate a program (a gradient to check, a peer's values):
LLVM without its optimizations, which take most of a small program's build time (a 4-block
transformer's adjoint by ``tvm.compile``: built and loaded in 3.3 s instead of 8.8 on an AVX2
AMD EPYC). ``relaxgrad.compile``'s
own schedules are checked at the default level, as users build them."""

TVM_CODEGEN_NOISE = ("Unknown pragma pragma_scope", "Detected pow(x, y) where y >= 3")
"""Warnings TVM 0.27 prints for what its own default CPU pipeline emits (LLVM codegen, one per
loop nest under a ``pragma_scope`` attribute; legalization, one per ``pow`` of a constant
exponent of 3 or more, as GPT-2's GELU cubes): noise to a reader of a peer comparison."""


@dataclass
class GradCheck:
    """Outcome of a numeric check: ``ok``, the worst error and one line per checked direction."""

    ok: bool
    max_error: float
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"gradient check {'passed' if self.ok else 'FAILED'}: max error {self.max_error:.3g}"
        return "\n".join([head] + ["  " + line for line in self.lines])


def random_inputs(func: relax.Function, seed: int = 0, low: float = -1.0, high: float = 1.0):
    """Random numpy inputs for the params of ``func`` (tuples become Python tuples)."""
    rng = np.random.default_rng(seed)

    def make(ty):
        if _ty.is_tuple(ty):
            return tuple(make(f) for f in ty.fields)
        shape, dtype = _ty.static_shape(ty), _ty.dtype_of(ty)
        if _ty.is_float_dtype(dtype):
            return rng.uniform(low, high, shape).astype(dtype)
        if dtype == "bool":
            return rng.integers(0, 2, shape).astype(bool)
        return rng.integers(0, 2, shape).astype(dtype)

    return [make(p.ty) for p in func.params]


def _to_tvm(value, dev):
    if isinstance(value, tuple):
        return tuple(_to_tvm(v, dev) for v in value)
    return tvm.runtime.tensor(np.asarray(value), dev)


def _to_numpy(value):
    if hasattr(value, "numpy"):
        return value.numpy()
    return tuple(_to_numpy(v) for v in value)


def _leaves(value, path=()):
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path, value


def _replace(value, path, new):
    if not path:
        return new
    items = list(value)
    items[path[0]] = _replace(items[path[0]], path[1:], new)
    return tuple(items)


def _get(value, path):
    for i in path:
        value = value[i]
    return value


def _default_tolerance(dtype: str) -> tuple[float, float]:
    """(eps, tolerance) for central differences in ``dtype``."""
    if dtype == "float64":
        return 1e-6, 1e-6
    if dtype == "float16":
        return 1e-2, 5e-2
    return 1e-4, 2e-2


def check_gradients(
    mod: tvm.IRModule,
    func_name: str = "main",
    inputs: Sequence | None = None,
    *,
    wrt: Sequence[int] | None = None,
    target_index: int = 0,
    directions: int = 2,
    eps: float | None = None,
    tol: float | None = None,
    seed: int = 0,
    target: str | dict | tvm.target.Target = "llvm",
    grad_pass: Callable | None = None,
    compile: Callable | None = None,  # noqa: A002 (mirrors tvm.compile)
) -> GradCheck:
    """Check the gradients of ``mod[func_name]`` against finite differences on compiled code.

    Parameters
    ----------
    mod : IRModule
        Module holding the (undifferentiated) function.
    inputs : list, optional
        numpy arrays (tuples for tuple params); random in [-1, 1) when omitted.
    wrt : list of int, optional
        Indices of the parameters to check; defaults to every float parameter.
    directions : int
        Random directions checked per parameter.
    eps, tol : float, optional
        Finite-difference step and tolerance on ``|fd - ad| / max(1, |fd|, |ad|)``;
        chosen from the dtype when omitted.
    target : str, dict or Target
        Where to compile and run; :data:`FAST_LLVM` compiles ~3x faster.
    grad_pass : callable, optional
        ``(func_name, require_grads, target_index) -> Pass``; defaults to relaxgrad's Gradient.
    compile : callable, optional
        ``(mod, target) -> VMExecutable``; defaults to ``tvm.compile`` (``relaxgrad.compile``
        builds with relaxgrad's pipeline).
    """
    func = mod[func_name]
    params = list(func.params)
    if inputs is None:
        inputs = random_inputs(func, seed)
    inputs = list(inputs)
    if wrt is None:
        wrt = [i for i, p in enumerate(params) if _ty.nested_all(p.ty, _ty.is_float_tensor)]
    grad_pass = grad_pass or Gradient
    grad_mod = grad_pass(func_name, [params[i] for i in wrt], target_index)(mod)
    grad_mod = LowerCallTIRWithGrad()(grad_mod)

    target = tvm.target.Target(target)
    kind = target.kind.name
    dev = tvm.cpu() if kind == "llvm" else tvm.device(kind)
    build = compile or (lambda m, t: tvm_compile_quietly(m, target=t))
    vm = relax.VirtualMachine(build(grad_mod, target), dev)
    fwd, adj = vm[func_name], vm[func_name + "_adjoint"]

    def loss_at(values) -> float:
        out = fwd(*[_to_tvm(v, dev) for v in values])
        out = out if hasattr(out, "numpy") else out[target_index]
        return float(out.numpy().astype("float64"))

    _, grads = adj(*[_to_tvm(v, dev) for v in inputs])
    grads = [_to_numpy(g) for g in grads]

    rng = np.random.default_rng(seed + 1)
    lines, worst, ok = [], 0.0, True
    for k, i in enumerate(wrt):
        for path, leaf in _leaves(inputs[i]):
            grad = np.asarray(_get(grads[k], path), dtype="float64")
            if grad.shape != leaf.shape:  # a broadcastable wrong shape would pass below
                name = params[i].name + "".join(f"[{j}]" for j in path)
                lines.append(f"{name}: gradient of shape {grad.shape}, not {leaf.shape}")
                ok, worst = False, float("inf")
                continue
            d_eps, d_tol = _default_tolerance(str(leaf.dtype))
            step, limit = eps or d_eps, tol or d_tol
            for _ in range(directions):
                d = rng.standard_normal(leaf.shape)
                moved = []
                for sign in (1, -1):
                    new_leaf = (leaf.astype("float64") + sign * step * d).astype(leaf.dtype)
                    values = list(inputs)
                    values[i] = _replace(inputs[i], path, new_leaf)
                    moved.append(loss_at(values))
                fd = (moved[0] - moved[1]) / (2 * step)
                ad = float(np.sum(grad * d))
                err = abs(fd - ad) / max(1.0, abs(fd), abs(ad))
                worst = max(worst, err)
                ok = ok and err <= limit
                name = params[i].name + "".join(f"[{j}]" for j in path)
                lines.append(
                    f"{name}: finite difference {fd:.6g}, adjoint {ad:.6g}, error {err:.2g}"
                )
    return GradCheck(ok, worst, lines)


def assert_gradients_close(mod: tvm.IRModule, func_name: str = "main", inputs=None, **kwargs):
    """:func:`check_gradients`, raising ``AssertionError`` with the report when it fails."""
    result = check_gradients(mod, func_name, inputs, **kwargs)
    if not result.ok:
        raise AssertionError(str(result))
    return result


def loss_module(
    fn: Callable[..., relax.Expr], arg_types: Sequence, seed: int = 0, name: str = "main"
) -> tvm.IRModule:
    """A module whose ``main(x0, x1, ...)`` returns ``sum(w * fn(x0, x1, ...))``.

    ``w`` is a random constant per output leaf, so every output element gets a different
    gradient (a plain ``sum`` would hide errors such as a softmax rule returning zero).
    """
    rng = np.random.default_rng(seed)
    params = [relax.Var(f"x{i}", ty) for i, ty in enumerate(arg_types)]
    bb = relax.BlockBuilder()
    with bb.function(name, params):
        with bb.dataflow():
            out = bb.emit(fn(*params))
            terms = []
            for path, _ in _leaves(_structure(out.ty)):
                leaf = out
                for i in path:
                    leaf = bb.emit(relax.TupleGetItem(leaf, i))
                weight = rng.uniform(0.5, 1.5, _ty.static_shape(leaf)).astype(_ty.dtype_of(leaf))
                weighted = relax.op.multiply(leaf, relax.const(weight, _ty.dtype_of(leaf)))
                terms.append(bb.emit(relax.op.sum(weighted)))
            loss = terms[0]
            for term in terms[1:]:
                loss = bb.emit(relax.op.add(loss, term))
            gv = bb.emit_output(loss)
        bb.emit_func_output(gv)
    return bb.get()


def _structure(ty):
    """A nested Python tuple mirroring a (tuple) type, with None leaves."""
    if _ty.is_tuple(ty):
        return tuple(_structure(f) for f in ty.fields)
    return None


def tvm_compile_quietly(mod: tvm.IRModule, target=None, **kwargs):
    """``tvm.compile(mod, target, **kwargs)`` (TVM's own pipeline, the peer of
    :func:`relaxgrad.compile` in benches and tests) without the lines of
    :data:`TVM_CODEGEN_NOISE` on stderr; any other output of the compile is printed."""
    with _stderr_without(TVM_CODEGEN_NOISE):
        return tvm.compile(mod, target, **kwargs)


@contextlib.contextmanager
def _stderr_without(noise: Sequence[str]) -> Iterator[None]:
    """Collect what is written to file descriptor 2 (C++ logging included) while the block
    runs, then write it back to ``sys.stderr`` less the lines containing any of ``noise``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not any(n in line for n in noise)]  # fmt: skip
            sys.stderr.write("".join(kept))
