"""Differential tests: relaxgrad's pass and TVM's C++ pass give structurally equal adjoints.

TVM's pass (a peer, used here only as a test oracle) runs with TVM's own rules, ours with
relaxgrad's, so the ops used are ones whose rules must match TVM's exactly.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

import relaxgrad
from relaxgrad.testing import check_gradients

from ._random_programs import random_program

SEEDS = range(150)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_program_matches_tvm(seed):
    mod = random_program(seed)
    ours = relaxgrad.Gradient("main")(mod)
    theirs = relax.transform.Gradient("main")(mod)
    tvm.ir.assert_structural_equal(ours["main_adjoint"], theirs["main_adjoint"])


@pytest.mark.parametrize("seed", SEEDS[:12])
def test_random_program_numeric(seed):
    mod = random_program(seed)
    float_params = [
        i for i, p in enumerate(mod["main"].params) if isinstance(p.ty, relax.TensorType)
    ]
    result = check_gradients(mod, wrt=float_params, seed=seed)
    assert result.ok, str(result)


def test_random_programs_use_checkpoints():
    """The generator really produces markers, so the checkpoint path is compared too."""
    scripts = [random_program(seed).script() for seed in SEEDS]
    assert sum("start_checkpoint" in s or "end_checkpoint" in s for s in scripts) > len(SEEDS) // 3
    adjoints = [relaxgrad.Gradient("main")(random_program(seed)).script() for seed in SEEDS]
    assert any("_cp" in s for s in adjoints)
    assert np.mean(["R.split" in s for s in scripts]) > 0.1
