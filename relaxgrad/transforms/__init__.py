"""relaxgrad's passes."""

from .custom import custom_gradient, stop_gradient
from .dropout import KeyDropout
from .gradient import Gradient
from .lower import LowerCallTIRWithGrad
from .split import SplitInfo, split_info

__all__ = [
    "Gradient",
    "KeyDropout",
    "LowerCallTIRWithGrad",
    "SplitInfo",
    "custom_gradient",
    "split_info",
    "stop_gradient",
]
