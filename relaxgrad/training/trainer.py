"""``Trainer``: compile a model's loss adjoint and optimizer step once, then run minibatches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import tvm
from tqdm.auto import tqdm
from tvm import relax
from tvm.ir import IRModule

import relaxgrad

from .. import _ty
from .._module import with_function
from ..transforms import Gradient
from .datasets import minibatches
from .losses import Loss, append_loss
from .optimizers import Optimizer

__all__ = ["Trainer", "training_module"]

Inputs = np.ndarray | Sequence[np.ndarray]


class Trainer:
    """Train the parameters of a Relax model function with relaxgrad's gradients.

    At construction :func:`training_module` adds the loss, its adjoint, the optimizer step and
    per-sample losses to the model's module, which is compiled once (``self.mod``, ``self.vm``).
    Parameters and optimizer state then live on the device as tensors; a step is two calls of
    compiled code: the adjoint, then the optimizer.

    Parameters
    ----------
    model : IRModule
        Module with the model function (one dataflow block returning one tensor).
    params : Mapping[str, np.ndarray]
        Initial values of the trainable parameters, by parameter name. The function's other
        parameters are the inputs, in their order.
    loss : Loss
        The loss of the model's result against a target.
    optimizer : Optimizer
        The optimizer; ``init`` is called on the loss function's parameter vars.
    func_name : str
        Name of the model function.
    target : str, dict or tvm.target.Target
        Compilation target (see :func:`relaxgrad.compile`); ``"llvm"`` by default.
    target_type : relax.Type, optional
        Type of the loss target; by default derived from the result by ``loss.target_type``.
    """

    def __init__(
        self,
        model: IRModule,
        params: Mapping[str, np.ndarray],
        loss: Loss,
        optimizer: Optimizer,
        *,
        func_name: str = "main",
        target="llvm",
        target_type: relax.Type | None = None,
    ):
        self.mod = training_module(model, list(params), loss, optimizer, func_name, target_type)
        self.func_name, self.loss, self.optimizer = func_name, loss, optimizer
        self.device = _device(target)
        self.vm = relax.VirtualMachine(_compile(self.mod, target), self.device)

        names = [p.name for p in model[func_name].params]
        loss_func = self.mod[f"{func_name}_loss"]
        self._param_pos = [i for i, name in enumerate(names) if name in params]
        self._input_pos = [i for i, name in enumerate(names) if name not in params]
        self._inputs = [loss_func.params[i] for i in self._input_pos]
        self._target = loss_func.params[-1]
        self.param_names = [names[i] for i in self._param_pos]
        self._params = [
            self._to_device(params[name], loss_func.params[i], "parameter")
            for i, name in zip(self._param_pos, self.param_names)
        ]
        self._optim_state = [s.copyto(self.device) for s in optimizer.state]
        first = _ty.shape_values(self._inputs[0])[0] if self._inputs else None
        self.batch_size: int | None = int(first) if isinstance(first, tvm.tirx.IntImm) else None
        self.history: list[float] = []

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The current parameter values, by name."""
        return {name: p.numpy() for name, p in zip(self.param_names, self._params)}

    def step(self, inputs: Inputs, target: np.ndarray) -> float:
        """One update on one minibatch; returns the loss before the update."""
        args = self._args(inputs) + [self._to_device(target, self._target, "target")]
        loss, grads = self.vm[f"{self.func_name}_loss_adjoint"](*args)
        new_params, self._optim_state = self.vm[f"{self.func_name}_optimizer"](
            self._params, grads, self._optim_state
        )
        self._params = list(new_params)
        value = float(loss.numpy())
        self.history.append(value)
        return value

    def fit(
        self,
        x: Inputs,
        y: np.ndarray,
        epochs: int = 1,
        batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        progress: bool = True,
    ) -> list[float]:
        """Train for ``epochs`` over minibatches of ``(x, y)``; returns the per-step losses
        (also appended to ``history``).

        Each epoch visits ``minibatches(len(y), batch_size, rng)`` with one
        ``rng = np.random.default_rng(seed)`` for the whole call (``None`` without shuffle):
        the incomplete last batch of an epoch is dropped. ``batch_size`` defaults to the
        model's static batch size, and must equal it when there is one.
        """
        batch_size = self._batch_size(batch_size)
        rng = np.random.default_rng(seed) if shuffle else None
        per_epoch = len(y) // batch_size
        losses: list[float] = []
        with tqdm(total=epochs * per_epoch, disable=not progress, unit="step") as bar:
            for epoch in range(epochs):
                bar.set_description(f"epoch {epoch + 1}/{epochs}")
                for idx in minibatches(len(y), batch_size, rng):
                    losses.append(self.step(_take(x, idx), y[idx]))
                    bar.update()
                    bar.set_postfix(loss=f"{np.mean(losses[-per_epoch:]):.4f}", refresh=False)
        return losses

    def predict(self, x: Inputs) -> np.ndarray:
        """The model's result on ``x``, batch by batch (the last batch zero-padded)."""
        return np.concatenate([pred for pred, _ in self._batched_predictions(x)])

    def evaluate(self, x: Inputs, y: np.ndarray) -> dict[str, float]:
        """``{"loss": mean per-sample loss, "accuracy": ...}`` on ``(x, y)``; accuracy (the
        fraction of argmax predictions equal to the label or the target's argmax) only for
        classification losses."""
        sample_loss = self.vm[f"{self.func_name}_sample_loss"]
        losses, preds = [], []
        for pred, idx in self._batched_predictions(x, keep_padding=True):
            target = _pad(y[idx], len(pred))
            per_sample = sample_loss(tvm.runtime.tensor(pred, self.device),
                                     self._to_device(target, self._target, "target"))
            losses.append(per_sample.numpy()[: len(idx)])
            preds.append(pred[: len(idx)])
        result = {"loss": float(np.mean(np.concatenate(losses)))}
        if self.loss.classifies:
            labels = y if y.ndim == 1 else y.argmax(axis=1)
            result["accuracy"] = float(np.mean(np.concatenate(preds).argmax(axis=1) == labels))
        return result

    def _batched_predictions(self, x: Inputs, keep_padding: bool = False):
        """``(predictions, indices)`` per batch; padding rows are cut unless ``keep_padding``."""
        x = _as_tuple(x)
        n = len(x[0])
        size = self.batch_size or n
        forward = self.vm[self.func_name]
        for start in range(0, n, size):
            idx = np.arange(start, min(start + size, n))
            batch = tuple(_pad(xi[idx], size) for xi in x)
            pred = forward(*self._args(batch)).numpy()
            yield (pred if keep_padding else pred[: len(idx)]), idx

    def _args(self, inputs: Inputs) -> list:
        """The model function's arguments: inputs and parameters in parameter order."""
        inputs = _as_tuple(inputs)
        if len(inputs) != len(self._inputs):
            raise ValueError(
                f"Trainer: {self.func_name} takes {len(self._inputs)} inputs, got {len(inputs)}"
            )
        args = [None] * (len(self._input_pos) + len(self._param_pos))
        for pos, value, var in zip(self._input_pos, inputs, self._inputs):
            args[pos] = self._to_device(value, var, "input")
        for pos, value in zip(self._param_pos, self._params):
            args[pos] = value
        return args

    def _to_device(self, value, var: relax.Var, what: str) -> tvm.runtime.Tensor:
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
        return tvm.runtime.tensor(value.astype(dtype, copy=False), self.device)

    def _batch_size(self, batch_size: int | None) -> int:
        if self.batch_size is None:
            if batch_size is None:
                raise ValueError("Trainer: the model's batch size is symbolic; pass batch_size")
            return batch_size
        if batch_size not in (None, self.batch_size):
            raise ValueError(
                f"Trainer: the model is compiled for batches of {self.batch_size}, not "
                f"{batch_size}"
            )
        return self.batch_size


