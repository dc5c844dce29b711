"""Train a ``torch.nn.Module`` with relaxgrad: :func:`from_torch`.

The path (PyTorch is imported only when this is called):

1. ``torch.export.export`` traces the module, once in train mode and once in eval mode. It is
   wrapped so that its buffers (BatchNorm's running statistics) are inputs of the traced graph
   and their values after the forward pass are extra outputs. The eval-mode trace is
   decomposed and imported only when it differs from the train-mode one (a dropout of
   probability 0 is the identity in both modes): decomposing to core ATen retraces the
   program and is most of an import's time.
2. TVM's importer ``tvm.relax.frontend.torch.from_exported_program(...,
   keep_params_as_input=True)`` turns each into a Relax function: ``main`` (train mode) and
   ``main_eval`` (eval mode, kept only when it differs from ``main``). Parameters and buffers
   are renamed to the module's ``state_dict`` keys (``"0.weight"``, ``"bn.running_mean"``),
   in ``state_dict`` order after the inputs.
3. Both return a tuple: the module's output, then the new value of each buffer. The Trainer
   appends the loss to field 0, and after each step replaces the buffers by the other fields.

Train-mode BatchNorm normalizes with the batch statistics and updates the running statistics
as PyTorch does (``momentum`` average, the unbiased batch variance for ``running_var``,
``num_batches_tracked += 1``); TVM 0.27's own converter of
``_native_batch_norm_legit_functional`` returns zeros for the new running statistics, so
:func:`from_torch` converts that op itself. Eval mode normalizes with the running statistics.

Other ops whose TVM 0.27 converter drops or gets something wrong are converted here too:
``embedding`` (``padding_idx``: that row gets no gradient), ``cat`` (PyTorch's legacy empty
tensors, as in Hugging Face's empty key/value caches, are skipped) and ``cumsum`` (of a bool
or integer tensor: int64, as in PyTorch). A parameter the module holds under several names
(tied weights: a language model's output layer and its input embedding) is one parameter of
the Relax functions, under its first name; its gradient sums those of its uses, and
``Trainer.state_dict()`` gives it under every name (``Model.aliases``).

Dropout drops (``dropout="random"``, the default): TVM 0.27's importer would turn ``dropout``,
``native_dropout`` and ``bernoulli`` (what an in-place ``nn.Dropout`` decomposes to) into the
identity, so :func:`from_torch` converts them itself to Philox masks
(:mod:`relaxgrad.ops.random`) drawn from a key: the train-mode function gains a last parameter
``dropout_key`` (a ``(2,)`` uint32 tensor, :data:`DROPOUT_KEY`) that the Trainer feeds a fresh
value every step, and each dropout of the graph has its own stream. ``dropout="identity"``
replaces each mask by its mean (dropout becomes the identity; with a warning). Any other random
op (``rand``, ``randn``, ``randint``, ``multinomial``, ``normal``, ``bernoulli`` of a tensor of
probabilities, ...), which the importer would make deterministic, is refused by name.
Dropout in eval mode is the identity in PyTorch too.

SiLU stays one op (``relax.nn.silu``, :data:`_KEPT_OPS`): core ATen's decomposition writes it
``x * sigmoid(x)``, two ops, so that mixed precision rounded the sigmoid to bf16, then the
product (autocast's ``silu`` rounds once), and the training step held the rounded sigmoid for
the backward pass beside ``x`` and the result (4 layers of Qwen2-0.5B's shape with LoRA, in bf16:
the adjoint's packed workspace 145 MiB, 107 with SiLU whole; float32 steps are unchanged, their
sigmoid being recomputed from ``x`` where it is read).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import IRModule
from tvm.relax import op
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import _ty
from .._module import with_function
from ..exprs import is_op
from ..ops import random
from ..ops.nn import batch_statistics
from ..transforms import stop_gradient
from .models import Model

__all__ = ["DROPOUT_KEY", "from_torch"]

#: Name of the key parameter that :func:`from_torch` adds to a train-mode function that drops out.
DROPOUT_KEY = "dropout_key"
_DROPOUT_OPS = ("native_dropout.default", "dropout.default", "dropout_.default")
_RANDOM_OPS = (*_DROPOUT_OPS, "bernoulli.p")  # the random ops from_torch converts
_KEPT_OPS = ("silu",)  # aten ops left whole by the decomposition (see the module docstring)


def from_torch(
    module,
    example_inputs: Sequence,
    *,
    dropout: Literal["random", "identity", "error"] = "random",
    func_name: str = "main",
) -> Model:
    """Import a ``torch.nn.Module`` as a trainable relaxgrad :class:`Model`.

    Parameters
    ----------
    module : torch.nn.Module
        The model. Its ``state_dict`` gives the initial parameter and buffer values; parameters
        with ``requires_grad=False`` stay fixed, as buffers. The train-mode function is traced
        with the module's own modes when it is in train mode (so a submodule put in eval mode
        stays so), after ``module.train()`` otherwise; the module's modes are restored.
    example_inputs : sequence of torch.Tensor
        One batch of inputs of ``module.forward``; the Relax functions have their static
        shapes and dtypes (so the batch size is fixed).
    dropout : "random", "identity" or "error"
        What a dropout in train mode does: drop at random from the key parameter
        ``dropout_key`` (default), act as the identity (with a warning), or raise a
        ``ValueError``.
    func_name : str
        Name of the train-mode function; the eval-mode one is ``<func_name>_eval``.

    A module in bfloat16 or float16 (``module.to(torch.bfloat16)``) is imported from a float32
    copy (its weights, exactly): the Model's ``precision`` is then ``"bf16"`` or ``"fp16"``,
    which ``Trainer.for_model`` takes as its default, so the float32 weights are master
    weights and the products run in the module's dtype.

    Returns
    -------
    Model
        ``mod`` with ``<func_name>(*inputs, *params, *buffers)`` in train mode and
        ``<func_name>_eval`` in eval mode (only when the two differ, as with BatchNorm or
        dropout), both returning ``(output, *new buffers)``; a train-mode function that drops
        out takes the key last (``key`` names it);
        ``params`` (trainable parameters) and ``buffers`` as numpy arrays by ``state_dict``
        key; ``updates`` (the buffers replaced by fields 1.. of the result); ``state_keys``
        (the ``state_dict`` keys in order); ``aliases`` (the other keys of tied tensors).
        ``Trainer.for_model(model, ...)`` trains it and ``trainer.state_dict()`` returns
        tensors for ``module.load_state_dict``.

    Raises
    ------
    ValueError
        If the module drops out in train mode and ``dropout="error"``, uses a random op other
        than dropout and ``bernoulli(x, p)`` (named in the message), if torch.export cannot
        trace it or TVM's importer cannot convert it (naming the cause), or if TVM's importer
        returns a function this path cannot use.

    Examples
    --------
    >>> model = from_torch(net, (torch.randn(32, 64),))
    >>> trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1))
    >>> trainer.step(x, y)
    >>> net.load_state_dict(trainer.state_dict())
    """
    if dropout not in ("random", "identity", "error"):
        raise ValueError(
            f"from_torch: dropout must be 'random', 'identity' or 'error', not {dropout!r}")
    module, example_inputs, precision = _float32_copy(module, tuple(example_inputs))
    state = module.state_dict()
    param_keys = [name for name, _ in module.named_parameters()]
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    buffer_keys = [name for name, _ in module.named_buffers()]
    input_names = _input_names(module, len(example_inputs))
    aliases = _tied_names(module)

    modes = {m: m.training for m in module.modules()}
    try:
        if not module.training:  # a module in train mode keeps its submodules' own modes
            module.train()
        train_program = _exported(module, example_inputs, buffer_keys)
        eval_program = _exported(module.eval(), example_inputs, buffer_keys)
    finally:
        for submodule, training in modes.items():
            submodule.training = training
    names = input_names + param_keys + buffer_keys
    train, renames, key, kernels = _import(train_program, module, "train", input_names,
                                           buffer_keys, dropout, aliases)
    train = _with_param_names(train, renames, names, len(example_inputs), key)
    mod = with_function(IRModule(kernels), func_name, train)
    eval_func = None  # the same function in both modes (no BatchNorm, no dropout...)
    # with no random ops and the same trace, the eval-mode function is the train-mode one
    if key is not None or not _same_trace(train_program, eval_program):
        evaluation, eval_renames, _, _ = _import(eval_program, module, "eval", input_names,
                                                 buffer_keys, dropout, aliases)
        evaluation = _with_param_names(evaluation, eval_renames, names, len(example_inputs))
        if not tvm_ffi.structural_equal(train, evaluation):
            eval_func = f"{func_name}_eval"
            mod = with_function(mod, eval_func, evaluation)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    # views of the module's tensors, not copies: the Trainer copies them once, to the device
    values = {k: _read_only(v.detach().cpu().numpy()) for k, v in tensors}
    return Model(
        mod,
        {k: values[k] for k in trainable},
        func_name,
        buffers={k: values[k] for k in param_keys + buffer_keys if k not in trainable},
        updates=tuple(buffer_keys),
        eval_func=eval_func,
        state_keys=tuple(state),
        aliases={k: v for k, v in aliases.items() if k in state},
        torch_state=True,
        key=None if key is None else DROPOUT_KEY,
        precision=precision,
    )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _float32_copy(module, inputs: tuple):
    """``(module, inputs, None)``, or for a module in bfloat16 or float16 a float32 copy of it,
    its inputs in float32 and its precision (``"bf16"`` or ``"fp16"``): the float32 weights
    are the master weights the Trainer keeps, its products running in the module's dtype."""
    import copy

    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    low = {t.dtype for t in (*module.parameters(), *module.buffers()) if t.dtype in names}
    if not low:
        return module, inputs, None
    if len(low) > 1:
        raise ValueError("from_torch: the module holds both bfloat16 and float16 tensors; "
                         "convert it to one dtype (module.to(torch.bfloat16))")
    inputs = tuple(x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x
                   for x in inputs)  # fmt: skip
    return copy.deepcopy(module).float(), inputs, names[low.pop()]


