"""``MixedPrecision``: a function's products in bfloat16 or float16, as ``torch.autocast`` runs
them.

In the named functions, every float32 matrix product and convolution (``matmul``, so linear
layers and attention's products, and ``conv1d/2d/3d`` and their transposes: the ops of
``torch.autocast``'s lower-precision lists for CPU and CUDA) reads its operands cast to the low
dtype, accumulated in float32 by the kernel (``out_dtype="float32"``). Softmax and
log-softmax, the statistics of normalizations, reductions, losses, ``exp`` and ``log`` compute
in float32 (autocast's float32 list).

Values are held as autocast's tensors are (``hold_low=True``, the default): a product's result
(with its bias added, as autocast's linear layer adds it), and what the ops of
:data:`KEEPS_LOW_OPS` (elementwise arithmetic, activations, softmax, normalizations) and layout
ops compute from such values only, are rounded to the low dtype once and held so (half the
memory a training step keeps for its backward pass), read back in float32 by the ops that
follow; a float32 tensor computed in the function (an attention mask) makes a sum float32, as
PyTorch's type promotion does. A softmax read by a product is held too (its probabilities are
what the product reads), and so is a batch norm's output where its input is held (autocast
leaves ``batch_norm`` in the dtype it is given: a CNN's convolution, batch norm and ReLU
outputs are all bf16 there). :func:`read_held_values` makes an adjoint's backward pass read those
copies (the Trainer applies it). ``hold_low=False`` keeps every result float32. What a
``topk``, ``argmax``, sort or comparison reads is never held, nor what leads to it through the
ops above: rounded, values close together tie and the choice changes (a mixture of experts'
router, whose softmax Hugging Face computes in float32 explicitly).

Each operand is cast once per function: a weight read by several products, and by the backward
pass (whose products read the low-precision copy the forward made, see the rules of
``relax.matmul`` and the convolutions), is one cast per step; a value reshaped or transposed
for several products is cast once, before the layout ops. The parameters stay float32, so
their gradients come back in float32 (through the gradient of the cast); the gradients of the
held values and of the products' operands are rounded to the low dtype, as autocast's are.

The pass runs on a model function before :class:`~relaxgrad.transforms.Gradient`; the
:class:`~relaxgrad.training.Trainer` applies it for ``precision="bf16"`` or ``"fp16"``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from .._module import with_function
from ..errors import GradientError
from ..exprs import is_op, substitute

__all__ = ["KEEPS_LOW_OPS", "LOW_PRECISION_OPS", "MixedPrecision", "low_precision_params",
           "read_held_values"]

_CONVOLUTIONS = ("conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose",
                 "conv3d_transpose")  # fmt: skip
LOW_PRECISION_OPS = ("relax.matmul", *(f"relax.nn.{name}" for name in _CONVOLUTIONS))
"""The ops :class:`MixedPrecision` runs in the low dtype (float32 accumulation, float32
result)."""

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


_LAYOUT_PUSH = ("relax.reshape", "relax.permute_dims", "relax.broadcast_to", "relax.expand_dims",
                "relax.squeeze")
"""Layout ops an operand's cast is moved above (one cast of the var they rearrange, shared)."""

_LAYOUT_LOW = (*_LAYOUT_PUSH, "relax.flatten")
"""Ops that move values without computing: a held value's low copy is what they rearrange.
(Not slices and concatenations: a rotary embedding's halves, held, fused into one kernel with
their round trips, which TVM's vectorizer then refused.)"""

_DECISIONS = ("relax.topk", "relax.argmax", "relax.argmin", "relax.argsort", "relax.sort",
              "relax.equal", "relax.not_equal", "relax.greater", "relax.greater_equal",
              "relax.less", "relax.less_equal", "relax.unique", "relax.nonzero")
"""Ops that choose by comparing values: what they read is never held (see :func:`_decisive`)."""

