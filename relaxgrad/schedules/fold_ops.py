"""Operator calls on constants evaluated with NumPy before legalization, where NumPy computes
the same bits as the kernel that legalization would build.

:class:`~relaxgrad.schedules.fold.FoldConstantCalls` evaluates a constant ``call_tir`` with its
PrimFunc built by LLVM, and LLVM's JIT costs about 7 ms a kernel however small. T5's relative
position buckets (integer arithmetic, comparisons, casts, ``where``) folded 44 kernels: 0.7 s,
a third of ``tvm.compile``'s whole time for the model. :class:`FoldConstantOps` evaluates those
calls with NumPy first, in one walk, for the operators and dtypes where the two agree bit for bit:

- shapes and copies: ``reshape``, ``expand_dims``, ``squeeze``, ``flatten``, ``broadcast_to``,
  ``permute_dims``, ``zeros``, ``ones``, ``full`` (and their ``_like``), integer ``arange``;
- integer arithmetic (wrapping as LLVM's does), ``floor_divide`` and ``floor_mod`` of integers
  by a divisor without zeros, and float ``add``, ``subtract``, ``multiply``, ``divide`` (IEEE
  754 rounds these the same everywhere);
- ``negative``, ``abs``, ``where``, comparisons, ``minimum`` and ``maximum`` (floats without
  NaN, where NumPy and LLVM differ), logical operators;
- ``astype`` between these dtypes but to ``bool``.

The elementwise math functions (``log``, ``exp``, ``tanh``...), whose last bits depend on the
library, are computed by their legalized kernel, built once per operator, attributes and
operand types: the chain of integer operations after T5's ``log`` folds in NumPy again, and
the model's 44 kernels become one. Anything else (reductions, whose order of additions
differs, float16) is left to ``FoldConstantCalls`` after legalization, and so is a call whose
values fall outside these cases. The result must have the call's shape and dtype, or the
call is left as it is.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import mutator

from .. import _ty
from ._common import may_change, rewrite_functions, static_shape
from .fold import ConstantBindings, _library, is_tensor_constant

_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float32", "float64"}  # fmt: skip


@tvm.transform.module_pass(opt_level=0, name="FoldConstantOps")
class FoldConstantOps:
    """Replace each call of an operator in this module's table whose operands are constants
    (or vars bound to calls folded before it) by its value computed with NumPy (see the module
    docstring). ``folded`` counts the calls replaced by the last run."""

    def __init__(self):
        self.folded = 0

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        folder = _Folder(mod)
        mod = rewrite_functions(folder, mod)
        self.folded = folder.folded
        return mod


@mutator
class _Folder(ConstantBindings):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self._start()
        self.kernels: dict = {}  # (operator, attributes, types) -> built kernel or None

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if not may_change(func, _starts_chain):  # every chain starts with a call of constants
            return func
        return super().visit_function_(func)

    def _constant(self, value) -> _ty.Constant | None:
        if isinstance(value, relax.Call) and _operator(value) is not None:
            return _evaluated(self.visit_expr(value))
        if isinstance(value, relax.Call) and _is_math(value):
            return self._computed(self.visit_expr(value))
        return None

    def _computed(self, call: relax.Call) -> _ty.Constant | None:
        """The value of ``call``, an elementwise math function of constant tensors, computed
        by its legalized kernel; None where it is anything else or the kernel fails."""
        shape = static_shape(call)
        if shape is None or not all(is_tensor_constant(arg) for arg in call.args):
            return None
        key = str([call.op.name, call.attrs, call.ty, [arg.ty for arg in call.args]])
        if key not in self.kernels:
            self.kernels[key] = _kernel(call)
        kernel = self.kernels[key]
        if kernel is None:
            return None
        out = tvm.runtime.empty(shape, _ty.dtype_of(call), tvm.cpu())
        try:
            kernel(*(arg.value for arg in call.args), out)
        except Exception:  # noqa: BLE001 (left to run, and raise, as compiled code)
            return None
        return relax.const(out)


def _kernel(call: relax.Call):
    """The built kernel of ``call``'s legalization (operands as parameters), where that is
    one ``call_tir`` of the parameters; None otherwise."""
    params = [relax.Var(f"x{i}", arg.ty) for i, arg in enumerate(call.args)]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        result = builder.emit(relax.Call(call.op, params, call.attrs, call.ty_args))
        builder.emit_func_output(result)
    try:
        mod = relax.transform.LegalizeOps()(builder.get())
        bindings = [b for block in mod["main"].body.blocks for b in block.bindings]
        value = bindings[0].value if len(bindings) == 1 else None
        if not (isinstance(value, relax.Call) and value.op.same_as(Op.get("relax.call_tir"))):
            return None
        operands = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else []
        if [x.same_as(p) for x, p in zip(operands, params)] != [True] * len(params):
            return None
        return _library({"main": mod[value.args[0]]})["main"]
    except Exception:  # noqa: BLE001 (not folded: it runs as compiled code)
        return None


def _is_math(call: relax.Call) -> bool:
    return isinstance(call.op, Op) and call.op.name in _MATH


_MATH = {f"relax.{name}" for name in (
    "log", "exp", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "sin", "cos", "tan", "power",
    "floor", "ceil", "round", "sign", "log1p", "square")}


def _operator(call: relax.Call):
    """The NumPy evaluator of ``call``'s operator; None where the table has none."""
    return _TABLE.get(call.op.name) if isinstance(call.op, Op) else None


