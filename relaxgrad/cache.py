"""A cache of compiled executables on disk: the same module, compiled again for the same target
(in another process, or the next run of a script), is loaded instead of built.

:func:`relaxgrad.compile` uses it when called with ``cache=True`` (the Trainer and the CLI do).
A miss returns the library it stored, loaded, rather than the build (whose in-memory LLVM
module would stay alive with it; see :func:`reloaded`). An entry is the library that
``VMExecutable.export_library`` writes, keyed by

- the module's structural hash (``tvm_ffi.structural_hash``: names, types and constants alike),
- the target (its JSON form) and the ``PassContext``'s opt level and config,
- the versions of TVM and relaxgrad, and a digest of relaxgrad's own source files (so a changed
  rule or schedule never loads a library it did not build).

The folder is ``$RELAXGRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/relaxgrad``, else
``~/.cache/relaxgrad``; ``RELAXGRAD_CACHE=0`` turns the cache off everywhere. Entries are
written to a temporary file and renamed, so concurrent processes never load half a library.
Processes compiling the same module for the same target at once (the ranks of a data-parallel
run on one machine) build it once: the others wait for the entry and load it. A compile under
pass instruments (which expect the passes to run) is never cached. Delete the folder to empty
the cache (:func:`clear`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule
from tvm.target import Target

from ._version import __version__

__all__ = ["cache_dir", "cached", "clear", "enabled", "reloaded"]

_log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The cache folder (see the module docstring); not created until an entry is written."""
    explicit = os.environ.get("RELAXGRAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relaxgrad"


def enabled() -> bool:
    """False when ``RELAXGRAD_CACHE`` is ``0`` (or ``false``/``off``/``no``)."""
    return os.environ.get("RELAXGRAD_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def clear() -> None:
    """Delete every cached library."""
    shutil.rmtree(cache_dir(), ignore_errors=True)


def cached(mod: IRModule, target: Target, build: Callable[[], relax.VMExecutable],
           load: Callable[[str], relax.VMExecutable] | None = None):
    """The executable of ``mod`` for ``target`` from the cache, else ``build()``'s, stored.

    Parameters
    ----------
    mod : IRModule
        The module to compile.
    target : Target
        Its target.
    build : callable
        Compiles ``mod`` (called on a miss).
    load : callable, optional
        Makes the executable of a stored library's path (by default
        ``relax.VMExecutable(tvm.runtime.load_module(path))``).

    Returns
    -------
    relax.VMExecutable
        The loaded or built executable.
    """
    context = tvm.transform.PassContext.current()
    if not enabled() or len(context.instruments) > 0 or not _loadable(target):
        return build()
    path = cache_dir() / f"{_key(mod, target, context)}.so"
    load = load or (lambda file: relax.VMExecutable(tvm.runtime.load_module(file)))
    present = path.exists()
    if present and (loaded := _entry(path, load)) is not None:
        return loaded
    with _building(path):
        # built by another process (or thread) while this one waited (an entry found broken
        # above is built again)
        if not present and path.exists() and (loaded := _entry(path, load)) is not None:
            return loaded
        executable = build()
        _store(executable, path)
    if not path.exists():
        return executable
    # a private copy of the stored library, loaded, rather than the build (see reloaded())
    return reloaded(executable, load, lambda file: shutil.copyfile(path, file))


def reloaded(executable, load: Callable[[str], relax.VMExecutable],
             write: Callable[[str], None] | None = None):
    """``executable`` exported to a library in this process's temporary folder (or written
    there by ``write(path)``) and loaded from there (by ``load``), or ``executable`` itself
    when that fails.

    A CPU build keeps LLVM's in-memory module and JIT-compiled code alive as long as its
    executable (hundreds of MiB for a large model: 470 MiB of a ResNet-50's training step),
    where the loaded library maps only its machine code. The file is deleted when the process
    ends."""
    folder = _process_folder()
    fd, path = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        if write is not None:
            write(path)
        else:
            executable.export_library(path)
        return load(path)
    except Exception as err:  # noqa: BLE001 (the build serves as well)
        _log.warning("relaxgrad: cannot reload the executable from %s (%s)", path, err)
        return executable


def _entry(path: Path, load: Callable[[str], relax.VMExecutable]):
    """The executable of the entry ``path``, or None (with a warning) if it cannot be loaded."""
    try:
        return load(str(path))
    except Exception as err:  # noqa: BLE001 (a broken entry is built again)
        _log.warning("relaxgrad cache: cannot load %s (%s); building again", path, err)
        return None


@contextlib.contextmanager
def _building(path: Path):
    """Held while the entry ``path`` is built: a process (or thread) about to build the same
    module for the same target waits, then loads the entry instead of building it again, as
    the ranks of a data-parallel run on one machine would all at once. An advisory ``flock``
    on ``<entry>.lock`` (the kernel lets it go if the process dies); nothing is held where
    ``fcntl`` is missing (Windows) or the folder cannot be written."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # and with it the lock


@functools.cache
def _process_folder() -> str:
    folder = tempfile.mkdtemp(prefix="relaxgrad-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _loadable(target: Target) -> bool:
    """Whether this process can load a library built for ``target``: TVM's wheel loads a CUDA
    library's device code only where its CUDA runtime is (the loader
    ``ffi.Module.load_from_bytes.cuda``); elsewhere an entry could be stored but never read."""
    kind = target.kind.name
    return kind in ("llvm", "c") or tvm.get_global_func(
        f"ffi.Module.load_from_bytes.{kind}", allow_missing=True
    ) is not None


def _store(executable: relax.VMExecutable, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".so")
        os.close(fd)
        try:
            executable.export_library(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as err:  # noqa: BLE001 (no cache entry, the executable still works)
        _log.warning("relaxgrad cache: cannot store %s (%s)", path, err)


def _key(mod: IRModule, target: Target, context: tvm.transform.PassContext) -> str:
    parts = [
        f"{tvm_ffi.structural_hash(mod):x}",
        str(target.export()),
        str(context.opt_level),
        str(sorted((str(k), str(v)) for k, v in context.config.items())),
        tvm.__version__,
        _source_digest(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@functools.cache
def _source_digest() -> str:
    """relaxgrad's version and the contents of its Python files."""
    digest = hashlib.sha256(__version__.encode())
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