KEEPS_LOW_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                 "relax.negative", "relax.maximum", "relax.minimum", "relax.abs", "relax.where",
                 "relax.clip", "relax.tanh", "relax.sigmoid", "relax.nn.relu", "relax.nn.gelu",
                 "relax.nn.gelu_tanh", "relax.nn.silu", "relax.nn.leakyrelu", "relax.nn.softmax",
                 "relax.nn.layer_norm", "relax.nn.rms_norm", "relax.nn.group_norm")
"""Ops whose result is held in the low dtype when their full-size float operands are: the ops
``torch.autocast`` (CPU) leaves in the dtype they are given, which a product's result is there.
``exp``, ``log``, powers, reductions, log-softmax and losses are not among them: their results
stay float32 (autocast's float32 list)."""


@mutator
class _Cast(PyExprMutator):
    """Casts the float32 operands of :data:`LOW_PRECISION_OPS` to ``dtype``, once per var and
    binding block; with ``hold``, the values of the low-precision chain held in ``dtype``."""

    def __init__(self, mod: IRModule, dtype: str, hold: bool):
        super().__init__(mod)
        self.dtype, self.hold, self.rewritten = dtype, hold, 0
        self._biased: set = set()  # the products whose only readers add a bias
        self._params: set = set()  # the function's parameters
        self._new_block()

    def _new_block(self) -> None:
        """The state of one binding block, empty."""
        self._casts: dict[relax.Expr, relax.Var] = {}  # var -> its low copy
        self._held: set = set()  # the vars whose values are their low copies' (rounded)
        self._unrounded: set = set()  # products rounded once their bias is added
        self._values: dict = {}  # var -> its (rewritten) value
        self._norms: set = set()  # batch norms (their tuples) of held values
        self._tuples: dict = {}  # var -> the tuple it is bound to

    def visit_function_(self, func):
        self._params = set(func.params)
        self._biased = _biased_products(func, self._params)
        self._into_products = _into_products(func)
        self._decisive = _decisive(func)
        return super().visit_function_(func)

    def visit_binding_block_(self, block):
        self._new_block()
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block):
        self._new_block()
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding):
        var, value = binding.var, binding.value
        if is_op(value, "relax.nn.batch_norm") and value.args[0] in self._held:
            self._norms.add(var)  # its output (item 0) is held, as autocast's (see _held_low)
        if isinstance(value, relax.Tuple):
            self._tuples[var] = value
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in self._tuples:
            field = self._tuples[value.tuple_value].fields[value.index]
            if field in self._held:  # a held value repacked (a batch norm's results, imported)
                self._held.add(var)
                self._casts[var] = self._casts[field]
        normalized = isinstance(value, relax.TupleGetItem) and value.index == 0 \
            and value.tuple_value in self._norms
        if not (isinstance(value, relax.Call) or normalized) or not _ty.is_tensor(var) \
                or _ty.dtype_of(var) != "float32":
            return super().visit_var_binding_(binding)
        new = self.builder_.normalize(self.visit_expr(value))
        self._values[var] = new
        low = self._held_low(var, new, var.name) if self.hold else None
        if low is None:
            self.builder_.emit_normalized(relax.VarBinding(var, new))
            return
        low = self.builder_.emit(low, f"{var.name}_{_SHORT[self.dtype]}")
        back = self.builder_.normalize(relax.op.astype(low, "float32"))
        self.builder_.emit_normalized(relax.VarBinding(var, back))
        self._casts[var] = low
        self._held.add(var)

    def _held_low(self, var: relax.Var, call: relax.Call, name: str) -> relax.Expr | None:
        """The low copy of ``call``'s value where it is held (a product's result, a layout op
        of a held value, an op of :data:`KEEPS_LOW_OPS` whose full-size float operands are all
        held), else None. A value a comparison decides on (:func:`_decisive`) is not held."""
        if var in self._decisive:
            return None
        if isinstance(call, relax.TupleGetItem):  # a batch norm's output (see visit_var_binding_)
            return relax.op.astype(self.builder_.emit(call, f"{name}_f32"), self.dtype)
        if any(is_op(call, op) for op in LOW_PRECISION_OPS):
            if _ty.dtype_of(call.args[0]) != self.dtype:
                return None  # not run low (float64 operands, say)
            if var in self._biased:  # rounded with its bias added, as autocast's linear
                self._unrounded.add(var)
                return None
            return relax.op.astype(self.builder_.emit(call, f"{name}_f32"), self.dtype)
        if any(is_op(call, op) for op in _LAYOUT_LOW):
            data = call.args[0]
            if data in self._held:
                low = self._casts[data]
            else:
                return None
            return relax.Call(call.op, [low, *call.args[1:]], call.attrs, call.ty_args)
        if is_op(call, "relax.nn.softmax") and var in self._into_products:
            # probabilities, in [0, 1]: rounded as the product that reads them rounds them,
            # whatever the scores' dtype (a mask made those float32)
            return relax.op.astype(self.builder_.emit(call, f"{name}_f32"), self.dtype)
        if any(is_op(call, op) for op in KEEPS_LOW_OPS):
            floats = [a for a in call.args if _ty.is_float_tensor(a)]
            low = self._held | self._unrounded
            if any(a in low for a in floats) and all(
                    a in low or self._promotes_not(a) for a in floats):
                return relax.op.astype(self.builder_.emit(call, f"{name}_f32"), self.dtype)
        return None

    def _promotes_not(self, x: relax.Expr) -> bool:
        """Whether a float32 operand ``x`` leaves a held operand's op held: a scalar, or a
        vector parameter (a bias, a norm's weight: what autocast casts inside the op). A float32
        tensor computed in the function (an attention mask) makes the result float32, as
        PyTorch's type promotion does: rounded, a mask's most negative float32 would be -inf,
        and a row of them NaN."""
        return _ty.ndim_of(x) == 0 or _is_bias(x, self._params, self._values)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not any(is_op(call, name) for name in LOW_PRECISION_OPS):
            return call
        operands = call.args[:2]
        if not all(_ty.dtype_of(x) == "float32" for x in (*operands, call)):
            return call
        low = [self._cast(x) for x in operands]
        self.rewritten += 1
        if is_op(call, "relax.matmul"):
            return relax.op.matmul(*low, out_dtype="float32")
        name = call.op.name.split(".")[-1]
        fields = ["strides", "padding", *(["output_padding"] if "transpose" in name else []),
                  "dilation", "groups", "data_layout", "kernel_layout", "out_layout"]
        attrs = [call.attrs[f] if not isinstance(call.attrs[f], tvm.tirx.IntImm)
                 else int(call.attrs[f]) for f in fields]  # fmt: skip
        return getattr(relax.op.nn, name)(*low, *attrs, out_dtype="float32")

    def _cast(self, x: relax.Expr) -> relax.Expr:
        """``x`` in the low dtype, once: a layout op's result (the rows of a norm's output
        reshaped for each of the products that read it) as the layout op of its operand's
        cast."""
        if x not in self._casts:
            name = f"{x.name}_{self.dtype}" if isinstance(x, relax.Var) else self.dtype
            value = self._values.get(x)
            if (value is not None and any(is_op(value, op) for op in _LAYOUT_PUSH)
                    and isinstance(value.args[0], relax.Var)
                    and _ty.dtype_of(value.args[0]) == "float32"):
                low = relax.Call(value.op, [self._cast(value.args[0]), *value.args[1:]],
                                 value.attrs, value.ty_args)
            else:
                low = relax.op.astype(x, self.dtype)
            self._casts[x] = self.builder_.emit(low, name)
        return self._casts[x]


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def _is_bias(x, params: set, values: dict) -> bool:
    """Whether ``x`` is a vector parameter or one reshaped (a convolution's ``(1, C, 1, 1)``
    bias): what autocast casts inside the op it is added in."""
    while x not in params:
        value = values.get(x)
        if value is None or not any(is_op(value, op) for op in ("relax.reshape",
                                                                 "relax.expand_dims")):
            return False
        x = value.args[0]
    return _ty.ndim_of(x) == 1


