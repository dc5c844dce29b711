"""Constant ``call_tir`` bindings evaluated with each PrimFunc built once, in place of TVM's
``FoldConstant`` after legalization.

An adjoint starts from constants: ``ones`` for the loss's gradient, its broadcast, the products
of that with the constant factors of the forward... A chain of ``v * c`` and ``v + x`` has its
whole backward constant. TVM 0.27's ``FoldConstant`` builds the PrimFunc of every call it folds
again (LLVM, about 20 ms a call: a 1,000-binding chain built the same four PrimFuncs 500 times,
20 of its 25 s of compile time), and even with nothing to build it grows quadratically with
the bindings (11 s for 8,000). :class:`FoldConstantCalls` folds the calls of one tensor whose
operands are constants, or vars bound to constants, building each PrimFunc once per module,
in one walk. What it leaves (a call of a tuple, a dynamic shape) runs as compiled code.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import rewrite_functions, static_shape
from .columns import _is_call_tir
from .scopes import WithoutSeqScopes


@tvm.transform.module_pass(opt_level=0, name="FoldConstantCalls")
class FoldConstantCalls:
    """Replace each ``call_tir`` whose operands are constants (or vars bound to folded ones)
    by its value, computed on the CPU with the PrimFunc built once per module (see the module
    docstring). ``builds`` counts the PrimFuncs built by the last run, ``folded`` the calls
    replaced."""

    def __init__(self):
        self.builds = 0
        self.folded = 0

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        folder = _Folder(mod)
        mod = rewrite_functions(folder, mod)
        self.builds, self.folded = len(folder.built), folder.folded
        return mod


def is_tensor_constant(expr) -> bool:
    return isinstance(expr, _ty.Constant) and _ty.is_tensor(expr)


class ConstantBindings(PyExprMutator):
    """What the constant folders' mutators share: each binding's value replaced by the constant
    that ``self._constant(value)`` gives (None: left as it is), aliases of folded vars too, and
    the vars bound to folded constants read as those constants (any other var through the
    mutator's remap, which a call left with a folded operand is rebound in). The folders
    subclass it (undecorated) and are decorated ``@mutator``; ``folded`` counts the values
    replaced."""

    def _start(self) -> None:
        self.constants: dict = {}  # var bound to a folded value -> its constant
        self.folded = 0

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.constants[var] if var in self.constants else super().visit_var_(var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        return self.constants[var] if var in self.constants else super().visit_dataflow_var_(var)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        constant = self._constant(value)
        if constant is not None:
            self.folded += 1
            binding = relax.VarBinding(binding.var, constant)
        elif isinstance(value, relax.Var) and value in self.constants:  # an alias
            binding = relax.VarBinding(binding.var, self.constants[value])
        if is_tensor_constant(binding.value):
            self.constants[binding.var] = binding.value
        super().visit_var_binding_(binding)


@mutator
class _Folder(ConstantBindings):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self._start()
        self.mod = mod
        self.built: dict = {}  # GlobalVar -> the built function, or None where building failed
        gvars, self.unchanged = _foldable(mod)
        self._build_together(gvars)

    def _build_together(self, gvars: list) -> None:
        """Build the PrimFuncs of ``gvars`` in one module: each build has a fixed cost (an
        LLVM module, its passes: about 30 ms), and T5's relative position buckets fold some 40
        kernels. Where the joint build fails, each is built alone when its call comes."""
        prims = {gvar: self.mod[gvar] for gvar in gvars}
        prims = {gvar: prim for gvar, prim in prims.items() if isinstance(prim, tirx.PrimFunc)}
        if len(prims) < 2:
            return
        try:
            library = _library({gvar.name_hint: prim for gvar, prim in prims.items()})
        except Exception:  # noqa: BLE001 (each built alone then)
            return
        for gvar in prims:
            self.built[gvar] = library[gvar.name_hint]

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        if hash(func) in self.unchanged:  # (by handle: a function of the module)
            return func  # nothing to fold: no need to rebuild it binding by binding
        return super().visit_function_(func)

    def _constant(self, value) -> _ty.Constant | None:
        if _is_call_tir(value) and len(value.args) == 2 and self._constant_operands(value):
            return self._evaluated(self.visit_expr(value))
        return None

    def _constant_operands(self, call: relax.Call) -> bool:
        """Whether the operands of ``call`` are constants or vars bound to them (a test before
        the call is visited, which replaces those vars by their constants)."""
        return all(isinstance(x, _ty.Constant) or x in self.constants for x in _operands(call))

    def _evaluated(self, call: relax.Call) -> _ty.Constant | None:
        """The value of ``call``, a ``call_tir`` of one static-shape tensor from constants;
        None where it is anything else or its PrimFunc does not build."""
        if not _foldable_call(call, lambda x: False):
            return None
        func = self._built(call.args[0])
        if func is None:
            return None
        out = tvm.runtime.empty(static_shape(call), _ty.dtype_of(call), tvm.cpu())
        try:
            func(*(x.value for x in _operands(call)), out)
        except Exception:  # noqa: BLE001 (e.g. an index out of bounds: left to run, and raise)
            return None
        return relax.const(out)

    def _built(self, gvar):
        if gvar not in self.built:
            prim = self.mod[gvar]
            built = None
            if isinstance(prim, tirx.PrimFunc):
                try:
                    built = _library({"main": prim})["main"]
                except Exception:  # noqa: BLE001 (not folded: it runs as compiled code)
                    built = None
            self.built[gvar] = built
        return self.built[gvar]


def _foldable(mod: IRModule) -> tuple[list, set]:
    """The GlobalVars of the ``call_tir`` bindings of ``mod``'s functions whose operands are
    constants or vars bound to such calls (or to constants), in order: what
    :class:`_Folder` will evaluate unless a kernel fails to build or run; and the handles
    (``hash``) of the Relax functions with none of them and no nested function or ``If``
    (whose bindings this scan does not read): those it leaves as they are."""
    constant, found, unchanged = set(), {}, set()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        if not isinstance(func.body, relax.SeqExpr):
            continue
        folds = False
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, _ty.Constant) or (isinstance(value, relax.Var)
                                                       and value in constant):  # fmt: skip
                    constant.add(binding.var)
                elif _foldable_call(value, constant.__contains__):
                    constant.add(binding.var)
                    found.setdefault(value.args[0], None)
                    folds = True
                elif isinstance(value, relax.If | relax.Function):
                    folds = True
        if not folds:
            unchanged.add(hash(func))
    return list(found), unchanged


def _operands(call: relax.Call) -> list:
    """The tensors a ``call_tir`` passes to its PrimFunc."""
    return call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]


def _foldable_call(value, constant) -> bool:
    """Whether ``value`` is a ``call_tir`` of one static-shape tensor whose operands are
    constants or vars for which ``constant`` holds."""
    if not (_is_call_tir(value) and len(value.args) == 2):
        return False
    if not all(isinstance(x, _ty.Constant) or constant(x) for x in _operands(value)):
        return False
    return static_shape(value) is not None  # (last: the slowest test)


def _library(prims: dict) -> tvm.runtime.Module:
    """The PrimFuncs ``prims`` (by name) built for the host CPU in one module, each under its
    name, without TIR builders' ``pragma_scope`` markers (LLVM warns about each)."""
    named = {name: prim.without_attr("target").with_attr("global_symbol", name)
             for name, prim in prims.items()}  # fmt: skip
    return tvm.tirx.build(WithoutSeqScopes()(IRModule(named)), target="llvm")
