"""The adjoint store: forward var -> adjoint var, with tuple-aware accumulation.

Adjoints of tuples travel as *nested messages*: ``None`` (no adjoint yet), a tensor ``Expr``
(a leaf), or a Python ``tuple`` of messages. This mirrors TVM's ``NestedMsg<Expr>``.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax
from tvm.ir import Type
from tvm.relax import BlockBuilder, Expr, Var

from .. import _ty
from ..errors import GradientError
from ..exprs import is_op

Msg = Expr | tuple | None

def is_no_grad(expr: Expr) -> bool:
    """Whether ``expr`` is a ``relax.grad.no_grad(...)`` marker returned by a rule."""
    return is_op(expr, "relax.grad.no_grad")


def to_msg(expr: Expr, ty: Type | None = None) -> Msg:
    """Split ``expr`` into a nested message following its (tuple) type."""
    ty = _ty.type_of(expr) if ty is None else ty
    if _ty.is_tuple(ty):
        fields = expr.fields if isinstance(expr, relax.Tuple) else None
        return tuple(
            to_msg(fields[i] if fields is not None else relax.TupleGetItem(expr, i), fty)
            for i, fty in enumerate(ty.fields)
        )
    if not _ty.is_tensor(ty):
        raise GradientError(f"Gradient: the adjoint leaf {expr} must be a Tensor, not {ty}")
    return expr


def msg_to_expr(msg: Msg) -> Expr:
    """The expr of a message; ``(t[0], ..., t[n-1])`` of one var ``t`` folds back to ``t``."""
    if isinstance(msg, tuple):
        fields = [msg_to_expr(m) for m in msg]
        if fields and all(
            isinstance(f, relax.TupleGetItem) and f.index == i for i, f in enumerate(fields)
        ):
            source = fields[0].tuple_value
            if all(f.tuple_value.same_as(source) for f in fields):
                return source
        return relax.Tuple(fields)
    if msg is None:
        raise GradientError("Gradient: internal error, an empty adjoint message reached an output")
    return msg


def combine(lhs: Msg, rhs: Msg, fn: Callable[[Expr, Expr], Expr]) -> Msg:
    """Combine two messages leaf by leaf (``None`` is the identity)."""
    if lhs is None:
        return rhs
    if rhs is None:
        return lhs
    if isinstance(lhs, tuple) and isinstance(rhs, tuple) and len(lhs) == len(rhs):
        return tuple(combine(a, b, fn) for a, b in zip(lhs, rhs))
    if not isinstance(lhs, tuple) and not isinstance(rhs, tuple):
        return fn(lhs, rhs)
    raise GradientError(f"Gradient: cannot add adjoints of different structure: {lhs} and {rhs}")


def decompose(expr: Expr, msg: Msg | Expr, visit_leaf: Callable[[Expr, Msg], None]) -> None:
    """Walk ``expr`` (maybe a tuple literal) and ``msg`` together, calling ``visit_leaf``.

    ``msg`` may also be a tuple-typed Expr: it is split one level at a time, as deep as the
    literal ``expr`` goes (so a deep tuple adjoint costs O(1) per literal level, not O(depth)).
    """
    if isinstance(expr, relax.Tuple):
        fields = _msg_fields(msg, len(expr.fields))
        if fields is None:
            raise GradientError(f"Gradient: adjoint {msg} does not match the tuple {expr}")
        for field, sub in zip(expr.fields, fields):
            decompose(field, sub, visit_leaf)
    else:
        visit_leaf(expr, msg)


def _msg_fields(msg, n: int):
    """The ``n`` field messages of a tuple message (a python tuple or a tuple-typed Expr)."""
    if isinstance(msg, tuple):
        return msg if len(msg) == n else None
    if isinstance(msg, relax.Tuple):
        return list(msg.fields) if len(msg.fields) == n else None
    if isinstance(msg, Expr) and _ty.is_tuple(msg) and len(_ty.tuple_fields(msg)) == n:
        return [relax.TupleGetItem(msg, i) for i in range(n)]
    return None


def fold(msg) -> Expr:
    """The expr of a message; a literal ``(t[0], ..., t[n-1])`` of one var ``t`` folds to ``t``
    (through nested literals only, never through types)."""
    if isinstance(msg, tuple):
        return msg_to_expr(msg)
    if isinstance(msg, relax.Tuple):
        return msg_to_expr(tuple(fold(f) if isinstance(f, relax.Tuple) else f for f in msg.fields))
    return msg


def tuple_aware_add(lhs: Expr, rhs: Expr) -> Expr:
    """``lhs + rhs`` for tensors or (nested) tuples of tensors of the same structure."""
    return msg_to_expr(combine(to_msg(lhs), to_msg(rhs), relax.op.add))


def add_in_tuple(tuple_expr: Expr, index: int, increment: Expr) -> Expr:
    """A tuple equal to ``tuple_expr`` with ``increment`` added to field ``index``."""
    fields = []
    for i in range(len(_ty.tuple_fields(tuple_expr))):
        if isinstance(tuple_expr, relax.Tuple):
            field = tuple_expr.fields[i]
        else:
            field = relax.TupleGetItem(tuple_expr, i)
        fields.append(tuple_aware_add(field, increment) if i == index else field)
    return relax.Tuple(fields)


def nested_zeros(ty: Type, what: str = "") -> Expr:
    """Zeros of a tensor type, or a (nested) tuple of zeros for a tuple type."""
    if _ty.is_tuple(ty):
        return relax.Tuple([nested_zeros(f, what) for f in ty.fields])
    if not _ty.is_tensor(ty) or _ty.shape_of(ty) is None:
        raise GradientError(
            f"Gradient: cannot build a zero adjoint for {what or 'a value'} of type {ty}: "
            "a tensor with known shape is needed"
        )
    return relax.op.zeros(_ty.shape_of(ty), _ty.dtype_of(ty))


class AdjointStore:
    """Maps forward vars to the var holding their (accumulated) adjoint, emitting into ``bb``."""

    def __init__(self, bb: BlockBuilder):
        self.bb = bb
        self.adjoints: dict[int, Var] = {}  # _ty.key(forward var) -> adjoint var

    def __contains__(self, var: Var) -> bool:
        return _ty.key(var) in self.adjoints

    def __getitem__(self, var: Var) -> Var:
        return self.adjoints[_ty.key(var)]

    def emit(self, source: Var, adjoint: Expr, is_output: bool = False) -> Var:
        """Bind ``adjoint`` as ``<source>_adjoint`` (or ``<source>_adjoint_out`` as output)."""
        name = source.name
        if is_output:
            return self.bb.emit_output(adjoint, name + "_adjoint_out")
        var = self.bb.emit(adjoint, name + "_adjoint")
        self.adjoints[_ty.key(source)] = var
        return var

    def update(self, expr: Expr, partial: Expr) -> None:
        """Add ``partial`` to the adjoint of ``expr`` (a var, constant, or tuple of them)."""
        bb = self.bb
        msg = bb.normalize(partial)

        def visit_leaf(leaf: Expr, leaf_msg: Msg) -> None:
            if isinstance(leaf, relax.Var):
                value = bb.normalize(fold(leaf_msg))
                if leaf in self:
                    value = tuple_aware_add(self[leaf], value)
                self.emit(leaf, value)
            elif isinstance(leaf, relax.ShapeExpr):
                if not is_no_grad(partial):
                    raise GradientError(f"Gradient: the shape {leaf} cannot receive a gradient")
            elif not isinstance(leaf, _ty.Constant):
                raise GradientError(
                    f"Gradient: cannot propagate an adjoint to {leaf}: only Vars, Constants and "
                    "tuples of them are supported as arguments"
                )

        decompose(expr, msg, visit_leaf)
