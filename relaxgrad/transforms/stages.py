"""The stages behind the ``Gradient`` pass, shared by its plain and split modes.

forward program (copy, markers stripped, vars mapped) -> checkpoint decision (a policy) ->
reverse walk (:mod:`.backward`) -> simplify -> assemble: :func:`differentiate` builds the
adjoint of one function; :class:`Callees` builds the VJPs of the functions it calls. The
passes (:mod:`.gradient`, :mod:`.split`) validate first and add the result to the module.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax import Function

from .. import _ty
from ..errors import GradientError
from ..exprs import called_functions, is_op, substitute
from ..ops import random
from .backward import BackwardWalk
from .checkpoint import CheckpointInfo, strip_markers
from .custom import CUSTOM_GRADIENT_ATTR, custom_vjp
from .lower import lower_call_tir_with_grad
from .simplify import remove_unused, simplify_gradient
from .validate import Request

__all__ = ["Callees", "differentiate"]


# -- forward program ---------------------------------------------------------------------------
def _forward_segments(func: Function, general: bool):
    """The function's blocks as ``[(is_dataflow, bindings)]`` and its return value; in the
    ``general`` layout every DataflowVar becomes a Var, so later blocks can read it."""
    segments = [
        (isinstance(block, relax.DataflowBlock), list(block.bindings))
        for block in func.body.blocks
    ]
    ret = func.body.body
    if not general:
        return segments, ret, {}
    remap: dict = {}
    out = []
    normalize = relax.BlockBuilder().normalize
    for is_dataflow, bindings in segments:
        new = []
        for b in bindings:
            value = substitute(b.value, remap)
            if not value.same_as(b.value):
                value = normalize(value)
            var = b.var
            if isinstance(var, relax.DataflowVar):
                var = relax.Var(var.name, var.ty)
                remap[b.var] = var
            if isinstance(b, relax.MatchCast):
                new.append(relax.MatchCast(var, value, b.ty))
            else:
                new.append(relax.VarBinding(var, value))
        out.append((is_dataflow, new))
    return out, substitute(ret, remap), remap


def _is_general(func: Function) -> bool:
    """Whether ``func`` is outside TVM's shape (one dataflow block of plain bindings)."""
    blocks = func.body.blocks
    return len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock)


def _differentiable(var) -> bool:
    return _ty.nested_all(var.ty, _ty.is_float_tensor)


def _impure(value, mod: IRModule) -> bool:
    if isinstance(value, relax.If):
        return True  # control flow lives outside dataflow blocks
    if not isinstance(value, relax.Call):
        return False
    if isinstance(value.op, tvm.ir.Op):
        return not bool(value.op.get_attr("FPurity"))
    if isinstance(value.op, relax.GlobalVar):
        func = mod[value.op]
        return isinstance(func, Function) and not func.is_pure
    return True


def _var_map(old: Function, new: Function) -> dict:
    """Map the vars of ``old`` to those of its structural copy ``new``."""
    mapping = dict(zip(old.params, new.params))
    for old_block, new_block in zip(old.body.blocks, new.body.blocks):
        for ob, nb in zip(old_block.bindings, new_block.bindings):
            mapping[ob.var] = nb.var
    return mapping


def _resolve_ret(ret, bindings) -> list | None:
    """The fields of the returned tuple (looking through vars bound to a Tuple), or None."""
    if isinstance(ret, relax.Tuple):
        return list(ret.fields)
    values = {_ty.key(b.var): b.value for b in bindings if isinstance(b, relax.VarBinding)}
    seen = 0
    while isinstance(ret, relax.Var) and _ty.key(ret) in values and seen < len(values):
        value = values[_ty.key(ret)]
        if isinstance(value, relax.Tuple):
            return list(value.fields)
        if not isinstance(value, relax.Var):
            return None
        ret, seen = value, seen + 1
    return None


