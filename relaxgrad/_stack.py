"""Run work that recurses as deep as its input on a thread with a stack to match.

Both relaxgrad's own walkers (over nested tuple types, say) and TVM's C++ visitors recurse once
per level of a nested expression or type. On the main thread's default stack (8 MiB, and
Python's recursion limit of 1,000) a deep enough input ends in a ``RecursionError`` or, inside
TVM's C++, in a segfault that kills the process with no error. :func:`with_deep_stack` runs a
call on a thread whose stack is :data:`STACK_BYTES` (virtual memory: only the pages touched are
used) with Python's recursion limit raised to :data:`RECURSION_LIMIT`, and hands back its result
or exception. The caller's ``tvm.transform.PassContext`` is entered again on that thread (TVM
keeps it per thread).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import tvm

__all__ = ["RECURSION_LIMIT", "STACK_BYTES", "with_deep_stack"]

STACK_BYTES = 1 << 30
"""The worker thread's stack size (1 GiB of address space)."""

RECURSION_LIMIT = 200_000
"""Python's recursion limit while a worker runs (about 5 KiB of C stack per Python frame)."""

T = TypeVar("T")

_lock = threading.Lock()
_active = 0
_saved_limit = 0
_local = threading.local()


def with_deep_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a thread with a deep stack (directly when already on one)."""
    if getattr(_local, "deep", False):
        return fn(*args, **kwargs)
    context = tvm.transform.PassContext.current()
    outcome: dict = {}

    def run():
        _local.deep = True
        try:
            with context:
                outcome["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    _raise_limit()
    try:
        previous = threading.stack_size(STACK_BYTES)
        try:
            worker = threading.Thread(target=run, name="relaxgrad-deep-stack")
            worker.start()
        finally:
            threading.stack_size(previous)
        worker.join()
    finally:
        _restore_limit()
    if "error" in outcome:
        raise outcome["error"].with_traceback(outcome["error"].__traceback__)
    return outcome["value"]


def _raise_limit() -> None:
    global _active, _saved_limit
    with _lock:
        if _active == 0:
            _saved_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_saved_limit, RECURSION_LIMIT))
        _active += 1


def _restore_limit() -> None:
    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            sys.setrecursionlimit(_saved_limit)
