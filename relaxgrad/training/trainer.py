"""``Trainer``: compile a model's loss adjoint and optimizer step once, then run minibatches."""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule

from .. import _ty, pipeline
from .._module import reachable, with_function
from ..cache import reloaded
from ..errors import GradientError
from ..ops import random
from ..schedules import onednn
from ..schedules.blas import native_arch
from ..transforms import FoldRepeatedHeads, Gradient, policies
from ..transforms.mixed_precision import MixedPrecision, low_precision_params, read_held_values
from ..transforms.plan_memory import RESULTS_IN_WORKSPACE
from .accumulate import accumulate_gradients, check_accumulate
from .datasets import minibatches
from .distributed import data_parallel, rank_device
from .export import export_trainer
from .losses import Loss, append_loss, prediction_type
from .models import Model
from .optimizers import Optimizer
from .resilience import NonFiniteError, Preemption, check_finite, checkpoints, rotate
from .state import StateFileError, read_state, write_state

__all__ = ["Trainer", "training_module"]

PROGRESS_DELAY = 3.0
"""Seconds a compile runs before the Trainer shows its progress line."""
INITIAL_LOSS_SCALE, GROWTH_INTERVAL = 2.0**16, 2000
"""``precision="fp16"``'s dynamic loss scale: its start, and the finite steps after which it
doubles (``torch.amp.GradScaler``'s defaults)."""

Inputs = np.ndarray | Sequence[np.ndarray]
_log = logging.getLogger(__name__)


