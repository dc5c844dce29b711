"""Learning-rate schedules: the factor the optimizer's learning rate is multiplied by at each step.

A schedule is a function of the optimizer step ``t`` (0 for the first update) returning a
factor; the :class:`~relaxgrad.training.Trainer` passes ``optimizer.lr * schedule(t)`` to the
compiled step as a run-time input, so a schedule never recompiles anything. The shapes are
Hugging Face's (``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup``, the same factors at the same steps): during ``warmup``
steps the factor rises linearly from 0 (the first update's is 0), then stays at 1, decays
linearly to 0 at ``total`` steps, or follows a half cosine to ``min_ratio`` (and stays there
after ``total``, where Hugging Face's cosine would rise again). Any function of one
int returning a float is a schedule too (``lambda t: 0.9 ** t``). The Trainer saves its step
count in checkpoints, so a resumed run goes on where its schedule was; the three named schedules
travel in exported artifacts too (:func:`spec`), where the runner computes them (this file is
copied beside it and needs only the standard library)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Schedule", "constant", "cosine", "from_spec", "linear", "spec"]

Schedule = Callable[[int], float]


def spec(schedule: Schedule | None) -> dict | None:
    """Plain data naming ``schedule`` (``{"name": "cosine", "warmup": ..., ...}``), or None
    for no schedule and for a function of the user's (which cannot be written down)."""
    if isinstance(schedule, constant | linear | cosine):
        return {"name": type(schedule).__name__, **vars(schedule)}
    return None


def from_spec(data: dict | None) -> Schedule:
    """The schedule :func:`spec` wrote (``constant()`` for None)."""
    if data is None:
        return constant()
    kinds = {"constant": constant, "linear": linear, "cosine": cosine}
    fields = {key: value for key, value in data.items() if key != "name"}
    return kinds[data["name"]](**fields)


def _check(warmup: int, total: int | None = None) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"schedule: warmup must be an int >= 0, not {warmup!r}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                              or total <= warmup):  # fmt: skip
        raise ValueError(f"schedule: total must be an int > warmup ({warmup}), not {total!r}")


def _warmup(step: int, warmup: int) -> float | None:
    """The warmup's factor at ``step``, None after it."""
    return step / warmup if step < warmup else None


@dataclass(frozen=True)
class constant:  # noqa: N801 (a schedule reads as a function)
    """1 after ``warmup`` steps of linear increase from 0.

    Parameters
    ----------
    warmup : int
        Steps of the linear warmup.
    """

    warmup: int = 0

    def __post_init__(self):
        _check(self.warmup)

    def __call__(self, step: int) -> float:
        ramp = _warmup(step, self.warmup)
        return 1.0 if ramp is None else ramp


@dataclass(frozen=True)
class linear:  # noqa: N801
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total`` steps.

    Parameters
    ----------
    warmup : int
        Steps of the linear warmup.
    total : int
        The step at which the factor reaches 0 (and stays).
    """

    warmup: int
    total: int

    def __post_init__(self):
        _check(self.warmup, self.total)

    def __call__(self, step: int) -> float:
        ramp = _warmup(step, self.warmup)
        if ramp is not None:
            return ramp
        return max(0.0, (self.total - step) / (self.total - self.warmup))


@dataclass(frozen=True)
class cosine:  # noqa: N801
    """Linear warmup over ``warmup`` steps, then a half cosine from 1 to ``min_ratio`` at
    ``total`` steps (``min_ratio`` after).

    Parameters
    ----------
    warmup : int
        Steps of the linear warmup.
    total : int
        The step at which the cosine reaches ``min_ratio``.
    min_ratio : float
        The final factor.
    """

    warmup: int
    total: int
    min_ratio: float = 0.0

    def __post_init__(self):
        _check(self.warmup, self.total)
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"cosine: min_ratio must be in [0, 1], not {self.min_ratio!r}")

    def __call__(self, step: int) -> float:
        ramp = _warmup(step, self.warmup)
        if ramp is not None:
            return ramp
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
