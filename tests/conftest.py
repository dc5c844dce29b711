"""Suite-wide settings: compiled modules are cached in a folder of this run only, shared by its
workers (the Trainer caches by default; a user's cache folder is never read or written by the
tests); under pytest-xdist, each worker's thread pools take its share of the cores."""

import atexit
import os
import shutil
import tempfile

# Under pytest-xdist (``-n 2``) the workers share the cores: each one's TVM and PyTorch thread
# pools get its share, set before either library starts its pool (a thread pool waiting on a
# core another worker holds makes PyTorch's and TVM's steps many times slower).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_name, _SHARE)

# One cache folder for the whole run: made by the first process (pytest-xdist's controller, which
# loads this file before it starts its workers), inherited by the workers and the processes the
# tests start, and removed by the process that made it.
if "RELAXGRAD_TEST_CACHE" not in os.environ:
    os.environ["RELAXGRAD_TEST_CACHE"] = tempfile.mkdtemp(prefix="relaxgrad-test-cache-")
    atexit.register(shutil.rmtree, os.environ["RELAXGRAD_TEST_CACHE"], True)
os.environ["RELAXGRAD_CACHE_DIR"] = os.environ["RELAXGRAD_TEST_CACHE"]
