"""planned_memory measures the storage TVM's lowering plans for a function;
estimate_activation_bytes estimates live intermediates before lowering."""

import textwrap

import numpy as np
import pytest

import relaxgrad
from relaxgrad import _ty
from relaxgrad.analysis import (
    estimate_activation_bytes,
    live_peak_bytes,
    planned_memory,
    planned_memory_split,
    replay_memory_plan,
)
from relaxgrad.cli import load_module, main
from relaxgrad.program import Node, Program, program_from_function

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


# sum(x @ w @ w @ w @ w) (4x4 float32, 64 bytes each): two of a, b, c, d are live at a time; the
# planner reuses a's storage for c and b's for d; the scalar gv is the output
CHAIN = textwrap.dedent(
    """
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Chain:
        @R.function
        def main(x: R.Tensor((4, 4), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                a = R.matmul(x, w)
                b = R.matmul(a, w)
                c = R.matmul(b, w)
                d = R.matmul(c, w)
                gv = R.sum(d)
                R.output(gv)
            return gv
    """
)


@pytest.fixture(scope="module")
def chain_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis") / "chain.py"
    path.write_text(CHAIN)
    return str(path)


@pytest.fixture(scope="module")
def chain(chain_file):
    return load_module(chain_file)


def test_split_of_a_hand_computed_chain(chain):
    assert planned_memory_split(chain, "main") == {"outputs": 4, "other": 128, "total": 132}
    assert estimate_activation_bytes(chain["main"]) == 2 * 64
    assert planned_memory(chain, "main") == 132


def test_split_of_an_adjoint_counts_result_and_gradients_as_outputs():
    mod = relaxgrad.Gradient("main")(mlp(False))
    split = planned_memory_split(mod, "main_adjoint")
    params = mod["main"].params
    grads = sum(int(np.prod(_ty.static_shape(p))) * 4 for p in params)
    assert split["outputs"] == 4 + grads  # the scalar loss and one gradient per parameter
    assert split["total"] == planned_memory(mod, "main_adjoint")


def test_estimate_follows_the_planned_activations():
    plain = relaxgrad.Gradient("main")(mlp(False))
    checkpointed = relaxgrad.Gradient("main")(mlp(True))
    estimates = [estimate_activation_bytes(m["main_adjoint"]) for m in (plain, checkpointed)]
    planned = [planned_memory_split(m, "main_adjoint")["other"] for m in (plain, checkpointed)]
    assert estimates[1] < estimates[0] and planned[1] < planned[0]
    # legalization adds a few small temporaries (e.g. the ones of the loss cotangent)
    for estimate, other in zip(estimates, planned):
        assert 0.8 * other <= estimate <= other


def test_live_peak_bytes_keeps_aliased_values_live():
    # a, b = tuple(a, b)[...]: a stays live through the tuple until c reads it
    prog = Program((
        Node("x", "param", (), 8, 0.0),
        Node("a", "relax.exp", (0,), 8, 1.0),
        Node("t", "tuple", (1,), 0, 0.0),
        Node("b", "relax.exp", (0,), 16, 1.0),
        Node("c", "get_item", (2,), 0, 0.0),
        Node("d", "relax.add", (4, 3), 8, 1.0),
        Node("e", "relax.exp", (5,), 8, 1.0),
    ), frozenset({6}))
    assert live_peak_bytes(prog) == 8 + 16 + 8  # a, b and d


def test_memory_command(chain_file, capsys):
    assert main(["memory", chain_file]) == 0
    out = capsys.readouterr().out
    assert "estimated before lowering: 128 bytes" in out
    assert "outputs 4 + other 128 = 132 bytes" in out
    assert main(["memory", chain_file, "--adjoint"]) == 0
    assert "main_adjoint: planned storage" in capsys.readouterr().out
    assert main(["memory", chain_file, "--func", "nope"]) == 2


@pytest.mark.parametrize("checkpoint", ["none", "sqrt", "save_dots"])
@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn"])
def test_replay_memory_plan_is_the_planner(model, checkpoint):
    """Replaying TVM's planner on the Relax adjoint gives what the real lowering plans."""
    from .transforms.test_policies import _models

    mod = relaxgrad.Gradient("main", checkpoint=checkpoint)(_models()[model]())
    replayed = replay_memory_plan(program_from_function(mod["main_adjoint"]))
    assert replayed == planned_memory_split(mod, "main_adjoint")


def test_replay_memory_plan_reuses_storage_by_size_class():
    # a and b (16 bytes) get storages A and B; c (8) takes A, freed at b (the smallest free
    # storage of 8 to 128 bytes); d (64, reading c through a view) grows B, freed at c (the
    # largest of 4 to 64), e (136) grows A, and g (4096) is too big for B: a new storage; the
    # output f gets a storage of its own
    prog = Program((
        Node("x", "param", (), 8, 0.0),
        Node("a", "relax.exp", (0,), 16, 1.0),
        Node("b", "relax.exp", (1,), 16, 1.0),
        Node("c", "relax.exp", (2,), 8, 1.0),
        Node("r", "relax.reshape", (3,), 0, 0.0),
        Node("d", "relax.exp", (4,), 64, 1.0),
        Node("e", "relax.exp", (5,), 136, 1.0),
        Node("g", "relax.exp", (6,), 4096, 1.0),
        Node("f", "relax.sum", (7,), 4, 1.0),
    ), frozenset({8}))
    assert replay_memory_plan(prog) == {"outputs": 4, "other": 136 + 64 + 4096, "total": 4300}