class Trainer:
    """Train the parameters of a Relax model function with relaxgrad's gradients.

    At construction :func:`training_module` adds the loss, its adjoint, the optimizer step and
    per-sample losses to the model's module (``self.mod``); the functions a step, a
    prediction and an evaluation call are compiled once (``self.vm``).
    Parameters and optimizer state then live on the device as tensors; a step is two calls of
    compiled code: the adjoint, then the optimizer, which also takes the step's learning rate
    and clipping norm (run-time inputs: a schedule recompiles nothing) and reports the
    gradients' global norm, from which the Trainer learns whether the step was finite.

    Parameters
    ----------
    model : IRModule
        Module with the model function: one dataflow block returning one tensor, or a tuple
        ``(prediction, *new buffer values)`` (see ``updates``).
    params : Mapping[str, np.ndarray]
        Initial values of the trainable parameters, by parameter name. The function's
        parameters that are neither trainable nor ``buffers`` are the inputs, in their order.
    loss : Loss
        The loss of the model's result against a target.
    optimizer : Optimizer
        The optimizer; ``init`` is called on the loss function's parameter vars, and the
        Trainer takes its initial ``state`` over (``optimizer.state`` is None afterwards, so
        that no second copy of it stays alive).
    func_name : str
        Name of the model function.
    target : str, dict or tvm.target.Target, optional
        Compilation target (see :func:`relaxgrad.compile`); this machine's CPU
        (``relaxgrad.pipeline.host_target()``) when None, ``"llvm"`` for a portable build.
    target_type : relax.Type, optional
        Type of the loss target; by default derived from the result by ``loss.target_type``.
    buffers : Mapping[str, np.ndarray], optional
        Initial values of non-trainable parameters the Trainer feeds (e.g. BatchNorm's
        running statistics), by parameter name; copied (see ``share_frozen``).
    updates : sequence of str
        Buffers replaced after each step by fields ``1, 2, ...`` of the model's tuple result
        (as PyTorch updates BatchNorm's running statistics in train mode).
    eval_func : str, optional
        Function with the same parameters that :meth:`predict` and :meth:`evaluate` run (e.g.
        the eval-mode twin of a train-mode function); ``func_name`` by default.
    accumulate : int
        Micro-batches per optimizer step (:mod:`relaxgrad.training.accumulate`): :meth:`step`
        cuts its batch into ``accumulate`` equal parts of the compiled batch size and steps with
        their mean gradient; :meth:`fit` then takes batches of ``accumulate`` times that size.
        With a symbolic batch size, the parts are as equal as can be, weighted by their rows.
    cache : bool
        Load the compiled module from :mod:`relaxgrad.cache` when the same module was compiled
        for the same target before (any process), and store it there otherwise.
    progress : bool
        Show a progress line (tqdm) while a compile takes more than a few seconds.
    distributed : bool, process group or DataParallel
        Train data parallel over ``torch.distributed``
        (:mod:`relaxgrad.training.distributed`): True for the default group (initialized from
        ``torchrun``'s environment when it is not), or a process group, or a
        :class:`~relaxgrad.training.distributed.DataParallel`. Each rank's batch is its shard;
        :meth:`fit` shards the data by rank, and gradients, losses and :meth:`evaluate` are
        averaged over the ranks.
    key : str, optional
        The parameter of the model function that takes a random key (a ``(2,)`` uint32
        tensor, e.g. ``dropout_key`` of :func:`from_torch`): every call of the train-mode
        function (each step, each micro-batch) gets a new one, ``(seed, counter)`` with the
        counter counting up from 0, so runs from the same seed draw the same masks. The
        evaluation function must not take it (:meth:`predict` runs without dropout).
    seed : int
        The seed of the keys, in ``[0, 2**32)``.
    schedule : callable, optional
        The learning rate of step ``t`` (0 at the first update) is ``optimizer.lr *
        schedule(t)``: :mod:`relaxgrad.training.schedules` (``constant``, ``linear``,
        ``cosine``, with warmup) or any function of the step. The step count is saved in
        checkpoints, so a resumed run goes on with its schedule.
    max_grad_norm : float, optional
        Clip the gradients to this global L2 norm before the update, as
        ``torch.nn.utils.clip_grad_norm_`` (Hugging Face's Trainer uses 1.0); the norm before
        clipping is ``grad_norm`` after each step. None: no clipping.
    on_nonfinite : {"raise", "skip"}
        A step whose loss or gradients' global norm is NaN or infinite is not applied
        (parameters, optimizer state and buffers stay as before it); ``"raise"`` raises
        :class:`~relaxgrad.training.NonFiniteError` naming the step, the batch of :meth:`fit`
        and the parameters whose gradients are not finite, ``"skip"`` logs that and counts it
        in ``skipped_steps`` (as ``torch.amp.GradScaler`` skips).
    check_inputs : bool
        Check every batch for NaN and infinity before any compute, naming the input that
        holds one (a debug option: a pass over the batch on the host).
    share_frozen : bool
        On the CPU, read each buffer that no step replaces (a frozen weight: a LoRA base's,
        any ``requires_grad=False`` weight of ``from_torch``) in the array given, zero-copy,
        when it is C-contiguous and 64-byte aligned (PyTorch's tensors are), instead of a copy:
        the weights are then held once while the PyTorch module is kept. The Trainer never
        writes them; the caller must not either while the Trainer is used (merging adapters
        into the module, ``load_state_dict``), or the Trainer reads the new values.
    precision : {"fp32", "bf16", "fp16"}
        ``"bf16"`` and ``"fp16"`` run the model's matrix products and convolutions, forward and
        backward, in bfloat16 or float16 with float32 accumulation
        (:class:`~relaxgrad.transforms.MixedPrecision`, as ``torch.autocast``); parameters,
        gradients and optimizer state stay float32. ``"fp16"`` scales the loss dynamically as
        ``torch.amp.GradScaler``: the backward pass is seeded with ``loss_scale`` (from
        2^16), the compiled optimizer step unscales the gradients, a step whose gradients
        overflow is skipped (counted in ``skipped_steps``) and halves the scale, and 2,000
        finite steps in a row double it; the scale is saved in checkpoints. (A non-finite
        loss is not an overflow of the scale: ``on_nonfinite`` decides.)
    frozen_dtype : {None, "bf16", "fp16"}
        With ``precision`` of the same dtype: hold each frozen weight (a buffer no step
        replaces, as a LoRA base's projections) that the model reads only through its
        low-precision products and lookups in that dtype, cast once here rather than every
        step (:func:`~relaxgrad.transforms.mixed_precision.low_precision_params`): half its
        memory, the same products; an embedding table (also one tied to the output
        projection) is then looked up in its rounded rows, as in a model loaded in that dtype.
        Such weights are kept rounded, and :meth:`state_dict` and :meth:`buffers` return them
        so (as float32 in ``state_dict``); ``frozen_low`` names them. None (default): every
        weight as given.
    gradient_checkpointing : bool or checkpoint policy
        Keep fewer activations from the forward pass and recompute the others in the backward
        pass, as Hugging Face's ``gradient_checkpointing_enable()``: True is ``"sqrt"``
        (activations kept about every sqrt(n) bindings, one more forward pass of compute), or
        any ``checkpoint=`` policy of :func:`relaxgrad.Gradient` (``"save_dots"``, a byte
        budget, ...; see :mod:`relaxgrad.transforms.policies`). False (default): every
        activation the backward pass reads is kept (but for the model's own
        ``R.grad.start_checkpoint`` markers). The steps compute the same values.

    Examples
    --------
    From PyTorch (see :func:`relaxgrad.training.from_torch`)::

        model = from_torch(net, (torch.randn(32, 64),))
        trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3))
        trainer.fit(x, y, epochs=5)
        net.load_state_dict(trainer.state_dict())
    """

    def __init__(
        self,
        model: IRModule,
        params: Mapping[str, np.ndarray],
        loss: Loss,
        optimizer: Optimizer,
        *,
        func_name: str = "main",
        target=None,
        target_type: relax.Type | None = None,
        buffers: Mapping[str, np.ndarray] | None = None,
        updates: Sequence[str] = (),
        eval_func: str | None = None,
        accumulate: int = 1,
        cache: bool = True,
        progress: bool = True,
        distributed=False,
        key: str | None = None,
        seed: int = 0,
        schedule: Callable[[int], float] | None = None,
        max_grad_norm: float | None = None,
        on_nonfinite: str = "raise",
        check_inputs: bool = False,
        precision: str = "fp32",
        share_frozen: bool = False,
        gradient_checkpointing=False,
        frozen_dtype: str | None = None,
    ):
        buffers = dict(buffers or {})
        funcs = {func_name, eval_func or func_name}
        model = FoldRepeatedHeads(funcs)(model)
        model = _with_precision(model, precision, funcs)
        model, self.frozen_low = _frozen_low(model, precision, frozen_dtype, funcs,
                                             [n for n in buffers if n not in updates])
        self.precision = precision
        self.loss_scale = INITIAL_LOSS_SCALE if precision == "fp16" else None
        self._finite_steps = 0  # steps since the loss scale last changed
        _check_controls(schedule, max_grad_norm, on_nonfinite)
        self.schedule, self.max_grad_norm = schedule, max_grad_norm
        self.on_nonfinite, self.check_inputs = on_nonfinite, bool(check_inputs)
        self.skipped_steps = 0  # steps not applied for a non-finite loss or gradient
        self.grad_norm: float | None = None  # the last step's global gradient norm
        self._controls_cache: tuple = ((), [])
        self._position: tuple[int, int] | None = None  # fit's (epoch, batch) while it steps
        _check_key(model, func_name, eval_func or func_name, key, seed)
        _check_updates(model, func_name, buffers, updates)
        self.mod = training_module(model, list(params), loss, optimizer, func_name, target_type,
                                   seed="param" if precision == "fp16" else "ones",
                                   checkpoint=_checkpoint_policy(gradient_checkpointing))
        self.func_name, self.loss, self.optimizer = func_name, loss, optimizer
        self.eval_func = eval_func or func_name
        self.updates = tuple(updates)
        if target is None:
            target = pipeline.host_target()
        self.device = rank_device(pipeline.target_device(target), distributed)
        self.target = target
        _warn_without_units(precision, target)
        self.executable = _compile(self._served(), target, cache, progress)
        self.vm = relax.VirtualMachine(self.executable, self.device)

        names = [p.name for p in model[func_name].params]
        loss_func = self.mod[f"{func_name}_loss"]
        self._param_pos = [i for i, name in enumerate(names) if name in params]
        self._buffer_pos = [i for i, name in enumerate(names) if name in buffers]
        self._key_pos = names.index(key) if key is not None else None
        self._input_pos = [
            i for i, name in enumerate(names)
            if name not in params and name not in buffers and name != key
        ]
        self.seed, self.key_counter = seed, 0  # the next key is (seed, key_counter)
        self._inputs = [loss_func.params[i] for i in self._input_pos]
        self._target = loss_func.params[-1]
        self.param_names = [names[i] for i in self._param_pos]
        self.buffer_names = [names[i] for i in self._buffer_pos]
        self._params = [
            self._to_device(params[name], loss_func.params[i], "parameter")
            for i, name in zip(self._param_pos, self.param_names)
        ]
        self._buffers = {
            name: self._to_device(buffers[name], loss_func.params[i], "buffer",
                                  share=share_frozen and name not in self.updates
                                  and name not in self.frozen_low)
            for i, name in zip(self._buffer_pos, self.buffer_names)
        }
        self.state_keys: tuple[str, ...] | None = None
        self.torch_state = False
        self.aliases: dict[str, str] = {}  # state key -> the parameter or buffer it names
        self.lora = None  # the LoraSpec of a model from relaxgrad.training.lora
        # the Trainer owns the optimizer's initial state (a second copy would stay alive)
        self._optim_state = [_on(s, self.device) for s in optimizer.state]
        optimizer.state = None
        first = _ty.shape_values(self._inputs[0])[0] if self._inputs else None
        self.batch_size: int | None = int(first) if isinstance(first, tvm.tirx.IntImm) else None
        self.history: list[float] = []
        self.steps = 0  # optimizer steps taken (restored by load)
        self.accumulate = check_accumulate(accumulate)
        self._fit_state: dict | None = None  # where fit is (saved), and where to resume (loaded)
        self._resume: dict | None = None
        self.dp = data_parallel(distributed, self)

    @classmethod
    def for_model(cls, model: Model, loss: Loss, optimizer: Optimizer, **kwargs) -> Trainer:
        """A Trainer of ``model``, with its parameters, buffers, updates and evaluation function.

        Parameters
        ----------
        model : Model
            E.g. from :func:`mlp`, :func:`from_torch` or :func:`from_nn_module`.
        loss : Loss
            The loss of the model's prediction against a target.
        optimizer : Optimizer
            The optimizer.
        **kwargs
            Other constructor arguments (``target``, ``target_type``).

        Returns
        -------
        Trainer
            Its :meth:`state_dict` has ``model.state_keys`` (torch tensors when
            ``model.torch_state``).
        """
        kwargs.setdefault("precision", model.precision or "fp32")
        trainer = cls(model.mod, model.params, loss, optimizer, func_name=model.func_name,
                      buffers=model.buffers, updates=model.updates, eval_func=model.eval_func,
                      key=model.key, **kwargs)
        trainer.state_keys, trainer.torch_state = model.state_keys, model.torch_state
        trainer.aliases = dict(model.aliases)
        trainer.lora = model.lora
        return trainer

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The current parameter values, by name."""
        return {name: p.numpy() for name, p in zip(self.param_names, self._params)}

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """The current buffer values, by name."""
        return {name: b.numpy() for name, b in self._buffers.items()}

    def state_dict(self) -> dict:
        """Parameters and buffers by name, as ``torch.nn.Module.state_dict`` has them.

        Returns
        -------
        dict
            For a model from :func:`from_torch`, the module's ``state_dict`` keys in its order
            and ``torch.Tensor`` values, so ``module.load_state_dict(trainer.state_dict())``
            loads the trained weights (a tied parameter under each of its names); otherwise
            numpy arrays, parameters first.
        """
        buffers = {n: v.astype("float32") if n in self.frozen_low else v  # held rounded
                   for n, v in self.buffers.items()}
        values = {**self.params, **buffers}
        values.update({key: values[name] for key, name in self.aliases.items()})
        keys = self.state_keys or tuple(values)
        if not self.torch_state:
            return {key: values[key] for key in keys}
        import torch

        return {key: torch.from_numpy(np.array(values[key])) for key in keys}

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """The training state as named arrays and plain metadata (what :meth:`save` writes).

        Arrays: ``param:<name>``, ``buffer:<name>``, ``optim:step`` and
        ``optim:<slot>:<param name>`` (the optimizer's state tuple, in order); metadata:
        ``format``, ``steps`` (optimizer steps taken, which the schedule follows),
        ``skipped_steps`` (not applied: non-finite), ``params``, ``buffers``, ``optim``
        (the array names of the optimizer state, in order), ``optimizer`` (its repr), ``seed``
        and ``key_counter`` (the next random key is ``(seed, key_counter)``) and, once
        :meth:`fit` has stepped, ``fit``: where it is (``epoch`` and ``batch``, the next batch
        to run; ``rng``, the shuffling generator's state at the start of that epoch; ``seed``,
        ``shuffle``, ``samples``, ``batch_size``, ``world_size``), from which a :meth:`fit`
        after :meth:`load` resumes. Readers ignore keys they do not know.
        """
        arrays = {f"param:{n}": v for n, v in self.params.items()}
        arrays.update({f"buffer:{n}": v for n, v in self.buffers.items()})
        optim_names = self._optim_names()
        arrays.update({n: s.numpy() for n, s in zip(optim_names, self._optim_state)})
        meta = {"format": 1, "steps": self.steps, "params": self.param_names,
                "buffers": self.buffer_names, "optim": optim_names,
                "optimizer": repr(self.optimizer), "seed": self.seed,
                "key_counter": self.key_counter, "skipped_steps": self.skipped_steps}
        if self.loss_scale is not None:
            meta["loss_scale"] = {"scale": self.loss_scale, "finite_steps": self._finite_steps}
        if self._fit_state is not None:
            meta["fit"] = self._fit_state
        return arrays, meta

    def save(self, path, keep: int = 1) -> None:
        """Write parameters, buffers, optimizer state and the position of :meth:`fit` to
        ``path`` atomically, in :mod:`relaxgrad.training.state`'s format (TVM's parameter
        file). With ``keep > 1`` the previous files move to ``path.1``, ``path.2``, ... (newest
        first, ``keep - 1`` of them) once the new one is complete on disk. Data parallel,
        every rank calls it: rank 0 writes, then all wait for it."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Trainer.save: keep must be an int >= 1, not {keep!r}")
        path = str(path)
        if self.dp is None or self.dp.rank == 0:
            arrays, meta = self.state_arrays()
            write_state(path, arrays, meta,
                        before_replace=(lambda: rotate(path, keep)) if keep > 1 else None)
        if self.dp is not None:
            self.dp.barrier()

    def load(self, path, fallback: bool = False) -> str:
        """Restore what :meth:`save` wrote into this Trainer (built for the same model and
        optimizer); raises ``ValueError`` naming what does not match, and
        :class:`~relaxgrad.training.state.StateFileError` naming the file when it is cut short,
        corrupt or not a state file. With ``fallback``, a missing or unreadable ``path`` gives
        way to the newest intact of ``path.1``, ``path.2``, ... (what ``save(keep=...)``
        kept), with a warning naming what was passed over. The next :meth:`fit` resumes where
        the saved one was (data parallel: every rank reads the file). Returns the file read."""
        if not fallback:
            self._load(path)
            return str(path)
        passed_over = []
        for candidate in checkpoints(str(path)):
            try:
                self._load(candidate)
            except StateFileError as err:
                passed_over.append(str(err))
                continue
            if passed_over:
                _log.warning("Trainer.load: passed over %s", "; ".join(passed_over))
            return candidate
        if not passed_over:
            raise FileNotFoundError(f"Trainer.load: no checkpoint {path} (nor {path}.1, ...)")
        raise StateFileError(f"Trainer.load: no intact checkpoint at {path}: "
                             + "; ".join(passed_over))

    def _load(self, path) -> None:
        arrays, meta = read_state(path)
        if meta.get("frozen"):  # Trainer.export's state: the frozen weights in their own file
            frozen = os.path.join(os.path.dirname(os.fspath(path)), meta["frozen"])
            if not os.path.exists(frozen):
                raise ValueError(f"Trainer.load: {path} keeps its frozen weights in "
                                 f"{meta['frozen']} beside it (Trainer.export's folder), which "
                                 f"is missing")
            arrays.update(read_state(frozen)[0])
        wanted = self.state_arrays()[0]
        missing = sorted(set(wanted) - set(arrays))
        extra = sorted(set(arrays) - set(wanted))
        if missing or extra:
            raise ValueError(f"Trainer.load: {path}: the state does not match this Trainer "
                             f"(missing {missing}, unexpected {extra})")
        for name, value in wanted.items():
            if arrays[name].shape != value.shape or arrays[name].dtype != value.dtype:
                raise ValueError(
                    f"Trainer.load: {path}: {name} is {arrays[name].dtype}{arrays[name].shape}, "
                    f"this Trainer has {value.dtype}{value.shape}")
        to = self.device
        self._params = [tvm.runtime.tensor(arrays[f"param:{n}"], to) for n in self.param_names]
        self._buffers = {n: tvm.runtime.tensor(arrays[f"buffer:{n}"], to)
                         for n in self.buffer_names}
        self._optim_state = [tvm.runtime.tensor(arrays[n], to) for n in self._optim_names()]
        self.steps = int(meta["steps"])
        self._fit_state = self._resume = meta.get("fit")
        self.seed = int(meta.get("seed", self.seed))
        self.key_counter = int(meta.get("key_counter", 0))
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        if self.loss_scale is not None and "loss_scale" in meta:
            self.loss_scale = float(meta["loss_scale"]["scale"])
            self._finite_steps = int(meta["loss_scale"]["finite_steps"])

    def _optim_names(self) -> list[str]:
        slots = [f"optim:{slot}:{n}" for slot in self.optimizer.slots for n in self.param_names]
        return ["optim:step", *slots]

    def export(self, folder, target=None) -> dict:
        """Write training artifacts that run with TVM's runtime alone, without relaxgrad:
        the compiled library, the state in :meth:`save`'s format, a manifest and a runner
        (:mod:`relaxgrad.training.export`); :meth:`load` resumes from the state the runner
        writes back. The runner takes one optimizer step per batch of the compiled size (no
        ``accumulate``).

        Parameters
        ----------
        folder : str or os.PathLike
            Where to write them (created if missing).
        target : str, dict or tvm.target.Target, optional
            Build for this target (e.g. ``"cuda"``) instead of exporting this Trainer's code.

        Returns
        -------
        dict
            The manifest (also in ``folder/manifest.json``).
        """
        return export_trainer(self, folder, target)

    def _served(self) -> IRModule:
        """The module the Trainer compiles: the functions of :attr:`mod` it calls (the loss's
        adjoint, the optimizer, the per-sample losses and the evaluation function) and what
        they call. ``<func>_loss``, which the adjoint differentiates, and the train-mode
        ``<func>`` beside an eval-mode function stay in :attr:`mod` unbuilt (LeViT's step: 8%
        of its compile)."""
        return reachable(self.mod, [f"{self.func_name}_loss_adjoint", f"{self.func_name}_optimizer",
                                    f"{self.func_name}_sample_loss", self.eval_func])

    def compile_for(self, target) -> relax.VMExecutable:
        """This Trainer's compiled functions, built for ``target``."""
        return _compile(self._served(), target, cache=True, progress=True)

    def gradients(self, inputs: Inputs, target: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and the gradients on one minibatch, without updating anything.

        Parameters
        ----------
        inputs : np.ndarray or sequence of np.ndarray
            The model's inputs (one batch).
        target : np.ndarray
            The loss target.

        Returns
        -------
        loss : float
            The loss.
        gradients : dict[str, np.ndarray]
            The gradient of each trainable parameter, by name.
        """
        value, grads = self._gradients(inputs, target, update_buffers=False)
        unscale = 1.0 if self.loss_scale is None else 1.0 / self.loss_scale
        return value, {n: g.numpy() * np.float32(unscale) for n, g in zip(self.param_names, grads)}

    @property
    def lr(self) -> float:
        """The learning rate of the next step: ``optimizer.lr * schedule(steps)``."""
        if self.schedule is None:
            return self.optimizer.lr
        factor = self.schedule(self.steps)
        if not isinstance(factor, int | float | np.floating) or not math.isfinite(factor):
            raise ValueError(f"Trainer: the schedule gave {factor!r} at step {self.steps}; "
                             f"it must return a finite number")
        return self.optimizer.lr * float(factor)

    def step(self, inputs: Inputs, target: np.ndarray) -> float:
        """One update on one minibatch; returns the loss before the update (and replaces the
        ``updates`` buffers by their new values). A step whose loss or gradient norm is not
        finite is not applied: see ``on_nonfinite``."""
        if self.check_inputs:
            names = [f"input {v.name}" for v in self._inputs] + ["the target"]
            check_finite([*_as_tuple(inputs), target], names, f"Trainer: {self._where()}")
        buffers = dict(self._buffers)  # the step replaces, never writes into, these tensors
        if not self.history and _weight_bytes(self) >= _LARGE_WEIGHTS:
            # what the caller let go since the Trainer was made (a PyTorch module whose weights
            # the Trainer holds now), given back before the step's memory is taken
            _release_free_memory()
        value, grads = self._gradients(inputs, target)
        new_params, new_state, report = self.vm[f"{self.func_name}_optimizer"](
            self._params, grads, self._optim_state, self._controls()
        )
        self.grad_norm = float(report[0].numpy())
        self.history.append(value)
        if not (math.isfinite(value) and math.isfinite(self.grad_norm)):
            self._buffers = buffers
            if self.loss_scale is not None and math.isfinite(value):  # the scale overflowed
                self.loss_scale /= 2
                self._finite_steps = 0
                self.skipped_steps += 1
                _log.info("Trainer: %s: the gradients overflowed float16; the loss scale is "
                          "now %g and the step was skipped", self._where(), self.loss_scale)
            else:
                self._nonfinite(value, grads)
            return value
        self._params, self._optim_state = list(new_params), list(new_state)
        self.steps += 1
        if self.loss_scale is not None:
            self._finite_steps += 1
            if self._finite_steps == GROWTH_INTERVAL:
                self.loss_scale, self._finite_steps = self.loss_scale * 2, 0
        return value

    def adjoint_args(self, inputs: Inputs, target: np.ndarray) -> list:
        """The arguments of the compiled loss adjoint for one batch: the model function's (the
        next random key included), the target and, with ``precision="fp16"``, the loss scale
        that seeds the backward pass."""
        args = self._args(inputs, train=True)
        args.append(self._to_device(target, self._target, "target"))
        if self.loss_scale is not None:
            args.append(tvm.runtime.tensor(np.array(self.loss_scale, "float32"), self.device))
        return args

    def _controls(self) -> list:
        """The optimizer's run-time controls ``(lr, max_norm, grad_scale)`` on the device."""
        unscale = 1.0 if self.loss_scale is None else 1.0 / self.loss_scale
        values = self.optimizer.controls(self.lr, self.max_grad_norm, unscale)
        key = tuple(float(v) for v in values)
        if key != self._controls_cache[0]:
            self._controls_cache = key, [tvm.runtime.tensor(v, self.device) for v in values]
        return self._controls_cache[1]

    def _where(self) -> str:
        where = f"step {self.steps + self.skipped_steps + 1}"
        if self._position is not None:
            where += f" (epoch {self._position[0] + 1}, batch {self._position[1] + 1})"
        return where

    def _nonfinite(self, value: float, grads) -> None:
        """Raise or log (``on_nonfinite``) a step that was not applied."""
        bad = [n for n, g in zip(self.param_names, grads) if not np.isfinite(g.numpy()).all()]
        what = [] if math.isfinite(value) else [f"the loss is {value}"]
        if bad:
            shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            counted = ("gradient of 1 parameter is" if len(bad) == 1
                       else f"gradients of {len(bad)} parameters are")  # fmt: skip
            what.append(f"the {counted} not finite ({shown})")
        elif not math.isfinite(self.grad_norm):
            what.append(f"the gradients' global norm is {self.grad_norm}")
        message = f"Trainer: {self._where()}: " + "; ".join(what) + "; the step was not applied"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + " (on_nonfinite='skip' skips such steps)")
        self.skipped_steps += 1
        _log.warning("%s (%d skipped so far)", message, self.skipped_steps)

    def _gradients(self, inputs: Inputs, target: np.ndarray, update_buffers: bool = True):
        """The loss and gradient tensors of one batch: over ``accumulate`` micro-batches, and
        averaged over the ranks when data parallel (after rank 0's buffers are broadcast)."""
        if self.dp is not None:
            self.dp.broadcast_buffers(self)
        if self.dp is not None and len(target) == 0:  # a rank without rows in a last batch
            value, grads = 0.0, None
        elif self.accumulate > 1:
            value, grads, _ = accumulate_gradients(self, inputs, target, self.accumulate)
        else:
            adjoint = self.vm[f"{self.func_name}_loss_adjoint"]
            out, grads = adjoint(*self.adjoint_args(inputs, target))
            if self.updates and update_buffers:  # out is (loss, *new buffer values)
                self._buffers.update(zip(self.updates, list(out)[1:]))
            value = float(_first(out).numpy())
        if self.dp is not None:
            return self.dp.mean_gradients(value, grads, len(target), self._params)
        return value, list(grads)

    def fit(
        self,
        x: Inputs,
        y: np.ndarray,
        epochs: int = 1,
        batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        progress: bool = True,
        checkpoint=None,
        checkpoint_every: int | None = None,
        keep: int = 1,
    ) -> list[float]:
        """Train for ``epochs`` over minibatches of ``(x, y)``; returns the per-step losses
        (also appended to ``history``).

        Each epoch visits ``minibatches(len(y), batch_size, rng)`` with one
        ``rng = np.random.default_rng(seed)`` for the whole call (``None`` without shuffle):
        the incomplete last batch of an epoch is dropped when the model has a static batch size
        (no padding: a model symbolic in the batch trains on it as it is). ``batch_size``
        defaults to the model's static batch size, and must equal it when there is one.

        Data parallel, ``batch_size`` is each rank's: the epoch's batches have ``world_size``
        times as many rows, in the same order on every rank, and rank ``r`` takes rows
        ``r, r + world_size, ...`` of each (the rows ``DistributedSampler`` gives it); only
        rank 0 shows the progress bar. With ``checkpoint`` (a path), :meth:`save` writes there
        every ``checkpoint_every`` steps (by default, every epoch) and at the end, keeping the
        last ``keep`` (see :meth:`save`). After :meth:`load`, fit goes on from the saved
        position (the same data size, seed, batch size and number of ranks), so a resumed run
        takes the steps of an uninterrupted one.

        With ``checkpoint``, SIGTERM and SIGINT (a scheduler's stop, Ctrl-C) let the step in
        flight finish, a checkpoint is written, and then the signal takes its course: SIGINT
        raises ``KeyboardInterrupt``, SIGTERM ends the process as it would have. Data
        parallel, every rank stops after the same step; ranks that got no signal raise
        :class:`~relaxgrad.training.DistributedError` saying another rank was stopped.
        """
        batch_size = self._batch_size(batch_size)
        world, rank = (1, 0) if self.dp is None else (self.dp.world_size, self.dp.rank)
        run = {"seed": seed, "shuffle": shuffle, "samples": len(y), "batch_size": batch_size,
               "world_size": world}
        if self.dp is not None:
            self.dp.check_same("the arguments of fit", {**run, "epochs": epochs})
        rng = np.random.default_rng(seed) if shuffle else None
        first_epoch, first_batch = _resume_point(self._resume, run, rng)
        self._resume = None
        drop_last = self.batch_size is not None
        per_epoch = len(minibatches(len(y), world * batch_size, None, drop_last))
        every = checkpoint_every or per_epoch
        position = first_epoch * per_epoch + first_batch  # batches of this run done
        losses: list[float] = []
        stopped = False
        with Preemption(checkpoint is not None) as preemption, _progress_bar(
                total=epochs * per_epoch, initial=position,
                disable=not progress or rank != 0, unit="step") as bar:  # fmt: skip
            for epoch in range(first_epoch, epochs):
                bar.set_description(f"epoch {epoch + 1}/{epochs}")
                rng_state = None if rng is None else rng.bit_generator.state
                batches = minibatches(len(y), world * batch_size, rng, drop_last)
                for k in range(first_batch if epoch == first_epoch else 0, len(batches)):
                    idx = batches[k][rank::world]
                    self._position = (epoch, k)
                    try:
                        losses.append(self.step(_take(x, idx), y[idx]))
                    finally:
                        self._position = None
                    self._fit_state = {**run, "epoch": epoch, "batch": k + 1, "rng": rng_state}
                    position += 1
                    if checkpoint is not None and position % every == 0:
                        self.save(checkpoint, keep)
                    bar.update()
                    bar.set_postfix(loss=f"{np.nanmean(losses[-per_epoch:]):.4f}",
                                    refresh=False)
                    stopped = checkpoint is not None and self._stop_requested(preemption)
                    if stopped:
                        break
                if stopped:
                    break
        if checkpoint is not None and position % every:
            self.save(checkpoint, keep)
        if stopped:
            self._stop(preemption)
        return losses

    def _stop_requested(self, preemption: Preemption) -> bool:
        """Whether this rank (or, data parallel, any rank) received SIGTERM or SIGINT."""
        if self.dp is None:
            return preemption.signal is not None
        return self.dp.all_sum([float(preemption.signal is not None)])[0] > 0

    def _stop(self, preemption: Preemption) -> None:
        """After the checkpoint of a stopped :meth:`fit`: the signal's own course."""
        if preemption.signal is None:  # data parallel: another rank got it
            from .distributed import DistributedError

            raise DistributedError(f"Trainer.fit: another rank was stopped by a signal; every "
                                   f"rank stopped after step {self.steps} and saved")
        preemption.deliver()

    def predict(self, x: Inputs) -> np.ndarray:
        """The model's result on ``x``, batch by batch (the last batch zero-padded)."""
        return np.concatenate([pred for pred, _ in self._batched_predictions(x)])

    def evaluate(self, x: Inputs, y: np.ndarray) -> dict[str, float]:
        """``{"loss": mean per-sample loss, "accuracy": ...}`` on ``(x, y)``; accuracy (the
        fraction of argmax predictions equal to the label or the target's argmax) only for
        classification losses. Data parallel, each rank evaluates its rows (every
        ``world_size``-th), with rank 0's buffers, and the sums are reduced over the ranks."""
        if self.dp is not None:
            self.dp.broadcast_buffers(self)
            idx = self.dp.shard(len(y))
            x, y = _take(x, idx), y[idx]
        sample_loss = self.vm[f"{self.func_name}_sample_loss"]
        loss, correct = 0.0, 0
        labels = y if y.ndim == 1 else y.argmax(axis=1)
        for pred, idx in self._batched_predictions(x, keep_padding=True):
            target = _pad(y[idx], len(pred))
            per_sample = sample_loss(tvm.runtime.tensor(pred, self.device),
                                     self._to_device(target, self._target, "target"))
            loss += float(per_sample.numpy()[: len(idx)].sum())
            if self.loss.classifies:
                correct += int(np.sum(pred[: len(idx)].argmax(axis=1) == labels[idx]))
        sums = [loss, correct, len(y)]
        if self.dp is not None:
            sums = self.dp.all_sum(sums)
        result = {"loss": sums[0] / sums[2]}
        if self.loss.classifies:
            result["accuracy"] = sums[1] / sums[2]
        return result

    def _batched_predictions(self, x: Inputs, keep_padding: bool = False):
        """``(predictions, indices)`` per batch; padding rows are cut unless ``keep_padding``."""
        x = _as_tuple(x)
        n = len(x[0])
        size = self.batch_size or max(n, 1)  # a rank may have no rows to evaluate
        forward = self.vm[self.eval_func]
        for start in range(0, n, size):
            idx = np.arange(start, min(start + size, n))
            batch = tuple(_pad(xi[idx], size) for xi in x)
            pred = _first(forward(*self._args(batch))).numpy()
            if keep_padding or len(idx) == size:
                yield pred, idx
            elif len(pred) != size:  # e.g. a language model's (batch * seq, vocab) logits
                raise ValueError(
                    f"Trainer: {self.eval_func} returns {len(pred)} rows for a batch of {size}, "
                    f"so the padding of a last batch of {len(idx)} cannot be cut; pass a "
                    f"multiple of {size} samples")
            else:
                yield pred[: len(idx)], idx

    def _args(self, inputs: Inputs, train: bool = False) -> list:
        """The model function's arguments: inputs and parameters in parameter order; with
        ``train``, the next random key too (the train-mode function's key parameter)."""
        inputs = _as_tuple(inputs)
        if len(inputs) != len(self._inputs):
            raise ValueError(
                f"Trainer: {self.func_name} takes {len(self._inputs)} inputs, got {len(inputs)}"
            )
        size = len(self._input_pos) + len(self._param_pos) + len(self._buffer_pos)
        args = [None] * (size + (self._key_pos is not None))
        for pos, value, var in zip(self._input_pos, inputs, self._inputs):
            args[pos] = self._to_device(value, var, "input")
        for pos, value in zip(self._param_pos, self._params):
            args[pos] = value
        for pos, name in zip(self._buffer_pos, self.buffer_names):
            args[pos] = self._buffers[name]
        if self._key_pos is None:
            return args
        if not train:  # the evaluation function has no key
            return args[: self._key_pos] + args[self._key_pos + 1 :]
        args[self._key_pos] = self._next_key()
        return args

    def _next_key(self) -> tvm.runtime.Tensor:
        """The key ``(seed, key_counter)``; counts the counter up."""
        key = np.array([self.seed, self.key_counter % 2**32], dtype="uint32")
        self.key_counter += 1
        return tvm.runtime.tensor(key, self.device)

    def _to_device(self, value, var: relax.Var, what: str, share: bool = False
                   ) -> tvm.runtime.Tensor:
        """``value`` as a tensor on the device for ``var``; with ``share``, the memory of
        ``value`` itself when it allows (:func:`_shared`), which no step may write."""
        if isinstance(value, tvm.runtime.Tensor):
            return value
        value = np.asarray(value)
        dtype = _ty.dtype_of(var)
        shape = _ty.shape_values(var)
        static = all(isinstance(d, tvm.tirx.IntImm) for d in shape)
        if static and tuple(int(d) for d in shape) != value.shape:
            raise ValueError(
                f"Trainer: {what} {var.name} must have shape {tuple(int(d) for d in shape)}, "
                f"got {value.shape}"
            )
        value = value.astype(dtype, copy=False)
        shared = _shared(value, self.device) if share else None
        return shared if shared is not None else tvm.runtime.tensor(value, self.device)

    def _batch_size(self, batch_size: int | None) -> int:
        if self.batch_size is None:
            if batch_size is None:
                raise ValueError("Trainer: the model's batch size is symbolic; pass batch_size")
            return batch_size
        full = self.batch_size * self.accumulate
        if batch_size not in (None, full):
            raise ValueError(
                f"Trainer: the model is compiled for batches of {self.batch_size}, not "
                f"{batch_size}" + (f" (with accumulate={self.accumulate}: {full})"
                                   if self.accumulate > 1 else "")
            )
        return full


