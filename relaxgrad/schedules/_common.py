"""Small helpers shared by the schedule step and its rules."""

from __future__ import annotations

import inspect
import textwrap
from collections import OrderedDict
from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir import IRModule, Op
from tvm.relax.expr_functor import PyExprVisitor, visitor
from tvm.script.parser.core.entry import parse
from tvm.target import Target

from .. import _ty, exprs

THREAD_ENV_ATTRS = ("thread_extent", "virtual_thread")
ELEMWISE, BROADCAST, INJECTIVE, COMM_REDUCE, OPAQUE = 0, 1, 2, 3, 8  # relax's OpPatternKind
SPATIAL, REDUCE = tirx.IterVar.DataPar, tirx.IterVar.CommReduce  # kinds of block iterators
#: the attribute of a PrimFunc that calls a library's function (``T.call_extern``): its symbol.
#: ``relaxgrad.compile`` reads it to know which libraries a build calls (:func:`calls_of`).
CALLS = "relaxgrad.calls"


def calling(func: tirx.PrimFunc, symbol: str) -> tirx.PrimFunc:
    """``func`` marked as calling the library function ``symbol`` (:data:`CALLS`)."""
    return func.with_attr(CALLS, symbol)


def calls_of(mod: IRModule) -> set[str]:
    """The library functions the PrimFuncs of ``mod`` are marked as calling (:func:`calling`)."""
    return {str(func.attrs[CALLS]) for func in mod.functions.values()
            if isinstance(func, tirx.PrimFunc) and func.attrs is not None
            and CALLS in func.attrs}  # fmt: skip


def parsed_script(template: Callable, values: dict) -> tirx.PrimFunc:
    """The PrimFunc of ``template``'s TVMScript (a function holding one ``@T.prim_func``, its
    keyword parameters the script's values, never called) for ``values``.

    The script is parsed from its text with the values, and the globals of ``template``'s
    module, as variables, rather than by running ``@T.prim_func`` on a nested function per
    call: that decorator, and TVMScript macros, walk the Python stack reading each frame's
    source (``inspect.stack()``), which inside a compile (deep stacks, torch loaded) took tens
    of milliseconds per function."""
    if template not in _SCRIPTS:
        source = inspect.getsource(template)
        body = textwrap.dedent(source[source.index("    @T.prim_func"):])
        _SCRIPTS[template] = "@T.prim_func" + body[body.index("\n"):]
    names = inspect.signature(template).parameters
    values = {name: values[name] for name in names}
    return parsed_text(_SCRIPTS[template], values, template.__globals__)


def parsed_text(script: str, values: dict, scope: dict | None = None) -> tirx.PrimFunc:
    """The PrimFunc of the TVMScript text ``script`` (one ``@T.prim_func``, without its
    ``global_symbol``) with ``values`` and the names of ``scope`` as its variables; parsed
    once per script and values (the same values give the same PrimFunc: a kernel of one kind
    built again, in another layer or another compile of the process, shares the parse)."""
    try:
        key = (script, id(scope), tuple((name, _frozen(v)) for name, v in values.items()))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _PARSED:
        _PARSED.move_to_end(key)
        return _PARSED[key]
    func = parse(script, extra_vars={**(scope or {}), **values}, check_well_formed=False)
    func = func.without_attr("global_symbol")
    if key is not None:
        _PARSED[key] = func
        if len(_PARSED) > _PARSED_FUNCS:
            _PARSED.popitem(last=False)
    return func


def _frozen(value):
    """``value`` as part of a key of :data:`_PARSED`: its lists as tuples, each value with its
    type (``1``, ``1.0`` and ``True`` are equal in Python, not in a script)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return type(value), value


_SCRIPTS: dict = {}
_PARSED: OrderedDict = OrderedDict()
"""(script, scope, values) -> the PrimFunc :func:`parsed_text` parsed, least recently used
first."""
_PARSED_FUNCS = 512


def is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Marked scheduled, or already binding GPU threads (e.g. TVM's own CUDA kernels of
    ``scatter_elements``, which legalization emits without the mark)."""
    if func.attrs and func.attrs.get("tirx.is_scheduled", False):
        return True
    found = []
    callbacks = [
        (tirx.For, lambda loop: found.append(loop) if loop.kind == tirx.ForKind.THREAD_BINDING
         else None),
        (tirx.AttrStmt, lambda attr: found.append(attr) if attr.attr_key in THREAD_ENV_ATTRS
         else None),
    ]
    tvm_ffi.structural_walk(func.body, callbacks, order="pre")
    return bool(found)


