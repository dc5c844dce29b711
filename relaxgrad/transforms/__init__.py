"""relaxgrad's passes."""

from .custom import custom_gradient, stop_gradient
from .dropout import KeyDropout
from .gradient import Gradient
from .grouped_heads import FoldRepeatedHeads
from .lora import LoRA
from .lower import LowerCallTIRWithGrad
from .mixed_precision import MixedPrecision
from .split import SplitInfo, split_info

__all__ = [
    "FoldRepeatedHeads",
    "Gradient",
    "KeyDropout",
    "LoRA",
    "LowerCallTIRWithGrad",
    "MixedPrecision",
    "SplitInfo",
    "custom_gradient",
    "split_info",
    "stop_gradient",
]
