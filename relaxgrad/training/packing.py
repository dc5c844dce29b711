"""Packing: several token sequences in one row of a fixed length, each attending only to itself,
with positions restarting at 0 — no compute spent on padding, one compiled shape for every mix
of lengths.

A Hugging Face causal LM takes a packed row as ``model(input_ids, attention_mask=mask,
position_ids=positions)`` with ``mask`` the 4-D additive mask of :func:`pack` (transformers
uses a prepared 4-D mask as it is): block-diagonal and causal, so the row's loss and gradients
are those of its sequences run one by one (``tests/training/test_packing.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Packed", "pack"]

IGNORE = -100


@dataclass(frozen=True)
class Packed:
    """Rows of packed sequences.

    Attributes
    ----------
    input_ids : np.ndarray
        ``(rows, length)`` int64 tokens, padding at the end of a row.
    position_ids : np.ndarray
        ``(rows, length)`` int64: each sequence's positions from 0 (padding: 0).
    attention_mask : np.ndarray
        ``(rows, 1, length, length)`` float32 additive mask: 0 where a token attends (earlier
        tokens of its own sequence and itself), the most negative float32 elsewhere; a padding
        token attends to itself only.
    labels : np.ndarray
        ``(rows * length,)`` int64 next-token targets, ``-100`` (ignored by
        ``CrossEntropyLoss(ignore_index=-100)``) at each sequence's last token, where the caller
        masked (a prompt) and on padding.
    rows : list of list of int
        The sequences (by index) in each row.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    rows: list[list[int]]

    @property
    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_ids, attention_mask, position_ids)``, a model's inputs."""
        return self.input_ids, self.attention_mask, self.position_ids


def pack(
    sequences: Sequence[Sequence[int]],
    length: int,
    *,
    labels: Sequence[Sequence[int]] | None = None,
    rows: int | None = None,
    pad_id: int = 0,
) -> Packed:
    """Pack ``sequences`` into rows of ``length`` tokens, first fit in order.

    Parameters
    ----------
    sequences : sequence of sequences of int
        Token ids, each at most ``length`` long.
    length : int
        Tokens per row.
    labels : sequence of sequences of int, optional
        Per sequence, the target of each token (same length as the sequence; ``-100`` to
        ignore one, e.g. a prompt's). By default the next token of the same sequence (the
        last token's is ignored: a sequence never predicts the next one's first token).
    rows : int, optional
        The number of rows (a compiled batch size): the rest are padding rows; an error if
        the sequences need more. Default: as many as they need.
    pad_id : int
        The token of padding.

    Returns
    -------
    Packed
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"pack: length must be a positive int, not {length!r}")
    seqs = [np.asarray(s, dtype="int64").reshape(-1) for s in sequences]
    if labels is None:
        targets = [np.append(s[1:], IGNORE) for s in seqs]
    else:
        if len(labels) != len(seqs):
            raise ValueError(f"pack: {len(labels)} label sequences for {len(seqs)} sequences")
        targets = [np.asarray(t, dtype="int64").reshape(-1) for t in labels]
    for i, (s, t) in enumerate(zip(seqs, targets)):
        if not 0 < len(s) <= length:
            raise ValueError(f"pack: sequence {i} has {len(s)} tokens; each must have 1 to "
                             f"{length}")
        if len(t) != len(s):
            raise ValueError(f"pack: sequence {i} has {len(s)} tokens and {len(t)} labels")
    groups: list[list[int]] = []
    free: list[int] = []
    for i, s in enumerate(seqs):
        row = next((r for r, room in enumerate(free) if room >= len(s)), None)
        if row is None:
            groups.append([])
            free.append(length)
            row = len(groups) - 1
        groups[row].append(i)
        free[row] -= len(s)
    count = len(groups) if rows is None else rows
    if count < len(groups):
        raise ValueError(f"pack: the sequences need {len(groups)} rows of {length} tokens, "
                         f"more than rows={rows}")
    ids = np.full((count, length), pad_id, dtype="int64")
    positions = np.zeros((count, length), dtype="int64")
    target = np.full((count, length), IGNORE, dtype="int64")
    blocked = np.finfo(np.float32).min
    mask = np.full((count, 1, length, length), blocked, dtype="float32")
    idx = np.arange(length)
    mask[:, 0, idx, idx] = 0.0  # every token (padding too) attends to itself
    for r, members in enumerate(groups):
        start = 0
        for i in members:
            n = len(seqs[i])
            ids[r, start:start + n] = seqs[i]
            positions[r, start:start + n] = np.arange(n)
            target[r, start:start + n] = targets[i]
            causal = np.tril(np.ones((n, n), dtype=bool))
            mask[r, 0, start:start + n, start:start + n] = np.where(causal, 0.0, blocked)
            start += n
    return Packed(ids, positions, mask, target.reshape(-1), groups)
