"""The one table of gradient rules.

A rule has TVM's FPrimalGradient signature::

    rule(orig_var, orig_call, output_grad, ctx: BlockBuilder) -> list[Expr]

returning one partial per argument of ``orig_call`` (``relax.op.grad.no_grad(arg)`` where the
argument gets no gradient). ``orig_var``/``orig_call`` are the checkpointed forward binding, so a
rule may reuse the forward result.

Return partials as (nested) expressions: the pass normalizes them, emitting nested calls as
bindings in order. A rule may call ``ctx.normalize`` (e.g. to read a shape), but that emits the
nested calls earlier, which changes the binding order of the adjoint (harmless, but it no longer
matches TVM's pass structurally).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tvm import relax
from tvm.ir import Op
from tvm.relax import BlockBuilder, Call, Expr, Var

Rule = Callable[[Var, Call, Expr, BlockBuilder], Sequence[Expr]]

_RULES: dict[str, Rule] = {}


def _op_name(op: Op | str) -> str:
    return op if isinstance(op, str) else str(op.name)


def register_gradient(op_name: str, rule: Rule | None = None, *, override: bool = False):
    """Register ``rule`` as the gradient of the Relax op ``op_name`` (usable as a decorator).

    Parameters
    ----------
    op_name : str
        Full op name, e.g. ``"relax.exp"``. It must be a registered TVM op.
    rule : Rule, optional
        The rule; when omitted, returns a decorator.
    override : bool
        Replace an existing rule instead of raising.
    """

    def _register(fn: Rule) -> Rule:
        Op.get(op_name)  # raises on a name TVM does not know
        if op_name in _RULES and not override:
            raise ValueError(f"relaxgrad: a gradient for {op_name} is already registered")
        _RULES[op_name] = fn
        return fn

    return _register(rule) if rule is not None else _register


def get_gradient(op: Op | str) -> Rule | None:
    """relaxgrad's own rule for ``op`` (an Op or its name), or None."""
    return _RULES.get(_op_name(op))


def registered_ops() -> list[str]:
    """Sorted names of every op with a relaxgrad rule."""
    return sorted(_RULES)


def no_grad_rule(orig_var: Var, orig_call: Call, output_grad: Expr, ctx: BlockBuilder) -> list:
    """Rule of ops whose result does not depend differentiably on any input.

    Forward: ``y = op(x1, ..., xn)``; backward: ``[no_grad(x1), ..., no_grad(xn)]``.
    """
    return [relax.op.grad.no_grad(arg) for arg in orig_call.args]


def register_no_grad(op_names: Iterable[str]) -> None:
    """Register :func:`no_grad_rule` for a whole family of ops."""
    for name in op_names:
        register_gradient(name, no_grad_rule)


# Ops that relaxgrad's own rules emit and that have no gradient of their own: differentiating
# an adjoint that contains them names them as coming from a first-order rule.
FIRST_ORDER_ONLY: set[str] = set()


# Ops left without a rule on purpose, and what to use instead.
NO_RULE_HINTS = {
    "relax.nn.dropout": (
        " [it has no random key: TVM compiles it as the identity, so its gradient would "
        "silently not drop; apply relaxgrad.transforms.KeyDropout to the module first, or use "
        "relaxgrad.ops.random.dropout]"
    ),
}


def missing_rule_hint(op_name: str) -> str:
    """A note for the missing-rule error: empty, or why ``op_name`` has no rule."""
    if op_name in NO_RULE_HINTS:
        return NO_RULE_HINTS[op_name]
    if op_name in FIRST_ORDER_ONLY or op_name.startswith("relax.grad."):
        return (
            " [emitted by a first-order gradient rule; it has no gradient of its own, so this "
            "adjoint cannot be differentiated again]"
        )
    return ""
