"""What a long run meets: non-finite values, preemption signals, and checkpoints kept in turns.

- :class:`NonFiniteError` is what :class:`~relaxgrad.training.Trainer` raises (with
  ``on_nonfinite="raise"``) when a step's loss or gradients' global norm is NaN or infinite,
  the step not applied; :func:`check_finite` names a non-finite input batch before any compute.
- :class:`Preemption` catches SIGTERM and SIGINT while :meth:`Trainer.fit` runs, so the step in
  flight finishes and a checkpoint is written; then the signal takes its original course.
- :func:`rotate` keeps the last ``keep`` checkpoints as ``path``, ``path.1``, ... (newest
  first); :func:`checkpoints` lists them, what ``Trainer.load(path, fallback=True)`` tries.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["NonFiniteError", "Preemption", "check_finite", "checkpoints", "rotate"]


class NonFiniteError(FloatingPointError):
    """A training step whose loss or gradients are NaN or infinite (the step is not applied)."""


def check_finite(arrays: Sequence[np.ndarray], names: Sequence[str], where: str) -> None:
    """Raise :class:`NonFiniteError` naming the first of ``arrays`` (floating point) that holds
    a NaN or an infinity, and how many."""
    for array, name in zip(arrays, names):
        array = np.asarray(array)
        if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
            continue
        bad = ~np.isfinite(array.astype("float32", copy=False))
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise NonFiniteError(f"{where}: {name} has {int(bad.sum())} non-finite values "
                                 f"(the first at {first}: {array[first]})")


class Preemption:
    """While active, SIGTERM and SIGINT only set :attr:`signal` (the first one received); on
    exit the previous handlers return and :meth:`deliver` gives the signal its original course.

    Only the main thread can install handlers; elsewhere this does nothing (signals then act
    as they would without it).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, active: bool = True):
        self.active = active and threading.current_thread() is threading.main_thread()
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if self.active:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _catch(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def deliver(self) -> None:
        """Act on the received signal as if it had not been caught (after ``__exit__``): raise
        ``KeyboardInterrupt`` for Python's SIGINT handler, call a Python handler, or send the
        signal again to this process for its default action (the exit status a kill by it
        gives)."""
        if self.signal is None:
            return
        handler = signal.getsignal(self.signal)
        if callable(handler):
            handler(self.signal, None)  # default_int_handler raises KeyboardInterrupt
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), self.signal)
        # SIG_IGN: the signal was to be ignored


def _numbered(path: str, k: int) -> str:
    return path if k == 0 else f"{path}.{k}"


def rotate(path: str, keep: int) -> None:
    """Shift ``path``, ``path.1``, ... to ``path.1``, ``path.2``, ... keeping ``keep - 1`` of
    them, so a new ``path`` can take the newest place (each rename atomic)."""
    for k in range(keep - 2, -1, -1):
        source = _numbered(path, k)
        if os.path.exists(source):
            os.replace(source, _numbered(path, k + 1))
    for stale in checkpoints(path)[max(keep, 1):]:  # from a run with a larger keep
        os.unlink(stale)


def checkpoints(path: str) -> list[str]:
    """``path`` and its numbered predecessors ``path.1``, ``path.2``, ... that exist, newest
    first; none where ``path``'s folder does not exist (a run's first start)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        return []
    pattern = re.compile(re.escape(name) + r"\.([1-9][0-9]*)")
    numbers = sorted(int(m.group(1)) for f in os.listdir(folder)
                     if (m := pattern.fullmatch(f)))  # fmt: skip
    found = [path] if os.path.exists(path) else []
    return found + [_numbered(path, k) for k in numbers]
