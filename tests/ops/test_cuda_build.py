"""Spot check: adjoints of some new rules build for CUDA with relaxgrad.compile (no GPU
needed; code generation only)."""

import pytest

import relaxgrad
from relaxgrad.testing import loss_module

from . import test_index, test_nn

CASES = {c.id: c for c in test_nn.CASES + test_index.CASES}
SPOT_CHECKS = ["layer_norm", "attention_causal", "conv1d_strides_padding", "strided_slice_mixed"]


@pytest.mark.parametrize("case_id", SPOT_CHECKS)
def test_adjoint_builds_for_cuda(case_id):
    case = CASES[case_id]
    mod = relaxgrad.Gradient("main")(loss_module(case.fn, case.types()))
    relaxgrad.compile(mod, {"kind": "cuda", "arch": "sm_90"})
