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

:func:`resolve` maps the ``checkpoint=`` option of :func:`relaxgrad.Gradient` to a policy;
:func:`recompute_cost`, :func:`saved_bytes`, :func:`peak_bytes` and
:func:`backward_peak_bytes` measure a save set;
:func:`program_from_function` builds a :class:`Program` from a Relax function.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import tvm
from tvm import relax

from .. import _ty
from ..errors import GradientError
from .exprs import free_vars

__all__ = [
    "Node",
    "Policy",
    "Program",
    "backward_peak_bytes",
    "budget",
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
    "sqrt",
]

#: ops whose value is another value (or a group of values): they cost nothing and hold no bytes
ALIAS_OPS = frozenset({"tuple", "get_item", "var"})
#: ops whose value is always available to the backward pass
FREE_OPS = frozenset({"param", "const"})
#: ops ``save_dots`` keeps (plus every ``relax.nn.conv*``)
DOT_OPS = frozenset({"relax.matmul", "relax.einsum", "relax.linear"})
#: the largest dynamic program (items x capacity cells) :func:`knapsack` solves exactly
MAX_DP_CELLS = 20_000_000


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


Policy = Callable[[Program], frozenset]


# ----------------------------------------------------------------------------------------------
# measuring a save set


def _is_free(program: Program, i: int) -> bool:
    return program.nodes[i].op in FREE_OPS


def _counts(program: Program, i: int) -> bool:
    """Whether node ``i`` is an intermediate whose keeping or recomputing matters."""
    return program.intermediate[i]


def recompute_cost(program: Program, saved: Iterable[int]) -> float:
    """Total cost of the bindings recomputed for the backward pass when ``saved`` are kept.

    Every non-saved intermediate (not a parameter, constant or output) is counted once, as
    TVM's ``Regenerator`` recomputes each of them once; dead-code elimination may later drop
    some, so this is an upper bound.

    Parameters
    ----------
    program : Program
        The function.
    saved : Iterable[int]
        Indices of the saved nodes.

    Returns
    -------
    float
        The sum of ``cost`` over recomputed nodes.
    """
    saved = set(saved)
    return float(sum(n.cost for i, n in enumerate(program.nodes)
                     if i not in saved and _counts(program, i)))


def saved_bytes(program: Program, saved: Iterable[int]) -> int:
    """Bytes kept from the forward pass: ``nbytes`` of saved intermediates.

    Parameters, constants and outputs are not counted (they exist anyway).

    Parameters
    ----------
    program : Program
        The function.
    saved : Iterable[int]
        Indices of the saved nodes.

    Returns
    -------
    int
        The sum of ``nbytes`` over saved intermediates.
    """
    return sum(program.nodes[i].nbytes for i in set(saved) if _counts(program, i))


