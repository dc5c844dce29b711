"""``MixedPrecision``: a function's products in bfloat16 or float16, as ``torch.autocast`` runs
them.

In the named functions, every float32 matrix product and convolution (``matmul``, so linear
layers and attention's products, and ``conv1d/2d/3d`` and their transposes: the ops of
``torch.autocast``'s lower-precision lists for CPU and CUDA) reads its operands cast to the low
dtype and returns float32, accumulated in float32 by the kernel (``out_dtype="float32"``).
Everything else stays float32: softmax and log-softmax, the statistics of normalizations,
reductions, losses, ``exp`` and ``log`` (the ops of autocast's float32 list, and all the others,
which autocast leaves in the dtype they are given, float32 here).

Each operand is cast once per function: a weight read by several products, and by the backward
pass (whose products read the low-precision copy the forward made, see the rules of
``relax.matmul`` and the convolutions), is one cast per step. The parameters stay float32, so
their gradients come back in float32 (through the gradient of the cast); the gradients of the
products' operands are rounded to the low dtype, as autocast's are.

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
from ..exprs import is_op

__all__ = ["LOW_PRECISION_OPS", "MixedPrecision", "low_precision_params"]

_CONVOLUTIONS = ("conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose",
                 "conv3d_transpose")  # fmt: skip
LOW_PRECISION_OPS = ("relax.matmul", *(f"relax.nn.{name}" for name in _CONVOLUTIONS))
"""The ops :class:`MixedPrecision` runs in the low dtype (float32 accumulation, float32
result)."""

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


@mutator
class _Cast(PyExprMutator):
    """Casts the float32 operands of :data:`LOW_PRECISION_OPS` to ``dtype``, once per var and
    binding block."""

    def __init__(self, mod: IRModule, dtype: str):
        super().__init__(mod)
        self.dtype, self.rewritten = dtype, 0
        self._casts: dict[relax.Expr, relax.Var] = {}

    def visit_binding_block_(self, block):
        self._casts = {}
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block):
        self._casts = {}
        return super().visit_dataflow_block_(block)

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
        if x not in self._casts:
            name = f"{x.name}_{self.dtype}" if isinstance(x, relax.Var) else self.dtype
            self._casts[x] = self.builder_.emit(relax.op.astype(x, self.dtype), name)
        return self._casts[x]


@tvm.transform.module_pass(opt_level=0, name="MixedPrecision")
class MixedPrecision:
    """Module pass: run the products of ``func_names`` in ``dtype`` (see the module docstring).

    Parameters
    ----------
    dtype : str
        ``"bfloat16"`` (``"bf16"``) or ``"float16"`` (``"fp16"``).
    func_names : sequence of str
        The functions to rewrite (``("main",)`` by default).

    Examples
    --------
    >>> mod = relaxgrad.transforms.MixedPrecision("bf16")(mod)
    >>> mod = relaxgrad.Gradient("main")(mod)   # products and their gradients in bfloat16
    """

    def __init__(self, dtype: str = "bfloat16", func_names=("main",)):
        if dtype not in _DTYPES:
            raise GradientError(f"MixedPrecision: dtype must be one of {sorted(_DTYPES)}, "
                                f"not {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.func_names = (func_names,) if isinstance(func_names, str) else tuple(func_names)

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        for name in self.func_names:
            if name not in names or not isinstance(mod[name], relax.Function):
                raise GradientError(f"MixedPrecision: the module has no Relax function {name}")
            cast = _Cast(mod, self.dtype)
            func = cast.visit_expr(mod[name])
            if cast.rewritten:
                mod = with_function(cast.builder_.get(), name, func)
        return mod


def low_precision_params(mod: IRModule, dtype: str, func_names, names) -> tuple[IRModule, list]:
    """``mod`` with the parameters ``names`` of every function in ``func_names`` taken in
    ``dtype`` (``"bf16"``, ``"bfloat16"``, ...) where each function reads them only through
    layout ops (transposes, reshapes) and ``astype(., dtype)`` (as :class:`MixedPrecision`
    leaves a weight that only products read), and those casts removed; and the names taken so. A
    value cast once in the caller then gives the same results; a parameter read otherwise too (a
    norm's weight, an embedding also gathered) stays as it was.

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
    """The vars from ``param`` to its casts to ``dtype`` through layout ops, where it reaches
    nothing else and some cast (see :func:`_readers`); else None."""
    chain, casts, todo = set(), 0, [param]
    while todo:
        var = todo.pop()
        if var in elsewhere:
            return None
        chain.add(var)
        for binding in readers.get(var, []):
            value = binding.value
            if _is_cast_of(value, var, dtype):
                casts += 1
            elif (any(is_op(value, name) for name in _LAYOUT_OPS)
                  and value.args[0].same_as(var)
                  and not any(var.same_as(a) for a in value.args[1:])):
                todo.append(binding.var)
            else:
                return None
    return chain if casts else None


def _is_cast_of(value, var, dtype: str) -> bool:
    return (is_op(value, "relax.astype") and value.args[0].same_as(var)
            and str(value.attrs.dtype) == dtype)


def _taken_low(func: relax.Function, names: set, chain: set, dtype: str) -> relax.Function:
    """``func`` with the parameters ``names`` in ``dtype``, their layout ops (``chain``: the
    vars from them to their casts) taking that dtype and their casts read as what they cast."""
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
            super().visit_var_binding_(binding)

    taken = _Taken()
    for old, low in new.items():
        taken.set_var_remap(old, low)
    body = taken.visit_expr(func.body)
    params = [new.get(p, p) for p in func.params]
    return relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)
