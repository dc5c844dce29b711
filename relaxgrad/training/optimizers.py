"""Optimizers whose step is a Relax function, compiled with the model, with state as tensors.

An optimizer follows TVM's optimizer protocol (``tvm.relax.training.optimizer``), so it also
works with ``SetupTrainer``: ``init(params)`` records the parameter vars and sets ``state``, the
initial state tensors; ``get_function()`` returns
``optimizer(params, gradients, optim_states) -> (new_params, new_optim_states)`` over tuples.

The state is ``(step, <slot 0 of each param>..., <slot 1 of each param>..., ...)``: ``step`` is
a scalar of the parameters' dtype, counting updates; the slots (momentum buffers, Adam's
moments) are shaped like the parameters and start at zero. Each subclass only writes the update
of one parameter, ``_update``; the formulas are PyTorch's (``torch.optim``), step counted from 1.

What a :class:`~relaxgrad.training.Trainer` compiles (:meth:`Optimizer.add_to`) takes a fourth
argument, run-time controls ``(lr, max_norm, grad_scale)``, and returns a third result,
``(norm,)``: the gradients are multiplied by ``grad_scale`` (the inverse of a loss scale), their
global L2 norm is ``norm`` (NaN or infinity when a gradient is not finite), and they are clipped
to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` clips them (``inf``: no clipping) before
the update with the learning rate ``lr``. When ``norm`` is not finite the function returns the
parameters and the state as they were (the step counter too). With ``in_place=True`` the
function is marked (``relaxgrad.in_place``) for ``relaxgrad.compile`` to write the new
parameters and state into the tensors it is given (:class:`~relaxgrad.schedules.UpdateInPlace`):
no second copy of them exists during the step, but the caller's tensors change, as PyTorch's
optimizers change theirs. ``no_decay`` names the parameters (by substrings of
their names, e.g. ``("bias", "norm")``) that get no weight decay, as fine-tuning recipes'
parameter groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.ir import IRModule
from tvm.relax import op

from .. import _ty
from ..schedules.inplace import IN_PLACE

__all__ = ["SGD", "Adam", "AdamW", "MomentumSGD", "Optimizer"]


class Optimizer:
    """Base class: builds the optimizer function around :meth:`_update`.

    Parameters
    ----------
    lr : float
        Learning rate (the base of a Trainer's schedule).
    weight_decay : float
        L2 penalty added to the gradient (``g + weight_decay * p``); :class:`AdamW` decays the
        parameter itself instead.
    no_decay : sequence of str
        Parameters whose name contains one of these get no weight decay (Hugging Face's
        recipes: ``("bias", "norm")``).
    """

    name: str = "optimizer"
    slots: tuple[str, ...] = ()  # per-parameter state tensors, in state order

    def __init__(self, lr: float, weight_decay: float = 0.0, no_decay: Sequence[str] = ()):
        if lr <= 0.0 or weight_decay < 0.0:
            raise ValueError(
                f"{type(self).__name__}: need lr > 0 and weight_decay >= 0, got {lr}, "
                f"{weight_decay}"
            )
        if isinstance(no_decay, str) or not all(isinstance(n, str) for n in no_decay):
            raise ValueError(f"{type(self).__name__}: no_decay must be a sequence of str, not "
                             f"{no_decay!r}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.no_decay = tuple(no_decay)
        self.param_list: list[relax.Var] | None = None
        self.dtype: str | None = None
        self.state: list[tvm.runtime.Tensor] | None = None

    def init(self, params: relax.Var | Sequence[relax.Var]) -> Optimizer:
        """Set the parameters to optimize (float tensors of one dtype, static shapes) and reset
        ``state`` to step 0 with zero slots."""
        params = [params] if isinstance(params, relax.Var) else list(params)
        self.param_list, self.dtype = params, _check_params(type(self).__name__, params)
        zeros = [np.zeros(_ty.static_shape(p), self.dtype) for p in params]
        values = [np.zeros((), self.dtype)] + [z for _ in self.slots for z in zeros]
        self.state = [tvm.runtime.tensor(v) for v in values]
        return self

    def get_function(self) -> relax.Function:
        """``optimizer(params, gradients, optim_states) -> (new_params, new_optim_states)``, in
        Relax ops only, the learning rate a constant (TVM's optimizer protocol; see
        :meth:`add_to` for what a Trainer compiles)."""
        return self._build(relax.BlockBuilder(), self.name, fused=False)[self.name]

    def add_to(self, mod: IRModule, name: str, in_place: bool = False) -> IRModule:
        """``mod`` with ``name(params, gradients, optim_states, controls) -> (new_params,
        new_optim_states, (norm,))`` added (see the module docstring for the controls and
        ``in_place``), its updates fused into one kernel per parameter where the optimizer has
        one (:class:`Adam`: each element of the parameter, gradient and moments read once,
        instead of three passes)."""
        if name in [gv.name_hint for gv in mod.get_global_vars()]:
            raise ValueError(
                f"{type(self).__name__}: the module already has a function named {name!r}"
            )
        mod = self._build(relax.BlockBuilder(mod), name, fused=True, controlled=True)
        if in_place:
            gv = mod.get_global_var(name)
            mod[gv] = mod[gv].with_attr(IN_PLACE, True)
        return mod

    def controls(self, lr: float | None = None, max_norm: float | None = None,
                 grad_scale: float = 1.0) -> list[np.ndarray]:
        """The ``controls`` argument of :meth:`add_to`'s function: ``lr`` (default this
        optimizer's), ``max_norm`` (None: no clipping) and ``grad_scale``, as 0-d arrays of the
        parameters' dtype."""
        values = (self.lr if lr is None else lr, np.inf if max_norm is None else max_norm,
                  grad_scale)  # fmt: skip
        return [np.array(v, self.dtype) for v in values]

    def _build(self, bb: relax.BlockBuilder, name: str, fused: bool,
               controlled: bool = False) -> IRModule:
        if self.param_list is None:
            raise RuntimeError(f"{type(self).__name__}: call init(params) before get_function()")
        params, n = self.param_list, len(self.param_list)
        param_tuple = relax.TupleType([p.ty for p in params])
        scalar = relax.TensorType((), self.dtype)
        state_tys = [scalar] + [p.ty for _ in self.slots for p in params]
        p_var = relax.Var("params", param_tuple)
        g_var = relax.Var("gradients", param_tuple)
        s_var = relax.Var("optim_states", relax.TupleType(state_tys))
        c_var = relax.Var("controls", relax.TupleType([scalar] * 3))
        with bb.function(name, [p_var, g_var, s_var, *([c_var] if controlled else [])]):
            with bb.dataflow():
                old_step = bb.emit(relax.TupleGetItem(s_var, 0), "old_step")
                step = bb.emit(old_step + self._const(1), "step")
                grads = [bb.emit(relax.TupleGetItem(g_var, i), f"{p.name}_grad")
                         for i, p in enumerate(params)]  # fmt: skip
                if controlled:
                    lr, scale, norm = self._controls(bb, c_var, grads)
                    ok = bb.emit(op.isfinite(norm), "finite")
                else:
                    lr, scale, norm, ok = self._const(self.lr), None, None, None
                new_params, new_slots = [], [[None] * n for _ in self.slots]
                for i, (param, g) in enumerate(zip(params, grads)):
                    name = param.name
                    p = bb.emit(relax.TupleGetItem(p_var, i), name)
                    slots = [
                        bb.emit(relax.TupleGetItem(s_var, 1 + k * n + i), f"{name}_{slot}")
                        for k, slot in enumerate(self.slots)
                    ]
                    hyper = _Hyper(lr, self._decay_of(param), scale, ok)
                    if fused:
                        p_new, slots_new = self._fused_update(bb, p, g, slots, step, hyper)
                    else:
                        p_new, slots_new = self._update(bb, p, g, slots, step, hyper)
                    new_params.append(bb.emit(p_new, f"{name}_new"))
                    for k, slot in enumerate(self.slots):
                        new_slots[k][i] = bb.emit(slots_new[k], f"{name}_{slot}_new")
                if ok is not None:  # a step with a non-finite gradient counts nothing
                    step = bb.emit(op.where(ok, step, old_step), "step_new")
                state = [step] + [v for per_slot in new_slots for v in per_slot]
                out_params = bb.emit_output(relax.Tuple(new_params), "params_new")
                out_state = bb.emit_output(relax.Tuple(state), "optim_states_new")
                outputs = [out_params, out_state]
                if controlled:
                    outputs.append(bb.emit_output(relax.Tuple([norm]), "report"))
            bb.emit_func_output(relax.Tuple(outputs))
        return bb.get()

    def _controls(self, bb: relax.BlockBuilder, controls: relax.Var, grads: list) -> tuple:
        """``(lr, the gradients' multiplier, their global norm)`` from the controls ``(lr,
        max_norm, grad_scale)``: the multiplier is ``grad_scale`` times the clipping factor
        ``min(1, max_norm / (norm + 1e-6))`` of ``torch.nn.utils.clip_grad_norm_``."""
        lr, max_norm, grad_scale = (bb.emit(relax.TupleGetItem(controls, k), name)
                                    for k, name in enumerate(("lr", "max_norm", "grad_scale")))
        squares = [bb.emit(op.sum(g * g)) for g in grads]
        total = squares[0]
        for square in squares[1:]:
            total = bb.emit(total + square)
        norm = bb.emit(op.sqrt(total) * op.abs(grad_scale), "norm")
        clip = op.minimum(self._const(1.0), max_norm / (norm + self._const(1e-6)))
        return lr, bb.emit(grad_scale * clip, "grad_multiplier"), norm

    def _decay_of(self, param: relax.Var) -> float:
        """The weight decay of ``param``: 0 for the names of :attr:`no_decay`."""
        if any(part in param.name for part in self.no_decay):
            return 0.0
        return self.weight_decay

    def _update(self, bb: relax.BlockBuilder, p, g, slots: list, step, hyper: _Hyper):
        """``(new param, [new slot, ...])`` for one parameter ``p`` with gradient ``g``; ``step``
        is the step count including this update (1 at the first); ``hyper.lr`` the learning
        rate (an expr), ``hyper.decay`` the parameter's weight decay (a float)."""
        raise NotImplementedError

    def _fused_update(self, bb: relax.BlockBuilder, p, g, slots: list, step, hyper: _Hyper):
        """:meth:`_update` with its elementwise work in as few kernels as the optimizer can
        (:meth:`add_to`), the gradient multiplied by ``hyper.scale`` first and the old values
        kept where ``hyper.ok`` is false; by default the same ops (which fusion joins)."""
        if hyper.scale is not None:
            g = bb.emit(g * hyper.scale, f"{p.name}_grad_scaled")
        p_new, slots_new = self._update(bb, p, g, slots, step, hyper)
        if hyper.ok is None:
            return p_new, slots_new
        return (op.where(hyper.ok, p_new, p),
                [op.where(hyper.ok, new, old) for new, old in zip(slots_new, slots)])

    def _const(self, value: float) -> relax.Constant:
        return relax.const(value, self.dtype)

    def _l2(self, bb: relax.BlockBuilder, p, g, decay: float):
        """The gradient with the L2 penalty: ``g + decay * p``."""
        if not decay:
            return g
        return bb.emit(g + self._const(decay) * p)

    def __repr__(self) -> str:
        hyper = ", ".join(
            f"{k}={v}" for k, v in vars(self).items()
            if k not in ("param_list", "dtype", "state") and not (k == "no_decay" and not v)
        )
        return f"{type(self).__name__}({hyper})"


class SGD(Optimizer):
    """Plain gradient descent: ``p -= lr * (g + weight_decay * p)`` (``torch.optim.SGD``)."""

    def _update(self, bb, p, g, slots, step, hyper):
        return p - hyper.lr * self._l2(bb, p, g, hyper.decay), []


class MomentumSGD(Optimizer):
    """SGD with momentum, as ``torch.optim.SGD(momentum=...)``.

    ``g += weight_decay * p``; ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at
    the first step); ``p -= lr * (g + momentum * buf if nesterov else buf)``.
    """

    slots = ("momentum",)

    def __init__(
        self,
        lr: float,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        no_decay: Sequence[str] = (),
    ):
        super().__init__(lr, weight_decay, no_decay)
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("MomentumSGD: nesterov needs momentum > 0 and zero dampening")
        self.momentum, self.dampening, self.nesterov = float(momentum), float(dampening), nesterov

    def _update(self, bb, p, g, slots, step, hyper):
        c = self._const
        g = self._l2(bb, p, g, hyper.decay)
        buf = bb.emit(c(self.momentum) * slots[0] + c(1.0 - self.dampening) * g)
        if self.dampening:
            buf = bb.emit(op.where(op.equal(step, c(1)), g, buf))
        direction = g + c(self.momentum) * buf if self.nesterov else buf
        return p - hyper.lr * direction, [buf]


class Adam(Optimizer):
    """Adam with bias correction, as ``torch.optim.Adam`` (``amsgrad=False``).

    ``g += weight_decay * p``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) *
    g * g``; ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    """

    slots = ("m", "v")

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        no_decay: Sequence[str] = (),
    ):
        super().__init__(lr, weight_decay, no_decay)
        if not all(0.0 <= b < 1.0 for b in betas) or eps < 0.0:
            raise ValueError(f"{type(self).__name__}: need betas in [0, 1) and eps >= 0")
        self.betas, self.eps = (float(betas[0]), float(betas[1])), float(eps)

    def _update(self, bb, p, g, slots, step, hyper):
        c, (beta1, beta2) = self._const, self.betas
        g = self._l2(bb, p, g, hyper.decay)
        p = self._decay(bb, p, hyper)
        m = bb.emit(slots[0] + c(1.0 - beta1) * (g - slots[0]))
        v = bb.emit(c(beta2) * slots[1] + c(1.0 - beta2) * (g * g))
        step_size = hyper.lr / (c(1.0) - op.power(c(beta1), step))
        correction2 = op.sqrt(c(1.0) - op.power(c(beta2), step))
        denom = op.sqrt(v) / correction2 + c(self.eps)
        return p - step_size * (m / denom), [m, v]

    def _fused_update(self, bb, p, g, slots, step, hyper):
        # One kernel for the three updates, the gradient's scaling, the weight decay and the
        # skip of a non-finite step: each element of p, g, m and v is read once (as separate
        # ops, m and v were written, then read again for p).
        if hyper.scale is None:
            return super()._fused_update(bb, p, g, slots, step, hyper)
        lr = hyper.lr if isinstance(hyper.lr, relax.Var) else bb.emit(hyper.lr)
        fused = bb.emit_te(self._fused, p, g, *slots, step, lr, hyper.scale, hyper.ok,
                           hyper.decay, primfunc_name_hint="adam_update")
        return relax.TupleGetItem(fused, 0), [relax.TupleGetItem(fused, k) for k in (1, 2)]

    def _fused(self, p, g, m, v, step, lr, scale, ok, decay):
        """``(new p, new m, new v)`` as one TE computation (see :class:`Adam`); the old values
        where ``ok`` is false."""
        (beta1, beta2), dtype = self.betas, p.dtype
        decoupled = type(self)._l2 is not Adam._l2  # AdamW decays p, not the gradient

        def c(value):
            return tirx.const(value, dtype)

        def grad_of(i):
            grad = g(*i) * scale()
            return grad + c(decay) * p(*i) if decay and not decoupled else grad

        def moments(*i):
            grad = grad_of(i)
            new_m = m(*i) + c(1.0 - beta1) * (grad - m(*i))
            new_v = c(beta2) * v(*i) + c(1.0 - beta2) * (grad * grad)
            return new_m, new_v

        def param(i, new_m, new_v):
            old = p(*i)
            if decay and decoupled:
                old = old * (c(1.0) - lr() * c(decay))
            step_size = lr() / (c(1.0) - tirx.power(c(beta1), step()))
            correction2 = tirx.sqrt(c(1.0) - tirx.power(c(beta2), step()))
            denom = tirx.sqrt(new_v) / correction2 + c(self.eps)
            return tirx.Select(ok(), old - step_size * (new_m / denom), p(*i))

        def kept(new, old, i):
            return tirx.Select(ok(), new, old(*i))

        if decay and not decoupled:
            # the moments read p (the L2 penalty): they are computed first, in a loop of their
            # own, and p's update reads them back, so that each tensor can be updated in place
            # (relaxgrad.schedules.UpdateInPlace) without a read of an overwritten element
            new_m, new_v = te.compute(
                p.shape, lambda *i: [kept(x, old, i) for x, old in zip(moments(*i), (m, v))],
                name="adam_moments")
            new_p = te.compute(p.shape, lambda *i: param(i, new_m(*i), new_v(*i)), name="adam")
            return [new_p, new_m, new_v]

        def update(*i):  # one loop: p's block first, as the moments' blocks do not read p
            new_m, new_v = moments(*i)
            return [param(i, new_m, new_v), kept(new_m, m, i), kept(new_v, v, i)]

        return te.compute(p.shape, update, name="adam")

    def _decay(self, bb, p, hyper):
        """The parameter before the update (decayed in place by :class:`AdamW`)."""
        return p


