"""relaxgrad's passes."""

from .gradient import Gradient

__all__ = ["Gradient"]
