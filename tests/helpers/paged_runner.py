"""Test driver: runs a model over a small paged KV cache the way the engine will.

Each step is one flat batch mixing requests' prefill chunks and decode tokens. Blocks are
handed out from the top of the pool down, so block tables are non-contiguous and requests'
blocks interleave; that exercises the slot mapping rather than an identity layout.
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.llama import LlamaForCausalLM


class PagedRunner:
    """Keeps per-request block tables and context lengths across steps."""

    def __init__(
        self, model: LlamaForCausalLM, arch: ModelArchConfig, num_blocks: int = 64, block_size: int = 4
    ) -> None:
        self.model = model
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_hidden_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def _grow(self, req: int, new_len: int) -> list[int]:
        """Give ``req`` enough blocks for ``new_len`` tokens; return its block table."""
        table = self.block_tables.setdefault(req, [])
        while len(table) * self.block_size < new_len:
            table.append(self.free_blocks.pop())
        return table

    def metadata(self, batch: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and attention metadata for one step; advances context lengths."""
        ids, positions, slots, tables, query_lens, seq_lens = [], [], [], [], [], []
        for req, tokens in batch:
            start = self.seq_lens.get(req, 0)
            end = start + len(tokens)
            table = torch.tensor(self._grow(req, end), dtype=torch.int64)
            pos = torch.arange(start, end, dtype=torch.int64)
            ids.append(torch.tensor(tokens, dtype=torch.int64))
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            tables.append(table)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.seq_lens[req] = end
        block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True, padding_value=0)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_tables=block_tables,
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64),
            block_size=self.block_size,
        )
        return torch.cat(ids), torch.cat(positions), metadata

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one flat batch; return each request's logits for its new tokens ([q_len, vocab])."""
        input_ids, positions, metadata = self.metadata(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(metadata.query_lens))