def training_module(
    model: IRModule,
    param_names: Sequence[str],
    loss: Loss,
    optimizer: Optimizer,
    func_name: str = "main",
    target_type: relax.Type | None = None,
    seed: str = "ones",
    checkpoint="markers",
) -> IRModule:
    """The module a :class:`Trainer` compiles: ``model`` plus

    - ``<func>_loss(*params of func, target)``: :func:`append_loss` (for a model returning a
      tuple, ``(loss, *fields 1.. of the result)``);
    - ``<func>_loss_adjoint``: :func:`relaxgrad.Gradient` of it w.r.t. ``param_names``, the
      loss as target (index 0 of a tuple), seeded with 1 or, with ``seed="param"``, with a
      last parameter (a loss scale), ``checkpoint`` its policy (default: the model's
      checkpoint markers, if any); its gradients (field 1 of its result) share the
      adjoint's workspace (:data:`~relaxgrad.transforms.plan_memory.RESULTS_IN_WORKSPACE`:
      the step lets them go once the optimizer has read them);
    - ``<func>_optimizer(params, gradients, optim_states, controls)``: ``optimizer.add_to``
      (the update of ``optimizer.get_function()`` with fused kernels, the learning rate, the
      clipping norm and a gradient multiplier as run-time ``controls``, returning the
      gradients' global norm too; it writes the new parameters and state into the tensors it
      is given (``in_place``); ``optimizer.init`` is called, so ``optimizer.state`` holds the
      initial state);
    - ``<func>_sample_loss(prediction, target)``: the per-sample losses (``reduction="none"``).
    """
    mod = append_loss(model, loss, func_name, target_type)
    loss_name = f"{func_name}_loss"
    loss_func = mod[loss_name]
    names = [p.name for p in model[func_name].params]
    unknown = sorted(set(param_names) - set(names))
    if unknown:
        raise ValueError(f"Trainer: {func_name} has no parameters named {unknown} (it has {names})")
    trainable = [p for name, p in zip(names, loss_func.params) if name in param_names]
    mod = Gradient(loss_name, trainable, target_index=0, seed=seed, checkpoint=checkpoint)(mod)
    adjoint = f"{loss_name}_adjoint"
    mod = with_function(mod, adjoint, read_held_values(mod[adjoint])
                        .with_attr(RESULTS_IN_WORKSPACE, [1]))  # fmt: skip
    optimizer.init(trainable)
    if f"{func_name}_optimizer" in _names(mod):
        raise ValueError(
            f"Trainer: the model module already has a function named '{func_name}_optimizer'"
        )
    mod = optimizer.add_to(mod, f"{func_name}_optimizer", in_place=True)
    prediction_ty = prediction_type(model[func_name])
    sample_loss = loss.with_reduction("none")(prediction_ty, loss_func.params[-1].ty)
    return _with_function(mod, f"{func_name}_sample_loss", sample_loss)


