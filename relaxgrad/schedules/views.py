"""A function's results that are reshapes of a kernel's output, made views of it (a pass over
the scheduled module, CPU and GPU).

TVM's ``RewriteDataflowReshape`` turns a ``call_tir`` of a reshape kernel into ``R.reshape``
(a view, ``vm.builtin.reshape``: no copy) only where its result is a dataflow var: a result
the function returns stays a kernel that copies every element. A gradient is such a result
whenever its parameter's shape is not the shape its kernel computes: a convolution's weight
gradient is a matmul's ``(out, in * kh * kw)`` reshaped to ``(out, in, kh, kw)``, copied
element by element (ResNet-50's adjoint at batch 8: 2.5-3.3 ms of copies per call once its
memory is warm, about 30 ms on a call whose results are fresh pages).

:class:`ReshapeOutputs` makes such a copy a view where TVM's memory planner can see it is
one: the reshape's input is a dataflow var of the same block bound to a ``call_tir`` or
``call_dps_packed`` (a fresh tensor, not a parameter or a view of one), and no in-place call
of the block writes it. The planner follows a reshape's result to its input
(``StaticPlanBlockMemory`` gives both one storage token) and so allocates that kernel's output
on its own, never in storage another tensor reuses: the values are the same bits, without the
copy (ResNet-50's adjoint, interleaved A/B over 20 rounds: median 678 -> 672 ms).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.ir import IRModule, Op

from .. import _ty
from .._module import with_functions
from ._common import is_op, is_reshape_kernel, static_shape, with_dataflow_blocks

_CALL_TIR = Op.get("relax.call_tir")
_FRESH = (_CALL_TIR, Op.get("relax.call_dps_packed"))
_IN_PLACE = Op.get("relax.call_tir_inplace")


@tvm.transform.module_pass(opt_level=0, name="ReshapeOutputs")
class ReshapeOutputs:
    """Each function result bound to a reshape kernel's ``call_tir`` on a fresh dataflow
    tensor, rebound to ``R.reshape`` of it (a view)."""

    def transform_module(self, mod: IRModule, ctx) -> IRModule:
        reshapes = {}  # a module's reshape kernels, looked up once each

        def is_reshape(gvar) -> bool:
            if gvar not in reshapes:
                reshapes[gvar] = is_reshape_kernel(mod.functions.get(gvar))
            return reshapes[gvar]

        def rewrite(bindings: list) -> list | None:
            values = {b.var: b.value for b in bindings if isinstance(b, relax.VarBinding)}
            written = set()  # what an in-place call writes (and so may change under a view)
            for value in values.values():
                if is_op(value, _IN_PLACE):
                    args = value.args[1]
                    written.update(args.fields if isinstance(args, relax.Tuple) else [args])
            out, changed = [], False
            for binding in bindings:
                view = _view(binding, values, written, is_reshape)
                if view is not None:
                    binding, changed = relax.VarBinding(binding.var, view), True
                out.append(binding)
            return out if changed else None

        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                new = with_dataflow_blocks(func, rewrite)
                if new is not None:
                    updates[gvar] = new
        return with_functions(mod, updates)


def _view(binding, values: dict, written: set, is_reshape) -> relax.Expr | None:
    """``R.reshape`` of the kernel output that ``binding`` (a function result) copies; None
    unless it is such a copy."""
    if not isinstance(binding, relax.VarBinding) or isinstance(binding.var, relax.DataflowVar):
        return None
    value = binding.value
    if not is_op(value, _CALL_TIR) or len(value.args) != 2 or not is_reshape(value.args[0]):
        return None
    args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else []
    shape = static_shape(binding.var)
    if len(args) != 1 or shape is None:
        return None
    source = args[0]
    if not isinstance(source, relax.DataflowVar) or source in written:
        return None
    source_shape = static_shape(source)
    if source_shape is None or math.prod(source_shape) != math.prod(shape) or \
            _ty.dtype_of(source) != _ty.dtype_of(binding.var):
        return None  # (TVM's reshape pattern holds for a leading slice, rows of a split too)
    producer = values.get(source)
    if not any(is_op(producer, op) for op in _FRESH):
        return None
    return relax.BlockBuilder().normalize(relax.op.reshape(source, shape))
