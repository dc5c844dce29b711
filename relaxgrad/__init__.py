"""relaxgrad: reverse-mode automatic differentiation for Apache TVM's Relax IR."""

from . import _threads  # noqa: F401 (first: sets TVM_NUM_THREADS before TVM's pool starts)
from ._version import __version__ as __version__
from .errors import GradientError
from .ops import get_gradient, register_gradient, registered_ops
from .pipeline import compile
from .transforms import Gradient, custom_gradient, split_info, stop_gradient

__all__ = [
    "Gradient",
    "GradientError",
    "compile",
    "custom_gradient",
    "get_gradient",
    "register_gradient",
    "registered_ops",
    "split_info",
    "stop_gradient",
]
