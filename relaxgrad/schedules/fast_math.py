"""``exp``, ``tanh``, ``sigmoid`` and ``erf`` of float32 as polynomials LLVM vectorizes, and
``rsqrt`` as ``1 / sqrt``, which TVM vectorizes (a pass over PrimFuncs, CPU).

LLVM lowers ``llvm.exp.v16f32`` to sixteen calls of libm's ``expf``: softmax's two
exponentials of a transformer's (16, 4, 128, 128) scores took 7 ms, more than the layer's
matmuls, and a tanh of a 256 x 256 activation twice its matmul. :class:`FastMath` rewrites
them, float32 only:

- ``T.exp(x)`` into Cephes' ``expf``: range reduction ``x = n ln 2 + r`` (``ln 2`` in two
  parts), a degree-6 polynomial in ``r`` and the ``2^n`` put into the exponent bits. Within
  2 ulp on ``[-87.3, 88.7]``; ``exp`` of a NaN is a NaN, of ``+inf`` is ``+inf`` and of
  anything below about -87.3 (``-inf`` included) is 0 (the subnormal results are flushed);
- ``T.tanh(x)`` into Cephes' ``tanhf``: an odd polynomial below 0.625 in magnitude, else
  ``1 - 2 / (exp(2|x|) + 1)`` with the sign of ``x``;
- ``T.sigmoid(x)`` into ``1 / (1 + exp(-x))``;
- ``T.erf(x)`` (GELU's, forward and backward) into the rational function of Eigen and XLA
  (TVM's ``topi.fast_erf``) on ``x`` clamped to [-4, 4]: BERT-base's GELUs took 0.5 s of a
  4.5 s step (one thread) with libm's ``erff`` per element.

Other dtypes are left to LLVM.

- A float32 value stored into a bfloat16 buffer, ``Cast("bfloat16", x)``, is stored as its
  rounding's ``uint16`` bits (:func:`bf16_bits`) into a ``uint16`` view of the buffer, ``x``
  bound first: TVM's bf16 legalization failed on a value the same in every vector lane (a
  broadcast: "dtype mismatch on BufferStore ... uint16 ... bfloat16x32", a LoRA step of a
  Qwen2 in bf16), and a copy of the polynomials' ``Let`` bindings made ``VectorizeLoop``
  fail ("Let cannot bind the same var to two different values": a mixed-precision MLP's
  ``tanh`` then cast). A value ``VectorizeLoop`` scalarizes (an ``if_then_else``: a rotary
  embedding's concatenation) is bound in a ``Let`` of the store instead (:func:`_scalarized`):
  TVM scalarized the ``Bind`` alone and stored its last lane's value in every lane.
- ``Cast("float32", load)`` of an element of a bfloat16 parameter buffer (a value mixed
  precision holds in bf16) into the element's bits read from a ``uint16`` view of the buffer
  and shifted into a float32's high half (:func:`_widened`): TVM's bf16 legalization passes over
  the values of ``Let`` expressions and ``Bind`` statements, where the polynomials (and the
  stores above) bind their operand, and there it read the element's bits as an integer
  (``exp``: ``inf``). A bfloat16 buffer the function allocates itself is read so in a ``Let``'s
  value inlined instead (:func:`_inlined_over_bf16`), and its stores are left to TVM.
- ``Cast("float32", Cast("bfloat16", x))`` of a float32 ``x`` (a value rounded to bfloat16:
  mixed precision's gradients of a product's operands, read back in float32) into that rounding
  on ``x``'s bits (:func:`bf16_rounded`), with no bfloat16 value at all: TVM's legalization of
  the two casts, fused into a batch norm's gradient with a select of a scalar, crashed LLVM's
  code generator (ResNet-50 in bf16). Roundings nested in ``x`` are dropped: a fused chain of
  values held in bf16 computes in float32 and rounds once, at its end (see :func:`_round_trip`:
  nested, each multiplied the code by four). These run before the ``Let`` bindings over
  bfloat16 values are inlined, so that a rounding bound in a polynomial's ``Let`` stays bound
  once (``tanh`` of a held product: 126 copies of it).
- ``T.rsqrt(x)`` of any float dtype into ``1 / T.sqrt(x)``, what LLVM computes for it anyway:
  TVM's ``VectorizeLoop`` cannot vectorize ``rsqrt`` and scalarizes the whole loop (every
  normalization's gradient has one), leaving it to LLVM's loop vectorizer, which LLVM 22
  miscompiles for the periodic indices of our fused loops (see
  :func:`relaxgrad.pipeline.cpu_target`).
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import Op

from .._module import with_functions
from ._common import calls_any

_IF_THEN_ELSE = Op.get("prim.if_then_else")
_REINTERPRET = Op.get("tirx.reinterpret")

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
         1.6666665459e-1, 5.0000001201e-1)  # fmt: skip
_LOW, _HIGH = -87.33654475, 88.72283905  # 2^n stays a normal float32: n in [-126, 128]


def fast_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """Cephes' ``expf(x)`` for a float32 ``x`` (see the module docstring)."""

    def const(v):
        return tirx.const(v, "float32")

    def let(name, value, body):
        var = tirx.Var(name, str(value.ty))
        return tirx.Let(var, value, body(var))

    def scaled(clamped, n):
        r = clamped - n * const(_LN2_HI) - n * const(_LN2_LO)
        return let("r", r, lambda r: times_power_of_two(polynomial(r), n))

    def polynomial(r):
        poly = const(_POLY[0])
        for c in _POLY[1:]:
            poly = poly * r + const(c)
        return poly * r * r + r + const(1.0)

    def times_power_of_two(p, n):
        # 2^n in the exponent bits; n = 128 (x near the top of the range) has none: 2^127 * 2.
        exponent = tirx.min(tirx.Cast("int32", n), tirx.const(127, "int32")) + 127
        bits = tirx.shift_left(exponent, tirx.const(23, "int32"))
        two = tirx.Select(n > const(127.0), const(2.0), const(1.0))
        return p * tirx.reinterpret("float32", bits) * two

    def exp(x):
        # a lane whose result is 0 computes exp(0), not a subnormal it would then drop: making
        # one costs a microcode assist on Intel's cores (a causal mask's softmax, half its
        # elements the most negative float32: 7.4 ms, 1.8 without them)
        below = x < const(_LOW)
        clamped = tirx.Select(below, const(0.0), tirx.min(x, const(_HIGH)))
        n = tirx.floor(clamped * const(_LOG2E) + const(0.5))
        result = let("n", n, lambda n: scaled(clamped, n))
        result = tirx.Select(below, const(0.0), result)
        result = tirx.Select(x > const(_HIGH), const(float("inf")), result)
        # NaN from its bits: LLVM's fast-math flags fold ``x != x`` away.
        magnitude = tirx.reinterpret("int32", x) & tirx.const(0x7FFFFFFF, "int32")
        return tirx.Select(magnitude > tirx.const(0x7F800000, "int32"), x, result)

    return let("x", x, exp)


_TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
              -3.33332819422e-1)  # fmt: skip


def fast_tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """Cephes' ``tanhf(x)`` for a float32 ``x`` on :func:`fast_exp`."""
    one, two = tirx.const(1.0, "float32"), tirx.const(2.0, "float32")

    def tanh(x):
        z = x * x
        poly = tirx.const(_TANH_POLY[0], "float32")
        for c in _TANH_POLY[1:]:
            poly = poly * z + tirx.const(c, "float32")
        small = poly * z * x + x
        # exp(2|x|) overflows to inf from |x| = 44.4: 1 - 2 / inf = 1, tanh's limit.
        large = tirx.Var("t", "float32")  # bound once: fast_exp's own lets appear once
        signed = tirx.Select(x < tirx.const(0.0, "float32"), -large, large)
        signed = tirx.Let(large, one - two / (fast_exp(two * tirx.abs(x)) + one), signed)
        return tirx.Select(tirx.abs(x) < tirx.const(0.625, "float32"), small, signed)

    var = tirx.Var("x", "float32")
    return tirx.Let(var, x, tanh(var))


def reciprocal_sqrt(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``1 / sqrt(x)``: ``T.rsqrt`` in ops TVM's vectorizer takes."""
    return tirx.const(1.0, str(x.ty)) / tirx.sqrt(x)


def fast_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``1 / (1 + exp(-x))`` on :func:`fast_exp` for a float32 ``x``."""
    one = tirx.const(1.0, "float32")
    return one / (one + fast_exp(-x))


# erf(x) ~ x * P(x^2) / Q(x^2) on [-4, 4] (Eigen's and XLA's float32 erf, TVM's fast_erf)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)  # fmt: skip
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)  # fmt: skip


def fast_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``erf(x)`` for a float32 ``x`` as a rational function of ``x`` clamped to [-4, 4]
    (beyond, erf rounds to +-1); NaN stays NaN."""

    def horner(coefficients, z):
        value = tirx.const(coefficients[0], "float32")
        for c in coefficients[1:]:
            value = value * z + tirx.const(c, "float32")
        return value

    def erf(x):
        four = tirx.const(4.0, "float32")
        clamped = tirx.max(tirx.min(x, four), -four)
        z = tirx.Var("z", "float32")
        ratio = tirx.Let(z, clamped * clamped,
                         clamped * horner(_ERF_P, z) / horner(_ERF_Q, z))  # fmt: skip
        magnitude = tirx.reinterpret("int32", x) & tirx.const(0x7FFFFFFF, "int32")
        return tirx.Select(magnitude > tirx.const(0x7F800000, "int32"), x, ratio)

    var = tirx.Var("x", "float32")
    return tirx.Let(var, x, erf(var))


def _u32(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "uint32")


def _bf16_rounding(x: tirx.PrimExpr, body) -> tirx.PrimExpr:
    """``body(bits, rounded, nan)`` for a float32 ``x``: its bits, ``bits + 0x7FFF + (bits >> 16
    & 1)`` (TVM's round to nearest, ties to even, in the high half; past bfloat16's largest
    finite value it carries into infinity), and whether ``x`` is a NaN (on the bits: ``x != x``
    folds away)."""
    bits = tirx.Var("bits", "uint32")
    odd = tirx.bitwise_and(tirx.shift_right(bits, _u32(16)), _u32(1))
    nan = tirx.bitwise_and(bits, _u32(0x7FFFFFFF)) > _u32(0x7F800000)
    return tirx.Let(bits, tirx.reinterpret("uint32", x), body(bits, bits + _u32(0x7FFF) + odd, nan))


def bf16_rounded(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """A float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32; a NaN stays
    ``x``."""
    def body(bits, rounded, nan):
        wide = tirx.reinterpret("float32", tirx.bitwise_and(rounded, _u32(0xFFFF0000)))
        return tirx.Select(nan, tirx.reinterpret("float32", bits), wide)

    return _bf16_rounding(x, body)


def bf16_bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """The bfloat16 nearest a float32 ``x`` (ties to even), as its ``uint16`` bits; a NaN keeps
    its sign and top mantissa bits, made quiet."""
    def body(bits, rounded, nan):
        quiet = tirx.bitwise_or(tirx.shift_right(bits, _u32(16)), _u32(0x40))
        return tirx.Select(nan, quiet, tirx.shift_right(rounded, _u32(16)))

    return tirx.Cast("uint16", _bf16_rounding(x, body))


def _stored_as_bits(store: tirx.BufferStore):
    """A float32 value stored into a bfloat16 buffer, ``buf[i] = Cast(bfloat16, x)``, as
    ``bits[i] = bf16_bits(x)`` into a ``uint16`` view of the buffer (see the module
    docstring), ``x`` bound first."""
    value = store.value
    if store.buffer.dtype != "bfloat16":
        return store
    if not (isinstance(value, tirx.Cast) and str(value.value.ty) == "float32") \
            or _reads_bf16(value.value):
        # left to TVM's bf16 legalization (bound, a bfloat16 load would go unlegalized: see
        # _widened), which copies a value it rounds: a Let in it (a held value's rounding read
        # by a comparison) was then bound twice ("Let cannot bind the same var to two
        # different values": RegNet's ReLU gradient in bf16, a sum of two bf16 gradients)
        return tirx.BufferStore(store.buffer, _without_lets(value), store.indices)
    buffer = store.buffer
    view = tirx.decl_buffer(buffer.shape, "uint16", f"{buffer.name}_bits", data=buffer.data,
                            strides=buffer.strides, elem_offset=buffer.elem_offset)
    var = tirx.Var("v", "float32")
    if _scalarized(value.value):  # one statement, scalarized whole
        return tirx.SeqStmt([tirx.DeclBuffer(view, data=buffer.data), tirx.BufferStore(
            view, tirx.Let(var, value.value, bf16_bits(var)), store.indices)])
    return tirx.SeqStmt([tirx.Bind(var, value.value), tirx.DeclBuffer(view, data=buffer.data),
                         tirx.BufferStore(view, bf16_bits(var), store.indices)])


def _scalarized(expr: tirx.PrimExpr) -> bool:
    """Whether TVM's ``VectorizeLoop`` may scalarize ``expr``: it holds an ``if_then_else``
    (whose condition may differ per lane). A ``Bind`` of such a value was scalarized as a
    statement of its own, a loop over the lanes binding the var, and the statements after it,
    vectorized, read the var as one scalar: the last lane's value in every lane (a rotary
    embedding's ``cat([-x2, x1])`` stored in bf16)."""
    return calls_any(expr, (_IF_THEN_ELSE,))


def _widened(store: tirx.BufferStore, params=()):
    """``store`` with each ``Cast(float32, load)`` of a bfloat16 element in its value as the
    element's bits, read from a ``uint16`` view of the buffer (declared before the store),
    shifted into a float32's high half (what a bfloat16 is): TVM's legalization of the
    bfloat16 load gave wrong values (``exp``'s: ``inf``) once the float32 was bound in a
    :func:`fast_exp`'s ``Let``."""
    views: dict = {}

    def widen(cast: tirx.Cast) -> tirx.PrimExpr:
        load = cast.value
        if (str(cast.ty) != "float32" or not isinstance(load, tvm.ir.expr.TensorLoad)
                or str(load.ty) != "bfloat16"):
            return cast
        buffer = load.source
        if not any(buffer.same_as(p) for p in params):
            return cast  # (a buffer the function allocates: legalized with its allocation)
        if buffer.name not in views:
            views[buffer.name] = (tirx.decl_buffer(
                buffer.shape, "uint16", f"{buffer.name}_bits", data=buffer.data,
                strides=buffer.strides, elem_offset=buffer.elem_offset), buffer.data)
        view = views[buffer.name][0]
        bits = tirx.Cast("uint32", tirx.BufferLoad(view, load.indices))
        return tirx.reinterpret("float32", tirx.shift_left(bits, _u32(16)))

    value = tvm_ffi.structural_map(store.value, (tirx.Cast, widen))
    if not views:
        return store
    return tirx.SeqStmt([*(tirx.DeclBuffer(v, data=data) for v, data in views.values()),
                         tirx.BufferStore(store.buffer, value, store.indices)])


def _reads_bf16(expr) -> bool:
    """Whether a bfloat16 value occurs in ``expr`` (a load, a cast, a select of them)."""
    found = []

    def visit(node):
        ty = getattr(node, "ty", None)
        if not found and ty is not None and str(ty).startswith("bfloat16"):
            found.append(node)

    tvm_ffi.structural_walk(expr, [(object, visit)])
    return bool(found)


def _inlined_over_bf16(let: tirx.Let) -> tirx.PrimExpr:
    """A ``Let`` whose value reads a bfloat16 buffer, inlined: TVM's bf16 legalization passes
    over ``Let`` values, leaving their ``Cast(float32, load)`` a conversion of the element's
    ``uint16`` bits (``exp`` of a bfloat16 input: ``inf``). The polynomials then read their
    operands more than once, which LLVM computes once."""
    if not _reads_bf16(let.value):
        return let
    return _without_lets(let)


def _without_lets(expr: tirx.PrimExpr) -> tirx.PrimExpr:
    """``expr`` with every ``Let`` in it inlined (a value copied into several places must not
    carry a ``Let`` along: ``VectorizeLoop`` refuses one var bound twice)."""
    if not isinstance(expr, tirx.Let):
        return tvm_ffi.structural_map(expr, (tirx.Let, _without_lets))
    var, value = expr.var, _without_lets(expr.value)
    body = _without_lets(expr.body)
    return tvm_ffi.structural_map(body, (type(var), lambda v: value if v.same_as(var) else v))


def _round_trip(cast: tirx.Cast) -> tirx.PrimExpr:
    """``Cast(float32, Cast(bfloat16, x))`` of a float32 ``x`` as :func:`bf16_rounded` of ``x``
    without the roundings nested in it (:func:`_unrounded`); ``x`` itself where it is a
    bfloat16 value already (rounded, or a bfloat16 widened): rounding it again changes nothing.

    Each rounding nested in another multiplies the code by four: TVM's simplifier substitutes a
    ``Let``'s value for each of its var's four reads (six nested roundings of a rotary
    embedding's gradient took LLVM's code generation minutes; BLOOM's GELU gradient, a chain of
    held products fused into one kernel, 633 roundings and more than ten minutes). So a fused
    chain of values held in bf16 computes in float32 and rounds once, at its end."""
    inner = cast.value
    if (str(cast.ty) == "float32" and isinstance(inner, tirx.Cast)
            and str(inner.ty) == "bfloat16" and str(inner.value.ty) == "float32"):
        if _holds_bf16(inner.value):
            return inner.value
        if not _reads_bf16(inner.value):  # (bound in a Let, it would go unlegalized)
            return bf16_rounded(_unrounded(inner.value))
    return cast


def _unrounded(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``x`` with each :func:`bf16_rounded` in it replaced by the value it rounds."""

    def unround(let: tirx.Let) -> tirx.PrimExpr:
        return let.value.args[0] if _holds_bf16(let) else let  # (bits = reinterpret(value))

    return tvm_ffi.structural_map(x, (tirx.Let, unround))


def _holds_bf16(x: tirx.PrimExpr) -> bool:
    """Whether the float32 ``x`` is a bfloat16 value: :func:`bf16_rounded`'s result or a
    bfloat16 widened (a cast, or :func:`_widened`'s bits shifted into the high half: a float32
    whose low half is zero is a bfloat16)."""
    if isinstance(x, tirx.Cast):
        return str(x.value.ty) == "bfloat16"
    if isinstance(x, tvm.ir.Call) and x.op.same_as(_REINTERPRET):
        shifted = x.args[0]
        return (isinstance(shifted, tvm.ir.prim.expr.LShift) and str(shifted.ty) == "uint32"
                and isinstance(shifted.b, tirx.IntImm) and int(shifted.b) == 16)  # fmt: skip
    return (isinstance(x, tirx.Let) and x.var.name == "bits" and isinstance(x.body, tirx.Select)
            and isinstance(x.body.false_value, tvm.ir.Call)
            and _is_bf16_mask(x.body.false_value.args[0]))  # fmt: skip


def _is_bf16_mask(x) -> bool:
    """Whether ``x`` is ``bits & 0xFFFF0000`` (a float32's low half cleared)."""
    return (isinstance(x, tirx.BitwiseAnd) and isinstance(x.b, tirx.IntImm)
            and int(x.b) == 0xFFFF0000)  # fmt: skip


@tvm.transform.module_pass(opt_level=0, name="FastMath")
class FastMath:
    """Rewrite float32 ``T.exp``, ``T.tanh``, ``T.sigmoid`` and ``T.erf`` of the module's
    PrimFuncs into :func:`fast_exp`, :func:`fast_tanh`, :func:`fast_sigmoid` and
    :func:`fast_erf`, ``T.rsqrt`` of any float dtype into :func:`reciprocal_sqrt`, and float32
    values rounded to bfloat16 into :func:`bf16_rounded`."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        rules = [(Op.get(f"tirx.{name}"), rule) for name, rule in
                 (("exp", fast_exp), ("tanh", fast_tanh), ("sigmoid", fast_sigmoid),
                  ("erf", fast_erf))]  # fmt: skip

        rsqrt = Op.get("tirx.rsqrt")

        def rewrite(call: tvm.ir.Call):
            if call.op.same_as(rsqrt) and "float" in str(call.ty):
                return reciprocal_sqrt(call.args[0])
            if str(call.ty) != "float32":  # vector lanes come later, with vectorize
                return call
            for op, rule in rules:
                if call.op.same_as(op):
                    return rule(call.args[0])
            return call

        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                widened = functools.partial(_widened, params=list(func.params))
                body = tvm_ffi.structural_map(func.body, (tirx.BufferStore, widened))
                body = tvm_ffi.structural_map(body, (tvm.ir.Call, rewrite))
                body = tvm_ffi.structural_map(body, (tirx.Cast, _round_trip))
                body = tvm_ffi.structural_map(body, (tirx.Let, _inlined_over_bf16))
                body = tvm_ffi.structural_map(body, (tirx.BufferStore, _stored_as_bits))
                if not body.same_as(func.body):
                    updates[gvar] = func.with_body(body)
        return with_functions(mod, updates)