def _targets(request: Request, ret, bindings) -> list:
    if request.target_index is None:  # a callee's VJP: the whole return value
        return [ret]
    if request.strict:
        fields = list(ret.fields) if isinstance(ret, relax.Tuple) else None
    else:
        fields = _resolve_ret(ret, bindings)
    name = request.func_name
    indices = request.target_index
    if fields is None:
        if indices != [0]:
            raise GradientError(
                f"Gradient: function {name} returns a single value, so target_index must be 0, "
                f"not {request.target_index_arg}"
            )
        targets = [ret]
    else:
        targets = []
        for i in indices:
            if not 0 <= i < len(fields):
                raise GradientError(
                    f"Gradient: target_index {i} is out of range: function {name} returns "
                    f"{len(fields)} values"
                )
            targets.append(fields[i])
    for i, target in zip(indices, targets):
        if not isinstance(target, relax.Var) and (request.strict or request.seed == "ones"):
            raise GradientError(
                f"Gradient: the target of function {name} must be a Var, but return field "
                f"{i} is {target}"
            )
        if request.seed == "ones":
            if not (_ty.is_float_tensor(target) and _ty.is_scalar_tensor(target)):
                raise GradientError(
                    f"Gradient: the target {target.name} of function {name} must be a float "
                    f"scalar (0-dim tensor), but has type {target.ty}; for a vector-Jacobian "
                    "product of a non-scalar target, use Gradient(..., seed=\"param\")"
                )
        elif not _ty.nested_all(_ty.type_of(target), _ty.is_float_tensor):
            raise GradientError(
                f"Gradient: the target {target.name} of function {name} must be a float tensor "
                f"or a tuple of them, but has type {target.ty}"
            )
    return targets


def _seed_params(request: Request, targets: list) -> list:
    if request.seed != "param":
        return []
    names = [t.name if isinstance(t, relax.Var) else "output" for t in targets]
    return [relax.Var(f"{n}_grad", _ty.type_of(t)) for n, t in zip(names, targets)]


# -- checkpoint decision -----------------------------------------------------------------------
def _decide(request: Request, info: CheckpointInfo, params, targets, mod, split: bool) -> None:
    """Set ``info.checkpoints`` with the request's policy; values that cannot be recomputed
    (match_cast, If, calls of functions, impure calls) are always kept; in ``split`` mode random
    masks never are (each is a pure function of its key, the residual instead)."""
    if request.checkpoint != "markers":
        from .policies import decide

        info.checkpoints = decide(request.checkpoint, info, params, targets)
    masks = {b.var for b in info.bindings if split and random.is_mask(b.value, mod)}
    if masks:  # recomputed from the key: split mode's residual is the key, not the mask
        if info.checkpoints is None:
            info.checkpoints = {b.var for b in info.bindings} | set(params)
        info.checkpoints -= masks
    if info.checkpoints is None:
        return
    for b in info.bindings:
        value = b.value
        if (
            isinstance(b, relax.MatchCast)
            or isinstance(value, relax.If)
            or (isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op))
            or _impure(value, mod)
        ):
            info.checkpoints.add(b.var)


# -- fitting a "live" budget to TVM's memory planner -------------------------------------------
#: the most adjoints built to fit a ``budget(B, "live")`` policy to TVM's memory planner
MAX_FITTING_ROUNDS = 6
#: segment counts, in multiples of sqrt's, tried in order when no budget choice fits (until one
#: fits: each recomputes about one forward pass, and TVM's planner is not monotone in the count)
SEGMENT_GRAINS = (1.0, 1.2, 1.4, 1.7, 2.0, 2.5, 3.0, 4.0)


def _fitted_budget(checkpoint) -> int | None:
    """The byte budget of a ``policies.budget(B, "live")`` policy (fitted to the planner by
    :func:`_fit_budget`), else None."""
    if getattr(checkpoint, "model", None) == "live":
        return getattr(checkpoint, "capacity", None)
    return None


