"""relaxgrad's version, on its own so that modules below the package's ``__init__`` (the compile
cache's key) can read it without importing the package."""

__version__ = "0.1.0"