def _is_operand(expr) -> bool:
    """A constant tensor, a static shape or an integer: what the evaluators read."""
    if isinstance(expr, relax.ShapeExpr):
        return all(isinstance(d, tirx.IntImm) for d in expr.values)
    return is_tensor_constant(expr) or isinstance(expr, tirx.IntImm)


def _starts_chain(value) -> bool:
    return isinstance(value, relax.Call) and (_operator(value) is not None or _is_math(value)) \
        and all(_is_operand(arg) for arg in value.args)


def _evaluated(call: relax.Call) -> _ty.Constant | None:
    """The value of ``call`` (its operands already replaced by their constants) as a constant;
    None where an operand is not constant, a dtype or a value is outside the table's cases,
    or NumPy's result does not have the call's shape and dtype."""
    if not all(_is_operand(arg) for arg in call.args):
        return None
    shape = static_shape(call)
    if shape is None or _ty.dtype_of(call) not in _DTYPES:
        return None
    operands = []
    for arg in call.args:
        if is_tensor_constant(arg):
            if _ty.dtype_of(arg) not in _DTYPES:
                return None
            operands.append(arg.value.numpy())
        else:
            operands.append(arg)
    with np.errstate(all="ignore"):  # (integer wrap-around, as the kernel's)
        value = _operator(call)(call, _ty.dtype_of(call), shape, *operands)
    if value is None:
        return None
    value = np.asarray(value)
    if list(value.shape) != shape or str(value.dtype) != _ty.dtype_of(call):
        return None
    return relax.const(np.array(value, order="C"), _ty.dtype_of(call))  # (0-d stays 0-d)


def _kind(array: np.ndarray) -> str:
    """'b' (bool), 'i' (signed), 'u' (unsigned) or 'f' (float)."""
    return array.dtype.kind


def _nan(*arrays) -> bool:
    return any(_kind(a) == "f" and bool(np.isnan(a).any()) for a in arrays)


def _same_dtype(*arrays) -> bool:
    return len({a.dtype for a in arrays}) == 1


def _arithmetic(fn, kinds: str):
    """An elementwise binary operator on two operands of one dtype whose kind is in ``kinds``."""

    def evaluate(call, dtype, shape, a, b):
        if not (_same_dtype(a, b) and _kind(a) in kinds):
            return None
        return fn(a, b)

    return evaluate


def _floored(fn):
    """``floor_divide`` or ``floor_mod`` of integers: TIR's ``floordiv`` and ``floormod``,
    which NumPy's match; a zero divisor is left to the kernel."""

    def evaluate(call, dtype, shape, a, b):
        if not (_same_dtype(a, b) and _kind(a) in "iu") or not np.all(b != 0):
            return None
        return fn(a, b)

    return evaluate


def _compare(fn):
    def evaluate(call, dtype, shape, a, b):
        if not _same_dtype(a, b) or _nan(a, b):  # (NaN: LLVM's ordered != is false)
            return None
        return fn(a, b)

    return evaluate


def _extreme(fn):
    def evaluate(call, dtype, shape, a, b):
        if not _same_dtype(a, b) or _kind(a) == "b" or _nan(a, b):
            return None
        return fn(a, b)

    return evaluate


