"""The registry against the op coverage table (docs/ops.md), so the table cannot drift."""

import re
from pathlib import Path

from tvm.ir import Op

import relaxgrad

OPS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def _coverage_rows() -> list[tuple[str, str, str]]:
    """``(op, rule, tvm_has_rule)`` of each row of the table in docs/ops.md."""
    rows = []
    for line in OPS_PAGE.read_text().splitlines():
        match = re.fullmatch(r"\| `([\w.]+)` \| (.+) \| (yes|no) \|", line.strip())
        if match:
            rows.append(match.groups())
    return rows


def test_table_lists_exactly_the_registered_ops():
    names = [op for op, _, _ in _coverage_rows()]
    assert len(names) == len(set(names)), "duplicate rows"
    registered = set(relaxgrad.registered_ops())
    assert set(names) == registered, (
        f"missing from docs/ops.md: {sorted(registered - set(names))}; "
        f"not registered: {sorted(set(names) - registered)}"
    )


def test_table_says_which_ops_tvm_differentiates():
    wrong = [
        op for op, _, tvm in _coverage_rows()
        if (Op.get(op).get_attr("FPrimalGradient") is not None) != (tvm == "yes")
    ]  # fmt: skip
    assert not wrong


def test_every_registered_rule_has_a_docstring():
    """Two lines, forward and backward, as TVM's own rules."""
    for op in relaxgrad.registered_ops():
        doc = relaxgrad.get_gradient(op).__doc__ or ""
        assert "Forward" in doc and "backward" in doc, op
