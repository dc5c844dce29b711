"""Suite-wide settings: compiled modules are cached in a folder of this run only (the Trainer
caches by default; a user's cache folder is never read or written by the tests)."""

import atexit
import os
import shutil
import tempfile

_CACHE = tempfile.mkdtemp(prefix="relaxgrad-test-cache-")
os.environ["RELAXGRAD_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
