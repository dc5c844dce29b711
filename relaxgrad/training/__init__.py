"""Training on relaxgrad's gradients: losses appended to model functions, optimizers whose step
is compiled Relax code, a ``Trainer``, model builders, importers of PyTorch modules
(:func:`from_torch`) and ``tvm.relax.frontend.nn`` modules (:func:`from_nn_module`), data
parallel training over ``torch.distributed`` (:class:`DataParallel`), learning-rate
:mod:`~relaxgrad.training.schedules`, and the digits dataset."""

from . import schedules
from .datasets import Split, load_digits, minibatches
from .distributed import DataParallel, DistributedError
from .lora import LoraSpec, lora, merged_state_dict, save_adapter
from .losses import CrossEntropyLoss, Loss, MSELoss, append_loss
from .models import Model, cnn, mlp
from .nn_module import from_nn_module
from .optimizers import SGD, Adam, AdamW, MomentumSGD, Optimizer
from .packing import Packed, pack
from .pytorch import from_torch
from .resilience import NonFiniteError
from .trainer import Trainer, training_module

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CrossEntropyLoss",
    "DataParallel",
    "DistributedError",
    "LoraSpec",
    "Loss",
    "MSELoss",
    "Model",
    "MomentumSGD",
    "NonFiniteError",
    "Optimizer",
    "Packed",
    "Split",
    "Trainer",
    "append_loss",
    "cnn",
    "from_nn_module",
    "from_torch",
    "load_digits",
    "lora",
    "merged_state_dict",
    "minibatches",
    "mlp",
    "pack",
    "save_adapter",
    "schedules",
    "training_module",
]