def _checkpoint_policy(gradient_checkpointing):
    """The ``checkpoint=`` policy of the Trainer's ``gradient_checkpointing``."""
    if gradient_checkpointing is False or gradient_checkpointing is None:
        return "markers"  # relaxgrad.Gradient's default: the model's own markers, if any
    if gradient_checkpointing is True:
        return "sqrt"
    try:
        policies.resolve(gradient_checkpointing)
    except GradientError as error:
        raise ValueError(f"Trainer: gradient_checkpointing must be a bool or a checkpoint "
                         f"policy of relaxgrad.Gradient: {error}") from None
    return gradient_checkpointing


def _with_precision(model: IRModule, precision: str, func_names: set[str]) -> IRModule:
    """``model`` with the products of ``func_names`` in ``precision``'s dtype."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"Trainer: precision must be 'fp32', 'bf16' or 'fp16', not "
                         f"{precision!r}")
    if precision == "fp32":
        return model
    return MixedPrecision(precision, sorted(func_names))(model)


def _frozen_low(model: IRModule, precision: str, frozen_dtype, func_names: set[str],
                frozen: list[str]) -> tuple[IRModule, tuple[str, ...]]:
    """``model`` with the ``frozen`` weights that only its products read taken in
    ``frozen_dtype`` (see the Trainer's ``frozen_dtype``), and their names."""
    if frozen_dtype is None:
        return model, ()
    if frozen_dtype != precision or precision == "fp32":  # (precision is checked already)
        raise ValueError(f"Trainer: frozen_dtype={frozen_dtype!r} needs precision of the same "
                         f"dtype ('bf16' or 'fp16'), not precision={precision!r}")
    model, taken = low_precision_params(model, precision, sorted(func_names), frozen)
    return model, tuple(taken)


def _warn_without_units(precision: str, target) -> None:
    """One warning where ``precision``'s products will run on this machine's CPU, which has no
    arithmetic in that precision: still correct, as float32 products of the same values."""
    if not native_arch(tvm.target.Target(target)) or not onednn.missing_units(precision):
        return
    warnings.warn(
        f"Trainer: precision={precision!r} on a CPU without {' or '.join(onednn.UNITS[precision])} "
        f"({onednn.cpu_model()}): its products run as float32 products of the {precision} "
        f"values, which gives the same results at no more speed than precision='fp32'",
        RuntimeWarning, stacklevel=3)


def _check_controls(schedule, max_grad_norm, on_nonfinite) -> None:
    if schedule is not None and not callable(schedule):
        raise ValueError(f"Trainer: schedule must be a function of the step, not {schedule!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                      or not isinstance(max_grad_norm, int | float)
                                      or not max_grad_norm > 0):  # fmt: skip
        raise ValueError(f"Trainer: max_grad_norm must be a number > 0 or None, not "
                         f"{max_grad_norm!r}")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"Trainer: on_nonfinite must be 'raise' or 'skip', not {on_nonfinite!r}")


