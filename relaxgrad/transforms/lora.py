"""``LoRA``: low-rank adapters on a function's linear layers, as PEFT's ``LoraConfig`` adds them.

Each named weight ``W`` read by a linear layer, ``matmul(x, permute_dims(W))`` (PyTorch's
``(out, in)`` layout, as :func:`~relaxgrad.training.from_torch` imports ``nn.Linear``) or
``matmul(x, W)`` (an ``(in, out)`` weight), gains two parameters ``A`` of shape ``(r, in)`` and
``B`` of shape ``(out, r)``, and every such product becomes

    matmul(x, W^T) + scale * matmul(matmul(x, A^T), B^T)

which is PEFT's unmerged LoRA forward (``scale = alpha / r``). The adapters are not merged into
``W``: differentiating with respect to ``A`` and ``B`` only, the backward pass computes the
``(tokens, r)`` products of the adapters and never the ``(out, in)`` gradient of a frozen
weight, and it stops at the lowest adapter (nothing below it is needed).

The adapters are added to the function's parameters after the existing ones (before ``key``, a
random-key parameter that must stay last), ``A`` then ``B`` for each weight in the order given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from .._module import with_function
from ..errors import GradientError
from ..exprs import is_op

__all__ = ["LoRA", "adapter_names", "linear_weights"]


def adapter_names(weight: str) -> tuple[str, str]:
    """The names of the adapters of parameter ``weight``: PEFT's state keys
    (``q_proj.weight`` -> ``q_proj.lora_A.weight``, ``q_proj.lora_B.weight``); a weight named
    ``<module>_weight`` (relaxgrad's builders) gets ``<module>_lora_A`` and ``<module>_lora_B``."""
    if weight.endswith(".weight"):
        module = weight[: -len(".weight")]
        return f"{module}.lora_A.weight", f"{module}.lora_B.weight"
    module = weight[: -len("_weight")] if weight.endswith("_weight") else weight
    return f"{module}_lora_A", f"{module}_lora_B"


@mutator
class _Adapt(PyExprMutator):
    """Adds the adapters' products to every linear-layer product of the named weights."""

    def __init__(self, mod: IRModule, weights: Mapping[relax.Var, tuple], scale: float):
        super().__init__(mod)
        self.weights, self.scale = weights, scale

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.matmul"):
            return call
        x, rhs = call.args
        weight = self._weight(rhs)
        if weight is None:
            return call
        a, b, _ = self.weights[weight]
        dtype = _ty.dtype_of(a)  # the adapters' products in their dtype, added in the layer's
        down = self.builder_.emit(relax.op.matmul(x, relax.op.permute_dims(a), out_dtype=dtype))
        up = self.builder_.emit(relax.op.matmul(down, relax.op.permute_dims(b), out_dtype=dtype))
        up = self.builder_.emit(relax.op.multiply(up, relax.const(self.scale, dtype)))
        base = self.builder_.emit(call)
        if _ty.dtype_of(call) != dtype:
            up = self.builder_.emit(relax.op.astype(up, _ty.dtype_of(call)))
        return relax.op.add(base, up)

    def _weight(self, rhs: relax.Expr) -> relax.Var | None:
        """The adapted weight a product's right operand reads, in its layout."""
        if rhs in self.weights:
            return rhs if not self.weights[rhs][2] else None
        if not isinstance(rhs, relax.Var):
            return None
        value = self.lookup_binding(rhs)
        weight = _transposed(value)
        if weight in self.weights and self.weights[weight][2]:
            return weight
        return None


def _transposed(value) -> relax.Expr | None:
    """``W`` when ``value`` is ``permute_dims(W)`` of a 2-D ``W``, else None."""
    if not is_op(value, "relax.permute_dims"):
        return None
    axes = value.attrs.axes
    if axes is not None and [int(a) for a in axes] != [1, 0]:
        return None
    return value.args[0]


def linear_weights(func: relax.Function) -> dict[str, bool]:
    """The parameters of ``func`` that a linear layer reads, by name: True for PyTorch's
    ``(out, in)`` layout (read transposed), False for ``(in, out)`` (read directly)."""
    params = set(func.params)
    return {var.name: True in layouts for var, layouts in _layouts(func).items()
            if var in params}


def _layouts(func: relax.Function) -> dict[relax.Var, set[bool]]:
    """For each parameter a linear layer reads: whether it reads it transposed (``(out, in)``,
    PyTorch's layout), directly (``(in, out)``), or both."""
    transposes, layouts = {}, {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            weight = _transposed(value)
            if isinstance(weight, relax.Var):
                transposes[binding.var] = weight
            if is_op(value, "relax.matmul"):
                rhs = value.args[1]
                if rhs in transposes:
                    layouts.setdefault(transposes[rhs], set()).add(True)
                elif isinstance(rhs, relax.Var):
                    layouts.setdefault(rhs, set()).add(False)
    return layouts


@tvm.transform.module_pass(opt_level=0, name="LoRA")
class LoRA:
    """Module pass: LoRA adapters on the linear layers of ``weights`` in ``func_names``.

    Parameters
    ----------
    weights : sequence of str
        Parameters of the functions, each read by at least one linear layer (see the module
        docstring); the adapters are named by :func:`adapter_names`.
    r : int
        The adapters' rank.
    alpha : float
        PEFT's ``lora_alpha``: the adapters' product is scaled by ``alpha / r``.
    func_names : sequence of str
        The functions to rewrite (the same parameters in each).
    key : str, optional
        A parameter that stays last (a random key).

    Raises
    ------
    GradientError
        When a function has no parameter of a name in ``weights``, a weight is not 2-D, or
        no linear layer of a function reads it.

    Examples
    --------
    >>> mod = relaxgrad.transforms.LoRA(["fc1_weight"], r=4, alpha=8)(mod)
    >>> mod = relaxgrad.Gradient("main", require_grads=[...adapters])(mod)
    """

    def __init__(self, weights: Sequence[str], r: int, alpha: float, func_names=("main",),
                 key: str | None = None):
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise GradientError(f"LoRA: r must be a positive int, not {r!r}")
        self.weights, self.r, self.alpha = list(weights), r, float(alpha)
        self.func_names = (func_names,) if isinstance(func_names, str) else tuple(func_names)
        self.key = key

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        for name in self.func_names:
            if name not in names or not isinstance(mod[name], relax.Function):
                raise GradientError(f"LoRA: the module has no Relax function {name}")
            mod = self._rewrite(mod, name)
        return mod

    def _rewrite(self, mod: IRModule, name: str) -> IRModule:
        func = mod[name]
        params = {p.name: p for p in func.params}
        layouts = _layouts(func)
        weights, adapters = {}, []
        for weight in self.weights:
            var = params.get(weight)
            if var is None:
                raise GradientError(f"LoRA: {name} has no parameter {weight!r}")
            shape = _ty.shape_values(var)
            if len(shape) != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
                raise GradientError(f"LoRA: {weight} must be a 2-D weight of static shape, "
                                    f"not {var.ty}")
            if var not in layouts:
                raise GradientError(f"LoRA: no linear layer of {name} reads {weight} "
                                    f"(matmul(x, permute_dims(W)) or matmul(x, W))")
            transposed = True in layouts[var]  # PyTorch's layout where both are read
            out, inp = (int(d) for d in (shape if transposed else shape[::-1]))
            dtype = _ty.dtype_of(var)
            a_name, b_name = adapter_names(weight)
            a = relax.Var(a_name, relax.TensorType((self.r, inp), dtype))
            b = relax.Var(b_name, relax.TensorType((out, self.r), dtype))
            weights[var] = (a, b, transposed)
            adapters += [a, b]
        adapt = _Adapt(mod, weights, self.alpha / self.r)
        new = adapt.visit_expr(func)
        old = list(new.params)
        last = [p for p in old if p.name == self.key][-1:]
        front = [p for p in old if p.name != self.key]
        func = relax.Function(front + adapters + last, new.body, new.ret_ty, new.is_pure,
                              new.attrs, new.span)
        return with_function(adapt.builder_.get(), name, func)