def rewrite_functions(mutator, mod: IRModule) -> IRModule:
    """``mod`` with every Relax function visited by ``mutator`` (a ``PyExprMutator`` of
    ``mod``), and the functions it added."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def may_change(func: relax.Function, wanted: Callable[[relax.Expr], bool]) -> bool:
    """Whether a rewrite of the values for which ``wanted`` holds may change ``func``: one of
    its bindings' values is such, or ``func`` holds expressions this scan does not read (a
    function or ``If`` inside, a result other than vars in tuples, as an adjoint's
    ``(loss, (grad, ...))``). A rewrite can return a function for which it does not hold as it
    is, rather than rebuild it binding by binding (a Python call per binding and per var, for
    nothing)."""
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not _vars_in_tuples(body.body):
        return True
    for block in body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.If | relax.Function | relax.SeqExpr) or wanted(value):
                return True
    return False


def _vars_in_tuples(expr: relax.Expr) -> bool:
    """Whether ``expr`` is a var or a tuple (of tuples...) of vars."""
    if isinstance(expr, relax.Tuple):
        return all(_vars_in_tuples(field) for field in expr.fields)
    return isinstance(expr, relax.Var)


def rebind(mutator, old: relax.Var, value: relax.Expr) -> None:
    """Emit ``value`` with ``mutator``'s builder in place of ``old``'s binding (a dataflow var
    or an output, as ``old`` was); later reads of ``old`` read it."""
    if isinstance(old, relax.DataflowVar):
        new = mutator.builder_.emit(value, old.name)
    else:
        new = mutator.builder_.emit_output(value, old.name)
    mutator.set_var_remap(old, new)


def with_dataflow_blocks(func: relax.Function, rewrite: Callable[[list], list | None]):
    """``func`` with each dataflow block's bindings replaced by ``rewrite(bindings)`` (None:
    the block as it was); None when no block changed."""
    blocks, changed = [], False
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            bindings = rewrite(list(block.bindings))
            if bindings is not None:
                block, changed = relax.DataflowBlock(bindings), True
        blocks.append(block)
    if not changed:
        return None
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def is_reshape_kernel(func) -> bool:
    """Whether ``func`` is a PrimFunc that TVM's ``has_reshape_pattern`` calls a reshape (which
    ``RewriteDataflowReshape`` turns into a view); that check raises on a function without a
    root block (a BLAS call), which is none."""
    return isinstance(func, tirx.PrimFunc) and isinstance(func.body, s_tir.SBlockRealize) \
        and relax.analysis.has_reshape_pattern(func)


def is_op(expr, op: Op | str) -> bool:
    """Whether ``expr`` is a call of the operator ``op`` (an ``Op`` or its name, as
    :func:`relaxgrad.exprs.is_op` takes it: compared as an ``Op``, a name never matched, and
    the bf16 products of a CPU without bf16 units stayed TVM kernels instead of sgemm calls)."""
    if isinstance(op, str):
        return exprs.is_op(expr, op)
    return isinstance(expr, relax.Call) and isinstance(expr.op, Op) and expr.op.same_as(op)


def static_shape(expr) -> list[int] | None:
    """The shape of a tensor expr as ints; None unless it is a tensor of static shape."""
    if not _ty.is_tensor(expr) or _ty.shape_of(expr) is None:
        return None
    shape = _ty.shape_values(expr)
    return [int(d) for d in shape] if all(isinstance(d, tirx.IntImm) for d in shape) else None


def is_one(expr) -> bool:
    """Whether ``expr`` is the constant 1 (an int or an ``IntImm``)."""
    return isinstance(expr, int | tirx.IntImm) and int(expr) == 1


def sblocks(func: tirx.PrimFunc) -> list[s_tir.SBlock]:
    """The blocks of ``func`` but its root, in program order."""
    found = []
    tvm_ffi.structural_walk(
        func.body,
        [(s_tir.SBlock, lambda b: found.append(b) if b.name_hint != "root" else None)],
        order="pre",
    )
    return found


def first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"


@visitor
class _Reads(PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.count: dict = {}

    def visit_var_(self, var: relax.Var) -> None:
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
        self.visit_var_(var)


def read_counts(*exprs: relax.Expr) -> dict:
    """How many times each var is read in ``exprs`` (a function: in its body), together (one
    visitor for them all: making one costs about as much as visiting a small expr)."""
    reads = _Reads()
    for expr in exprs:
        reads.visit_expr(expr)
    return reads.count


def bound_values(func: relax.Function) -> dict:
    """The value of each var bound by a ``VarBinding`` in ``func``'s blocks."""
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    return {b.var: b.value for block in blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}  # fmt: skip


