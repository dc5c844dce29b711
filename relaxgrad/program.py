"""A function as plain data: the :class:`Program` the checkpoint policies and the memory
models read, and :func:`program_from_function`, which builds one from a Relax function.

A :class:`Program` is a list of :class:`Node` (parameters first, then bindings in order), each
with its op, the indices of the nodes it reads, its bytes and its recompute cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import tvm
from tvm import relax

from . import _ty
from .errors import GradientError
from .exprs import free_vars

__all__ = [
    "ALIAS_OPS",
    "FREE_OPS",
    "Node",
    "Program",
    "build_program",
    "program_from_function",
    "returned_vars",
]

#: ops whose value is another value (or a group of values): they cost nothing and hold no bytes
ALIAS_OPS = frozenset({"tuple", "get_item", "var"})
#: ops whose value is always available to the backward pass
FREE_OPS = frozenset({"param", "const"})


@dataclass(frozen=True)
class Node:
    """One value of a function: a parameter or a binding.

    ``op`` is ``"param"``, a Relax op name (``"relax.matmul"``), ``"tuple"``, ``"get_item"``,
    ``"var"`` (an alias), ``"const"`` or ``"call:<global func name>"``; ``inputs`` are indices of
    earlier nodes; ``nbytes`` is 0 when unknown (and for aliases); ``cost`` estimates the
    recomputation (flops; 0 for aliases, constants and parameters); ``dtype`` is the dtype of
    its tensor(s) (``""`` when unknown or mixed; not compared: it only picks the storage pool
    in :func:`relaxgrad.analysis.replay_memory_plan`).
    """

    name: str
    op: str
    inputs: tuple[int, ...]
    nbytes: int
    cost: float
    dtype: str = field(default="", compare=False)


@dataclass(frozen=True)
class Program:
    """A function as plain data: parameters first, then bindings in order.

    ``outputs`` are the returned values (always materialized), ``start_marked`` the nodes
    wrapped by ``R.grad.start_checkpoint``, ``end_marked`` the results of
    ``R.grad.end_checkpoint``. A marker binding ``y = marker(x)`` is a ``"var"`` alias node
    ``y`` reading ``x`` (with aliases of markers resolved, as TVM remaps them): for
    ``start_checkpoint`` ``x`` is start-marked, for ``end_checkpoint`` ``y`` is end-marked.
    """

    nodes: tuple[Node, ...]
    outputs: frozenset[int] = frozenset()
    start_marked: frozenset[int] = frozenset()
    end_marked: frozenset[int] = frozenset()

    def __post_init__(self):
        for i, node in enumerate(self.nodes):
            if any(not 0 <= j < i for j in node.inputs):
                raise GradientError(
                    f"Program: node {i} ({node.name} = {node.op}) reads {list(node.inputs)}; "
                    "a node may only read earlier nodes"
                )

    @cached_property
    def intermediate(self) -> tuple[bool, ...]:
        """Per node: whether keeping or recomputing it matters (not a parameter, constant or
        output)."""
        return tuple(n.op not in FREE_OPS and i not in self.outputs
                     for i, n in enumerate(self.nodes))

    def index(self, name: str) -> int:
        """The index of the node named ``name`` (the last one when several share it)."""
        for i in range(len(self.nodes) - 1, -1, -1):
            if self.nodes[i].name == name:
                return i
        raise GradientError(f"Program: no node named {name!r}")


# ----------------------------------------------------------------------------------------------
# Relax function -> Program


def _tensor_types(ty) -> list:
    if _ty.is_tuple(ty):
        return [t for f in _ty.tuple_fields(ty) for t in _tensor_types(f)]
    return [ty] if _ty.is_tensor(ty) else []


def _elements(ty) -> int | None:
    try:
        return int(np.prod(_ty.static_shape(ty), dtype=np.int64))
    except (TypeError, AttributeError):
        return None


def _nbytes(ty) -> int:
    """Bytes of a (tuple of) tensor type(s); 0 when any shape is unknown."""
    total = 0
    for t in _tensor_types(ty):
        elements = _elements(t)
        if elements is None or _ty.shape_of(t) is None:
            return 0
        dtype = tvm.DataType(_ty.dtype_of(t))
        total += elements * ((dtype.bits * dtype.lanes + 7) // 8)
    return total


def _dtype(ty) -> str:
    """The dtype of a (tuple of) tensor type(s); ``""`` when unknown or mixed."""
    dtypes = {str(_ty.dtype_of(t) or "") for t in _tensor_types(ty)}
    return dtypes.pop() if len(dtypes) == 1 else ""


def _cost(op: str, value, ty) -> float:
    """Flops-like recompute cost by op kind: 2*M*N*K for matmul, one per element otherwise."""
    outs = [_elements(t) for t in _tensor_types(ty)]
    out = sum(e for e in outs if e is not None) or 1
    args = list(value.args) if isinstance(value, relax.Call) else []
    try:
        if op == "relax.matmul":
            return 2.0 * out * _ty.static_shape(args[0])[-1]
        if op.startswith("relax.nn.conv"):
            return 2.0 * out * int(np.prod(_ty.static_shape(args[1])[1:]))
        if op == "relax.einsum":
            sizes = [_elements(t) or 1 for t in _tensor_types(args[0])]
            return 2.0 * max([out, *sizes])
        if args and op.startswith(("relax.sum", "relax.mean", "relax.max", "relax.min",
                                   "relax.prod", "relax.variance", "relax.std")):
            return float(_elements(args[0]) or out)
    except (TypeError, AttributeError, IndexError):
        pass
    return float(out)


def _reads(expr, index: dict, where: str) -> list[int]:
    """Indices of the vars ``expr`` reads (through the pass's one expression walker)."""
    found = free_vars(expr)
    missing = [v.name for v in found if _ty.key(v) not in index]
    if missing:
        raise GradientError(f"{where}: {', '.join(missing)} used before being defined")
    return [index[_ty.key(v)] for v in found]


def _op_name(value) -> str:
    if isinstance(value, relax.Call):
        if isinstance(value.op, tvm.ir.Op):
            return str(value.op.name)
        if isinstance(value.op, tvm.ir.GlobalVar):
            return "call:" + str(value.op.name_hint)
        return "call:" + str(getattr(value.op, "global_symbol", None) or value.op)
    if isinstance(value, relax.Tuple):
        return "tuple"
    if isinstance(value, relax.TupleGetItem):
        return "get_item"
    if isinstance(value, relax.Var):
        return "var"
    if isinstance(value, relax.If):
        return "if"
    return "const"


def returned_vars(expr) -> list:
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in returned_vars(f)]
    return []


