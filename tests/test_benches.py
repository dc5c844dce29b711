"""The benches that the README's and the docs' figures come from run end to end at their
smallest sizes (the benches themselves are never timed here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


def _run(script: str, *args: str) -> str:
    run = subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_real_models_trains_as_pytorch_and_times_the_adjoint_over_the_forward():
    """relaxgrad and PyTorch eager, one child each: the same loss after the steps, and the
    adjoint / forward ratio, which times ``<func>_loss``: the Trainer does not build it."""
    out = _run("real_models.py", "--small", "--models", "bert", "--runs", "1", "--steps", "1",
               "--precision", "fp32", "--frameworks", "fp32:relaxgrad", "fp32:eager")
    assert "failed" not in out, out
    losses = [float(x) for x in re.findall(r"loss after \d+ steps (\S+?),", out)]
    assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-3), out
    assert re.search(r"adjoint / forward \d", out), out


def test_train_step_times_relaxgrad_against_pytorch():
    out = _run("train_step.py", "--models", "mlp", "--runs", "1", "--steps", "2")
    assert re.search(r"^MLP .*\d", out, re.M), out