def _into_products(func: relax.Function) -> set:
    """The vars of ``func`` read by a product of :data:`LOW_PRECISION_OPS`, directly or
    through layout ops (:data:`_LAYOUT_LOW`) only."""
    readers, _ = _readers(func)
    found, todo = set(), []
    for var, reads in readers.items():
        if any(any(is_op(b.value, op) for op in LOW_PRECISION_OPS) for b in reads):
            found.add(var)
            todo.append(var)
    values = {b.var: b.value for bs in readers.values() for b in bs}
    while todo:
        value = values.get(todo.pop())
        if value is not None and any(is_op(value, op) for op in _LAYOUT_LOW):
            source = value.args[0]
            if isinstance(source, relax.Var) and source not in found and all(
                    b.var in found for b in readers.get(source, [])):
                found.add(source)
                todo.append(source)
    return found


def _decisive(func: relax.Function) -> set:
    """The vars of ``func`` that an op of :data:`_DECISIONS` (``topk``, ``argmax``,
    comparisons of two tensors: not :func:`_threshold`) reads, directly or through layout ops
    and ops of :data:`KEEPS_LOW_OPS` (the ops whose results could be held): rounded to bf16,
    values close together become equal and the choice between them changes (a mixture of
    experts' router probabilities: ``topk`` of ``softmax(logits)`` picked other experts than
    float32's for some token in every batch, and those experts' gradients were 36% off;
    Hugging Face's routers compute that softmax in float32 explicitly)."""
    found: set = set()
    bindings = [b for block in func.body.blocks for b in block.bindings] \
        if isinstance(func.body, relax.SeqExpr) else []
    passing = (*_LAYOUT_LOW, *KEEPS_LOW_OPS)
    for binding in reversed(bindings):
        value = binding.value
        if any(is_op(value, op) for op in _DECISIONS) and not _threshold(value) or (
                binding.var in found and any(is_op(value, op) for op in passing)):
            found.update(a for a in value.args if isinstance(a, relax.Var))
    return found


