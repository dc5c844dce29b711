"""Split mode: the forward and the backward of a function as two functions.

``Gradient(f, ..., split=True)`` adds

- ``<f>_fwd(params...) -> (original result, (residuals...))`` and
- ``<f>_bwd(residuals..., [output grads]) -> (grads...)``

instead of ``<f>_adjoint``. The pair is the adjoint cut in two: the adjoint is built as usual
(:func:`.stages.differentiate`), its re-emitted forward bindings go to ``_fwd`` and everything
else to ``_bwd``. The residuals are exactly the forward values the backward reads: a value the
checkpoint policy keeps is a residual; a value it drops is recomputed inside ``_bwd`` (as
``<name>_cp``) from residuals. So the memory held between the two calls follows the same
policies (``checkpoint=``) as the single adjoint.

Parameters of ``f`` that the backward reads are residuals too (as PyTorch's ``ctx.save_for_
backward`` saves inputs): ``_bwd`` takes nothing but residuals and output grads. They cost no
memory (``_fwd`` returns the caller's own tensors); :func:`split_info` tells them apart.

With ``seed="ones"`` (the default) ``_bwd`` takes no output gradient; with ``seed="param"``
it takes one per target, after the residuals. Functions of several blocks (``strict=False``) are
cut block by block: each keeps its kind on both sides, and empty ones are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax import Function

from .. import _ty
from .._module import with_function
from .._stack import with_deep_stack
from ..errors import GradientError
from ..exprs import _substitute_block, free_vars, substitute
from .simplify import remove_unused
from .stages import Callees, differentiate
from .validate import validate

__all__ = ["Residual", "SplitInfo", "split_info"]

_NUM = "relaxgrad.num_residuals"
_PARAMS = "relaxgrad.param_residuals"


@dataclass(frozen=True)
class Residual:
    """One value ``<f>_fwd`` hands to ``<f>_bwd``."""

    name: str
    shape: tuple | None  # ints, or strings for symbolic dims; None when unknown
    dtype: str
    nbytes: int | None  # None when the shape is symbolic
    is_param: bool  # a parameter of f: no memory beyond the caller's own tensor


@dataclass(frozen=True)
class SplitInfo:
    """What split mode saves between the forward and the backward (cf. PopXL's GradGraphInfo)."""

    residuals: list
    total_bytes: int | None  # bytes of the saved non-parameter residuals (None: symbolic)
    param_bytes: int | None  # bytes of the parameter residuals (held by the caller anyway)

    def __str__(self) -> str:
        lines = ["residuals of the split gradient:"]
        for r in self.residuals:
            shape = "?" if r.shape is None else str(r.shape).replace("'", "")
            size = "?" if r.nbytes is None else f"{r.nbytes} bytes"
            kind = " (parameter)" if r.is_param else ""
            lines.append(f"  {r.name}: {shape} {r.dtype}, {size}{kind}")
        lines.append(f"saved: {_fmt(self.total_bytes)}; parameters: {_fmt(self.param_bytes)}")
        return "\n".join(lines)


def _fmt(n) -> str:
    return "? bytes (symbolic shapes)" if n is None else f"{n} bytes"


def split_gradient_module(mod: IRModule, **args) -> IRModule:
    """The split-mode pass body: ``mod`` with ``<f>_fwd`` and ``<f>_bwd`` added."""
    name = args["func_name"]
    request = validate(mod, **args)
    callees = Callees(mod, args["checkpoint"])
    callees.prepare(request.func, name)
    forward: set = set()
    adjoint, new_mod = differentiate(callees.mod, request, callees, forward_keys=forward)
    n_seeds = len(adjoint.params) - len(request.func.params)
    fwd, bwd = split_adjoint(adjoint, forward, n_seeds, name)
    for suffix in ("_fwd", "_bwd"):
        existing = {gv.name_hint for gv in new_mod.get_global_vars()}
        if name + suffix in existing:
            raise GradientError(
                f"Gradient: the module already has a function named {name + suffix}"
            )
    new_mod = with_function(new_mod, name + "_fwd", fwd)
    return with_function(new_mod, name + "_bwd", bwd)


def split_adjoint(adjoint: Function, forward: set, n_seeds: int, name: str):
    """Cut ``adjoint`` (its last ``n_seeds`` params are output grads) into ``(fwd, bwd)``;
    ``forward`` holds the keys of the forward bindings' vars. Each block keeps its kind; a
    block left empty on one side is dropped."""
    blocks = list(adjoint.body.blocks)
    bindings = [b for block in blocks for b in block.bindings]
    ret = adjoint.body.body
    if not isinstance(ret, relax.Tuple) or len(ret.fields) != 2:
        raise GradientError(f"Gradient: unexpected adjoint result {ret} of {name}")
    orig_ret, grads = ret.fields
    params = list(adjoint.params)
    primal, seeds = params[: len(params) - n_seeds], params[len(params) - n_seeds :]

    # forward part: the forward bindings and whatever they (and the result) need
    defs = {_ty.key(b.var): b for b in bindings}
    needed = {k for k in forward if k in defs}
    stack = list(free_vars(orig_ret)) + [defs[k].var for k in needed]
    while stack:
        v = stack.pop()
        b = defs.get(_ty.key(v))
        if b is None:
            continue
        for u in free_vars(b.value):
            k = _ty.key(u)
            if k in defs and k not in needed:
                needed.add(k)
                stack.append(u)
        needed.add(_ty.key(v))
    fwd_blocks = [_keep(block, needed, True) for block in blocks]
    bwd_blocks = [_keep(block, needed, False) for block in blocks]
    fwd_bindings = [b for block in fwd_blocks for b in block.bindings]
    bwd_bindings = [b for block in bwd_blocks for b in block.bindings]

    # residuals: forward vars and primal params the backward reads, in definition order
    read: set = set()
    for b in bwd_bindings:
        read.update(_ty.key(v) for v in free_vars(b.value))
    read.update(_ty.key(v) for v in free_vars(grads))
    residuals = [p for p in primal if _ty.key(p) in read]
    residuals += [b.var for b in fwd_bindings if _ty.key(b.var) in read]
    if any(isinstance(r, relax.DataflowVar) for r in residuals) and len(fwd_blocks) > 1:
        raise GradientError(  # cannot happen: the general layout has no DataflowVar forward
            f"Gradient: split=True cannot pass a dataflow var of {name} between functions"
        )

    fwd = _fwd_function(primal, fwd_blocks, orig_ret, residuals, adjoint)
    bwd = _bwd_function(residuals, seeds, bwd_blocks, grads, adjoint, primal)
    return fwd, bwd


def _keep(block, needed: set, forward: bool):
    """The bindings of ``block`` on one side of the cut, in a block of the same kind."""
    kept = [b for b in block.bindings if (_ty.key(b.var) in needed) == forward]
    if isinstance(block, relax.DataflowBlock):
        return relax.DataflowBlock(kept)
    return relax.BindingBlock(kept)


def _fwd_function(primal, blocks, orig_ret, residuals, adjoint) -> Function:
    blocks = [b for b in blocks if b.bindings]
    if len(blocks) == 1 and isinstance(blocks[0], relax.DataflowBlock):
        # one dataflow block: its (dataflow) vars leave it through an output binding
        bb = relax.BlockBuilder()
        with bb.function("fwd", primal, pure=adjoint.is_pure):
            with bb.dataflow():
                for b in blocks[0].bindings:
                    bb.emit_normalized(b)
                out = bb.emit_output(relax.Tuple([orig_ret, relax.Tuple(residuals)]))
            bb.emit_func_output(out)
        func = bb.get()["fwd"]
        return Function(func.params, func.body, None, func.is_pure, adjoint.attrs)
    body = relax.SeqExpr(blocks, relax.Tuple([orig_ret, relax.Tuple(residuals)]))
    body = relax.BlockBuilder().normalize(body)
    return Function(primal, body, None, adjoint.is_pure, adjoint.attrs)


def _bwd_function(residuals, seeds, blocks, grads, adjoint, primal) -> Function:
    remap = {r: relax.Var(r.name, r.ty) for r in residuals}
    primal_keys = {_ty.key(p) for p in primal}
    new_blocks = [_substitute_block(block, remap) for block in blocks if block.bindings]
    params = [remap[r] for r in residuals] + list(seeds)
    body = relax.SeqExpr(new_blocks, substitute(grads, remap))
    body = relax.BlockBuilder().normalize(body)
    func = Function(params, body, None, adjoint.is_pure, adjoint.attrs)
    func = remove_unused(func)
    func = relax.utils.copy_with_new_vars(func)
    names = [r.name for r in residuals if _ty.key(r) in primal_keys]
    return (
        func.with_attr(_NUM, tvm.tirx.IntImm("int64", len(residuals)))
        .with_attr(_PARAMS, names)
    )


def split_info(mod: IRModule, func_name: str = "main") -> SplitInfo:
    """The residuals of ``<func_name>_bwd`` (made by ``Gradient(func_name, split=True)``):
    names, shapes, dtypes and bytes, and the total saved bytes."""
    names = {gv.name_hint for gv in mod.get_global_vars()}
    bwd_name = func_name + "_bwd"
    if bwd_name not in names:
        raise GradientError(
            f"split_info: the module has no function {bwd_name}; apply "
            f"Gradient({func_name!r}, split=True) first"
        )
    bwd = mod[bwd_name]
    attrs = bwd.attrs or {}
    if _NUM not in attrs:
        raise GradientError(f"split_info: {bwd_name} was not made by split mode")
    n = int(attrs[_NUM])
    param_names = {str(s) for s in attrs[_PARAMS]}
    residuals = []
    for p in bwd.params[:n]:
        residuals.append(_residual(p, p.name in param_names))
    saved = [r.nbytes for r in residuals if not r.is_param]
    params = [r.nbytes for r in residuals if r.is_param]
    total = None if None in saved else sum(saved)
    param_total = None if None in params else sum(params)
    return SplitInfo(residuals, total, param_total)


def _residual(var, is_param: bool) -> Residual:
    """A tensor's shape, dtype and bytes; a tuple's bytes are those of its tensors."""
    if not _ty.is_tensor(var):
        return Residual(var.name, None, str(var.ty), _nbytes(var.ty), is_param)
    dims = _ty.shape_values(var)
    shape = None
    if dims is not None:
        shape = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in dims)
    return Residual(var.name, shape, str(_ty.dtype_of(var)), _nbytes(var.ty), is_param)


def _nbytes(ty) -> int | None:
    """Bytes of a tensor type or of the tensors of a tuple type; None when not static."""
    if _ty.is_tuple(ty):
        sizes = [_nbytes(f) for f in _ty.tuple_fields(ty)]
        return None if None in sizes else sum(sizes)
    if not _ty.is_tensor(ty):
        return 0  # shapes, prim values: nothing held in tensor memory
    dims = _ty.shape_values(ty)
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    count = 1
    for d in dims:
        count *= int(d)
    return count * ((tvm.runtime.DataType(str(_ty.dtype_of(ty))).bits + 7) // 8)


@tvm.transform.module_pass(opt_level=0, name="Gradient")
class SplitGradient:
    """The split-mode ``Gradient`` pass (made by ``Gradient(..., split=True)``)."""

    def __init__(self, args: dict):
        self.args = args

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        return with_deep_stack(split_gradient_module, mod, **self.args)
