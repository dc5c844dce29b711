"""relaxgrad's gradient rules: one registry, one module per op family."""

from .registry import get_gradient, register_gradient, register_no_grad, registered_ops

__all__ = ["get_gradient", "register_gradient", "register_no_grad", "registered_ops"]

# Importing the families registers their rules.
from . import (  # noqa: E402, F401
    binary,
    create,
    datatype,
    grad,
    image,
    index,
    linear_algebra,
    manipulate,
    nn,
    random,
    search,
    sorting,
    statistical,
    unary,
)
