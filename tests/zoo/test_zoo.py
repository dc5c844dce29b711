"""Hugging Face ``transformers`` architectures (tiny configs from :mod:`tests.zoo.models`)
trained through :func:`from_torch` and ``Trainer.for_model`` give PyTorch's losses and gradients.

Per model, one import and one compile shared by its tests (a module-scoped fixture):

- first step: the loss and each parameter's gradient are at least as close to PyTorch's float64
  ones as PyTorch's own float32 ones are (norm-wise, ``SLACK`` times PyTorch's float32 error,
  the larger of its errors at two thread counts, whose reductions add in different orders,
  plus ``RTOL`` of the norm of the whole float64 gradient, for gradients that are rounding
  noise, such as attention keys' biases; the loss within one float32 ulp at least), and the
  rows of a gradient that PyTorch leaves exactly zero (unused tokens, an embedding's
  ``padding_idx`` row) are exactly zero;
- a few SGD steps give PyTorch's float32 losses (or, where float32 training drifts from
  float64 within them, losses and weights as close to float64's as PyTorch float32's), and the
  trained weights load back into the module (a tied parameter under each of its ``state_dict``
  keys);
- eval mode: ``trainer.predict`` equals ``module.eval()(x)`` (and refuses a partial batch of a
  language model, whose padding rows it could not tell apart);
- the adjoint has at most ``MAX_ADJOINT_RATIO`` times the forward's bindings;
- a PEFT LoRA model: gradients of exactly its trainable (adapter) parameters, and steps that
  leave its frozen base weights as they were, bit for bit.

Each test starts from the Trainer's current weights (loaded into a copy of the module), so the
tests of one model do not depend on their order.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relaxgrad.analysis import count_bindings  # noqa: E402
from relaxgrad.training import SGD, CrossEntropyLoss, Trainer  # noqa: E402

from .models import PADDED, SDPA, ZOO, imported  # noqa: E402

SLACK, RTOL = 2.0, 1e-7
STEPS, LR = 3, 0.5
#: models held to a wider first-step slack, with the reason: their float32 gradients' error is
#: rounding noise amplified, and ours and PyTorch's are two draws of it
NOISY = {
    # median 0.9x PyTorch float32's error, but up to 2.5x on a few late-stage biases (TVM's
    # own build of the same adjoint: up to 3.6x)
    "mobilevit": 3.0,
    # one weight (stage 2's keys/values projection) at 1.9-2.1x PyTorch float32's distance,
    # by the order of its reductions (in the full suite, after the other models: 2.05x); its
    # batch norms over 4 samples amplify any rounding. On an AMD EPYC (Zen 3, AVX2), one
    # thread: median 1.6x, up to 3.9x of PyTorch's float32 on one thread, whose own error
    # varies up to 2.3x by its thread count (up to 1.8x of the larger of the two)
    "levit": 3.0,
}
#: models trained fewer steps, with the reason
FEW_STEPS = {
    # its gradients have a norm of ~1000 at initialization: after one SGD step PyTorch's
    # float32 and float64 losses part (2e-5 apart after any step size from 0.5 to 1e-4)
    "levit": 1,
}
MAX_ADJOINT_RATIO = 6
SKIP: dict[str, str] = {}
#: known adjoints over the limit
LARGE_ADJOINT: dict[str, str] = {}
#: one model's tests share its import and compile: under pytest-xdist (``--dist loadgroup``)
#: they run in one worker
PARAMS = [pytest.param(name, marks=[pytest.mark.xdist_group(name),
                                    *([pytest.mark.skip(reason=SKIP[name])] if name in SKIP
                                      else [])])
          for name in ZOO]


class Case:
    """One model: the torch module, its batch, and the Trainer of its import."""

    def __init__(self, name):
        self.name = name
        self.module, inputs, y, self.model = imported(name)
        self.inputs, self.y = inputs, torch.from_numpy(y)
        self.x = tuple(t.numpy() for t in inputs)
        attention = self.module.model.config._attn_implementation
        assert attention == ("sdpa" if name in SDPA else "eager")
        self.trainer = Trainer.for_model(self.model, CrossEntropyLoss(), SGD(LR))

    def torch_copy(self, dtype=torch.float32):
        """A copy of the module holding the Trainer's current weights, in train mode."""
        module = copy.deepcopy(self.module)
        module.load_state_dict(self.trainer.state_dict())
        return module.to(dtype).train()

    def torch_gradients(self, dtype, threads=None):
        """PyTorch's loss and gradients (float64 numpy arrays) in ``dtype``, on ``threads``
        threads (default: as set)."""
        module = self.torch_copy(dtype)
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in self.inputs]
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            loss = torch.nn.functional.cross_entropy(module(*inputs), self.y)
            loss.backward()
        finally:
            torch.set_num_threads(before)
        grads = {n: p.grad.double().numpy() for n, p in module.named_parameters()
                 if p.requires_grad}  # (a LoRA's frozen base has none)
        return loss.item(), grads


@pytest.fixture(scope="module", params=PARAMS)
def case(request):
    return Case(request.param)


def _zero_rows(grad: np.ndarray) -> np.ndarray:
    """Indices of the rows (along axis 0) that are exactly zero."""
    return np.flatnonzero(~grad.reshape(len(grad), -1).any(axis=1))


