"""The one exception type relaxgrad raises for bad input."""

import tvm_ffi


@tvm_ffi.error.register_error("RelaxgradGradientError")
class GradientError(ValueError, RuntimeError):
    """Bad input to a relaxgrad pass or rule.

    A ``ValueError`` (and, for drop-in compatibility with TVM's C++ pass, which raises
    ``RuntimeError`` for the same conditions, also a ``RuntimeError``). The message names the
    function, variable or op at fault. Registered with tvm-ffi so that it keeps its type when
    raised inside a module pass.
    """