def _tied_names(module) -> dict[str, str]:
    """Every other name of a parameter or buffer that the module holds under several names
    (tied weights, e.g. ``lm_head.weight`` is ``transformer.wte.weight``) -> its first name."""
    first, aliases = {}, {}
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _input_names(module, count: int) -> list[str]:
    """The names of ``forward``'s first ``count`` parameters (``input<i>`` past them)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    plain = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [plain[i] if i < len(plain) else f"input{i}" for i in range(count)]


def _exported(module, example_inputs: tuple, buffer_keys: list[str]):
    """``torch.export.export`` of ``module`` in its current mode, its buffers as inputs and
    their values after the forward pass as outputs (not yet decomposed)."""
    import torch

    buffers = dict(module.named_buffers())
    mode = "train" if module.training else "eval"
    with warnings.catch_warnings(), _refused("torch.export cannot trace", module, mode):
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        return torch.export.export(
            _buffers_as_inputs(module, buffer_keys, len(example_inputs)),
            (*example_inputs, *(buffers[k].detach().clone() for k in buffer_keys)),
        )


_ZERO_DROPOUT = re.compile(r"(torch\.ops\.aten\.dropout\.default\(\w+, 0\.0), (?:True|False)\)")


def _same_trace(a, b) -> bool:
    """Whether two traces of one module (its train- and eval-mode ones) are the same program,
    so that they decompose to the same one: the same code in every graph module, where a
    dropout of probability 0 (the identity in either mode) is the same whether it trains or
    not, the same signature and the same constants."""
    import torch

    def code(program) -> list[str]:
        return [_ZERO_DROPOUT.sub(r"\1)", m.code) for _, m in program.graph_module.named_modules()
                if isinstance(m, torch.fx.GraphModule)]

    return (code(a) == code(b) and str(a.graph_signature) == str(b.graph_signature)
            and a.constants.keys() == b.constants.keys()
            and all(_same_constant(a.constants[k], b.constants[k]) for k in a.constants))


def _same_constant(a, b) -> bool:
    """Equal tensors (dtype, shape and values), or one and the same other object."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return a is b