def build_program(params, bindings, outputs, name: str, start=(),
                  end=()) -> tuple[Program, list]:
    """The Program of ``params`` then ``bindings`` (``outputs``: vars returned; ``start``,
    ``end``: vars already stripped of their checkpoint markers), and the var of each node."""
    where = f"program_from_function({name})"
    start_op = tvm.ir.Op.get("relax.grad.start_checkpoint")
    end_op = tvm.ir.Op.get("relax.grad.end_checkpoint")
    nodes: list[Node] = []
    variables: list = []
    index: dict[int, int] = {}
    marked_as: dict[int, int] = {}  # marker alias -> the value it wraps
    start_marked = {_ty.key(v) for v in start}
    end_marked = {_ty.key(v) for v in end}
    for p in params:
        index[_ty.key(p)] = len(nodes)
        nodes.append(Node(p.name, "param", (), _nbytes(p.ty), 0.0, _dtype(p.ty)))
        variables.append(p)
    for binding in bindings:
        var, value = binding.var, binding.value
        inputs = tuple(dict.fromkeys(_reads(value, index, f"{where}, {var.name}")))
        op = "var" if isinstance(binding, relax.MatchCast) else _op_name(value)
        if isinstance(value, relax.Call) and (value.op.same_as(start_op)
                                              or value.op.same_as(end_op)):
            if not isinstance(value.args[0], relax.Var):
                raise GradientError(f"{where}: the argument of {op} bound to {var.name} "
                                    "must be a Var")
            inputs = (marked_as.get(inputs[0], inputs[0]),)  # TVM remaps marker vars
            marked_as[len(nodes)] = inputs[0]
            marked, key = (start_marked, variables[inputs[0]]) if value.op.same_as(
                start_op) else (end_marked, var)
            marked.add(_ty.key(key))
            op = "var"
        alias = op in ALIAS_OPS
        nbytes = 0 if alias else _nbytes(var.ty)
        cost = 0.0 if alias or op == "const" else _cost(op, value, var.ty)
        index[_ty.key(var)] = len(nodes)
        nodes.append(Node(var.name, op, inputs, nbytes, cost, _dtype(var.ty)))
        variables.append(var)
    returned = {index[_ty.key(v)] for v in outputs if _ty.key(v) in index}
    returned |= {i for i, v in enumerate(variables)
                 if i >= len(params) and not isinstance(v, relax.DataflowVar)}

    def indices(keys: set) -> frozenset:
        return frozenset(i for i, v in enumerate(variables) if _ty.key(v) in keys)

    program = Program(tuple(nodes), frozenset(returned), indices(start_marked),
                      indices(end_marked))
    return program, variables


def program_from_function(func: relax.Function, name: str = "function") -> Program:
    """The :class:`Program` of a Relax function whose body is binding blocks.

    A marker binding ``y = R.grad.start_checkpoint(x)`` makes ``x`` start-marked and ``y`` an
    alias (``"var"``) of ``x``; ``y = R.grad.end_checkpoint(x)`` makes ``y`` an end-marked
    alias. A ``match_cast`` is an alias too. ``nbytes`` comes from static shapes and dtypes
    (tuple-valued calls: the sum of the fields; aliases: 0), ``cost`` from the op kind.
    Outputs are non-dataflow vars and the vars the function returns.

    Parameters
    ----------
    func : relax.Function
        The function (its body a SeqExpr of binding blocks).
    name : str
        The function's name, for messages.

    Returns
    -------
    Program
        The function as plain data.
    """
    if not isinstance(func.body, relax.SeqExpr):
        raise GradientError(f"program_from_function({name}): the body must be a sequence of "
                            "binding blocks")
    bindings = [b for block in func.body.blocks for b in block.bindings]
    return build_program(func.params, bindings, returned_vars(func.body.body), name)[0]
