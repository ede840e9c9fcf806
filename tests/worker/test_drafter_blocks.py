"""Which blocks' draft KV the drafter trusts (``DraftModelSource.complete``): a block keeps its mark only
while its tokens stay the ones its draft KV was computed for (engine-level: the next turn's
catch-up in tests/engine/test_draft_model.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pagellm.worker.draft_model_source import DraftModelSource


def test_blocks_whose_contents_change_lose_their_mark() -> None:
    drafter = DraftModelSource.__new__(DraftModelSource)  # (only its block marks: no model)
    drafter.block_size = 4
    drafter.complete = np.ones(16, dtype=bool)
    drafter.complete[2] = False
    row_of = {"a": 0, "b": 1}
    batch = SimpleNamespace(rows=lambda ids: np.array([row_of[i] for i in ids]),
                            block_table=np.array([[3, 5, 7, 0], [3, 6, 0, 0]]), num_blocks=np.array([3, 2]))  # fmt: skip
    step = SimpleNamespace(
        block_copies=[(2, 9), (3, 10)],  # a copy's target takes its source's mark
        kv_loads=[SimpleNamespace(block_ids=[11, 12])],  # blocks read in from the disk tier
        scheduled=[SimpleNamespace(seq_id="a", start_position=5), SimpleNamespace(seq_id="b", start_position=8)],
    )
    drafter.observe(step, batch)
    # a computes from position 5: its blocks from the second (5, 7); b from 8: none it holds.
    assert sorted(np.flatnonzero(~drafter.complete)) == [2, 5, 7, 9, 11, 12]