def _import(program, module, mode: str, input_names, buffer_keys: list[str],
            dropout: str, aliases: dict[str, str]):
    """``main(*inputs, *buffers, *params)`` of the module traced in ``program`` (in ``mode``),
    returning ``(output, *buffers after the forward pass)``; the renames of its parameters
    (exported name -> input name or ``state_dict`` key; the first name of a tied parameter, by
    ``aliases``); the dropout key it reads (None if none); and the PrimFuncs it calls (the
    dropout masks'), by GlobalVar."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    num_inputs = len(input_names)
    with warnings.catch_warnings(), _refused("torch.export cannot trace", module, mode):
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        program = program.run_decompositions(_decompositions())
    _check_random(program, dropout if mode == "train" else "eval")
    masks = _Masks(dropout)
    converters = {name: getattr(masks, name.split(".")[0].strip("_")) for name in _RANDOM_OPS}
    with _refused("TVM's importer cannot convert", module, mode):
        mod = from_exported_program(
            program,
            keep_params_as_input=True,
            custom_convert_map={**_CONVERTERS, **converters},
            run_ep_decomposition=False,
        )
    func = _WrapTakes().visit_expr(mod["main"])
    fields = getattr(func.ret_ty, "fields", None)
    if fields is None or len(fields) != 1 + len(buffer_keys):
        raise ValueError(
            "from_torch: the module must return one tensor; TVM's importer returned "
            f"{func.ret_ty}"
        )
    renames = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.PARAMETER:
            target = spec.target.removeprefix("module.")
            renames[spec.arg.name] = aliases.get(target, target)
    user = [spec.arg.name for spec in program.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    renames.update(zip(user[num_inputs:], buffer_keys))
    renames.update(zip(user[:num_inputs], input_names))
    kernels = {gv: f for gv, f in mod.functions_items() if not isinstance(f, relax.Function)}
    return func, renames, masks.key, kernels


def _decompositions():
    """torch.export's core ATen decompositions but those of :data:`_KEPT_OPS`."""
    import torch

    table = torch.export.default_decompositions()
    for name in _KEPT_OPS:
        table.pop(getattr(torch.ops.aten, name).default, None)
    return table


