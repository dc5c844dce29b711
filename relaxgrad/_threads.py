"""The number of threads TVM's runtime uses, set once when relaxgrad is imported.

TVM 0.27 starts, unless ``TVM_NUM_THREADS`` says otherwise, half as many threads as the machine
has logical CPUs, assuming two hyper-threads per core. On a machine without hyper-threading
(most cloud VMs of a few cores) that leaves half the cores idle: a 2-core VM ran every kernel,
and the BLAS calls, on one thread while PyTorch used two. relaxgrad sets ``TVM_NUM_THREADS`` to
the number of physical cores this process may run on, before TVM's thread pool starts, unless
the user has set it.
"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Cores this process may run on, counting the hyper-threads of one core once (from
    ``/sys``; the logical CPUs where that is not readable)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return os.cpu_count() or 1
    siblings = set()
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                siblings.add(f.read().strip())
        except OSError:
            return len(cpus)
    return len(siblings)


def configure() -> None:
    """Set ``TVM_NUM_THREADS`` to :func:`physical_cores` unless it is set."""
    if not os.environ.get("TVM_NUM_THREADS"):
        os.environ["TVM_NUM_THREADS"] = str(physical_cores())


configure()
