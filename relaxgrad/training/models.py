"""Model builders: Relax functions ``main(x, *params) -> logits`` with static shapes, and their
initial parameters.

Weights use PyTorch's layouts (dense ``(out, in)``, conv ``OIHW``) and its default
initialization (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weights and biases), so a
``torch.nn`` twin can load the same values by name (``fc0_weight`` -> ``fc0.weight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

from .. import _ty

__all__ = ["LoraSpec", "Model", "cnn", "mlp"]


@dataclass(frozen=True)
class LoraSpec:
    """What :func:`lora` added: ``weights`` (the adapted parameters, in order), and for each
    whether it has PyTorch's ``(out, in)`` layout; ``r``, ``alpha``, ``targets`` as given."""

    r: int
    alpha: float
    targets: tuple[str, ...] | str
    weights: tuple[str, ...]
    transposed: tuple[bool, ...]

    @property
    def scale(self) -> float:
        """The adapters' factor, ``alpha / r`` as PEFT's."""
        return self.alpha / self.r

    def adapters(self) -> list[tuple[str, str, str]]:
        """``(weight, A, B)`` parameter names for each adapted weight."""
        from ..transforms.lora import adapter_names

        return [(w, *adapter_names(w)) for w in self.weights]


@dataclass
class Model:
    """A model function and initial values of its trainable parameters.

    ``mod[func_name]`` takes the input batch first, then the parameters named in ``params``
    (in that order), and returns logits. Imported models (:func:`from_torch`,
    :func:`from_nn_module`) may also have non-trainable ``buffers`` after the parameters,
    return a tuple ``(output, *new values of the buffers named in updates)`` and have a
    separate evaluation function; :meth:`Trainer.for_model` passes all of it to the Trainer.

    Attributes
    ----------
    mod : IRModule
        The module holding the model function(s).
    params : dict[str, np.ndarray]
        Initial values of the trainable parameters, by parameter name.
    func_name : str
        The (train-mode) model function.
    buffers : dict[str, np.ndarray]
        Initial values of non-trainable parameters of the function (e.g. BatchNorm's running
        statistics), by parameter name.
    updates : tuple[str, ...]
        The buffers that fields ``1, 2, ...`` of the function's result replace after each step.
    eval_func : str, optional
        The function ``predict`` and ``evaluate`` run (same parameters); ``func_name`` if None.
    state_keys : tuple[str, ...], optional
        Keys of ``Trainer.state_dict()``, in order (parameters and buffers by default).
    aliases : dict[str, str]
        State keys that name another key's tensor (a tied parameter's other names, e.g.
        ``lm_head.weight`` -> ``transformer.wte.weight``): ``Trainer.state_dict()`` gives
        the tensor under both.
    torch_state : bool
        Whether ``Trainer.state_dict()`` returns ``torch.Tensor`` values (for
        ``module.load_state_dict``) instead of numpy arrays.
    key : str, optional
        The parameter of the model function that takes the random key (a ``(2,)`` uint32
        tensor, see :mod:`relaxgrad.ops.random`), which the Trainer feeds a new value every
        step; the evaluation function has no such parameter.
    precision : str, optional
        ``"bf16"`` or ``"fp16"`` for a model imported from a module in that dtype (imported as
        float32: the master weights), the Trainer's default ``precision``.
    lora : LoraSpec, optional
        The adapters :func:`~relaxgrad.training.lora` added (then ``params`` holds only them).
    """

    mod: tvm.IRModule
    params: dict[str, np.ndarray]
    func_name: str = "main"
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    updates: tuple[str, ...] = ()
    eval_func: str | None = None
    state_keys: tuple[str, ...] | None = None
    torch_state: bool = False
    aliases: dict[str, str] = field(default_factory=dict)
    key: str | None = None
    precision: str | None = None
    lora: LoraSpec | None = None

    @property
    def batch_size(self) -> int | None:
        """The static batch size of the input (None when it is symbolic)."""
        first = _ty.shape_values(self.mod[self.func_name].params[0])[0]
        return int(first) if isinstance(first, tvm.tirx.IntImm) else None