def _threshold(call: relax.Call) -> bool:
    """Whether ``call`` compares a value with a constant or a scalar (ReLU's ``x <= 0``, a
    clamp's mask): rounding moves its outcome only for values within half a bf16 step of the
    threshold (for 0, none), as autocast's rounding does."""
    return is_op(call, "relax.nn.relu") or (
        len(call.args) == 2 and any(isinstance(a, _ty.Constant) or _ty.ndim_of(a) == 0
                                    for a in call.args))  # fmt: skip


def _biased_products(func: relax.Function, params: set) -> set:
    """The vars of ``func`` bound to a product whose only readers add a bias to it
    (:func:`_is_bias`): a linear or convolution layer split into a product and an ``add``."""
    readers, elsewhere = _readers(func)
    values = {b.var: b.value for bs in readers.values() for b in bs}
    products = [v for v, value in values.items()
                if any(is_op(value, op) for op in LOW_PRECISION_OPS)]  # fmt: skip
    biased = set()
    for var in products:
        reads = readers.get(var, [])
        if var in elsewhere or not reads:
            continue
        if all(is_op(b.value, "relax.add") and len(b.value.args) == 2
               and any(a.same_as(var) for a in b.value.args)
               and _is_bias(next(a for a in b.value.args if not a.same_as(var)), params, values)
               for b in reads):  # fmt: skip
            biased.add(var)
    return biased