def without_unit_reductions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with each reduction block whose reduced iterators all have extent 1 (a matmul
    of k = 1, a sum over an axis of 1) written as the spatial block it is: ``out = init``
    combined with the single update, ``T.init`` and those iterators gone.

    dlight's ``normalize_prim_func`` drops such iterators but keeps ``T.init``, and inlining an
    epilogue then applies it to the init and the update both: ``matmul(a, b) + c`` of k = 1
    computed ``a @ b + 2 c``."""
    body = tvm_ffi.structural_map(func.body, (s_tir.SBlockRealize, _spatial_unit_reduction))
    if body.same_as(func.body):
        return func
    # The loops of the dropped iterators bind nothing now: gone too (dlight needs each loop
    # bound to a block iterator).
    return func.with_body(tvm_ffi.structural_map(body, (tirx.For, _without_unused_unit_loop)))


def _without_unused_unit_loop(loop):
    if not is_one(loop.extent):
        return loop
    used = []
    tvm_ffi.structural_walk(
        loop.body, [(tvm.ir.Var, lambda v: used.append(v) if v.same_as(loop.loop_var) else None)]
    )
    return loop if used else loop.body


def _spatial_unit_reduction(realize):
    block = realize.block
    reduced = {iv.var: iv.dom.min for iv in block.iter_vars if int(iv.iter_type) == REDUCE}
    if block.init is None or not reduced:
        return realize
    if not all(is_one(iv.dom.extent) for iv in block.iter_vars if iv.var in reduced):
        return realize
    inits = _stores(block.init)  # one per accumulator: two for an argmax (index, value)
    if inits is None:
        return realize
    init_of = {init.buffer: init for init in inits}
    stores = []
    tvm_ffi.structural_walk(block.body, [(tirx.BufferStore, stores.append)])
    if len(stores) != len(inits) or not all(
        s.buffer in init_of and _same_indices(s, init_of[s.buffer]) for s in stores
    ):
        return realize
    loads = []
    tvm_ffi.structural_walk(block.body, [(tvm.ir.TensorLoad, loads.append)])
    if any(ld.source in init_of and not _same_indices(ld, init_of[ld.source]) for ld in loads):
        return realize

    def initial(load):  # the update's read of an accumulator: its initial value
        init = init_of.get(load.source)
        return load if init is None else init.value

    def fixed(node):  # the reduced iterators at their only value
        return tvm_ffi.structural_map(node, (tvm.ir.Var, lambda v: reduced.get(v, v)))

    body = fixed(tvm_ffi.structural_map(block.body, (tvm.ir.TensorLoad, initial)))

    def region(r):
        ranges = [tvm.ir.Range.from_min_extent(fixed(x.min), x.extent) for x in r.region]
        return tirx.BufferRegion(r.source, ranges)

    keep = [i for i, iv in enumerate(block.iter_vars) if iv.var not in reduced]
    spatial = s_tir.SBlock(
        [block.iter_vars[i] for i in keep],
        [region(r) for r in block.reads if r.source not in init_of],
        [region(w) for w in block.writes],
        block.name_hint,
        body,
        None,
        block.alloc_buffers,
        block.match_buffers,
        block.annotations,
    )
    return s_tir.SBlockRealize([realize.iter_values[i] for i in keep], realize.predicate, spatial)


def _stores(stmt) -> list | None:
    """The stores of ``stmt``, a store or a sequence of them; None if it is anything else."""
    if isinstance(stmt, tirx.BufferStore):
        return [stmt]
    if isinstance(stmt, tirx.SeqStmt) and all(isinstance(s, tirx.BufferStore) for s in stmt.seq):
        return list(stmt.seq)
    return None


def _same_indices(a, b) -> bool:
    return len(a.indices) == len(b.indices) and all(
        x.same_as(y) for x, y in zip(a.indices, b.indices)
    )


def op_patterns(mod: IRModule) -> dict:
    """The ``op_pattern`` of each PrimFunc of ``mod`` that has one, by its GlobalVar."""
    return {gvar: int(func.attrs["op_pattern"]) for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and func.attrs and "op_pattern" in func.attrs}


def calls_any(node, ops) -> bool:
    """Whether ``node`` (a TIR expression or statement) calls one of the ``ops``."""
    found = []

    def visit(call):
        if not found and call.op in ops:
            found.append(call)

    tvm_ffi.structural_walk(node, [(tvm.ir.Call, visit)])
    return bool(found)