@contextlib.contextmanager
def _refused(what: str, module, mode: str):
    """Turn an error of torch.export or TVM's importer (TVM 0.27 asserts on ops it has no
    converter for) into a ``ValueError`` naming the module and its ``mode``; from_torch's own
    pass through."""
    try:
        yield
    except Exception as e:
        if isinstance(e, ValueError) and str(e).startswith("from_torch"):
            raise
        raise ValueError(
            f"from_torch: {what} {type(module).__name__} (in {mode} mode)"
            f"{_attention_hint(module)}: {type(e).__name__}: {e}"
        ) from e


def _attention_hint(module) -> str:
    """A hint for Hugging Face ``transformers`` models whose attention is not eager (torch 2.13
    cannot always export SDPA attention, e.g. GPT-2's)."""
    for submodule in module.modules():
        attention = getattr(getattr(submodule, "config", None), "_attn_implementation", None)
        if attention not in (None, "eager"):
            return (f"; {type(submodule).__name__} uses {attention!r} attention: set "
                    "config._attn_implementation = 'eager' (the same function) and import again")
    return ""


def _buffers_as_inputs(module, buffer_keys: list[str], num_inputs: int):
    """``module`` wrapped so that its buffers are inputs of the traced graph."""
    import torch

    class BuffersAsInputs(torch.nn.Module):
        """``forward(*inputs, *buffers) -> (module(*inputs), *buffers after it)``."""

        def __init__(self, module, buffer_keys, num_inputs):
            super().__init__()
            self.module, self.buffer_keys, self.num_inputs = module, buffer_keys, num_inputs

        def forward(self, *args):
            inputs, buffers = args[: self.num_inputs], args[self.num_inputs :]
            out = torch.func.functional_call(
                self.module, dict(zip(self.buffer_keys, buffers)), inputs, strict=False
            )
            if not isinstance(out, torch.Tensor):
                raise ValueError(
                    f"from_torch: the module must return one tensor, not {type(out).__name__}"
                )
            return (out, *(b.clone() for b in buffers))

    return BuffersAsInputs(module, buffer_keys, num_inputs)