@tvm.transform.module_pass(opt_level=0, name="MixedPrecision")
class MixedPrecision:
    """Module pass: run the products of ``func_names`` in ``dtype`` (see the module docstring).

    Parameters
    ----------
    dtype : str
        ``"bfloat16"`` (``"bf16"``) or ``"float16"`` (``"fp16"``).
    func_names : sequence of str
        The functions to rewrite (``("main",)`` by default).
    hold_low : bool
        Hold the results of the low-precision chain in ``dtype`` (see the module docstring);
        False keeps them float32.

    Examples
    --------
    >>> mod = relaxgrad.transforms.MixedPrecision("bf16")(mod)
    >>> mod = relaxgrad.Gradient("main")(mod)   # products and their gradients in bfloat16
    """

    def __init__(self, dtype: str = "bfloat16", func_names=("main",), hold_low: bool = True):
        if dtype not in _DTYPES:
            raise GradientError(f"MixedPrecision: dtype must be one of {sorted(_DTYPES)}, "
                                f"not {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.func_names = (func_names,) if isinstance(func_names, str) else tuple(func_names)
        self.hold_low = bool(hold_low)

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        for name in self.func_names:
            if name not in names or not isinstance(mod[name], relax.Function):
                raise GradientError(f"MixedPrecision: the module has no Relax function {name}")
            cast = _Cast(mod, self.dtype, self.hold_low)
            func = cast.visit_expr(mod[name])
            if cast.rewritten:
                mod = with_function(cast.builder_.get(), name, func)
        return mod


def low_precision_params(mod: IRModule, dtype: str, func_names, names) -> tuple[IRModule, list]:
    """``mod`` with the parameters ``names`` of every function in ``func_names`` taken in
    ``dtype`` (``"bf16"``, ``"bfloat16"``, ...) where each function reads them only through
    layout ops (transposes, reshapes), ``astype(., dtype)`` (as :class:`MixedPrecision` leaves a
    weight that only products read) and lookups (``take``: an embedding table, also one tied to
    the output projection), those casts removed and each lookup's rows widened back to float32;
    and the names taken so. A value cast once in the caller then gives the products the same
    results, and the lookups its rounded rows (as a model loaded in that dtype looks them up); a
    parameter read otherwise too (a norm's weight, a bias) stays as it was.

    The :class:`~relaxgrad.training.Trainer` applies it to frozen weights for
    ``frozen_dtype`` (held in half the memory, and not cast again each step)."""
    dtype = _DTYPES.get(dtype, dtype)
    chains = {name: _cast_chains(mod[name], names, dtype) for name in func_names}
    taken = [name for name in names if all(name in chain for chain in chains.values())]
    for func_name, chain in chains.items() if taken else ():
        reached = set().union(*(chain[name] for name in taken))
        low = _taken_low(mod[func_name], set(taken), reached, dtype)
        mod = with_function(mod, func_name, low)
    return mod, taken


_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape")  # read any dtype, move no value


def _readers(func: relax.Function) -> tuple[dict, set]:
    """Per var, the bindings that read it; and the vars read elsewhere (results, conditions)."""
    readers: dict = {}
    elsewhere: set = set()

    @relax.expr_functor.visitor
    class _Reads(relax.expr_functor.PyExprVisitor):
        def visit_var_binding_(self, binding):
            for var in relax.analysis.free_vars(binding.value):
                readers.setdefault(var, []).append(binding)

        def visit_seq_expr_(self, seq):
            for block in seq.blocks:
                self.visit_binding_block(block)
            elsewhere.update(relax.analysis.free_vars(seq.body))

    _Reads().visit_expr(func.body)
    return readers, elsewhere


def _cast_chains(func: relax.Function, names, dtype: str) -> dict[str, set]:
    """Per float32 parameter of ``names`` that ``func`` reads only through layout ops and
    casts to ``dtype`` (at least one): the vars from it to those casts (the parameter and the
    layout ops' results)."""
    readers, elsewhere = _readers(func)
    chains = {}
    for param in func.params:
        if param.name not in names or _ty.dtype_of(param) != "float32":
            continue
        chain = _cast_chain(param, readers, elsewhere, dtype)
        if chain is not None:
            chains[param.name] = chain
    return chains


def _cast_chain(param: relax.Var, readers: dict, elsewhere: set, dtype: str) -> set | None:
    """The vars from ``param`` to its casts to ``dtype`` and lookups through layout ops, where
    it reaches nothing else and some cast or lookup (see :func:`_readers`); else None."""
    chain, reads, todo = set(), 0, [param]
    while todo:
        var = todo.pop()
        if var in elsewhere:
            return None
        chain.add(var)
        for binding in readers.get(var, []):
            value = binding.value
            if _is_cast_of(value, var, dtype) or _is_lookup_in(value, var):
                reads += 1
            elif (any(is_op(value, name) for name in _LAYOUT_OPS)
                  and value.args[0].same_as(var)
                  and not any(var.same_as(a) for a in value.args[1:])):
                todo.append(binding.var)
            else:
                return None
    return chain if reads else None


def _is_cast_of(value, var, dtype: str) -> bool:
    return (is_op(value, "relax.astype") and value.args[0].same_as(var)
            and str(value.attrs.dtype) == dtype)


def _is_lookup_in(value, var) -> bool:
    """Whether ``value`` looks up rows of ``var`` (``take(var, indices)``, not by ``var``)."""
    return (is_op(value, "relax.take") and value.args[0].same_as(var)
            and not value.args[1].same_as(var))


def _taken_low(func: relax.Function, names: set, chain: set, dtype: str) -> relax.Function:
    """``func`` with the parameters ``names`` in ``dtype``, their layout ops (``chain``: the
    vars from them to their casts and lookups) taking that dtype, their casts read as what they
    cast and their lookups' rows widened to float32."""
    new = {p: relax.Var(p.name, relax.TensorType(_ty.shape_values(p), dtype))
           for p in func.params if p.name in names}

    @mutator
    class _Taken(PyExprMutator):
        def visit_var_binding_(self, binding):
            value = binding.value
            if is_op(value, "relax.astype") and _is_cast_of(value, value.args[0], dtype) \
                    and value.args[0] in chain:
                self.set_var_remap(binding.var, self.visit_expr(value.args[0]))
                return
            if is_op(value, "relax.take") and value.args[0] in chain:
                rows = self.builder_.emit(self.visit_expr(value))
                self.set_var_remap(binding.var, self.builder_.emit(
                    relax.op.astype(rows, "float32"), binding.var.name))
                return
            super().visit_var_binding_(binding)

    taken = _Taken()
    for old, low in new.items():
        taken.set_var_remap(old, low)
    body = taken.visit_expr(func.body)
    params = [new.get(p, p) for p in func.params]
    return relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)