def peak_bytes(program: Program, saved: Iterable[int]) -> int:
    """Estimated peak of forward values live in the backward pass: kept plus recomputed.

    ``saved_bytes`` plus the bytes of the largest recomputation segment, a connected group of
    non-saved intermediates: recomputing one value of a segment recomputes its non-saved
    ancestors, and they stay live until the backward pass has used them (Chen et al.'s
    ``saved + max segment`` model).

    Parameters
    ----------
    program : Program
        The function.
    saved : Iterable[int]
        Indices of the saved nodes.

    Returns
    -------
    int
        The estimate in bytes.
    """
    saved = set(saved)
    parent = list(range(len(program.nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    recomputed = [m and i not in saved for i, m in enumerate(program.intermediate)]
    for i, node in enumerate(program.nodes):
        if recomputed[i]:
            for j in node.inputs:
                if recomputed[j]:
                    parent[find(j)] = find(i)
    segments: dict[int, int] = {}
    for i, node in enumerate(program.nodes):
        if recomputed[i]:
            root = find(i)
            segments[root] = segments.get(root, 0) + node.nbytes
    return saved_bytes(program, saved) + max(segments.values(), default=0)


def backward_peak_bytes(program: Program, saved: Iterable[int]) -> int:
    """Simulated peak of the bytes live in the backward pass, as the pass recomputes lazily.

    Walks the nodes that reach an output backwards, as the pass does. Visiting node ``i``
    reads ``i`` and its inputs (aliases resolved to what they alias); a non-saved one not
    already recomputed is recomputed then, with its missing non-saved inputs (each once). A
    forward value (saved or recomputed) stays live until the walk has visited it; the adjoint
    of an intermediate is live from its first contribution (the visit of its last reader) to
    its own visit. Saved intermediates are live from the start; while node ``i`` is visited,
    its rule's temporaries add ``nbytes`` of ``i``. Unlike :func:`peak_bytes` it
    counts the adjoints and recomputed values of several segments live at once (what TVM's
    planner must hold); fusion may save some of it, so it is an upper-bound-like estimate.

    Parameters
    ----------
    program : Program
        The function.
    saved : Iterable[int]
        Indices of the saved nodes.

    Returns
    -------
    int
        The estimated peak in bytes.
    """
    nodes, inter = program.nodes, program.intermediate
    saved = set(saved)
    real: list[tuple[int, ...]] = []  # per node: the non-alias nodes it stands for
    for i, node in enumerate(nodes):
        real.append(tuple(dict.fromkeys(k for j in node.inputs for k in real[j]))
                    if node.op in ALIAS_OPS else (i,))
    reads = [tuple(dict.fromkeys(k for j in n.inputs for k in real[j])) for n in nodes]
    reaches = [i in program.outputs for i in range(len(nodes))]
    last_reader = [-1] * len(nodes)  # the reader visited first (the largest index)
    for i in range(len(nodes) - 1, -1, -1):
        if reaches[i]:
            for j in nodes[i].inputs:
                reaches[j] = True
            for k in reads[i]:
                last_reader[k] = max(last_reader[k], i)
    live = sum(nodes[i].nbytes for i in saved if inter[i])
    ready = [i in saved or not inter[i] for i in range(len(nodes))]
    peak = live

    def recompute(u: int) -> int:
        added, stack = 0, [u]
        while stack:
            v = stack[-1]
            missing = [k for k in reads[v] if not ready[k]]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            if not ready[v]:
                ready[v] = True
                added += nodes[v].nbytes
        return added

    for i in range(len(nodes) - 1, -1, -1):
        if not reaches[i] or nodes[i].op in ALIAS_OPS or not inter[i] and i not in program.outputs:
            continue
        for k in (i, *reads[i]):
            if not ready[k]:
                live += recompute(k)
        live += sum(nodes[k].nbytes for k in reads[i] if inter[k] and last_reader[k] == i)
        peak = max(peak, live + nodes[i].nbytes)  # the rule's temporaries
        if inter[i]:
            live -= 2 * nodes[i].nbytes  # its value and its adjoint die here
    return peak


# ----------------------------------------------------------------------------------------------
# policies


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
    costly = [_counts(program, i) and nodes[i].op not in ALIAS_OPS for i in range(len(nodes))]
    if not any(costly):
        return 0
    mean_cost = statistics.fmean(nodes[i].cost for i in range(len(nodes)) if costly[i])
    return sum(1 for i in range(len(nodes)) if costly[i] and nodes[i].cost >= mean_cost)


def segments(program: Program, count: float | None = None) -> frozenset:
    """:func:`sqrt` with ``count`` segments (about; ``sqrt(n)`` when None): more segments keep
    more boundaries and recompute smaller pieces at a time."""
    nodes = program.nodes
    costly = [_counts(program, i) and nodes[i].op not in ALIAS_OPS for i in range(len(nodes))]
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
        if not _is_free(program, i):
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
    :func:`knapsack` while its dynamic program has at most ``max_cells`` cells, else greedily
    in one order computed once (for many calls)."""

    def __init__(self, program: Program, max_cells: int):
        self.program, self.max_cells = program, max_cells
        nodes = program.nodes
        items = [i for i, n in enumerate(nodes)
                 if program.intermediate[i] and n.op not in ALIAS_OPS and n.cost > 0]
        self.free = [i for i in items if nodes[i].nbytes == 0]
        paid = [i for i in items if nodes[i].nbytes > 0]
        sizes, values = [nodes[i].nbytes for i in paid], [nodes[i].cost for i in paid]
        self.order = [paid[k] for k in _by_value(sizes, values, lambda k: -values[k] / sizes[k])]
        self.gcd = math.gcd(*sizes) if sizes else 1

    def __call__(self, saved, capacity: int) -> frozenset:
        nodes = self.program.nodes
        rest = [i for i in self.order if i not in saved]
        if len(rest) * (capacity // self.gcd + 1) <= self.max_cells:
            chosen, _ = knapsack([nodes[i].nbytes for i in rest], [nodes[i].cost for i in rest],
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
# the knapsack solvers behind ``budget``: pure functions over plain lists



def knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int,
             max_cells: int = MAX_DP_CELLS) -> tuple[list[int], bool]:
    """Items of greatest total value whose total size fits ``capacity`` (0/1 knapsack).

    Exact by dynamic programming over the capacity in units of the sizes' gcd, with items of
    equal size grouped (the most valuable of a size come first), when ``len(sizes)`` times the
    capacity in units is at most ``max_cells``; otherwise :func:`greedy_knapsack`.

    Parameters
    ----------
    sizes : Sequence[int]
        Item sizes (> 0).
    values : Sequence[float]
        Item values (>= 0).
    capacity : int
        The size limit.
    max_cells : int
        The largest dynamic program solved exactly.

    Returns
    -------
    tuple[list[int], bool]
        The chosen item indices, and whether the choice is optimal.
    """
    n = len(sizes)
    if sum(sizes) <= capacity:
        return list(range(n)), True
    gcd = math.gcd(*sizes) if n else 1
    cap = capacity // gcd
    if n * (cap + 1) > max_cells:
        return greedy_knapsack(sizes, values, capacity), False
    groups: dict[int, list[int]] = {}
    for i in _by_value(sizes, values, lambda i: -values[i]):
        groups.setdefault(sizes[i] // gcd, []).append(i)
    best = np.zeros(cap + 1)
    steps = []
    for unit, members in groups.items():
        prefix = np.concatenate([[0.0], np.cumsum([values[i] for i in members])])
        new, take = best.copy(), np.zeros(cap + 1, dtype=np.int64)
        for k in range(1, min(len(members), cap // unit) + 1):
            cand = np.full(cap + 1, -np.inf)
            cand[k * unit:] = best[:cap + 1 - k * unit] + prefix[k]
            better = cand > new
            new[better], take[better] = cand[better], k
        steps.append((unit, members, take))
        best = new
    chosen, c = [], cap
    for unit, members, take in reversed(steps):
        k = int(take[c])
        chosen += members[:k]
        c -= k * unit
    return sorted(chosen), True


def _bit_reversed(rank: int, bits: int) -> int:
    return int(format(rank, f"0{bits}b")[::-1], 2) if bits else 0


def _by_value(sizes: Sequence[int], values: Sequence[float], key: Callable) -> list[int]:
    """Item indices sorted by ``key``; equal items (same size and value) in bit-reversed order.

    Any prefix of a bit-reversed order is spread evenly over the items, so when only some of
    many equal items fit (the same layer repeated), the chosen ones split the program into
    segments of similar length rather than saving its first layers.
    """
    classes: dict[tuple, list[int]] = {}
    for i in range(len(sizes)):
        classes.setdefault((sizes[i], values[i]), []).append(i)
    spread = {}
    for members in classes.values():
        bits = (len(members) - 1).bit_length()
        for rank, i in enumerate(members):
            spread[i] = _bit_reversed(rank, bits)
    return sorted(range(len(sizes)), key=lambda i: (key(i), spread[i]))


def greedy_knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int) -> list[int]:
    """Items by decreasing value per size, each taken when it still fits.

    Its total value is at least the optimum minus the largest single value (it holds every
    item the fractional relaxation takes whole), so the recompute cost it leaves is at most the
    optimum plus the largest single cost.

    Parameters
    ----------
    sizes : Sequence[int]
        Item sizes (> 0).
    values : Sequence[float]
        Item values (>= 0).
    capacity : int
        The size limit.

    Returns
    -------
    list[int]
        The chosen item indices.
    """
    chosen, room = [], capacity
    for i in _by_value(sizes, values, lambda i: -values[i] / sizes[i]):
        if sizes[i] <= room:
            chosen.append(i)
            room -= sizes[i]
    return sorted(chosen)


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


def _returned(expr) -> list:
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in _returned(f)]
    return []


def _build(params, bindings, outputs, name: str, start=(), end=()) -> tuple[Program, list]:
    """The Program of ``params`` then ``bindings``, and the var of each node."""
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
    return _build(func.params, bindings, _returned(func.body.body), name)[0]


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
    program, variables = _build(
        params, info.bindings, [*targets, *_returned(info.ret)], "the function",
        getattr(info, "start_marked", ()), getattr(info, "end_marked", ()),
    )
    return {variables[i] for i in policy(program)} | set(params)