def _check_updates(model: IRModule, func_name: str, buffers: Mapping, updates: Sequence[str]):
    """The buffers named in ``updates`` exist and match the extra fields of the result."""
    unknown = [name for name in updates if name not in buffers]
    if unknown:
        raise ValueError(f"Trainer: updates {unknown} are not buffers (buffers: {list(buffers)})")
    if not updates:
        return
    ty = model[func_name].body.body.ty
    extra = len(ty.fields) - 1 if _ty.is_tuple(ty) else 0
    if extra != len(updates):
        raise ValueError(
            f"Trainer: {func_name} returns {extra} values after the prediction, but "
            f"{len(updates)} buffers are to be updated ({list(updates)})"
        )


def _resume_point(saved: dict | None, run: dict, rng) -> tuple[int, int]:
    """``(epoch, batch)`` where :meth:`Trainer.fit` resumes the ``saved`` run (restoring the
    shuffling ``rng`` to that epoch's start), ``(0, 0)`` without one; ValueError when ``run``
    is another run."""
    if saved is None:
        return 0, 0
    differ = [f"{key} {saved.get(key)!r} (now {value!r})" for key, value in run.items()
              if saved.get(key) != value]
    if differ:
        raise ValueError("Trainer.fit: cannot resume the loaded run, which had "
                         + ", ".join(differ))
    if rng is not None:
        rng.bit_generator.state = saved["rng"]
    return int(saved["epoch"]), int(saved["batch"])


