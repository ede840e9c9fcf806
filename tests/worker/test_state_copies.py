"""Recurrent-state rows copied before a step's forward (a sample born, a beam forked, a
speculating sequence's checkpoint and roll-back): every source row read before any target row is
written, whichever way the rows are copied."""

from __future__ import annotations

import pytest
import torch

from pagellm.model.scan_state import ScanState
from pagellm.worker.kv_cache import copy_states


@pytest.mark.parametrize("pairs", [
    [(0, 2)],  # one row: copied a row at a time
    [(0, 4), (3, 5), (3, 6)],  # a sample born and its parent's and its own checkpoints
    [(0, 1), (1, 2)],  # a row both read and written: read first
    [(5, 0), (0, 5)],  # a swap
    [(0, 1), (2, 3), (4, 5), (6, 7), (1, 6)],  # more pairs than copied a row at a time
])  # fmt: skip
def test_every_source_row_is_read_before_any_is_written(pairs: list[tuple[int, int]]) -> None:
    g = torch.Generator().manual_seed(0)
    state = ScanState(torch.randn(8, 3, 5, generator=g).bfloat16(), torch.randn(8, 2, 4, 4, generator=g))
    before = [t.clone() for t in state.slot_tensors()]
    copy_states([state], pairs)
    for old, new in zip(before, state.slot_tensors()):
        expected = old.clone()
        for source, target in pairs:
            expected[target] = old[source]
        assert torch.equal(new, expected)