def read_held_values(func: relax.Function) -> relax.Function:
    """``func`` (an adjoint of a function :class:`MixedPrecision` rewrote) with its backward
    pass reading the held copies: where the forward computes a held value in float32 (``v_f32``)
    and holds it rounded (``v_bf16 = astype(v_f32, bf16)``, the names MixedPrecision gives
    them), the later readers of ``v_f32`` (the gradient of a softmax or a ``tanh``, which read
    their result) read ``astype(v_bf16, float32)``: the value PyTorch's autocast saves for them,
    and ``v_f32`` dies with the forward pass instead of living beside its copy until the
    backward one."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    held = {}  # float32 var -> its held copy
    for block in func.body.blocks:
        for b in block.bindings:
            value = b.value
            if (is_op(value, "relax.astype") and isinstance(value.args[0], relax.Var)
                    and str(value.attrs.dtype) in _SHORT):
                source = value.args[0]
                short = _SHORT[str(value.attrs.dtype)]
                if (source.name.endswith("_f32") and b.var.name == f"{source.name[:-4]}_{short}"
                        and _ty.dtype_of(source) == "float32"):
                    held[source] = b.var
    if not held:
        return func
    lows = set(held.values())  # a set: a 24-layer adjoint scanned the values per binding, 5 s

    @mutator
    class _Reads(PyExprMutator):
        def visit_binding_block_(self, block):
            self.wide, self.seen = {}, set()
            return super().visit_binding_block_(block)

        def visit_dataflow_block_(self, block):
            self.wide, self.seen = {}, set()
            return super().visit_dataflow_block_(block)

        def visit_var_binding_(self, binding):
            remap = {}
            for v in relax.analysis.free_vars(binding.value):
                low = held.get(v)
                if low is not None and low in self.seen and not binding.var.same_as(low):
                    if v not in self.wide:
                        self.wide[v] = self.builder_.emit(relax.op.astype(low, "float32"),
                                                          v.name[:-4])
                    remap[v] = self.wide[v]
            if remap:
                binding = relax.VarBinding(binding.var, substitute(binding.value, remap))
            super().visit_var_binding_(binding)
            if binding.var in lows:
                self.seen.add(binding.var)

    body = _Reads().visit_expr(func.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
