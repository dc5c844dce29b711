"""One file format for training state: checkpoints and exported training artifacts.

A state file is TVM's own parameter format (``tvm.runtime.save_param_dict``), which TVM's
runtime reads without relaxgrad (``tvm.runtime.load_param_dict`` in Python, ``LoadParams`` in
C++): named tensors, plus one ``uint8`` tensor under :data:`META_KEY` holding a JSON object
(step count, seed, names, shapes, optimizer, ...), and one under :data:`CHECK_KEY` holding the
byte count and SHA-256 of all the others (names, dtypes, shapes, bytes, the metadata's too).
:func:`read_state` walks the file's layout before TVM reads it (every length within the file,
the sizes consistent) and then checks the digest, so a file cut short, altered or not a state
file at all gets a :class:`StateFileError` naming the file and what is wrong, rather than
TVM's ``Invalid DLTensor file format`` (or an allocation of a corrupted size). A file written
by another program without :data:`CHECK_KEY` (e.g. ``examples/cpp_train``) gets the layout
check only.

Writes are atomic: the bytes go to a temporary file ``.tmp-<random><name>`` in the same
folder, which is fsynced and renamed over the destination, so a process killed mid-write
leaves the previous file intact; such leftovers of a killed write are removed by the next
write of the same file. A write that fails (a full disk) removes its temporary file and raises,
the previous file intact.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Mapping

import numpy as np
import tvm

__all__ = ["CHECK_KEY", "META_KEY", "StateFileError", "read_state", "write_state"]

META_KEY = "__relaxgrad_meta__"
CHECK_KEY = "__relaxgrad_check__"
_TMP_PREFIX = ".tmp-"


class StateFileError(ValueError):
    """A state file that cannot be read: cut short, altered, or not a relaxgrad state file."""


def write_state(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping,
                before_replace: Callable[[], None] | None = None) -> None:
    """Write named arrays, a JSON-serializable ``meta`` and their digest to ``path``,
    atomically.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (replaced if it exists).
    arrays : Mapping[str, numpy.ndarray or tvm.runtime.Tensor]
        The tensors, by name (any name but :data:`META_KEY`).
    meta : Mapping
        Plain data (``json.dumps``-able).
    before_replace : callable, optional
        Called once the new file is complete on disk, just before it takes ``path``'s place
        (e.g. to move the previous file aside, keeping it).
    """
    for reserved in (META_KEY, CHECK_KEY):
        if reserved in arrays:
            raise ValueError(f"write_state: {reserved!r} is reserved for the metadata")
    tensors = {name: _tensor(value) for name, value in arrays.items()}
    tensors[META_KEY] = _bytes(json.dumps(dict(meta), sort_keys=True).encode())
    tensors[CHECK_KEY] = _bytes(json.dumps(_digest(tensors)).encode())
    data = bytes(tvm.runtime.save_param_dict(tensors))
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _remove_leftovers(folder, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TMP_PREFIX, suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError):
            err.add_note(f"write_state: writing {path} failed; the previous file is intact")
        raise


def read_state(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Read a file written by :func:`write_state`: ``(arrays, meta)``.

    Raises
    ------
    StateFileError
        If the file is cut short, its tensors differ from the digest written with them, or it
        is not a relaxgrad state file (naming the file and the fault).
    FileNotFoundError
        If there is no such file.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    fault = _layout_fault(data)
    if fault is not None:
        raise StateFileError(f"read_state: {path!r} is cut short or is not a state file "
                             f"({len(data)} bytes: {fault})")
    try:
        tensors = dict(tvm.runtime.load_param_dict(data))
    except Exception as err:  # noqa: BLE001 - TVM raises InternalError for any malformed file
        raise StateFileError(f"read_state: {path!r} is not a state file (TVM's parameter "
                             f"format cannot read it: {str(err).splitlines()[-1]})") from None
    if META_KEY not in tensors:
        raise StateFileError(f"read_state: {path!r} is not a relaxgrad state file "
                             f"(no {META_KEY!r} entry)")
    corrupt = StateFileError(f"read_state: {path!r} is corrupt: its contents do not match "
                             f"the digest written with them")
    if CHECK_KEY in tensors:
        check = bytes(tensors.pop(CHECK_KEY).numpy())
        try:
            digest = json.dumps(_digest(tensors)).encode()
        except Exception:  # noqa: BLE001 - a damaged dtype that numpy cannot take
            raise corrupt from None
        if check != digest:
            raise corrupt
    if any(name.startswith("__relaxgrad") and name != META_KEY for name in tensors):
        raise corrupt  # a damaged reserved name
    try:
        meta = json.loads(bytes(tensors.pop(META_KEY).numpy()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StateFileError(f"read_state: {path!r} has unreadable metadata ({err})") from None
    return {name: t.numpy() for name, t in tensors.items()}, meta


_LIST_MAGIC, _TENSOR_MAGIC = 0xF7E58D4F05049CB7, 0xDD5E40F096B4A13F


def _layout_fault(data: bytes) -> str | None:
    """What is wrong with the layout of TVM's parameter format in ``data`` (None if nothing):
    a list header, names, then tensors (magic, device, ndim, dtype, shape, byte count, bytes),
    every length within the data and consistent with the shape, nothing after the last."""
    at = 0

    def take(fmt: str) -> tuple:
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise _Short(f"it ends inside a header at byte {at}")
        values = struct.unpack_from(fmt, data, at)
        at += size
        return values

    def skip(size: int, what: str) -> None:
        nonlocal at
        if size < 0 or at + size > len(data):
            raise _Short(f"{what} of {size} bytes at byte {at} runs past its end")
        at += size

    try:
        magic, _ = take("<QQ")
        if magic != _LIST_MAGIC:
            return "it does not start as TVM's parameter format"
        (count,) = take("<Q")
        for _ in range(count):
            skip(take("<Q")[0], "a name")
        (tensors,) = take("<Q")
        if tensors != count:
            return f"{count} names but {tensors} tensors"
        for _ in range(tensors):
            magic, _, _, _, ndim = take("<QQiii")
            if magic != _TENSOR_MAGIC or not 0 <= ndim <= 32:
                return f"a tensor header at byte {at - 28} is damaged"
            _, bits, lanes = take("<BBH")
            shape = take(f"<{ndim}q")
            (size,) = take("<q")
            if min(shape, default=0) < 0 or size != int(np.prod(shape)) * bits * lanes // 8:
                return f"a tensor of shape {shape} claims {size} bytes"
            skip(size, "a tensor")
    except _Short as short:
        return str(short)
    if at != len(data):
        return f"{len(data) - at} bytes follow the last tensor"
    return None


class _Short(Exception):
    pass


def _digest(tensors: Mapping[str, tvm.runtime.Tensor]) -> dict:
    """``{"bytes": n, "sha256": hex}`` of the tensors' names, dtypes, shapes and bytes (by
    name: the order of a dict does not matter)."""
    sha, total = hashlib.sha256(), 0
    for name in sorted(tensors):
        array = tensors[name].numpy()
        sha.update(f"{name}:{array.dtype}:{array.shape};".encode())
        raw = np.ascontiguousarray(array).tobytes()
        sha.update(raw)
        total += len(raw)
    return {"bytes": total, "sha256": sha.hexdigest()}


def _remove_leftovers(folder: str, name: str) -> None:
    """Remove the temporary files that killed writes of ``folder/name`` left."""
    # (mkstemp's random part is 8 characters: another file's leftovers do not match)
    pattern = os.path.join(glob.escape(folder), f"{_TMP_PREFIX}{'?' * 8}{glob.escape(name)}")
    for leftover in glob.glob(pattern):
        try:
            os.unlink(leftover)
        except FileNotFoundError:
            pass


def _bytes(text: bytes) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.frombuffer(text, dtype="uint8").copy())


def _tensor(value) -> tvm.runtime.Tensor:
    if isinstance(value, tvm.runtime.Tensor):
        return value
    return tvm.runtime.tensor(np.array(value, order="C"))  # ascontiguousarray makes 0-d 1-d
