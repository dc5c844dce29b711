"""Data parallel training over ``torch.distributed``: one compiled step on every rank, gradients
averaged by an all-reduce before the optimizer step.

``Trainer(..., distributed=True)`` (or a process group, or a :class:`DataParallel`) attaches a
:class:`DataParallel` to the Trainer. At construction it checks that every rank built the same
Trainer (parameter names, shapes and dtypes, buffers, batch size, accumulation, loss and
optimizer) and broadcasts rank 0's parameters and buffers, as PyTorch's
``DistributedDataParallel`` does. Then, on each step:

- rank 0's buffers (BatchNorm's running statistics) are broadcast before the forward pass
  (DDP's ``broadcast_buffers=True`` rule), and each rank normalizes with its own shard's batch
  statistics;
- each rank computes the loss and gradients of its shard; gradients times the shard's rows, and
  the loss times the rows, go into one flat buffer per dtype (aligned segments, so TVM takes
  slices of the result back by DLPack without copies), are summed by ``all_reduce`` and divided
  by the total rows: the mean gradient of the whole batch, weighted by rows when shards differ;
- every rank runs the same optimizer step on the same gradient, so parameters stay identical.

The backend is gloo for a CPU Trainer and NCCL for a GPU one. A rank that dies, or a collective
that waits longer than ``timeout`` seconds, raises :class:`DistributedError` on the ranks that
wait (under ``torchrun``, the launcher then ends the others).
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable, Sequence

import numpy as np
import tvm

__all__ = ["DataParallel", "DistributedError", "data_parallel", "rank_device"]

_ALIGN = 64  # bytes: tvm.runtime.from_dlpack takes only data aligned to 64 bytes
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # set by torchrun


class DistributedError(RuntimeError):
    """A collective failed: a rank died, left, or did not answer within the timeout."""


class DataParallel:
    """How a :class:`~relaxgrad.training.Trainer` trains data parallel.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The ranks to train with. None: the default group, initialized here from ``torchrun``'s
        environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when none is.
    timeout : float
        Seconds a collective waits for the other ranks before it fails, for a group initialized
        here (a caller's group keeps its own timeout).
    backend : str, optional
        ``"gloo"`` or ``"nccl"`` for a group initialized here; by default gloo on CPU and NCCL
        on GPUs.
    """

    def __init__(self, group=None, timeout: float = 300.0, backend: str | None = None):
        self.group, self.timeout, self.backend = group, float(timeout), backend
        self.rank, self.world_size, self.device = 0, 1, "cpu"
        self._where = "Trainer"

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world_size={self.world_size})"

    def attach(self, trainer) -> DataParallel:
        """Join the group, check that all ranks built the same Trainer, and give every rank
        rank 0's parameters and buffers. Returns self."""
        dist = _dist()
        if self.group is None and not dist.is_initialized():
            missing = [name for name in _ENV if name not in os.environ]
            if missing:
                raise ValueError(
                    f"Trainer: distributed training needs a process group: run under torchrun, "
                    f"call torch.distributed.init_process_group first, or pass a group "
                    f"(the environment lacks {', '.join(missing)})")
            backend = self.backend or ("gloo" if trainer.device.dlpack_device_type() == 1
                                       else "nccl")
            if backend == "nccl":
                _torch().cuda.set_device(trainer.device.index)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout))
            atexit.register(_destroy_group)
        params = trainer._params
        self.device = _torch().from_dlpack(params[0]).device if params else "cpu"
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._where = f"Trainer (rank {self.rank} of {self.world_size})"
        self.check_same("the Trainer", fingerprint(trainer))
        trainer._params = self.broadcast(trainer._params)
        self.broadcast_buffers(trainer)
        return self

    def check_same(self, what: str, value: dict) -> None:
        """Raise ValueError on every rank unless all ranks pass an equal ``value`` (a dict)."""
        values = [None] * self.world_size
        self._collective("comparing ranks", _dist().all_gather_object, values, value,
                         group=self.group)
        differ = {key: {r: v.get(key) for r, v in enumerate(values)}
                  for key in value if any(v.get(key) != value[key] for v in values)}
        if differ:
            detail = "; ".join(f"{key}: " + ", ".join(f"rank {r} {v!r}" for r, v in by.items())
                               for key, by in differ.items())
            raise ValueError(f"{self._where}: the ranks differ in {what}: {detail}")

    def mean_gradients(
        self, loss: float, grads: Sequence | None, rows: int, like: Sequence
    ) -> tuple[float, list]:
        """The loss and gradients averaged over ranks, each rank weighted by its ``rows``.

        ``grads`` are this rank's gradient tensors (None when its shard is empty: zeros shaped
        as ``like``); the result's tensors share the reduced buffer's memory.
        """
        torch = _torch()
        if grads is None:
            grads = [torch.zeros_like(torch.from_dlpack(p)) for p in like]
        tensors = [torch.from_dlpack(g) for g in grads]
        # the loss and the rows ride at the end of the first bucket when it is float32 or
        # float64 (rows exact below 2**24), else in a float64 tensor of their own
        dtype = tensors[0].dtype if tensors[0].dtype in (torch.float32, torch.float64) \
            else torch.float64
        stats = torch.tensor([loss * rows, float(rows)], dtype=dtype, device=tensors[0].device)
        buckets = _buckets(tensors, scale=rows, extra=stats)
        first = buckets[0][0]
        if first.dtype == dtype:
            first[-2:] = stats
        else:
            buckets.append((stats, []))
        for flat, _ in buckets:
            self._collective("the all-reduce of gradients", _dist().all_reduce, flat,
                             group=self.group)
        sums = first[-2:] if first.dtype == dtype else stats
        total_loss, total_rows = sums.tolist()
        if total_rows == 0:
            raise ValueError(f"{self._where}: no rank has rows in this batch")
        for flat, _ in buckets:
            flat.div_(total_rows)
        return total_loss / total_rows, _unbucket(buckets, len(tensors))

    def broadcast(self, tensors: Sequence) -> list:
        """Rank 0's values of ``tensors`` (TVM tensors), on every rank."""
        if not tensors or self.world_size == 1:
            return list(tensors)
        torch = _torch()
        buckets = _buckets([torch.from_dlpack(t) for t in tensors])
        for flat, _ in buckets:
            self._collective("a broadcast from rank 0", _dist().broadcast, flat, 0,
                             group=self.group)
        return _unbucket(buckets, len(tensors))

    def broadcast_buffers(self, trainer) -> None:
        """Give every rank rank 0's buffers (DDP's rule, before each forward pass)."""
        names = list(trainer._buffers)
        values = self.broadcast([trainer._buffers[n] for n in names])
        trainer._buffers.update(zip(names, values))

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """The sums over ranks of a few numbers (in float64)."""
        torch = _torch()
        total = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._collective("an all-reduce", _dist().all_reduce, total, group=self.group)
        return total.tolist()

    def shard(self, n: int) -> np.ndarray:
        """This rank's rows of ``n``: every ``world_size``-th from ``rank``, as
        ``DistributedSampler`` takes them."""
        return np.arange(self.rank, n, self.world_size)

    def barrier(self) -> None:
        """Wait for every rank."""
        self._collective("a barrier", _dist().barrier, group=self.group)

    def _collective(self, what: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as err:  # torch's DistBackendError among them
            raise DistributedError(
                f"{self._where}: {what} failed: a rank died, left or did not answer in time "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from err


def data_parallel(distributed, trainer) -> DataParallel | None:
    """The Trainer's :class:`DataParallel` for its ``distributed`` argument (False or None: none;
    True: the default group; a process group; or a DataParallel), attached."""
    if distributed is None or distributed is False:
        return None
    if distributed is True:
        distributed = DataParallel()
    elif not isinstance(distributed, DataParallel):
        distributed = DataParallel(group=distributed)
    return distributed.attach(trainer)


def rank_device(device: tvm.runtime.Device, distributed) -> tvm.runtime.Device:
    """The device of this process: ``device``, but a GPU numbered by ``LOCAL_RANK`` (set by
    torchrun) when training data parallel, so each process of a machine has its own GPU."""
    if distributed is None or distributed is False or device.dlpack_device_type() == 1:
        return device
    return tvm.device(device.dlpack_device_type(), int(os.environ.get("LOCAL_RANK", "0")))


def fingerprint(trainer) -> dict:
    """What must be equal on every rank: names, shapes and dtypes of parameters and buffers, the
    batch size, accumulation, loss and optimizer."""

    def described(names, tensors):
        return [f"{n}:{t.dtype}{tuple(t.shape)}" for n, t in zip(names, tensors)]

    return {
        "function": trainer.func_name,
        "parameters": described(trainer.param_names, trainer._params),
        "buffers": described(trainer.buffer_names, [trainer._buffers[n] for n in
                                                    trainer.buffer_names]),
        "batch size": trainer.batch_size,
        "accumulate": trainer.accumulate,
        "loss": f"{type(trainer.loss).__name__}({getattr(trainer.loss, 'reduction', '')})",
        "optimizer": repr(trainer.optimizer),
    }


def _buckets(tensors: Sequence, scale: float = 1.0, extra=None) -> list:
    """``[(flat, [(index, offset, shape)])]``: ``tensors`` (torch) times ``scale``, copied into
    one flat tensor per dtype, each segment starting on a 64-byte boundary (the gaps zero); the
    first bucket gets ``len(extra)`` more elements at its end when ``extra`` has its dtype."""
    torch = _torch()
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    buckets = []
    for dtype, indices in by_dtype.items():
        step = max(1, _ALIGN // tensors[indices[0]].element_size())
        layout, size = [], 0
        for i in indices:
            layout.append((i, size, tuple(tensors[i].shape)))
            size += -(-tensors[i].numel() // step) * step
        tail = len(extra) if extra is not None and not buckets and extra.dtype == dtype else 0
        flat = torch.empty(size + tail, dtype=dtype, device=tensors[indices[0]].device)
        for (i, offset, _), end in zip(layout, [o for _, o, _ in layout[1:]] + [size + tail]):
            numel = tensors[i].numel()
            if scale == 1:
                flat[offset: offset + numel].copy_(tensors[i].reshape(-1))
            else:
                torch.mul(tensors[i].reshape(-1), scale, out=flat[offset: offset + numel])
            flat[offset + numel: end].zero_()
        buckets.append((flat, layout))
    return buckets


def _unbucket(buckets: list, count: int) -> list:
    """The TVM tensors of :func:`_buckets`' segments, views of the flat tensors (DLPack)."""
    out = [None] * count
    for flat, layout in buckets:
        for i, offset, shape in layout:
            numel = int(np.prod(shape, dtype=np.int64))
            out[i] = tvm.runtime.from_dlpack(flat[offset: offset + numel].view(shape))
    return out


def _destroy_group() -> None:
    """Destroy the default group made by :meth:`DataParallel.attach` while the interpreter is
    whole: a gloo group left to the interpreter's teardown can abort the process ("terminate
    called without an active exception") after a clean run or a failed collective."""
    dist = _dist()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; a peer may be gone
            pass


def _torch():
    try:
        import torch
    except ImportError as err:
        raise ValueError("Trainer: data parallel training needs PyTorch (torch.distributed): "
                         "pip install torch") from err
    return torch


def _dist():
    _torch()
    import torch.distributed as dist

    return dist
