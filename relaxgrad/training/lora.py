"""LoRA fine-tuning of any :class:`Model`: :func:`lora` adds adapters to its linear layers and
freezes the rest; :func:`save_adapter` writes them in PEFT's format
(``adapter_model.safetensors`` and ``adapter_config.json``, which ``PeftModel.from_pretrained``
loads); :func:`merged_state_dict` folds them into the weights.

A model that PEFT already wraps (``peft.get_peft_model``) needs none of this:
:func:`~relaxgrad.training.from_torch` imports it with its adapters trainable and its base
frozen, and after training ``module.load_state_dict(trainer.state_dict())`` then PEFT's own
``module.save_pretrained`` save it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import GradientError
from ..transforms.lora import LoRA, adapter_names, linear_weights
from .models import LoraSpec, Model

__all__ = ["LoraSpec", "lora", "merged_state_dict", "save_adapter"]


def lora(
    model: Model,
    targets: Sequence[str] | str,
    r: int = 8,
    alpha: float = 8,
    seed: int = 0,
) -> Model:
    """``model`` with LoRA adapters on the linear layers named by ``targets``, everything else
    frozen.

    Parameters
    ----------
    model : Model
        From :func:`from_torch`, :func:`from_nn_module`, :func:`mlp`, or hand-written Relax.
    targets : sequence of str, or str
        As PEFT's ``target_modules``: a weight parameter ``<module>.weight`` (or
        ``<module>_weight``) is adapted when ``<module>`` is a target or ends with
        ``"." + target`` (e.g. ``["q_proj", "v_proj"]``); a str is a regular expression the
        whole module name must match.
    r : int
        The adapters' rank.
    alpha : float
        PEFT's ``lora_alpha`` (the adapters' output is scaled by ``alpha / r``).
    seed : int
        Seeds ``A``'s initialization (PEFT's: uniform in ``+-1/sqrt(in_features)``); ``B``
        starts at zero, so the model starts as it was.

    Returns
    -------
    Model
        Its ``params`` are the adapters only (``<module>.lora_A.weight``, ``(r, in)``, and
        ``<module>.lora_B.weight``, ``(out, r)``), its ``buffers`` the former parameters and
        buffers (frozen: no gradient is computed for them); ``lora`` tells what was added.
        The gradient of the training step stops at the lowest adapter.

    Raises
    ------
    GradientError
        When no linear-layer weight matches ``targets``, or a matching weight is read by no
        linear layer (e.g. a convolution's).
    """
    if model.lora is not None:
        raise GradientError("lora: the model already has LoRA adapters")
    func = model.mod[model.func_name]
    linear = linear_weights(func)
    values = {**model.buffers, **model.params}  # a weight frozen already is a target too
    names = [p.name for p in func.params if p.name in values]
    weights = [n for n in names if _module(n) is not None and _matches(_module(n), targets)]
    if not weights:
        raise GradientError(f"lora: no weight parameter of {model.func_name} matches the "
                            f"targets {targets!r}")
    unread = [w for w in weights if w not in linear]
    if unread:
        raise GradientError(f"lora: {', '.join(unread)} match {targets!r} but no linear "
                            f"layer reads them (only linear layers take adapters)")
    funcs = [model.func_name] + ([model.eval_func] if model.eval_func else [])
    mod = LoRA(weights, r, alpha, funcs, key=model.key)(model.mod)
    rng = np.random.default_rng(seed)
    params = {}
    for weight in weights:
        shape = values[weight].shape
        out, inp = shape if linear[weight] else shape[::-1]
        a, b = adapter_names(weight)
        bound = 1.0 / np.sqrt(inp)
        dtype = values[weight].dtype
        params[a] = rng.uniform(-bound, bound, (r, inp)).astype(dtype)
        params[b] = np.zeros((out, r), dtype)
    spec = LoraSpec(r, float(alpha), targets if isinstance(targets, str) else tuple(targets),
                    tuple(weights), tuple(linear[w] for w in weights))
    state_keys = None if model.state_keys is None else (*model.state_keys, *params)
    return replace(model, mod=mod, params=params, buffers={**model.buffers, **model.params},
                   state_keys=state_keys, lora=spec)


def _module(name: str) -> str | None:
    for suffix in (".weight", "_weight"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _matches(module: str, targets) -> bool:
    """PEFT's rule (``check_target_module_exists``)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _spec(trainer) -> LoraSpec:
    spec = getattr(trainer, "lora", None)
    if spec is None:
        raise GradientError("the Trainer's model has no adapters of relaxgrad.training.lora")
    return spec


def merged_state_dict(trainer) -> dict:
    """The trainer's ``state_dict()`` without the adapters, each adapted weight ``W`` replaced
    by ``W + alpha / r * B @ A`` (PEFT's ``merge_and_unload``): what
    ``module.load_state_dict`` of the model without adapters takes (e.g. before the module's
    ``save_pretrained``)."""
    spec = _spec(trainer)
    state = trainer.state_dict()
    params, buffers = trainer.params, trainer.buffers
    adapters = set()
    for (weight, a, b), transposed in zip(spec.adapters(), spec.transposed):
        delta = spec.scale * (params[b].astype(np.float64) @ params[a].astype(np.float64))
        base = buffers[weight]
        merged = (base + (delta if transposed else delta.T)).astype(base.dtype)
        keys = [weight, *(k for k, v in trainer.aliases.items() if v == weight)]
        for key in keys:
            if key in state:
                state[key] = _like(state[key], merged)
        adapters.update((a, b))
    return {k: v for k, v in state.items() if k not in adapters}


def _like(old, value: np.ndarray):
    if isinstance(old, np.ndarray):
        return value
    import torch

    return torch.from_numpy(value)


def save_adapter(trainer, folder, prefix: str = "", base_model_name_or_path: str | None = None,
                 task_type: str | None = "CAUSAL_LM") -> Path:
    """Write the trainer's adapters as PEFT does: ``folder/adapter_model.safetensors`` (keys
    ``base_model.model.<module>.lora_A.weight``, ...) and ``folder/adapter_config.json``
    (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``), which
    ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the PyTorch model :func:`lora`
    adapted. ``prefix`` is cut from the front of the module names: the Hugging Face model's
    path in the module :func:`from_torch` traced, with a dot (``"model."`` when a wrapper holds
    it as ``self.model``). Returns the folder."""
    from safetensors.numpy import save_file

    spec = _spec(trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = trainer.params
    tensors = {}
    for _, a, b in spec.adapters():
        for name in (a, b):
            if not name.startswith(prefix):
                raise GradientError(f"save_adapter: adapter {name} does not start with the "
                                    f"prefix {prefix!r}")
            tensors[f"base_model.model.{name[len(prefix):]}"] = np.ascontiguousarray(params[name])
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = spec.targets if isinstance(spec.targets, str) else sorted(spec.targets)
    config = {
        "peft_type": "LORA", "task_type": task_type, "r": spec.r, "lora_alpha": spec.alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
