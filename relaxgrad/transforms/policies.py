"""Checkpoint policies: which forward values the backward pass keeps, as pure functions.

A policy sees a function as plain data, a :class:`Program` (a list of :class:`Node`), and returns
the indices of the nodes it *saves*: saved values are kept from the forward pass for the
backward pass, every other value the backward pass needs is recomputed from saved ones (TVM's
``Regenerator`` semantics: each non-saved binding is recomputed once). Parameters and constants
are always available; outputs are materialized anyway, so neither counts as memory or
recomputation.

=================  ==========================================================================
policy             saves
=================  ==========================================================================
``markers``        TVM's rule for ``R.grad.start_checkpoint`` / ``end_checkpoint`` markers
``none``           everything (no checkpointing)
``sqrt``           segment boundaries about every sqrt(n) nodes (Chen et al., 2016)
``save_dots``      matmul / conv / einsum outputs; cheap ops are recomputed (JAX)
``save_names``     exactly the named nodes (JAX's ``save_only_these_names``)
``budget``         the least recompute cost whose saved (peak, live) bytes fit a byte budget
=================  ==========================================================================

:func:`resolve` maps the ``checkpoint=`` option of :func:`relaxgrad.Gradient` to a policy.
Around the policies: :class:`Program` and :func:`program_from_function` are
:mod:`relaxgrad.program`'s; :func:`recompute_cost`, :func:`saved_bytes`, :func:`peak_bytes` and
:func:`backward_peak_bytes`, which measure a save set, :mod:`.costs`'; :func:`knapsack` and
:func:`greedy_knapsack`, the solvers behind :func:`budget`, :mod:`.solvers`'. This module
exports them too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable

import numpy as np

from ..errors import GradientError
from ..program import (
    ALIAS_OPS,
    FREE_OPS,
    Node,
    Program,
    build_program,
    program_from_function,
    returned_vars,
)
from .costs import backward_peak_bytes, peak_bytes, recompute_cost, saved_bytes
from .solvers import MAX_DP_CELLS, dp_knapsack, greedy_knapsack, greedy_order, knapsack

__all__ = [
    "ALIAS_OPS",
    "FREE_OPS",
    "Node",
    "Policy",
    "Program",
    "backward_peak_bytes",
    "budget",
    "costly_count",
    "decide",
    "greedy_knapsack",
    "knapsack",
    "markers",
    "none",
    "peak_bytes",
    "program_from_function",
    "recompute_cost",
    "resolve",
    "save_dots",
    "save_names",
    "saved_bytes",
    "segments",
    "sqrt",
]

#: ops ``save_dots`` keeps (plus every ``relax.nn.conv*``)
DOT_OPS = frozenset({"relax.matmul", "relax.einsum", "relax.linear"})

Policy = Callable[[Program], frozenset]


def _finish(program: Program, saved: Iterable[int]) -> frozenset:
    """``saved`` plus parameters and constants; an alias is saved iff all its inputs are.

    Keeping a tuple keeps its fields alive, so an alias of a non-saved value is not saved.
    """
    saved = set(saved)
    for i, node in enumerate(program.nodes):
        if node.op in FREE_OPS:
            saved.add(i)
        elif node.op in ALIAS_OPS:
            if all(j in saved for j in node.inputs):
                saved.add(i)
            else:
                saved.discard(i)
    return frozenset(saved)


def markers(program: Program) -> frozenset:
    """TVM's rule: what ``R.grad.start_checkpoint`` / ``end_checkpoint`` markers keep.

    Parameters are saved, start-marked nodes are saved, and any other node is saved iff each
    of its inputs is saved or end-marked. Without any marker everything is saved. As in TVM,
    the marker var ``y`` of ``y = start_checkpoint(x)`` is not saved though ``x`` is: it is a
    ``"var"`` alias of a start-marked node, and what is computed from it is recomputed.

    Parameters
    ----------
    program : Program
        The function.

    Returns
    -------
    frozenset[int]
        Indices of the saved nodes.
    """
    if not program.start_marked and not program.end_marked:
        return frozenset(range(len(program.nodes)))
    saved: set[int] = set()
    for i, node in enumerate(program.nodes):
        if node.op == "var" and node.inputs[0] in program.start_marked:
            continue  # ``y = start_checkpoint(x)``: computing from y starts a segment
        if (node.op == "param" or i in program.start_marked
                or all(j in saved or j in program.end_marked for j in node.inputs)):
            saved.add(i)
    return frozenset(saved)


def none(program: Program) -> frozenset:
    """No checkpointing: every node is saved.

    Parameters
    ----------
    program : Program
        The function.

    Returns
    -------
    frozenset[int]
        All indices.
    """
    return frozenset(range(len(program.nodes)))


def sqrt(program: Program) -> frozenset:
    """Chen et al. (2016): cut the program into about sqrt(n) segments; save their boundaries.

    ``n`` counts the costly nodes, those whose cost is at least the mean cost of the
    intermediates (the matmuls of an MLP: a layer's cheap elementwise ops are fused into its
    matmul and add no segment of their own). Walks the nodes in topological order, adding up
    the bytes of the intermediates (counting 1 per node when no size is known); once a segment
    holds ``total / sqrt(n)`` bytes, the next
    *cut point* (a node such that no earlier non-free value is used after it, e.g. a layer
    output or a residual-stream add) is saved and a new segment starts. Outputs also end a
    segment. Where no cut point comes before a segment grows to twice its size, the node at
    hand is saved anyway. The backward pass then keeps about sqrt(n) boundaries and recomputes
    one segment at a time: memory O(sqrt(n)) for about one extra forward pass.

    Parameters
    ----------
    program : Program
        The function.

    Returns
    -------
    frozenset[int]
        Indices of the saved nodes (with parameters and constants).
    """
    return segments(program)


def costly_count(program: Program) -> int:
    """The nodes :func:`sqrt` counts: intermediates costing at least their mean cost."""
    nodes = program.nodes
    costly = [program.intermediate[i] and nodes[i].op not in ALIAS_OPS for i in range(len(nodes))]
    if not any(costly):
        return 0
    mean_cost = statistics.fmean(nodes[i].cost for i in range(len(nodes)) if costly[i])
    return sum(1 for i in range(len(nodes)) if costly[i] and nodes[i].cost >= mean_cost)


def segments(program: Program, count: float | None = None) -> frozenset:
    """:func:`sqrt` with ``count`` segments (about; ``sqrt(n)`` when None): more segments keep
    more boundaries and recompute smaller pieces at a time."""
    nodes = program.nodes
    costly = [program.intermediate[i] and nodes[i].op not in ALIAS_OPS for i in range(len(nodes))]
    sized = any(nodes[i].nbytes for i in range(len(nodes)) if costly[i])
    weight = [(nodes[i].nbytes if sized else 1) if costly[i] else 0 for i in range(len(nodes))]
    if not any(costly):
        return _finish(program, ())
    segment = sum(weight) / (count if count else math.sqrt(costly_count(program)))
    last_use = list(range(len(nodes)))
    for i, node in enumerate(nodes):
        for j in node.inputs:
            last_use[j] = i
    saved: set[int] = set()
    reach = -1  # the last use of any non-free value defined so far
    filled = 0
    for i in range(len(nodes)):
        filled += weight[i]
        is_cut = reach <= i
        if i in program.outputs and is_cut:
            filled = 0
        elif costly[i] and filled >= (segment if is_cut else 2 * segment):
            saved.add(i)
            filled = 0
        if program.nodes[i].op not in FREE_OPS:
            reach = max(reach, last_use[i])
    return _finish(program, saved)


def _is_dot(op: str) -> bool:
    return op in DOT_OPS or op.startswith("relax.nn.conv")


def save_dots(program: Program) -> frozenset:
    """Save the outputs of matmul, conv* and einsum; recompute the cheap ops between them.

    Like JAX's ``dots_saveable``.

    Parameters
    ----------
    program : Program
        The function.

    Returns
    -------
    frozenset[int]
        Indices of the saved nodes (with parameters and constants).
    """
    return _finish(program, (i for i, n in enumerate(program.nodes) if _is_dot(n.op)))


def save_names(names: Iterable[str]) -> Policy:
    """A policy that saves exactly the nodes named ``names`` (and parameters).

    Like JAX's ``save_only_these_names``. The policy raises :class:`GradientError` when a
    name is not a node of the program.

    Parameters
    ----------
    names : Iterable[str]
        Var names.

    Returns
    -------
    Policy
        The policy.
    """
    names = tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise GradientError(f"Gradient: checkpoint names must be strings, got {names!r}")

    def policy(program: Program) -> frozenset:
        index = {node.name: i for i, node in enumerate(program.nodes)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise GradientError(f"Gradient: checkpoint names {', '.join(unknown)} are not vars "
                                "of the function")
        return _finish(program, (index[n] for n in names))

    policy.__name__ = policy.__qualname__ = f"save_names({list(names)!r})"
    return policy


def budget(nbytes: int, model: str = "saved") -> Policy:
    """A policy that saves what minimizes recomputation while its memory fits ``nbytes``.

    Each non-saved intermediate costs its ``cost`` once (:func:`recompute_cost`). The memory
    counted depends on ``model``:

    - ``"saved"`` (default): :func:`saved_bytes`, the kept intermediates only (not the working
      set of recomputed values). The choice is then a 0/1 knapsack, solved by
      :func:`knapsack`: exactly when its dynamic program is small enough (tested against brute
      force), otherwise greedily, with a recompute cost at most the optimum plus the largest
      single node cost.
    - ``"peak"``: :func:`peak_bytes`, kept plus the largest recomputation segment. A heuristic
      without a proven bound. It starts from save sets of two kinds: cuts of the program
      into segments of at most 1/16 ... 15/16 of the budget (in order, a node is saved when
      joining it to its inputs' segments would pass that), and ``"saved"``-model knapsacks of
      1/16 ... 16/16 of the budget; each start then spends what remains of the budget on a
      knapsack of the costliest nodes, and the cheapest result that fits wins (when none
      fits, the one with the least peak). On 300 random programs of 3-12 nodes (173 with a
      save set that fits) it found the optimum in 161, a costlier set that fits in 7 (by at
      most 16% of the forward cost) and none that fits in 5.
    - ``"live"``: :func:`backward_peak_bytes`, a simulation of the backward walk (kept values,
      recomputed values of several segments, adjoints and rule temporaries live at once), by
      the same search as ``"peak"``. The closest to TVM's planned memory of the adjoint, but
      not the planner: TVM's ``StaticPlanBlockMemory`` reuses storage by size classes and
      fragments (on ``bench/checkpoint.py``'s transformer this policy's choice for 61 MiB
      plans 74 MiB, the ``"peak"`` model's 101 MiB). So :func:`relaxgrad.Gradient` *fits*
      a ``"live"`` budget ``B`` to the planner: it runs this policy for a few model budgets,
      builds each choice's adjoint, replays TVM's planner on it
      (:func:`relaxgrad.analysis.replay_memory_plan`, exact on the bench's models) and keeps
      the choice with the least recompute among those planned within ``B`` (when none is, the
      least planned). Use it to bound the backward pass's planned memory. Called directly,
      the policy is the model's choice, a pure function of the program like the others.

    Parameters
    ----------
    nbytes : int
        The byte budget (>= 0).
    model : str
        ``"saved"``, ``"peak"`` or ``"live"``.

    Returns
    -------
    Policy
        The policy; its ``capacity`` and ``model`` attributes are ``nbytes`` and ``model``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise GradientError(f"Gradient: a checkpoint budget must be a byte count >= 0, "
                            f"got {nbytes!r}")
    if model not in ("saved", "peak", "live"):
        raise GradientError(f"Gradient: a checkpoint budget model is 'saved', 'peak' or 'live', "
                            f"got {model!r}")
    capacity = int(nbytes)

    def policy(program: Program) -> frozenset:
        if model == "saved":
            return _Filler(program, MAX_DP_CELLS)(set(), capacity)
        measure = peak_bytes if model == "peak" else backward_peak_bytes
        fill = _Filler(program, MAX_DP_CELLS // 32)
        starts = [_segment(program, capacity * k // 16) for k in range(1, 16)]
        starts += [fill(set(), capacity * k // 16) for k in range(1, 17)]
        best = None
        for saved in starts:
            room = capacity - measure(program, saved)
            saved = fill(saved, max(room, 0))
            peak = measure(program, saved)
            score = (peak > capacity, peak if peak > capacity else 0,
                     recompute_cost(program, saved))
            if best is None or score < best[0]:
                best = (score, saved)
        return best[1]

    policy.__name__ = policy.__qualname__ = (
        f"budget({capacity})" if model == "saved" else f"budget({capacity}, {model!r})")
    policy.capacity, policy.model = capacity, model
    return policy


class _Filler:
    """Adds to a save set the costliest other intermediates whose bytes fit a capacity: by
    :func:`.solvers.dp_knapsack` while its table has at most ``max_cells`` cells, else greedily
    in one order computed once (for many calls)."""

    def __init__(self, program: Program, max_cells: int):
        self.program, self.max_cells = program, max_cells
        nodes = program.nodes
        items = [i for i, n in enumerate(nodes)
                 if program.intermediate[i] and n.op not in ALIAS_OPS and n.cost > 0]
        self.free = [i for i in items if nodes[i].nbytes == 0]
        paid = [i for i in items if nodes[i].nbytes > 0]
        sizes, values = [nodes[i].nbytes for i in paid], [nodes[i].cost for i in paid]
        self.order = [paid[k] for k in greedy_order(sizes, values)]
        self.gcd = math.gcd(*sizes) if sizes else 1

    def __call__(self, saved, capacity: int) -> frozenset:
        nodes = self.program.nodes
        rest = [i for i in self.order if i not in saved]
        if len(rest) * (capacity // self.gcd + 1) <= self.max_cells:
            chosen = dp_knapsack([nodes[i].nbytes for i in rest], [nodes[i].cost for i in rest],
                                 capacity)
            rest = [rest[k] for k in chosen]
        else:
            room, taken = capacity, []
            for i in rest:
                if nodes[i].nbytes <= room:
                    taken.append(i)
                    room -= nodes[i].nbytes
            rest = taken
        return _finish(self.program, [*saved, *self.free, *rest])


def _segment(program: Program, cap: int) -> set:
    """Saved nodes that cut the non-saved intermediates into segments of at most ``cap`` bytes.

    In order, a node joins the segments of its non-saved inputs unless that would pass
    ``cap``; then it is saved (an alias cannot be, so aliases may still join past ``cap``).
    """
    nodes = program.nodes
    parent = list(range(len(nodes)))
    size = [n.nbytes for n in nodes]

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    saved: set[int] = set()
    for i, node in enumerate(nodes):
        if not program.intermediate[i]:
            continue
        roots = {find(j) for j in node.inputs if program.intermediate[j] and j not in saved}
        total = node.nbytes + sum(size[r] for r in roots)
        if total > cap and node.op not in ALIAS_OPS:
            saved.add(i)
            continue
        for r in roots:
            parent[r] = i
        size[i] = total
    return saved


# ----------------------------------------------------------------------------------------------
# the ``checkpoint=`` option

_NAMED: dict[str, Policy] = {"markers": markers, "none": none, "sqrt": sqrt,
                             "save_dots": save_dots}


def _checked(policy: Callable) -> Policy:
    """``policy`` with its result checked: a set of node indices."""

    def run(program: Program) -> frozenset:
        saved = policy(program)
        try:
            saved = frozenset(saved)
        except TypeError:
            raise GradientError(f"Gradient: checkpoint policy {policy!r} returned {saved!r}, "
                                "not a set of node indices") from None
        n = len(program.nodes)
        bad = [i for i in saved if isinstance(i, bool) or not isinstance(i, (int, np.integer))
               or not 0 <= i < n]
        if bad:
            raise GradientError(f"Gradient: checkpoint policy {policy!r} returned {bad[:5]!r}, "
                                f"not node indices in [0, {n})")
        return saved

    run.__name__ = run.__qualname__ = getattr(policy, "__name__", repr(policy))
    return run


def resolve(checkpoint) -> Policy:
    """The policy for the ``checkpoint=`` option of :func:`relaxgrad.Gradient`.

    Parameters
    ----------
    checkpoint : None, str, dict, list of str, int or callable
        ``None`` or ``"markers"`` (TVM's markers), ``"none"``, ``"sqrt"``, ``"save_dots"``;
        ``{"save": [names]}`` or a list of names (:func:`save_names`); an int, a byte budget
        (:func:`budget`); or a callable ``Program -> set of saved indices`` (its result is
        checked).

    Returns
    -------
    Policy
        The policy.

    Raises
    ------
    GradientError
        On any other value.
    """
    if checkpoint is None:
        return markers
    if isinstance(checkpoint, str):
        if checkpoint in _NAMED:
            return _NAMED[checkpoint]
        raise GradientError(f"Gradient: unknown checkpoint policy {checkpoint!r}; the named "
                            f"policies are {', '.join(map(repr, _NAMED))}")
    if isinstance(checkpoint, dict):
        if set(checkpoint) != {"save"} or isinstance(checkpoint["save"], str):
            raise GradientError(f"Gradient: checkpoint={checkpoint!r}: a dict checkpoint is "
                                "{'save': [var names]}")
        return save_names(checkpoint["save"])
    if isinstance(checkpoint, (list, tuple)):
        return save_names(checkpoint)
    if isinstance(checkpoint, (int, np.integer)) and not isinstance(checkpoint, bool):
        return budget(checkpoint)
    if callable(checkpoint):
        return _checked(checkpoint)
    raise GradientError(
        f"Gradient: checkpoint={checkpoint!r} is not a checkpoint policy; use "
        f"{', '.join(map(repr, _NAMED))}, {{'save': [names]}}, a byte budget (int) or a "
        "callable Program -> frozenset of saved node indices"
    )


def decide(checkpoint, info, params, targets) -> set:
    """The vars the pass keeps for ``checkpoint=``: the policy applied to the forward bindings.

    Parameters
    ----------
    checkpoint : None, str, dict, list of str, int or callable
        The option (see :func:`resolve`).
    info : relaxgrad.transforms.checkpoint.CheckpointInfo
        The forward program, markers stripped (``bindings``, ``ret``, ``start_marked``,
        ``end_marked``).
    params : list of relax.Var
        The function's parameters (always kept).
    targets : list of relax.Var
        The differentiated targets (outputs, like the returned vars).

    Returns
    -------
    set of relax.Var
        The kept vars, parameters included.
    """
    policy = resolve(checkpoint)
    program, variables = build_program(
        params, info.bindings, [*targets, *returned_vars(info.ret)], "the function",
        getattr(info, "start_marked", ()), getattr(info, "end_marked", ()),
    )
    return {variables[i] for i in policy(program)} | set(params)
