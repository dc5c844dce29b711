"""planned_memory measures the storage TVM's lowering plans for a function."""

import relaxgrad
from relaxgrad.analysis import planned_memory

from .transforms.test_checkpoint import BATCH, WIDTH, mlp


def test_forward_memory_is_positive_and_bounded():
    fwd = planned_memory(mlp(False), "main")
    # the forward pass keeps at most a few (BATCH, WIDTH) float32 intermediates live at once
    assert 0 < fwd <= 4 * BATCH * WIDTH * 4 * 2


def test_checkpointing_lowers_planned_memory_of_the_adjoint():
    plain = planned_memory(relaxgrad.Gradient("main")(mlp(False)), "main_adjoint")
    checkpointed = planned_memory(relaxgrad.Gradient("main")(mlp(True)), "main_adjoint")
    assert checkpointed < plain
    # and the adjoint needs more than the forward pass: it keeps values for the backward pass
    assert plain > planned_memory(mlp(False), "main")