def _check_random(program, dropout: str) -> None:
    """Refuse the random ops :class:`_Masks` does not convert (and, with ``dropout="error"``,
    an active dropout), naming the nodes; warn under ``dropout="identity"``."""
    import torch

    refused, dropping = [], []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "")
        tags = getattr(node.target, "tags", ())
        if name in _RANDOM_OPS:
            if name == "bernoulli.p" or (_arg(node, 2, "train", True) and _arg(node, 1, "p", 0.5)):
                found = f"{node.name} ({name}, p={_arg(node, 1, 'p', 0.5)})"
                (refused if dropout == "eval" else dropping).append(found)
        elif torch.Tag.nondeterministic_seeded in tags:
            refused.append(f"{node.name} ({name})")
    if refused:
        raise ValueError(
            f"from_torch: the module uses random ops that relaxgrad cannot import: "
            f"{', '.join(refused)}. TVM's importer would make them deterministic; only dropout "
            "and bernoulli(x, p) are converted to keyed random masks."
        )
    if not dropping or dropout == "random":
        return
    message = f"from_torch: the module drops out in train mode ({', '.join(dropping)})"
    if dropout == "error":
        raise ValueError(
            message + " and dropout='error'. Use dropout='random' (the default) to drop at "
            "random, or put the dropout layers in eval mode before importing."
        )
    warnings.warn(message + "; dropout='identity' turns dropout into the identity.",
                  stacklevel=4)


