"""Cheap elementwise producers recomputed in each consumer's kernel, a Relax rewrite between
``AnnotateTIROpPattern`` and ``FuseOps`` (CPU).

``FuseOps`` fuses a producer into its consumer only when the consumer is the producer's sole
reader. An adjoint often reads a forward value twice: ``t = x + bias`` feeds ``relu(t)`` in the
forward part and ``where(t < 0, 0, g)`` in the backward one, so ``t`` is written to memory and
read back, and ``relu`` runs as a kernel of its own; a normalization's gradient reads
``c = x - mean`` in two reductions and an elementwise kernel. :class:`DuplicateCheapProducers`
gives each further reader (elementwise, injective or a reduction, all of which fuse their
elementwise producers) its own copy of such a producer (an elementwise or broadcast PrimFunc
whose operands of the result's size all come, through such producers, from one var, the
others smaller; or a reshape: a GELU's input, the bias sum reshaped from the gemm's rows, is
read by GELU and by its gradient): each copy fuses into its reader, and ``x`` is kept instead
of ``t`` (the same size), so the memory does not grow. A copy reads its producer's operands,
so one of them that is itself such a producer would gain a reader: a copy reads copies of
those too, made with it (a producer read once, by a producer that is copied, counts as such),
so that one round copies a whole chain (batch norm's gradient: ``c * rstd`` and, in its copies,
``c``; GPT-2's GELU, whose gradient reads ``x * x`` and ``x + 0.044715 x ** 3``: both, and
what they read). Rounds repeat until none is copied, up to ``max_rounds``, for the chains a
round's rewrite makes (copying a chain one link per round, 4 rounds left one of GPT-2's GELU
intermediates written: its adjoint, interleaved A/B over 6 rounds, median 3980 -> 3908 ms
with the chains copied at once). A producer of no full-size operand (a broadcast mask, as the
cross-entropy's gradient, :class:`~relaxgrad.schedules.NllLossGradAsMask`) is copied too. A
producer of narrower floats than its full-size operand (a float32 value rounded to bfloat16, which
mixed precision holds so for the backward pass) is a root: copies of what is computed from it
read it, so the float32 value it was rounded from dies; its late readers (below) read copies
of it all the same, computed from the held value it comes from. A
copy computes at most ``_MAX_COST`` ops, its producers' copies included: a chain whose steps
read the step before twice (``a = a * a + a``) would otherwise double its work per step. A
reader whose result is larger than the producer (one that broadcasts it) reads the producer
itself where the copy would compute a transcendental function (``exp``, ``cos``, ``erf``, ...:
a library call or a polynomial per element, not an instruction as ``sqrt``): there a copy
computes it once per element the producer is broadcast to, while the memory it saves is the
producer's, small beside the reader's. A rotary embedding's ``cos(positions * freqs)`` and
``sin``, read by every layer's queries and keys (broadcast over the heads), were a cosine and a
sine per element of theirs: computed once now, a Qwen2-0.5B-shaped bf16 LoRA step's other
kernels than its products took 0.92x their time on an AMD EPYC Zen 3 (4 layers, interleaved
in one process). Cheap arithmetic (a batch norm's mean) is still copied: it costs the reader
next to nothing, and as a kernel of its own it would add a call per statistic.

A producer read by a kernel that fuses nothing (a BLAS call) is copied too where that saves
memory rather than time: when its readers fall in two groups far apart (the forward pass that
reads an activation, the backward pass that reads it again for a weight's gradient, at least
``_LATE_GAP`` bindings later) and the var it is computed from is alive anyway until the last
of them (a normalization's input, read by its gradient), the later readers read a copy made
just before each of them, so that the producer dies with the forward pass instead of living
beside the var it is computed from. A copy read by a BLAS call is a kernel of its own, one pass
over the memory, which the forward pass ran already: ResNet-50's ``relu(batch_norm(conv))``
outputs and its blocks' ``relu(x + shortcut)``, BERT-base's GELU outputs (read again by the
weight gradients of the products that follow them), which the training step otherwise keeps
from its forward pass to its backward pass next to the convolution and product outputs they
are computed from.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from ._common import ELEMWISE, INJECTIVE, calls_any, op_patterns, static_shape

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_FUSABLE = 3  # relax's OpPatternKind up to kCommReduce: elementwise, broadcast, injective, reduce
_MAX_COST = 32  # ops a copy may recompute (GPT-2's GELU's x + 0.044715 x ** 3: 12)
_LATE_GAP = 64  # bindings between a producer's readers for the later ones to read copies


@tvm.transform.module_pass(opt_level=0, name="DuplicateCheapProducers")
class DuplicateCheapProducers:
    """Copy a cheap elementwise producer for each of its readers after the first (see the
    module docstring)."""

    def __init__(self, max_rounds: int = 4):
        self.max_rounds = max_rounds

    def transform_module(self, mod: IRModule, ctx: tvm.transform.PassContext) -> IRModule:
        # A copy reads its producer's operands: when one of them is itself a cheap producer, it
        # has a reader more, which the next round gives a copy of its own (``c = x - mean``
        # read by the copies of ``c * rstd`` in a batch norm's gradient).
        todo = None  # the functions a round rewrites: all, then those the last one changed
        facts: dict = {}  # what the rounds read of each binding and var (_Rewriter.facts)
        for _ in range(self.max_rounds):
            rewriter, changed = _Rewriter(mod, facts), set()
            for gvar, func in mod.functions_items():
                if isinstance(func, relax.Function) and (todo is None or gvar in todo):
                    copies = rewriter.copies
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
                    if rewriter.copies > copies:
                        changed.add(gvar)
            mod = rewriter.builder_.get()
            if not changed:
                break
            todo = changed
        return mod


def _patterns(mod: IRModule) -> dict:
    """The ``op_pattern`` of each PrimFunc of ``mod`` that has one, by its GlobalVar; a reshape
    (``has_reshape_pattern``: the same elements in the same order, an injective op) counts as
    elementwise, which it is but for its indices."""
    return {gvar: ELEMWISE if pattern == INJECTIVE
            and relax.analysis.has_reshape_pattern(mod[gvar]) else pattern
            for gvar, pattern in op_patterns(mod).items()}  # fmt: skip


_TRANSCENDENTAL = {tvm.ir.Op.get(f"tirx.{name}") for name in (
    "exp", "exp2", "exp10", "log", "log10", "log1p", "pow", "cos", "sin", "tan",
    "cosh", "sinh", "tanh", "acos", "asin", "atan", "atan2", "acosh", "asinh", "atanh", "erf",
    "sigmoid")}  # fmt: skip
"""Calls that compute a transcendental function: a library call or a polynomial per element,
not an instruction as ``sqrt``."""


def _pattern(patterns: dict, call) -> int | None:
    """The ``op_pattern`` of the PrimFunc ``call`` runs through ``call_tir``, else None."""
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
        return None
    return patterns.get(call.args[0])


def _operands(call: relax.Call) -> list:
    """The operands of a ``call_tir``: the fields of its tuple (read as a list at once; item by
    item, a Relax tuple asks for its fields again per item)."""
    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else list(args)


def _late_readers(readers: list, root_alive_until: float) -> set:
    """The readers (binding handles) of a producer that read a copy of it: those after the
    widest gap between its readers' ``(position, handle)``s, when that gap is at least
    ``_LATE_GAP`` bindings and the var the copies read is alive until the last of them."""
    positions = [p for p, _ in readers]
    if len(positions) < 2 or root_alive_until < positions[-1]:
        return set()
    gap, cut = max((b - a, i + 1) for i, (a, b) in enumerate(zip(positions, positions[1:])))
    return {h for _, h in readers[cut:]} if gap >= _LATE_GAP else set()


def _narrows(var, full: list) -> bool:
    """Whether ``var`` holds 16-bit floats computed from wider full-size operands (a float32
    value rounded to bfloat16 to be held in half the memory; not a normalization's statistics
    computed in float32 from float64, say)."""
    dtype = _ty.dtype_of(var)
    if not _ty.is_float_dtype(dtype) or tvm.DataType(dtype).bits > 16:
        return False
    bits = tvm.DataType(dtype).bits
    return any(_ty.is_float_tensor(a) and tvm.DataType(_ty.dtype_of(a)).bits > bits
               for a in full)  # fmt: skip


def _size(expr) -> int | None:
    shape = static_shape(expr)
    return None if shape is None else math.prod(shape)


@mutator
class _Rewriter(PyExprMutator):
    """One round. ``facts``: what :meth:`_cheap_producers` read of each binding and the size of
    each var, kept over the rounds, which rebuild the functions they change with their other
    bindings the same objects; keyed by handle (``hash``, where a dict of TVM objects compares
    their Python wrappers' keys slowly), each with its object, so that no handle is reused."""

    def __init__(self, mod: IRModule, facts: dict):
        super().__init__(mod)
        self.mod, self.patterns = mod, _patterns(mod)
        self.costly: dict = {}  # cheap producer var -> whether its copy computes one
        self.facts = facts
        self.cheap: dict = {}  # producer var -> its call, for the producers worth copying
        self.seen: set = set()  # producers whose first reader has been emitted
        self.inner: set = set()  # cheap producers of one reader, copied within copies only
        self.late: dict = {}  # producer var -> the bindings (handles) that read a copy of it
        self.chains: dict = {}  # producer var (its handle) -> (its call, operands to copy)
        self.copies = 0

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.inner, self.seen, self.late, self.chains = set(), set(), {}, {}
        self.cheap = self._cheap_producers(func)
        if len(self.cheap) == len(self.inner) and not self.late:  # none read twice
            return func  # nothing to copy: no need to rebuild it binding by binding
        return super().visit_function_(func)

    def _cheap_producers(self, func: relax.Function) -> dict:
        if not isinstance(func.body, relax.SeqExpr):
            return {}
        bindings = [b for block in func.body.blocks
                    if isinstance(block, relax.DataflowBlock) for b in block.bindings]  # fmt: skip
        facts = [self._facts(b) for b in bindings]
        readers: dict = {}  # each var's (by handle) call_tir readers' patterns
        read_anywhere: dict = {}  # the reads of each var by bindings (a call reads it once)
        at: dict = {}  # each var's call_tir readers: (position, binding handle)
        last_read: dict = {}  # each var's last reading binding's position
        for position, (b, _, pattern, args, free) in enumerate(facts):
            if pattern is not None:
                for arg in {hash(a) for a in args}:  # a reader of one var twice (c * c) once
                    readers.setdefault(arg, []).append(pattern)
                    at.setdefault(arg, []).append((position, hash(b)))
            for key in free:
                read_anywhere[key] = read_anywhere.get(key, 0) + 1
                last_read[key] = position
        bound = {hash(var) for _, var, _, _, _ in facts}
        for var in relax.analysis.free_vars(func.body.body):  # the function's result
            read_anywhere[hash(var)] = read_anywhere.get(hash(var), 0) + 1
        cheap = {}
        roots: dict = {}  # the full-size vars (handles) each elementwise producer expands to
        costs: dict = {}  # the ops a copy of it computes, its producers' copies included
        for b, var, pattern, args, _ in facts:
            if pattern is None or pattern > 1 or not isinstance(var, relax.DataflowVar):
                continue
            size = self._size(var)
            sizes = [self._size(a) for a in args]
            if size is None or None in sizes or any(s > size for s in sizes):
                continue
            found = set()
            for arg, arg_size in zip(args, sizes):
                if arg_size == size:
                    found |= roots.get(hash(arg), {hash(arg)})
            if _narrows(var, [a for a, s in zip(args, sizes) if s == size]):
                roots[hash(var)], costs[hash(var)] = {hash(var)}, 0
                if len(found) == 1 and hash(var) in at:  # a product's operand, read again late
                    self._read_late(var, found, at, last_read, bound)
                continue  # a copy of it would keep the wider var alive: it is a root
            if len(found) > 1:
                continue  # copies would keep two full-size vars alive for one
            cost = 1 + sum(costs.get(hash(arg), 0) for arg in args)  # (x * x: x's twice)
            if cost > _MAX_COST:
                continue  # a chain reading each step twice (a = a * a + a) would grow 2 ** n
            roots[hash(var)], costs[hash(var)] = found, cost
            users = readers.get(hash(var), [])
            if not users or read_anywhere.get(hash(var), 0) != len(users):
                continue  # read by something other than call_tir, e.g. a tuple or the output
            if all(p <= _FUSABLE for p in users):
                cheap[var] = b.value
                if len(users) < 2:
                    self.inner.add(var)  # copied only inside its reader's copies
            elif len(found) == 1:
                self._read_late(var, found, at, last_read, bound)
        values = {hash(var): b.value for b, var, _, _, _ in facts} if self.late else {}
        for var in self.late:  # a copy computes the chain down to the full-size var
            self._chain(var, values, roots)
        return cheap

    def _read_late(self, var, found: set, at: dict, last_read: dict, bound: set) -> None:
        """Record in ``late`` the readers of ``var`` that read a copy computed from the one
        full-size var in ``found`` (see :func:`_late_readers`)."""
        (root,) = found
        late = _late_readers(at[hash(var)], last_read.get(root, -1)
                             if root in bound else math.inf)  # (a parameter: always)
        if late:
            self.late[var] = late

    def _chain(self, var, values: dict, roots: dict) -> None:
        """Record in ``chains`` the call of ``var`` and, recursively, of the elementwise
        producers it reads that expand to a full-size var (their copies serve its copy)."""
        if hash(var) in self.chains:
            return
        value = values[hash(var)]
        inner = [a for a in dict.fromkeys(_operands(value))
                 if roots.get(hash(a), {hash(a)}) != {hash(a)}]  # (not a root: narrowed)
        self.chains[hash(var)] = (value, inner)
        for arg in inner:
            self._chain(arg, values, roots)

    def _facts(self, binding: relax.VarBinding) -> tuple:
        """``(binding, var, op_pattern or None, operands, handles of the vars it reads)``."""
        found = self.facts.get(hash(binding))
        if found is None:
            value = binding.value
            pattern = _pattern(self.patterns, value)
            args = _operands(value) if pattern is not None else []
            free = [hash(v) for v in relax.analysis.free_vars(value)]
            found = self.facts[hash(binding)] = (binding, binding.var, pattern, args, free)
        return found

    def _size(self, var) -> int | None:
        found = self.facts.get(hash(var))
        if found is None:
            found = self.facts[hash(var)] = (var, _size(var))
        return found[1]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        _, _, pattern, args, _ = self._facts(binding)
        if pattern is None or not (self.cheap or self.late):
            return super().visit_var_binding_(binding)
        copies = {}
        size = self._size(binding.var)
        for arg in dict.fromkeys(args):  # each var once, in order
            if hash(binding) in self.late.get(arg, ()):
                copies[arg] = self._copy_chain(arg)
            elif arg in self.cheap and arg not in self.inner \
                    and not (size is not None and self._size(arg) < size
                             and self._transcendental(arg)):
                if arg in self.seen:
                    copies[arg] = self._copy(arg)
                self.seen.add(arg)
        if not copies:
            return super().visit_var_binding_(binding)
        return super().visit_var_binding_(
            relax.VarBinding(binding.var, self._with_operands(binding.value, copies)))

    def _transcendental(self, var) -> bool:
        """Whether a copy of the cheap producer ``var`` computes a transcendental function
        (its own kernel's or that of a cheap producer it reads, which the copy copies)."""
        if var not in self.costly:
            value = self.cheap[var]
            gvar = value.args[0]
            known = self.facts.get(hash(gvar))  # (kept over the rounds, as the bindings')
            if known is None:
                known = (gvar, calls_any(self.mod[gvar].body, _TRANSCENDENTAL))
                self.facts[hash(gvar)] = known
            self.costly[var] = known[1] or any(
                self._transcendental(arg) for arg in _operands(value) if arg in self.cheap)
        return self.costly[var]

    def _copy(self, var) -> relax.Var:
        """A copy of the cheap producer ``var``, reading copies of the cheap producers it
        reads (each would otherwise gain this copy as a reader, and a producer of one reader
        is copied nowhere else), so that one round copies a whole chain (GPT-2's GELU:
        ``x * x``, then ``x ** 3``, then ``x + ...``)."""
        value = self.cheap[var]
        inner = {arg: self._copy(arg) for arg in dict.fromkeys(_operands(value))
                 if arg in self.cheap}  # fmt: skip
        self.copies += 1
        return self.builder_.emit(self._with_operands(value, inner), "dup")

    def _copy_chain(self, var) -> relax.Var:
        """A copy of the producer ``var`` for a late reader, computed from the full-size var
        it expands to (copies of the producers in between)."""
        value, inner = self.chains[hash(var)]
        copies = {arg: self._copy_chain(arg) for arg in inner}
        self.copies += 1
        return self.builder_.emit(self._with_operands(value, copies), "late")

    def _with_operands(self, value: relax.Call, copies: dict) -> relax.Call:
        operands = relax.Tuple([self.visit_expr(copies.get(a, a)) for a in _operands(value)])
        return relax.Call(value.op, [value.args[0], operands, *value.args[2:]],
                          value.attrs, value.ty_args)  # fmt: skip