def _fit_budget(mod, request: Request, callees, return_result: bool):
    """The request with a ``"live"`` budget ``B`` replaced by the ``"live"`` budget whose adjoint
    TVM plans within ``B`` with the least recompute, and that adjoint (:func:`differentiate`'s
    result).

    The ``"live"`` model simulates the backward walk, not TVM's planner, which reuses storage
    by size classes and fragments (on ``bench/checkpoint.py``'s transformer the model's choice
    for 61 MiB plans 74 MiB). So the policy is run for model budgets ``c`` (``B`` first, then
    ``c`` scaled by ``B`` over the planned bytes, then bisection between the largest ``c`` that
    fits and the smallest that does not), each choice's adjoint built and its planned bytes
    other than outputs replayed by :func:`relaxgrad.analysis.replay_memory_plan` (exact on
    the bench's models, about 0.1 s for a 12-block transformer), for at most
    :data:`MAX_FITTING_ROUNDS` adjoints. Of the choices that fit, the one with the least
    recompute cost wins. When none fits, :func:`policies.segments` at :data:`SEGMENT_GRAINS`
    is tried too, in order up to the first that fits, and again the least recompute that fits,
    else the least planned bytes, wins.
    """
    from ..analysis import replay_memory_plan
    from ..program import program_from_function
    from .costs import recompute_cost
    from .policies import budget, costly_count, segments  # looked up per call: tests patch them

    goal, model = _fitted_budget(request.checkpoint), request.checkpoint.model
    trials: dict[int, tuple] = {}  # model budget -> (score, request, result)

    def trial(capacity, inner=None) -> tuple[bool, float, int]:
        inner, costs = inner or budget(capacity, model), []

        def chosen(program):
            saved = inner(program)
            costs.append(recompute_cost(program, saved))
            return saved

        chosen.__name__ = chosen.__qualname__ = inner.__name__
        fixed = dataclasses.replace(request, checkpoint=chosen)
        result = _differentiate(mod, fixed, callees, return_result)
        program = program_from_function(result[0], request.func_name)
        planned = replay_memory_plan(program)["other"]
        fits, cost = planned <= goal, sum(costs)
        trials[capacity] = ((not fits, cost if fits else planned, planned), fixed, result)
        return fits, cost, planned

    capacity, fits_at, over_at = goal, None, None
    for _ in range(MAX_FITTING_ROUNDS):
        if capacity in trials:
            break
        fits, cost, planned = trial(capacity)
        if fits:
            fits_at = capacity if fits_at is None else max(fits_at, capacity)
            if cost == 0:
                break  # nothing recomputed: nothing more to gain
        else:
            over_at = capacity if over_at is None else min(over_at, capacity)
            if capacity == 0:
                break  # nothing saved, and still over
        if fits_at is not None and over_at is not None:
            if over_at - fits_at <= max(goal // 64, 1):
                break
            capacity = (fits_at + over_at) // 2
        else:
            capacity = int(capacity * min(4.0, max(0.25, goal / max(planned, 1))))
    if all(over for (over, _, _), _, _ in trials.values()):
        # The knapsack's save sets bottom out above B (on the 12-block transformer at 0.29 of
        # no checkpointing, for B = 0.25): try the sqrt segmentation at finer grains too (2.5x
        # sqrt's count planned 0.23 there, where 1.2x to 2x planned 0.25 to 0.34), at more
        # recompute.
        for grain in SEGMENT_GRAINS:

            def finer(program, grain=grain):
                return segments(program, grain * math.sqrt(max(costly_count(program), 1)))

            finer.__name__ = finer.__qualname__ = f"segments_x{grain}"
            if trial(("segments", grain), finer)[0]:
                break
    _, fixed, result = min(trials.values(), key=lambda t: t[0])
    return fixed, result


# -- the whole function ------------------------------------------------------------------------
def differentiate(
    mod: IRModule,
    request: Request,
    callees: Callees | None,
    return_result: bool = True,
    forward_keys: set | None = None,
) -> tuple[Function, IRModule]:
    """The adjoint function of ``request.func`` (not yet added to any module), and ``mod`` with
    whatever the rules added to it (e.g. TE gradient kernels). ``forward_keys``, when given,
    receives the ``_ty.key`` of every var the re-emitted forward bindings define (split mode
    partitions the adjoint with it). A ``policies.budget(B, "live")`` checkpoint is first
    fitted to TVM's memory planner (:func:`_fit_budget`)."""
    if _fitted_budget(request.checkpoint) is not None:
        request, result = _fit_budget(mod, request, callees, return_result)
        if forward_keys is None:
            return result
    return _differentiate(mod, request, callees, return_result, forward_keys)


def _differentiate(
    mod: IRModule,
    request: Request,
    callees: Callees | None,
    return_result: bool = True,
    forward_keys: set | None = None,
) -> tuple[Function, IRModule]:
    """:func:`differentiate` for the request's policy as it is."""
    func = request.func
    copied = relax.utils.copy_with_new_vars(func)
    var_map = _var_map(func, copied)
    general = _is_general(copied)
    segments, ret, df_remap = _forward_segments(copied, general)

    bb = relax.BlockBuilder(mod)
    params = list(copied.params)
    bb.begin_scope(params)
    if not general:
        bb._begin_dataflow_block()
    blocks = []
    try:
        info = strip_markers(bb, params, segments, ret)
        targets = _targets(request, info.ret, info.bindings)
        seed_params = _seed_params(request, targets)
        if seed_params:
            bb.end_scope()
            bb.begin_scope(params + seed_params)
        _decide(request, info, params, targets, mod, split=forward_keys is not None)
        if forward_keys is not None:
            forward_keys.update(_ty.key(b.var) for b in info.bindings)
        if request.require_grads is None:
            grads = params if request.strict else [p for p in params if _differentiable(p)]
        else:
            grads = [df_remap.get(var_map[v], var_map[v]) for v in request.require_grads]
        if general:
            for is_dataflow, bindings in info.segments:
                bb._begin_dataflow_block() if is_dataflow else bb._begin_binding_block()
                _emit_forward(bb, bindings)
                blocks.append(bb._end_block())
            backward_dataflow = not any(_impure(b.value, mod) for b in info.bindings)
            if backward_dataflow:
                bb._begin_dataflow_block()
            else:
                bb._begin_binding_block()
        else:
            backward_dataflow = True
            _emit_forward(bb, info.bindings)
        if request.seed == "param":
            seeds = list(zip(targets, seed_params))
        else:
            seeds = [(t, relax.op.ones(_ty.shape_of(t), _ty.dtype_of(t))) for t in targets]
        walk = BackwardWalk(bb, request.func_name, params, info, callees)
        result = walk.run(
            seeds, grads, info.ret if return_result else None, dataflow=backward_dataflow
        )
    finally:
        blocks.append(bb._end_block())
        bb.end_scope()
    body = bb.normalize(relax.SeqExpr(blocks, result))
    adjoint = Function(params + seed_params, body, None, copied.is_pure, copied.attrs)
    if any(is_op(b.value, "relax.call_tir_with_grad") for b in info.bindings):
        adjoint = lower_call_tir_with_grad(adjoint)
    adjoint = remove_unused(adjoint)
    return simplify_gradient(adjoint), bb.get()


def _emit_forward(bb: relax.BlockBuilder, bindings) -> None:
    for binding in bindings:
        bb.emit_normalized(binding)


# -- calls of other functions ------------------------------------------------------------------
class Callees:
    """VJP functions of the Relax functions a differentiated function calls, built once each.

    ``<callee>_vjp(params..., output_grad) -> (grads of its float params)`` recomputes the
    callee's forward and walks it back; every call site reuses it.
    """

    def __init__(self, mod: IRModule, checkpoint):
        self.mod = mod
        self.checkpoint = checkpoint
        self.done: dict[str, tuple] = {}  # callee name -> (vjp GlobalVar, param indices)
        self.errors: dict[str, GradientError] = {}

    def prepare(self, func: Function, name: str, stack: tuple = ()) -> None:
        """Build the VJPs of every function ``func`` calls, callees first."""
        stack = (*stack, name)
        for gv in called_functions(func):
            callee = gv.name_hint
            if callee in stack:
                cycle = " -> ".join([*stack, callee])
                raise GradientError(
                    f"Gradient: function {name} calls {callee} recursively ({cycle}); "
                    "recursive functions cannot be differentiated"
                )
            if callee in self.done or callee in self.errors:
                continue
            target = self.mod[gv]
            if not isinstance(target, Function):
                raise GradientError(
                    f"Gradient: function {name} calls {callee}, a {type(target).__name__}; "
                    "only Relax functions can be called"
                )
            if target.attrs is not None and CUSTOM_GRADIENT_ATTR in target.attrs:
                indices = [i for i, p in enumerate(target.params) if _differentiable(p)]
                self.mod, vjp_gv, indices = custom_vjp(self.mod, gv, target, indices)
                self.done[callee] = (vjp_gv, indices)
                continue
            self.prepare(target, callee, stack)
            self._build(gv, target)

    def _build(self, gv: relax.GlobalVar, func: Function) -> None:
        callee = gv.name_hint
        indices = [i for i, p in enumerate(func.params) if _differentiable(p)]
        ret_ty = func.ret_ty if func.ret_ty is not None else _ty.type_of(func.body)
        if not indices or not _ty.nested_all(ret_ty, _ty.is_float_tensor):
            self.done[callee] = (None, [])
            return
        request = Request(
            func_name=callee,
            func=func,
            require_grads=[func.params[i] for i in indices],
            target_index=None,
            target_index_arg=None,
            seed="param",
            checkpoint=self.checkpoint,
            strict=False,
        )
        try:
            vjp, mod = differentiate(self.mod, request, self, return_result=False)
        except GradientError as err:
            self.errors[callee] = err
            return
        name = _fresh_name(mod, callee + "_vjp")
        bb = relax.BlockBuilder(mod)
        vjp_gv = bb.add_func(vjp.with_attr("global_symbol", name), name)
        self.mod = bb.get()
        self.done[callee] = (vjp_gv, indices)

    def __call__(self, gv: relax.GlobalVar, caller: str):
        callee = gv.name_hint
        if callee in self.errors:
            err = self.errors[callee]
            raise GradientError(f"{err} (called from function {caller})") from err
        return self.done[callee]


def _fresh_name(mod: IRModule, name: str) -> str:
    names = {gv.name_hint for gv in mod.get_global_vars()}
    candidate, i = name, 1
    while candidate in names:
        candidate, i = f"{name}{i}", i + 1
    return candidate