def _check_key(model: IRModule, func_name: str, eval_func: str, key: str | None, seed) -> None:
    """``key`` names a (2,) uint32 parameter of the train function, absent from the (separate)
    evaluation function; ``seed`` fits in 32 bits."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
        raise ValueError(f"Trainer: seed must be an int in [0, 2**32), not {seed!r}")
    if key is None:
        return
    params = {p.name: p for p in model[func_name].params}
    if key not in params:
        raise ValueError(f"Trainer: {func_name} has no key parameter {key!r}")
    if not random.is_key(params[key]):
        raise ValueError(f"Trainer: the key parameter {key!r} of {func_name} must be a (2,) "
                         f"uint32 tensor, not {params[key].ty}")
    if eval_func == func_name or key in {p.name for p in model[eval_func].params}:
        raise ValueError(f"Trainer: the model takes a random key {key!r}, so it needs an "
                         f"evaluation function without it (eval_func), not {eval_func}")


def _progress_bar(**kwargs):
    """A tqdm bar: the notebook widget when ipywidgets is installed and we run in a notebook,
    else the text bar (``tqdm.auto`` would warn ``IProgress not found`` in a notebook without
    ipywidgets)."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm(**kwargs)


def _names(mod: IRModule) -> set[str]:
    return {gv.name_hint for gv in mod.get_global_vars()}