class _Builder:
    """Collects parameter vars and their initial values while a model is being emitted."""

    def __init__(self, dtype: str, seed: int):
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)
        self.vars: list[relax.Var] = []
        self.values: dict[str, np.ndarray] = {}

    def param(self, name: str, shape: tuple[int, ...], fan_in: int) -> relax.Var:
        bound = 1.0 / np.sqrt(fan_in)
        self.values[name] = self.rng.uniform(-bound, bound, shape).astype(self.dtype)
        var = relax.Var(name, relax.TensorType(shape, self.dtype))
        self.vars.append(var)
        return var

    def dense(self, name: str, in_features: int, out_features: int):
        """``x -> x @ w.T + b`` with ``w`` of shape ``(out, in)``."""
        w = self.param(f"{name}_weight", (out_features, in_features), in_features)
        b = self.param(f"{name}_bias", (out_features,), in_features)
        return lambda x: op.add(op.matmul(x, op.permute_dims(w)), b)

    def conv(self, name: str, in_channels: int, out_channels: int, kernel: int):
        """A same-padded ``kernel x kernel`` convolution with bias (NCHW, OIHW)."""
        fan_in = in_channels * kernel * kernel
        w = self.param(f"{name}_weight", (out_channels, in_channels, kernel, kernel), fan_in)
        b = self.param(f"{name}_bias", (out_channels,), fan_in)
        bias = op.reshape(b, (1, out_channels, 1, 1))
        return lambda x: op.add(op.nn.conv2d(x, w, padding=kernel // 2), bias)


def _build(x: relax.Var, builder: _Builder, layers) -> Model:
    """Emit ``layers`` (callables ``Expr -> Expr``) on ``x`` as ``main(x, *params)``."""
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *builder.vars]):
        with bb.dataflow():
            h = x
            for layer in layers:
                h = bb.emit(layer(h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return Model(bb.get(), builder.values)


def _batch(batch_size: int | str):
    """A static batch size, or a symbolic one named by a string (e.g. ``"n"``)."""
    return tvm.tirx.Var(batch_size, "int64") if isinstance(batch_size, str) else batch_size


def mlp(
    batch_size: int | str = 32,
    in_features: int = 64,
    hidden: Sequence[int] = (64,),
    num_classes: int = 10,
    dtype: str = "float32",
    seed: int = 0,
) -> Model:
    """A multilayer perceptron: ``dense -> relu`` per hidden layer, then a dense layer to logits.

    Parameters are named ``fc<i>_weight`` and ``fc<i>_bias``; a string ``batch_size`` makes the
    batch dim symbolic.
    """
    builder = _Builder(dtype, seed)
    x = relax.Var("x", relax.TensorType((_batch(batch_size), in_features), dtype))
    sizes = [in_features, *hidden, num_classes]
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(builder.dense(f"fc{i}", n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(op.nn.relu)
    return _build(x, builder, layers)


def cnn(
    batch_size: int | str = 32,
    image: tuple[int, int, int] = (1, 8, 8),
    channels: Sequence[int] = (16, 32),
    pools: Sequence[str] = ("max", "avg"),
    kernel: int = 3,
    num_classes: int = 10,
    dtype: str = "float32",
    seed: int = 0,
) -> Model:
    """A small convolutional network on NCHW images.

    Each stage ``i`` is ``conv2d(kernel, same padding) -> relu -> pools[i] 2x2 pooling``
    (``"max"`` or ``"avg"``), halving height and width; then a reshape to ``(batch, features)``
    and a dense layer to logits. Parameters: ``conv<i>_weight``, ``conv<i>_bias``, ``fc_weight``,
    ``fc_bias``.
    """
    if len(pools) != len(channels):
        raise ValueError(f"cnn: pools {tuple(pools)} must have one entry per stage {channels}")
    pool_ops = {"max": op.nn.max_pool2d, "avg": op.nn.avg_pool2d}
    builder = _Builder(dtype, seed)
    batch_size = _batch(batch_size)
    x = relax.Var("x", relax.TensorType((batch_size, *image), dtype))
    in_channels, height, width = image
    layers = []
    for i, (out_channels, pool) in enumerate(zip(channels, pools)):
        if pool not in pool_ops or height % 2 or width % 2:
            raise ValueError(f"cnn: stage {i} cannot {pool!r}-pool a {height}x{width} map by 2")
        layers += [
            builder.conv(f"conv{i}", in_channels, out_channels, kernel),
            op.nn.relu,
            lambda h, pool_op=pool_ops[pool]: pool_op(h, 2, 2),
        ]
        in_channels, height, width = out_channels, height // 2, width // 2
    features = in_channels * height * width
    layers += [
        lambda h: op.reshape(h, (batch_size, features)),
        builder.dense("fc", features, num_classes),
    ]
    return _build(x, builder, layers)