def _logical(fn):
    def evaluate(call, dtype, shape, *operands):
        if not all(_kind(a) == "b" for a in operands):
            return None
        return fn(*operands)

    return evaluate


def _signed_unary(fn):
    def evaluate(call, dtype, shape, a):
        return fn(a) if _kind(a) in "if" else None

    return evaluate


def _cast(value: np.ndarray, dtype: str) -> np.ndarray | None:
    """``value`` cast to ``dtype`` as LLVM's conversions do; None for a cast to bool from
    another dtype (LLVM's NaN is false, NumPy's true).

    A float that does not fit the integer dtype (infinities and NaN included: T5 casts the
    ``log`` of 0 before a ``where`` drops it) is undefined in LLVM, and the kernel gets what
    the processor's conversion instruction gives; NumPy's cast is that same instruction."""
    target = np.dtype(dtype)
    if target.kind == "b" and _kind(value) != "b":
        return None
    return value.astype(target)


def _astype(call, dtype, shape, a):
    return _cast(a, dtype)


def _where(call, dtype, shape, cond, a, b):
    if _kind(cond) != "b" or not _same_dtype(a, b):
        return None
    return np.where(cond, a, b)


def _reshaped(call, dtype, shape, a, *rest):
    """``reshape``, ``expand_dims``, ``squeeze``, ``flatten``: the elements in their order."""
    return a.reshape(shape)


def _broadcast_to(call, dtype, shape, a, _shape):
    return np.broadcast_to(a, shape)


def _permute_dims(call, dtype, shape, a):
    axes = call.attrs.axes
    return np.transpose(a, None if axes is None else [int(axis) for axis in axes])


def _filled(value) -> callable:
    def evaluate(call, dtype, shape, *operands):
        return np.full(shape, value, dtype)

    return evaluate


def _full(call, dtype, shape, _shape_or_x, fill):
    """``full`` and ``full_like``: legalization converts the fill value through a Python
    scalar, so only a value that ``dtype`` holds exactly is folded."""
    cast = _cast(fill, dtype)
    if cast is None or fill.ndim != 0 or not cast.astype(fill.dtype) == fill:
        return None
    return np.full(shape, cast, dtype)


def _arange(call, dtype, shape, start, end, step):
    if np.dtype(dtype).kind not in "iu":  # (floats: TIR's start + i * step may round apart)
        return None
    start, step = int(start.value), int(step.value)
    return (start + step * np.arange(shape[0], dtype=np.int64)).astype(dtype)


_TABLE = {
    "relax.add": _arithmetic(np.add, "iuf"),
    "relax.subtract": _arithmetic(np.subtract, "iuf"),
    "relax.multiply": _arithmetic(np.multiply, "iuf"),
    "relax.divide": _arithmetic(np.divide, "f"),
    "relax.floor_divide": _floored(np.floor_divide),
    "relax.floor_mod": _floored(np.remainder),
    "relax.minimum": _extreme(np.minimum),
    "relax.maximum": _extreme(np.maximum),
    "relax.equal": _compare(np.equal),
    "relax.not_equal": _compare(np.not_equal),
    "relax.less": _compare(np.less),
    "relax.less_equal": _compare(np.less_equal),
    "relax.greater": _compare(np.greater),
    "relax.greater_equal": _compare(np.greater_equal),
    "relax.logical_and": _logical(np.logical_and),
    "relax.logical_or": _logical(np.logical_or),
    "relax.logical_xor": _logical(np.logical_xor),
    "relax.logical_not": _logical(np.logical_not),
    "relax.negative": _signed_unary(np.negative),
    "relax.abs": _signed_unary(np.abs),
    "relax.where": _where,
    "relax.astype": _astype,
    "relax.reshape": _reshaped,
    "relax.expand_dims": _reshaped,
    "relax.squeeze": _reshaped,
    "relax.flatten": _reshaped,
    "relax.broadcast_to": _broadcast_to,
    "relax.permute_dims": _permute_dims,
    "relax.zeros": _filled(0),
    "relax.zeros_like": _filled(0),
    "relax.ones": _filled(1),
    "relax.ones_like": _filled(1),
    "relax.full": _full,
    "relax.full_like": _full,
    "relax.arange": _arange,
}