class AdamW(Adam):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``: first
    ``p *= 1 - lr * weight_decay``, then Adam's update without the L2 penalty."""

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        no_decay: Sequence[str] = (),
    ):
        super().__init__(lr, betas, eps, weight_decay, no_decay)

    def _l2(self, bb, p, g, decay):
        return g

    def _decay(self, bb, p, hyper):
        if not hyper.decay:
            return p
        return bb.emit(p * (self._const(1.0) - hyper.lr * self._const(hyper.decay)))


@dataclass(frozen=True)
class _Hyper:
    """One parameter's hyperparameters in an update: the learning rate (an expr), its weight
    decay and, in a Trainer's function, the gradients' multiplier and whether to apply."""

    lr: relax.Expr
    decay: float
    scale: relax.Expr | None = None  # the gradients' multiplier (clipping, loss scale)
    ok: relax.Expr | None = None  # a bool scalar: apply the update (else keep the old values)


def _check_params(owner: str, params: list[relax.Var]) -> str:
    """Validate the parameters to optimize; returns their common dtype."""
    if not params:
        raise ValueError(f"{owner}: no parameters to optimize")
    dtypes, seen = set(), set()
    for p in params:
        if not isinstance(p, relax.Var) or not _ty.is_float_tensor(p.ty):
            raise ValueError(f"{owner}: parameters must be float tensor Vars, got {p!r}")
        try:
            _ty.static_shape(p)
        except TypeError as err:
            raise ValueError(f"{owner}: parameter {p.name} has a symbolic shape {p.ty}") from err
        if _ty.key(p) in seen:
            raise ValueError(f"{owner}: parameter {p.name} appears more than once")
        seen.add(_ty.key(p))
        dtypes.add(_ty.dtype_of(p))
    if len(dtypes) > 1:
        raise ValueError(f"{owner}: all parameters must have one dtype, got {sorted(dtypes)}")
    return dtypes.pop()