def _arg(node, index: int, name: str, default):
    """Argument ``index`` (or keyword ``name``) of an FX node."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


class _Masks:
    """Converters of PyTorch's dropout and ``bernoulli(x, p)`` for TVM's importer: keyed Philox
    masks (``"random"``; the key var is created on first use, each node gets the next stream)
    or their means (``"identity"``)."""

    def __init__(self, dropout: str):
        self.random = dropout == "random"
        self.key: relax.Var | None = None
        self.sites = 0

    def _stream(self) -> tuple[relax.Var, int]:
        if self.key is None:
            self.key = relax.Var(DROPOUT_KEY, random.KEY_TYPE)
        self.sites += 1
        return self.key, self.sites - 1

    def _apply(self, node, importer) -> tuple[relax.Expr, relax.Expr]:
        """``(y, keep)`` of ``dropout(x, p, train)``."""
        bb, x = importer.block_builder, importer.env[node.args[0]]
        p, train = float(_arg(node, 1, "p", 0.5)), bool(_arg(node, 2, "train", True))
        if not self.random or not train or p == 0.0:
            return x, bb.emit(op.ones(_ty.shape_of(x), "bool"))
        key, site = self._stream()
        y, keep = random.dropout(bb, x, key, p, site)
        return bb.emit(y), keep

    def native_dropout(self, node, importer) -> relax.Expr:
        return importer.block_builder.emit(relax.Tuple(list(self._apply(node, importer))))

    def dropout(self, node, importer) -> relax.Expr:
        return self._apply(node, importer)[0]

    def bernoulli(self, node, importer) -> relax.Expr:
        """``bernoulli(x, p)``: a float tensor like ``x`` of 1s with probability ``p``."""
        bb, x = importer.block_builder, importer.env[node.args[0]]
        p, dtype = float(_arg(node, 1, "p", 0.5)), _ty.dtype_of(x)
        if not self.random:
            return bb.emit(op.full_like(x, relax.const(p, dtype)))
        key, site = self._stream()
        keep = random.bernoulli(bb, x, key, p, site)
        return bb.emit(op.astype(keep, dtype))


def _batch_norm_train(node, importer) -> relax.Expr:
    """``_native_batch_norm_legit_functional(x, w, b, running_mean, running_var, training,
    momentum, eps) -> (out, mean, rstd, new_running_mean, new_running_var)``, as PyTorch."""
    bb, env = importer.block_builder, importer.env
    args = list(node.args) + [None] * (8 - len(node.args))
    x, running_mean, running_var = env[args[0]], env[args[3]], env[args[4]]
    training = True if args[5] is None else bool(args[5])
    momentum = 0.1 if args[6] is None else float(args[6])
    eps = 1e-5 if args[7] is None else float(args[7])
    shape, dtype = _ty.static_shape(x), _ty.dtype_of(running_mean)
    ones = relax.const(np.ones(shape[1], dtype), dtype)
    weight = env[args[1]] if args[1] is not None else ones
    bias = env[args[2]] if args[2] is not None else relax.const(np.zeros(shape[1], dtype), dtype)
    normalized = bb.emit(
        op.nn.batch_norm(x, weight, bias, running_mean, running_var, axis=1, epsilon=eps,
                         momentum=momentum, training=training)
    )
    out = bb.emit(relax.TupleGetItem(normalized, 0))
    axes = [0, *range(2, len(shape))]
    count = int(np.prod([shape[a] for a in axes]))
    # (the statistics as batch_norm's gradient computes them: one computation after
    # relaxgrad.compile's ShareStatistics and common subexpressions)
    batch_mean, _, batch_var = batch_statistics(x, axes)
    mean, var = (bb.emit(op.astype(op.reshape(s, [shape[1]]), dtype))
                 for s in (batch_mean, batch_var))
    rstd = bb.emit(op.rsqrt(var + relax.const(eps, dtype)))
    if not training:
        return bb.emit(relax.Tuple([out, mean, rstd, running_mean, running_var]))
    m = relax.const(momentum, dtype)
    keep = relax.const(1.0 - momentum, dtype)
    unbiased = relax.const(count / max(count - 1, 1), dtype)
    new_mean = bb.emit(keep * running_mean + m * mean)
    new_var = bb.emit(keep * running_var + m * (unbiased * var))
    return bb.emit(relax.Tuple([out, mean, rstd, new_mean, new_var]))


def _cat(node, importer) -> relax.Expr:
    """``cat(tensors, dim)``, skipping PyTorch's legacy empty tensors (shape ``(0,)``), which
    ``torch.cat`` accepts beside tensors of any rank (Hugging Face's empty key/value caches);
    TVM's converter refuses the mixed ranks."""
    tensors = [importer.env[t] for t in node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    kept = [t for t in tensors if not _is_legacy_empty(t)] or tensors[:1]
    if len(kept) == 1:
        return kept[0]
    return importer.block_builder.emit(op.concat(relax.Tuple(kept), axis=dim))


def _divide(node, importer) -> relax.Expr:
    """``div(a, b)`` (true division) in the dtype PyTorch gives it: a float of integer operands
    (TVM's converter keeps int64, and DeBERTa-v2's log-bucketed relative positions then took
    the ``log`` of an int64 tensor)."""
    lhs, rhs = importer.retrieve_args(node)[:2]
    dtype = _result_dtype(node, importer)
    if dtype is None or not _ty.is_float_dtype(dtype):
        return importer._binary_op(op.divide, operator.truediv)(node)
    bb = importer.block_builder

    def operand(value):
        if isinstance(value, relax.Expr):
            return value if _ty.dtype_of(value) == dtype else bb.emit(op.astype(value, dtype))
        return relax.const(value, dtype)

    return bb.emit(op.divide(operand(lhs), operand(rhs)))


def _result_dtype(node, importer) -> str | None:
    """The dtype of ``node``'s result, as torch.export recorded it (None if it did not)."""
    value = node.meta.get("val")
    dtype = getattr(value, "dtype", None)
    return None if dtype is None else importer._convert_data_type(str(dtype), importer.env)


def _index(node, importer) -> relax.Expr:
    """``index(x, indices)``, PyTorch's advanced indexing: the index tensors (``None`` for a
    whole axis) broadcast together and pick elements jointly; their shape replaces the indexed
    axes where those are adjacent, and comes first otherwise. Written as one ``take`` of the
    indexed axes flattened, at the row ``sum(index_k * stride_k)`` (TVM's converter does not
    broadcast index shapes: ConvBERT's span convolution and its attention mask)."""
    bb = importer.block_builder
    x, indices = importer.retrieve_args(node)[:2]
    dims = _ty.static_shape(x)
    axes = [a for a, index in enumerate(indices) if index is not None]
    if dims is None or not axes:
        return importer._index_tensor(node)
    tensors = [indices[a] for a in axes]
    if any(_ty.dtype_of(t) == "bool" for t in tensors):
        return importer._index_tensor(node)  # a mask: its result's shape is data-dependent
    shape = list(np.broadcast_shapes(*(tuple(_ty.static_shape(t)) for t in tensors)))
    rest = [a for a in range(len(dims)) if a not in axes]
    # x with the indexed axes first, flattened into one
    moved = bb.emit(op.permute_dims(x, axes + rest)) if axes + rest != list(range(len(dims))) \
        else x
    rows = int(np.prod([dims[a] for a in axes]))
    flat = bb.emit(op.reshape(moved, [rows, *(dims[a] for a in rest)]))
    row = None
    stride = rows
    for a, index in zip(axes, tensors):
        stride //= dims[a]
        index = bb.emit(op.astype(index, "int64"))
        wrapped = bb.emit(op.floor_mod(index, relax.const(dims[a], "int64")))  # x[-1]
        term = bb.emit(op.broadcast_to(wrapped, shape))
        if stride != 1:
            term = bb.emit(op.multiply(term, relax.const(stride, "int64")))
        row = term if row is None else bb.emit(op.add(row, term))
    picked = bb.emit(op.take(flat, bb.emit(op.reshape(row, [-1])), axis=0))
    out = bb.emit(op.reshape(picked, [*shape, *(dims[a] for a in rest)]))
    adjacent = axes == list(range(axes[0], axes[-1] + 1))
    before = len([a for a in rest if a < axes[0]]) if adjacent else 0
    if before:  # the index shape in place of the indexed axes
        n = len(shape)
        order = [*range(n, n + before), *range(n), *range(n + before, n + len(rest))]
        out = bb.emit(op.permute_dims(out, order))
    return out


def _arange(node, importer) -> relax.Expr:
    """``arange(start, end, step)`` of static bounds: PyTorch's values, as a constant (TVM's
    converter counts ``ceil((end - start) / step)`` wrong for a negative step: 18 values for
    ``arange(8, -8, -1)``, Funnel's relative positions)."""
    import torch

    bounds = [*node.args]
    if not all(isinstance(b, int | float) for b in bounds):
        return importer._arange(node)
    dtype = node.kwargs.get("dtype")
    values = torch.arange(*bounds, **({} if dtype is None else {"dtype": dtype}))
    return relax.const(values.numpy(), str(values.numpy().dtype))


def _relu(node, importer) -> relax.Expr:
    """``relu(x)`` as ``where(x <= 0, 0, x)``: PyTorch's gradient at 0 (zero; TVM's ``relu``
    gradient passes ``g`` there: Swinv2's position-bias MLP, fed a (0, 0) offset with a zero bias,
    got a bias gradient 10^5 times PyTorch's error), and a NaN stays a NaN."""
    bb, x = importer.block_builder, importer.env[node.args[0]]
    zero = relax.const(0, _ty.dtype_of(x))
    return bb.emit(op.where(bb.emit(op.less_equal(x, zero)), zero, x))


def _cumsum(node, importer) -> relax.Expr:
    """``cumsum(x, dim, dtype=None)``: as in PyTorch, the sum of a bool or integer tensor is
    int64 (TVM's converter keeps bool, which LLVM cannot add: Hugging Face's masks)."""
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        dtype = importer._convert_data_type(str(dtype), importer.env)
    elif not _ty.is_float_dtype(_ty.dtype_of(x)):
        dtype = "int64"
    return importer.block_builder.emit(op.cumsum(x, dim, dtype))


def _is_legacy_empty(tensor: relax.Expr) -> bool:
    """Whether ``tensor`` is 1-D of static size 0."""
    dims = _ty.shape_values(tensor)
    return len(dims) == 1 and isinstance(dims[0], tvm.tirx.IntImm) and int(dims[0]) == 0


def _embedding(node, importer) -> relax.Expr:
    """``embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)``: rows of
    ``weight``, where the ``padding_idx`` row gets no gradient, as in PyTorch (TVM's converter
    drops ``padding_idx``)."""
    bb = importer.block_builder
    args = list(node.args) + [None] * (5 - len(node.args))
    weight, indices = importer.env[args[0]], importer.env[args[1]]
    padding_idx = -1 if args[2] is None else int(args[2])
    if args[3]:
        raise ValueError(
            f"from_torch: {node.name}: embedding with scale_grad_by_freq=True is not supported"
        )
    shape, (rows, width) = _ty.static_shape(indices), _ty.static_shape(weight)
    flat = bb.emit(op.reshape(bb.emit(op.astype(indices, "int32")), (-1,)))
    out = bb.emit(op.take(weight, flat, axis=0))
    if padding_idx != -1:
        pad = relax.const(padding_idx % rows, "int32")
        frozen = bb.emit(op.take(bb.emit(stop_gradient(weight)), flat, axis=0))
        is_pad = bb.emit(op.expand_dims(bb.emit(op.equal(flat, pad)), 1))
        out = bb.emit(op.where(is_pad, frozen, out))
    return bb.emit(op.reshape(out, (*shape, width)))


@mutator
class _WrapTakes(PyExprMutator):
    """``take(..., mode="fast")`` -> ``mode="wrap"``: TVM's importer takes PyTorch's indices,
    which may count from the end (``x[:, -1]``), in "fast" mode, which reads out of bounds for
    them (garbage, or a crash) and makes TVM warn at every compile; "wrap" is PyTorch's
    meaning and the same for every other index."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if is_op(call, "relax.take") and call.attrs.mode == "fast":
            take = op.take(call.args[0], call.args[1], axis=call.attrs.axis, mode="wrap")
            return self.builder_.normalize(take)
        return call


_CONVERTERS = {
    "_native_batch_norm_legit_functional.default": _batch_norm_train,
    "arange.start_step": _arange,
    "cat.default": _cat,
    "concat.default": _cat,
    "cumsum.default": _cumsum,
    "div.Scalar": _divide,
    "div.Tensor": _divide,
    "embedding.default": _embedding,
    "index.Tensor": _index,
    "relu.default": _relu,
}


def _with_param_names(
    func: relax.Function, renames: dict[str, str], names: list[str], num_inputs: int,
    key: relax.Var | None = None,
) -> relax.Function:
    """``func`` with its parameters renamed by ``renames`` (exported name -> state_dict key or
    input name) and ordered as ``names`` (inputs, params, buffers), then ``key`` if given (the
    dropout key, a free var of ``func``). Parameters renamed alike (one tied tensor that
    torch.export passes once per name) become one parameter, so its gradient is the sum of its
    uses' gradients."""
    by_name: dict[str, list[relax.Var]] = {}
    for p in func.params:
        by_name.setdefault(renames.get(p.name, p.name), []).append(p)
    if sorted(by_name) != sorted(names):
        raise ValueError(
            f"from_torch: TVM's importer made parameters {sorted(by_name)}, expected {names}"
        )
    new = [relax.Var(name, by_name[name][0].ty) for name in names]
    binds = {old: var for name, var in zip(names, new) for old in by_name[name]}
    body = func.bind_params(binds).body
    new += [] if key is None else [key]
    return relax.Function(new, body, func.ret_ty, func.is_pure).with_attr("num_input", num_inputs)