def training_module(
    model: IRModule,
    param_names: Sequence[str],
    loss: Loss,
    optimizer: Optimizer,
    func_name: str = "main",
    target_type: relax.Type | None = None,
) -> IRModule:
    """The module a :class:`Trainer` compiles: ``model`` plus

    - ``<func>_loss(*params of func, target)``: :func:`append_loss`;
    - ``<func>_loss_adjoint``: :func:`relaxgrad.Gradient` of it w.r.t. ``param_names``;
    - ``<func>_optimizer(params, gradients, optim_states)``: ``optimizer.get_function()``
      (``optimizer.init`` is called, so ``optimizer.state`` holds the initial state);
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
    mod = Gradient(loss_name, trainable)(mod)
    optimizer.init(trainable)
    mod = _with_function(mod, f"{func_name}_optimizer", optimizer.get_function())
    prediction_ty = model[func_name].body.body.ty
    sample_loss = loss.with_reduction("none")(prediction_ty, loss_func.params[-1].ty)
    return _with_function(mod, f"{func_name}_sample_loss", sample_loss)


def _names(mod: IRModule) -> set[str]:
    return {gv.name_hint for gv in mod.get_global_vars()}


def _compile(mod: IRModule, target) -> relax.VMExecutable:
    """``relaxgrad.compile`` (CPU and GPU pipelines) where this relaxgrad has it, else
    ``tvm.compile``."""
    compile_fn = getattr(relaxgrad, "compile", None) or tvm.compile
    return compile_fn(mod, target)


def _device(target) -> tvm.runtime.Device:
    if not isinstance(target, tvm.target.Target):
        target = tvm.target.Target(target)
    kind = target.kind.name
    return tvm.cpu() if kind in ("llvm", "c") else tvm.device(kind, 0)


def _with_function(mod: IRModule, name: str, func: relax.Function) -> IRModule:
    if name in _names(mod):
        raise ValueError(f"Trainer: the model module already has a function named {name!r}")
    return with_function(mod, name, func)


def _as_tuple(x: Inputs) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _take(x: Inputs, idx: np.ndarray):
    return tuple(xi[idx] for xi in x) if isinstance(x, (tuple, list)) else x[idx]


def _pad(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``size`` rows."""
    if len(a) == size:
        return a
    return np.concatenate([a, np.zeros((size - len(a), *a.shape[1:]), a.dtype)])
