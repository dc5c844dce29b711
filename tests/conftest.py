"""Suite-wide settings: compiled modules are cached in a folder of this run only (the Trainer
caches by default; a user's cache folder is never read or written by the tests); under
pytest-xdist, each worker's thread pools take its share of the cores."""

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

_CACHE = tempfile.mkdtemp(prefix="relaxgrad-test-cache-")
os.environ["RELAXGRAD_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
