"""Hugging Face architectures (tiny configs from :mod:`tests.zoo.models`) trained with
``Trainer(precision="bf16")``: each first-step gradient at most twice as far from PyTorch's
float64 one as PyTorch's bf16 autocast's (norm-wise, plus ``RTOL`` of the whole gradient's norm,
a quarter of bf16's epsilon, for gradients that are rounding noise), all finite and float32.

The architectures where mixed precision went wrong: Qwen2's rotary embeddings (a wrong forward
pass), BLOOM (a GELU written as a chain of ops took more than ten minutes to compile), Mixtral
(router probabilities held in bf16 tied for ``topk``, 36% off gradients), RegNet (a ReLU's
gradient whose mask reads a held value failed TVM's vectorizer); and one of each other kind.
``bench/zoo_precision.py`` runs every architecture of the zoo.
"""

import copy
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relaxgrad.training import SGD, CrossEntropyLoss, Trainer  # noqa: E402

from .models import imported  # noqa: E402

SLACK, RTOL = 2.0, 1e-3
MODELS = ["qwen2", "bloom", "mixtral", "bert", "vit", "resnet", "regnet"]
#: seconds a model's import and compile may take (BLOOM's took more than 600)
COMPILE_LIMIT = 120


def _torch_gradients(module, inputs, y, dtype, autocast):
    twin = copy.deepcopy(module).to(dtype).train()
    given = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = twin(*given)
    torch.nn.functional.cross_entropy(logits.float(), y).backward()
    return {n: p.grad.double().numpy() for n, p in twin.named_parameters() if p.requires_grad}


@pytest.mark.filterwarnings("ignore:Trainer. precision='bf16' on a CPU without")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(n))
                                  for n in MODELS])  # fmt: skip
def test_bf16_first_gradients_are_as_close_as_autocasts(name):
    """(In the zoo's xdist group of the model: one import of it, :func:`imported`.)"""
    start = time.perf_counter()
    module, inputs, y, model = imported(name)
    y = torch.from_numpy(y)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1), precision="bf16",
                                cache=False)
    assert time.perf_counter() - start < COMPILE_LIMIT
    _, ours = trainer.gradients(tuple(t.numpy() for t in inputs), y.numpy())
    exact = _torch_gradients(module, inputs, y, torch.float64, False)
    autocast = _torch_gradients(module, inputs, y, torch.float32, True)
    assert sorted(ours) == sorted(exact)
    scale = np.sqrt(sum(np.sum(g**2) for g in exact.values()))
    for key, g in ours.items():
        assert g.dtype == np.float32 and np.isfinite(g).all(), key
        error = np.linalg.norm(g.astype("float64") - exact[key])
        theirs = np.linalg.norm(autocast[key] - exact[key])
        assert error <= SLACK * theirs + RTOL * scale, (key, error, theirs)
