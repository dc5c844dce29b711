"""TVM's ``LegalizeOps`` with each operator's legalization computed once per kind of call.

``LegalizeOps`` calls an operator's ``FLegalize`` function for every call, which builds the
call's PrimFunc from TE (``bb.call_te``: tens of Python calls per operand, then
``create_prim_func``), only for the context module to find it structurally equal to one it holds
and hand back that one's GlobalVar. An adjoint repeats its forward's calls and a model repeats
its blocks: of a 16-block transformer's 7,200 calls, 6,600 are calls of the same operator,
attributes and operands as an earlier one (legalizing it takes 0.7 s instead of 1.9).
:class:`LegalizeOpsOnce` runs ``LegalizeOps`` with each legalization function wrapped: a call
whose operands are all vars of tensors of static shape, like an earlier call legalized into
``call_tir`` of a PrimFunc of those operands (as they were, no other binding emitted), is
legalized into ``call_tir`` of that PrimFunc on its own operands; constants and shapes of
integers among the operands (``reshape``'s shape, a scalar) are part of the kind, by value.
Everything else is legalized as ``LegalizeOps`` does, or by the legalization given for its
operator in ``overrides`` (the CPU pipeline's parallel ``take_backward``, :mod:`.scatter`).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule, Op

from .. import _ty
from ._common import static_shape

_CALL_TIR = Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="LegalizeOpsOnce")
class LegalizeOpsOnce:
    """``relax.transform.LegalizeOps`` with each legalization reused for the later calls of the
    same operator, attributes and operand types (see the module docstring). ``reused`` counts
    the calls of the last run legalized that way. ``overrides``: operator name -> ``FLegalize``
    used instead of the operator's own."""

    def __init__(self, overrides: dict | None = None):
        self.reused = 0
        self.overrides = dict(overrides or {})

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        found = _legalizers(mod)
        legalizers = [_Once(name, self.overrides.get(name, legalize)) for name, legalize in found]
        mod = relax.transform.LegalizeOps({once.name: once for once in legalizers})(mod)
        self.reused = sum(once.reused for once in legalizers)
        return mod


def _legalizers(mod: IRModule) -> list:
    """``(name, FLegalize)`` of the operators that ``mod``'s Relax functions call (those that
    their legalizations call are legalized as ``LegalizeOps`` does)."""
    names: set = set()

    def called(call: relax.Call) -> None:
        if isinstance(call.op, Op):
            names.add(call.op.name)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func, [(relax.Call, called)])
    found = [(name, Op.get(name).get_attr("FLegalize")) for name in sorted(names)]
    return [(name, legalize) for name, legalize in found if legalize is not None]


class _Once:
    """An operator's ``FLegalize``, its ``call_tir`` legalizations kept by the kind of call:
    attributes, types of the operands and of the result, which operands are the same var."""

    def __init__(self, name: str, legalize):
        self.name, self.legalize = name, legalize
        self.kinds: dict = {}  # structural hash of a kind -> [(kind, call_tir, operand indices)]
        self.reused = 0

    def __call__(self, bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        args = list(call.args)
        described = [_describe(a) for a in args]
        if any(d is None for d in described):
            return self.legalize(bb, call)
        first = {}  # each operand's first position: add(x, x) is not add(x, y)
        kind = [call.attrs, call.ty, described, list(call.ty_args),
                [first.setdefault(hash(a), i) for i, a in enumerate(args)]]  # fmt: skip
        key = tvm_ffi.structural_hash(kind)
        for other, legalized, operands in self.kinds.get(key, []):
            if tvm_ffi.structural_equal(other, kind):
                self.reused += 1
                fields = relax.Tuple([args[i] for i in operands])
                return relax.Call(legalized.op, [legalized.args[0], fields], legalized.attrs,
                                  legalized.ty_args)  # fmt: skip
        legalized = self.legalize(bb, call)
        operands = _operands(legalized, args)
        if operands is not None:
            self.kinds.setdefault(key, []).append((kind, legalized, operands))
        return legalized


def _describe(arg: relax.Expr):
    """What a kind of call holds of an operand: a var's type where its shape is static; a
    constant or a shape of integers itself (``reshape``'s shape, ``take``'s scalar index: what
    the PrimFunc may build in); else None (the call is legalized afresh)."""
    if isinstance(arg, relax.Var):
        return arg.ty if static_shape(arg) is not None else None
    if isinstance(arg, _ty.Constant):
        return arg
    if isinstance(arg, relax.ShapeExpr):
        return arg if all(isinstance(v, tvm.tirx.IntImm) for v in arg.values) else None
    return None


def _operands(legalized, args: list) -> list[int] | None:
    """The first position in ``args`` of each operand of ``legalized`` if it is ``call_tir``
    of a PrimFunc on vars of ``args``, with no other argument; else None. (A later call of the
    kind has the same var at the same positions.)"""
    if not (isinstance(legalized, relax.Call) and legalized.op.same_as(_CALL_TIR)):
        return None
    if len(legalized.args) != 2 or not isinstance(legalized.args[0], tvm.ir.GlobalVar):
        return None
    if not isinstance(legalized.args[1], relax.Tuple):
        return None
    positions = []
    for field in legalized.args[1].fields:
        found = [i for i, a in enumerate(args) if a.same_as(field)]
        if not found:
            return None
        positions.append(found[0])
    return positions
