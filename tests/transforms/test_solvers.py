"""The knapsack solvers behind the ``budget`` policy, as pure functions over plain lists, against
a brute-force oracle."""

import itertools
import random

import pytest

from relaxgrad.transforms import solvers


def oracle(sizes, values, capacity) -> float:
    """The greatest total value of any items whose sizes fit ``capacity``."""
    return max(sum(values[i] for i in chosen) for r in range(len(sizes) + 1)
               for chosen in itertools.combinations(range(len(sizes)), r)
               if sum(sizes[i] for i in chosen) <= capacity)


def instance(seed: int):
    rng = random.Random(seed)
    n = rng.randint(0, 12)
    sizes = [rng.randint(1, 30) for _ in range(n)]
    values = [float(rng.randint(0, 100)) for _ in range(n)]
    return sizes, values, rng.randint(0, 100)


def check(sizes, values, capacity, chosen) -> float:
    """``chosen``'s total value, once it is checked to be distinct items that fit."""
    assert chosen == sorted(set(chosen)) and all(0 <= i < len(sizes) for i in chosen)
    assert sum(sizes[i] for i in chosen) <= capacity
    return sum(values[i] for i in chosen)


@pytest.mark.parametrize("seed", range(60))
def test_dp_knapsack_is_optimal(seed):
    sizes, values, capacity = instance(seed)
    chosen = solvers.dp_knapsack(sizes, values, capacity)
    assert check(sizes, values, capacity, chosen) == oracle(sizes, values, capacity)


@pytest.mark.parametrize("seed", range(60))
def test_greedy_knapsack_is_at_most_one_item_from_the_optimum(seed):
    sizes, values, capacity = instance(seed)
    chosen = solvers.greedy_knapsack(sizes, values, capacity)
    value = check(sizes, values, capacity, chosen)
    assert value >= oracle(sizes, values, capacity) - max(values, default=0.0)


@pytest.mark.parametrize("seed", range(20))
def test_knapsack_is_exact_within_max_cells_and_greedy_beyond(seed):
    sizes, values, capacity = instance(seed)
    assert solvers.knapsack(sizes, values, capacity) == solvers.dp_knapsack(
        sizes, values, capacity)
    greedy = solvers.greedy_knapsack(sizes, values, capacity)
    if sum(sizes) > capacity:
        cells = solvers.dp_cells(sizes, capacity)
        assert solvers.knapsack(sizes, values, capacity, max_cells=cells) == (
            solvers.dp_knapsack(sizes, values, capacity))
        assert solvers.knapsack(sizes, values, capacity, max_cells=cells - 1) == greedy
    else:  # everything fits: every solver takes everything
        assert solvers.knapsack(sizes, values, capacity, max_cells=0) == list(range(len(sizes)))
        assert greedy == list(range(len(sizes)))


def test_dp_cells_counts_the_capacity_in_units_of_the_sizes_gcd():
    assert solvers.dp_cells([4, 8, 12], 20) == 3 * (20 // 4 + 1)
    assert solvers.dp_cells([], 7) == 0


def test_greedy_spreads_equal_items_over_their_positions():
    """Of eight equal items, four chosen are every other one (not the first four)."""
    assert solvers.greedy_knapsack([1] * 8, [1.0] * 8, 4) == [0, 2, 4, 6]


@pytest.mark.parametrize("solver", [solvers.dp_knapsack, solvers.greedy_knapsack,
                                    solvers.knapsack])
def test_solvers_share_one_signature(solver):
    """Each is ``solver(sizes, values, capacity) -> sorted indices``: interchangeable."""
    assert solver([3, 4, 5], [4.0, 5.0, 6.0], 8) in ([0, 2], [0, 1])
    assert solver([3, 4, 5], [4.0, 5.0, 6.0], 2) == []
