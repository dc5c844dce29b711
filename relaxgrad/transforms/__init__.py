"""relaxgrad's passes."""

from .gradient import Gradient
from .lower import LowerCallTIRWithGrad

__all__ = ["Gradient", "LowerCallTIRWithGrad"]