def test_first_step_is_as_close_to_float64_as_torch_float32(case):
    loss, grads = case.trainer.gradients(case.x, case.y.numpy())
    loss64, grads64 = case.torch_gradients(torch.float64)
    loss32, grads32 = case.torch_gradients(torch.float32)
    # PyTorch's float32 error in a second order of its reductions (another thread count)
    other = 2 if torch.get_num_threads() == 1 else 1
    loss32b, grads32b = case.torch_gradients(torch.float32, threads=other)
    # the loss: within one float32 unit in the last place, at least
    ulp = float(np.spacing(np.float32(abs(loss64))))
    torch_loss_error = max(abs(loss32 - loss64), abs(loss32b - loss64))
    assert abs(loss - loss64) <= SLACK * torch_loss_error + max(RTOL * abs(loss64), ulp)
    assert set(grads) == set(grads64)
    scale = np.sqrt(sum(np.sum(g**2) for g in grads64.values()))
    for name, exact in grads64.items():
        ours = grads[name].astype("float64")
        error = np.linalg.norm(ours - exact)
        torch_error = max(np.linalg.norm(grads32[name] - exact),
                          np.linalg.norm(grads32b[name] - exact))
        slack = NOISY.get(case.name, SLACK)
        assert error <= slack * torch_error + RTOL * scale, (name, error, torch_error)
        if exact.ndim >= 2:
            zero = np.intersect1d(_zero_rows(exact), _zero_rows(grads32[name]))
            assert not ours[zero].any(), (name, zero)
    if case.name in PADDED:  # the batch has padding tokens, whose embedding row stays fixed
        key, pad = PADDED[case.name]
        assert (case.inputs[0].numpy() == pad).any() and not grads64[key][pad].any()
        assert not grads[key][pad].any()


def _torch_steps(case, dtype) -> tuple[list[float], dict]:
    """PyTorch's losses and final state over the model's SGD steps, in ``dtype``."""
    module = case.torch_copy(dtype)
    optimizer = torch.optim.SGD(module.parameters(), LR)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in case.inputs]
    losses = []
    for _ in range(FEW_STEPS.get(case.name, STEPS)):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(*inputs), case.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.double().numpy() for k, v in module.state_dict().items()}


def _close(ours, theirs, exact, rtol: float, atol: float, slack: float = SLACK) -> bool:
    """``ours`` is within ``rtol``/``atol`` of PyTorch float32's ``theirs``, or at least as close
    to the float64 ``exact`` as PyTorch float32 is (``slack`` times): a model whose float32
    training diverges from float64 within the steps (LeViT, whose batch norms normalize 4
    samples) is held to PyTorch float32's own distance."""
    ours, theirs, exact = (np.asarray(a, "float64") for a in (ours, theirs, exact))
    if np.allclose(ours, theirs, rtol=rtol, atol=atol):
        return True
    return np.linalg.norm(ours - exact) <= slack * np.linalg.norm(theirs - exact) + atol


def test_steps_follow_torch(case):
    losses32, state32 = _torch_steps(case, torch.float32)  # from the Trainer's weights
    losses64, state64 = _torch_steps(case, torch.float64)
    losses = [case.trainer.step(case.x, case.y.numpy()) for _ in losses32]
    slack = NOISY.get(case.name, SLACK)
    for step, (ours, theirs, exact) in enumerate(zip(losses, losses32, losses64)):
        assert _close(ours, theirs, exact, 1e-4, 0.0, slack), (step, ours, theirs, exact)
    state = case.trainer.state_dict()
    assert list(state) == list(state32)
    for key, value in state.items():
        assert _close(value.numpy(), state32[key], state64[key], 1e-3, 1e-5, slack), key


def test_predict_is_eval_mode(case):
    module = case.torch_copy().eval()
    with torch.no_grad():
        expected = module(*case.inputs).numpy()
    np.testing.assert_allclose(case.trainer.predict(case.x), expected, rtol=1e-4, atol=1e-5)
    if len(expected) != len(case.x[0]):  # a language model's (batch * seq, vocab) logits
        with pytest.raises(ValueError, match="padding of a last batch of 1 cannot be cut"):
            case.trainer.predict(tuple(x[:1] for x in case.x))


def test_adjoint_size(case, record_property, request):
    if case.name in LARGE_ADJOINT:
        request.applymarker(pytest.mark.xfail(reason=LARGE_ADJOINT[case.name], strict=True))
    func = case.model.func_name
    # the adjoint of the model with its loss, against that function (the loss's own
    # bindings, ~20 for a cross-entropy computed from the logits, on both sides)
    forward = count_bindings(case.trainer.mod[f"{func}_loss"])
    adjoint = count_bindings(case.trainer.mod[f"{func}_loss_adjoint"])
    record_property("bindings", f"{case.name}: forward {forward}, adjoint {adjoint}")
    print(f"{case.name}: forward {forward} bindings, adjoint {adjoint} ({adjoint / forward:.1f}x)")
    assert adjoint <= MAX_ADJOINT_RATIO * forward


def test_lora_trains_only_its_adapters():
    case = Case("lora")
    trainable = {n for n, p in case.module.named_parameters() if p.requires_grad}
    frozen = {n for n, p in case.module.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and frozen
    _, grads = case.trainer.gradients(case.x, case.y.numpy())
    assert set(grads) == trainable
    before = {n: v.numpy().copy() for n, v in case.trainer.state_dict().items()}
    for _ in range(2):
        case.trainer.step(case.x, case.y.numpy())
    after = case.trainer.state_dict()
    for name in frozen:
        np.testing.assert_array_equal(after[name].numpy(), before[name], err_msg=name)
    assert any(not np.array_equal(after[n].numpy(), before[n]) for n in trainable)
