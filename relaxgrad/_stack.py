"""Run work that recurses as deep as its input on a thread with a stack to match.

Both relaxgrad's own walkers (over nested tuple types, say) and TVM's C++ visitors recurse once
per level of a nested expression or type. On the main thread's default stack (8 MiB, and
Python's recursion limit of 1,000) a deep enough input ends in a ``RecursionError`` or, inside
TVM's C++, in a segfault that kills the process with no error. :func:`with_deep_stack` runs a
call on one long-lived thread whose stack is :data:`STACK_BYTES` (virtual memory: only the pages
touched are used) with Python's recursion limit raised to :data:`RECURSION_LIMIT`, and hands back
its result or exception; calls from several threads take turns. The caller's
``tvm.transform.PassContext`` is entered again on that thread (TVM keeps it per thread).
"""

from __future__ import annotations

import queue
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
_queue: queue.SimpleQueue | None = None


def with_deep_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the deep-stack thread (directly when already on it)."""
    if getattr(_local, "deep", False):
        return fn(*args, **kwargs)
    context = tvm.transform.PassContext.current()
    done, outcome = threading.Event(), {}

    def run():
        try:
            with context:
                outcome["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err
        finally:
            done.set()

    _raise_limit()
    try:
        _worker().put(run)
        done.wait()
    finally:
        _restore_limit()
    if "error" in outcome:
        raise outcome["error"].with_traceback(outcome["error"].__traceback__)
    return outcome["value"]


def _worker() -> queue.SimpleQueue:
    """The queue of the one deep-stack thread, started on first use. It lives as long as the
    process (a daemon): TVM keeps per-thread state (its thread pool, workspaces) that a thread
    ending after each call would tear down under code still using it at exit."""
    global _queue
    with _lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            previous = threading.stack_size(STACK_BYTES)
            try:
                threading.Thread(target=_serve, args=(_queue,), name="relaxgrad-deep-stack",
                                 daemon=True).start()
            finally:
                threading.stack_size(previous)
        return _queue


def _serve(jobs: queue.SimpleQueue) -> None:
    _local.deep = True
    while True:
        jobs.get()()


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
