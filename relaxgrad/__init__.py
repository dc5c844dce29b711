"""relaxgrad: reverse-mode automatic differentiation for Apache TVM's Relax IR."""

from .errors import GradientError
from .ops import get_gradient, register_gradient, registered_ops
from .pipeline import compile
from .transforms import Gradient

__all__ = [
    "Gradient",
    "GradientError",
    "compile",
    "get_gradient",
    "register_gradient",
    "registered_ops",
]
