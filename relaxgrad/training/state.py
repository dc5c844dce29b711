"""One file format for training state: checkpoints and exported training artifacts.

A state file is TVM's own parameter format (``tvm.runtime.save_param_dict``), which TVM's
runtime reads without relaxgrad (``tvm.runtime.load_param_dict`` in Python, ``LoadParams`` in
C++): named tensors, plus one ``uint8`` tensor under :data:`META_KEY` holding a JSON object
(step count, seed, names, shapes, optimizer, ...). Writes are atomic: the bytes go to a
temporary file in the same folder, which is fsynced and renamed over the destination, so a
process killed mid-write leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import numpy as np
import tvm

__all__ = ["META_KEY", "read_state", "write_state"]

META_KEY = "__relaxgrad_meta__"


def write_state(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
    """Write named arrays and a JSON-serializable ``meta`` to ``path``, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (replaced if it exists).
    arrays : Mapping[str, numpy.ndarray or tvm.runtime.Tensor]
        The tensors, by name (any name but :data:`META_KEY`).
    meta : Mapping
        Plain data (``json.dumps``-able).
    """
    if META_KEY in arrays:
        raise ValueError(f"write_state: {META_KEY!r} is reserved for the metadata")
    tensors = {name: _tensor(value) for name, value in arrays.items()}
    text = json.dumps(dict(meta), sort_keys=True).encode()
    tensors[META_KEY] = tvm.runtime.tensor(np.frombuffer(text, dtype="uint8").copy())
    data = bytes(tvm.runtime.save_param_dict(tensors))
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_state(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Read a file written by :func:`write_state`: ``(arrays, meta)``."""
    with open(path, "rb") as f:
        tensors = dict(tvm.runtime.load_param_dict(f.read()))
    if META_KEY not in tensors:
        raise ValueError(f"read_state: {os.fspath(path)!r} is not a relaxgrad state file "
                         f"(no {META_KEY!r} entry)")
    meta = json.loads(bytes(tensors.pop(META_KEY).numpy()).decode())
    return {name: t.numpy() for name, t in tensors.items()}, meta


def _tensor(value) -> tvm.runtime.Tensor:
    if isinstance(value, tvm.runtime.Tensor):
        return value
    return tvm.runtime.tensor(np.array(value, order="C"))  # ascontiguousarray makes 0-d 1-d