def _compile(mod: IRModule, target, cache: bool, progress: bool) -> relax.VMExecutable:
    """``relaxgrad.compile``, with a line showing the time spent once it takes over
    :data:`PROGRESS_DELAY` seconds."""
    stop = threading.Event()

    def show():
        if stop.wait(PROGRESS_DELAY):
            return
        with _progress_bar(desc="relaxgrad: compiling", bar_format="{desc} {elapsed}",
                           leave=False) as bar:
            bar.start_t -= PROGRESS_DELAY  # elapsed since the compile began
            while not stop.wait(1.0):
                bar.refresh()

    ticker = threading.Thread(target=show, daemon=True) if progress else None
    if ticker is not None:
        ticker.start()
    builds = pipeline.builds
    # the objects from before the compile are left out of the collection after it: it looks
    # at the compile's own objects only, and frees the same memory in 0.02 s instead of
    # 0.4-0.6 s with PyTorch and transformers loaded; a program that froze its own is left
    # as it is
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        executable = pipeline.compile(mod, target, cache=cache)
        if isinstance(executable, pipeline.Executable) and executable.library is None:
            # the library, loaded, rather than the build and its LLVM module (as the cache)
            executable = reloaded(executable, pipeline._load_cached)
        return executable
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        if pipeline.builds != builds:  # a compile, not a library from the cache: let it go
            _release_free_memory()
        if freeze:
            gc.unfreeze()


