"""The knapsack solvers behind the ``budget`` checkpoint policy: pure functions over plain lists.

Every solver has one signature, ``solver(sizes, values, capacity) -> chosen``: item sizes
(bytes, > 0), item values (recompute cost saved, >= 0) and a size limit in, the indices of the
chosen items (sorted) out, their sizes summing to at most ``capacity``. They know nothing of
programs or graphs (:mod:`.policies` maps nodes to items and back), so they are tested against
brute force on their own.

=====================  ======================================================================
solver                 choice
=====================  ======================================================================
``dp_knapsack``        optimal: dynamic programming over the capacity
``greedy_knapsack``    by value per size; at most the largest single value from the optimum
``knapsack``           ``dp_knapsack`` while its table has at most ``max_cells`` cells, else
                       ``greedy_knapsack``
=====================  ======================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "MAX_DP_CELLS",
    "Solver",
    "dp_cells",
    "dp_knapsack",
    "greedy_knapsack",
    "greedy_order",
    "knapsack",
]

#: the largest dynamic program (items x capacity cells) :func:`knapsack` solves exactly
MAX_DP_CELLS = 20_000_000

#: ``solver(sizes, values, capacity) -> chosen item indices``
Solver = Callable[[Sequence[int], Sequence[float], int], list[int]]


def dp_cells(sizes: Sequence[int], capacity: int) -> int:
    """The cells of :func:`dp_knapsack`'s table: items times the capacity in units of the
    sizes' gcd (what its time and memory grow with)."""
    gcd = math.gcd(*sizes) if sizes else 1
    return len(sizes) * (capacity // gcd + 1)


def dp_knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int) -> list[int]:
    """Items of greatest total value whose total size fits ``capacity`` (0/1 knapsack), exactly.

    Dynamic programming over the capacity in units of the sizes' gcd (:func:`dp_cells` cells),
    with items of equal size grouped (the most valuable of a size come first). When every item
    fits, every item is chosen.

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
        The chosen item indices, sorted.
    """
    n = len(sizes)
    if sum(sizes) <= capacity:
        return list(range(n))
    gcd = math.gcd(*sizes) if n else 1
    cap = capacity // gcd
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
    return sorted(chosen)


def greedy_knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int) -> list[int]:
    """Items by decreasing value per size (:func:`greedy_order`), each taken when it still fits.

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
        The chosen item indices, sorted.
    """
    chosen, room = [], capacity
    for i in greedy_order(sizes, values):
        if sizes[i] <= room:
            chosen.append(i)
            room -= sizes[i]
    return sorted(chosen)


def knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int,
             max_cells: int = MAX_DP_CELLS) -> list[int]:
    """Items of greatest total value whose total size fits ``capacity`` (0/1 knapsack).

    Every item when all fit; else :func:`dp_knapsack` (exact) when its table has at most
    ``max_cells`` cells (:func:`dp_cells`), otherwise :func:`greedy_knapsack`.

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
    list[int]
        The chosen item indices, sorted.
    """
    if sum(sizes) > capacity and dp_cells(sizes, capacity) > max_cells:
        return greedy_knapsack(sizes, values, capacity)
    return dp_knapsack(sizes, values, capacity)


def greedy_order(sizes: Sequence[int], values: Sequence[float]) -> list[int]:
    """The order :func:`greedy_knapsack` takes items in: by decreasing value per size, equal
    items spread evenly (see :func:`_by_value`).

    Parameters
    ----------
    sizes : Sequence[int]
        Item sizes (> 0).
    values : Sequence[float]
        Item values (>= 0).

    Returns
    -------
    list[int]
        All item indices, in that order.
    """
    return _by_value(sizes, values, lambda i: -values[i] / sizes[i])


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
