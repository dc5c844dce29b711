"""What a save set costs: the recompute and memory models of the checkpoint policies.

Each measure is a pure function of a :class:`~relaxgrad.program.Program` and the indices of the
nodes it saves (kept from the forward pass for the backward pass); every other intermediate is
recomputed, once. Parameters, constants and outputs exist anyway: they count as neither.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..program import ALIAS_OPS, Program

__all__ = ["backward_peak_bytes", "peak_bytes", "recompute_cost", "saved_bytes"]


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
                     if i not in saved and program.intermediate[i]))


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
    return sum(program.nodes[i].nbytes for i in set(saved) if program.intermediate[i])


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