_LARGE_WEIGHTS = 64 << 20
"""Weights (parameters and buffers) of at least this many bytes make a Trainer's first step
give back what the caller let go before it (:func:`_release_free_memory`): a PyTorch module the
Trainer holds the weights of is about as large. Below it, that memory is small beside what
the process holds (PyTorch, TVM), and a full garbage collection costs 0.4-0.5 s in a process
with PyTorch and ``transformers`` loaded, which a small model's compile and steps take less
than."""


def _weight_bytes(trainer: Trainer) -> int:
    tensors = [*trainer._params, *trainer._buffers.values()]
    return sum(math.prod(t.shape) * tvm.DataType(str(t.dtype)).itemsize for t in tensors)


def _release_free_memory() -> None:
    """Give the memory a compile freed back to the system: the IR and builds that reference
    cycles keep alive (a garbage collection), then what the C library holds free (glibc's
    ``malloc_trim``): 200 MiB after ResNet-50's compile, which would otherwise stay in the
    training process's RSS. No trim where the C library has no such function."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def _with_function(mod: IRModule, name: str, func: relax.Function) -> IRModule:
    if name in _names(mod):
        raise ValueError(f"Trainer: the model module already has a function named {name!r}")
    return with_function(mod, name, func)


def _on(tensor: tvm.runtime.Tensor, device) -> tvm.runtime.Tensor:
    """``tensor`` on ``device``: itself when it is there already."""
    same = (tensor.device.dlpack_device_type(), tensor.device.index) == (
        device.dlpack_device_type(), device.index)
    return tensor if same else tensor.copyto(device)


def _shared(value: np.ndarray, device) -> tvm.runtime.Tensor | None:
    """A CPU tensor over ``value``'s memory (zero-copy, through DLPack; a read-only array
    too, as DLPack 1.0 marks it), or None where TVM's kernels cannot read it in place: another
    device, an array that is not C-contiguous, or not aligned to the 64 bytes TVM's kernels
    assume. The tensor keeps ``value`` alive."""
    if device.dlpack_device_type() != tvm.cpu().dlpack_device_type():
        return None
    if not value.flags.c_contiguous or value.ctypes.data % 64 or value.size == 0:
        return None
    try:
        return tvm_ffi.from_dlpack(value.__dlpack__(max_version=(1, 0)), require_alignment=64,
                                   require_contiguous=True)
    except (BufferError, TypeError, RuntimeError):  # an exporter or dtype DLPack cannot carry
        return None


def _first(result):
    """A function's result, or field 0 of a tuple result."""
    return result if isinstance(result, tvm.runtime.Tensor) else result[0]


def _as_tuple(x: Inputs) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _take(x: Inputs, idx: np.ndarray):
    return tuple(xi[idx] for xi in x) if isinstance(x, (tuple, list)) else x[idx]


def _pad(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``size`` rows."""
    if len(a) == size:
        return a
    return np.concatenate([a, np.zeros((size - len(a), *a.shape[1:]), a.dtype)])
