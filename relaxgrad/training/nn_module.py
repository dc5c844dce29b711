"""Train a model written with ``tvm.relax.frontend.nn``: :func:`from_nn_module`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .models import Model

__all__ = ["from_nn_module"]


def from_nn_module(module, spec: Mapping, *, params: Mapping | None = None, seed: int = 0,
                   func_name: str | None = None) -> Model:
    """Export a ``tvm.relax.frontend.nn.Module`` with ``export_tvm`` as a trainable
    :class:`Model`.

    Parameters
    ----------
    module : tvm.relax.frontend.nn.Module
        The model.
    spec : Mapping
        ``export_tvm``'s spec of one method, e.g.
        ``{"forward": {"x": nn.spec.Tensor((32, 64), "float32")}}``. Static shapes (the
        optimizer needs static parameter shapes, the Trainer a static batch size).
    params : Mapping[str, np.ndarray], optional
        Initial values by parameter name (``module.named_parameters()`` names, e.g.
        ``"fc1.weight"``). Parameters without a value here get one from their ``data`` when it
        is set, else PyTorch's default: ones and zeros for the weight and bias of ``LayerNorm``,
        ``RMSNorm`` and ``GroupNorm``, ``N(0, 1)`` for ``Embedding``, and
        ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the rest (``fan_in``: the product of all
        dims but the first of the layer's weight).
    seed : int
        Seed of the default initialization.
    func_name : str, optional
        The exported method to train; the only one in ``spec`` by default.

    Returns
    -------
    Model
        ``mod[func_name](*inputs, *params)`` and the initial ``params`` by name; train it with
        :meth:`Trainer.for_model` (whose ``state_dict()`` returns numpy arrays by the same
        names).

    Raises
    ------
    ValueError
        If ``spec`` has several methods and ``func_name`` is not given, or a parameter has a
        symbolic shape.
    """
    if func_name is None:
        if len(spec) != 1:
            raise ValueError(f"from_nn_module: spec has methods {list(spec)}; pass func_name")
        func_name = next(iter(spec))
    mod, named = module.export_tvm(spec={func_name: spec[func_name]})
    rng = np.random.default_rng(seed)
    given = dict(params or {})
    unknown = sorted(set(given) - {name for name, _ in named})
    if unknown:
        raise ValueError(f"from_nn_module: no parameters named {unknown}")
    values = {}
    for name, param in named:
        try:
            shape = tuple(int(d) for d in param.shape)
        except TypeError as err:
            raise ValueError(f"from_nn_module: {name} has a symbolic shape {param.shape}") from err
        if name in given:
            value = np.asarray(given[name])
        elif param.data is not None:
            value = param.data.numpy()
        else:
            value = _default_init(module, name, shape, rng)
        values[name] = value.astype(param.dtype).reshape(shape)
    return Model(mod, values, func_name)


def _default_init(module, name: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """PyTorch's default initial value of parameter ``name`` of ``module``: ones / zeros for the
    weight / bias of a norm layer, ``N(0, 1)`` for embeddings, else ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))`` with ``fan_in`` from the layer's weight (all dims but the first)."""
    from tvm.relax.frontend import nn

    path, _, leaf = name.rpartition(".")
    owner = _submodule(module, path)
    if isinstance(owner, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return np.ones(shape) if leaf == "weight" else np.zeros(shape)
    if isinstance(owner, nn.Embedding):
        return rng.standard_normal(shape)
    weight = getattr(owner, "weight", None)
    weight_shape = tuple(int(d) for d in weight.shape) if weight is not None else shape
    fan_in = int(np.prod(weight_shape[1:])) if len(weight_shape) > 1 else weight_shape[0]
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape)


def _submodule(module, path: str):
    for part in path.split(".") if path else []:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module
