"""LFM2's short convolution over a step's flat batch equals a causal Conv1d over each request's
whole sequence, however its tokens are split into steps (prefill chunks, decodes, mixed) and
whichever slot holds its state; a request from position 0 ignores what its slot held; each block
end computed leaves the state there in its KV block (the prefix cache's snapshot)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionMetadata
from pagellm.model.layer_spec import LayerSpec
from pagellm.model.short_conv import ConvState, ShortConv

HIDDEN, KERNEL, BLOCK = 8, 3, 4


def make_conv(bias: bool) -> ShortConv:
    spec = LayerSpec(index=0, hidden_size=HIDDEN, num_heads=1, num_kv_heads=1, head_dim=HIDDEN, intermediate_size=16,
                     norm_eps=1e-5, norm_unit_offset=False, sandwich_norms=False, qk_norm=False, qkv_bias=False,
                     o_bias=False, mlp_bias=False, activation="silu", moe=False, window=None, local_rope=False,
                     scale=1.0, softcap=None, conv_kernel=KERNEL, conv_bias=bias)  # fmt: skip
    conv = ShortConv(spec, None)
    torch.manual_seed(0)
    for p in conv.parameters():
        p.data.normal_()
    return conv


def conv_inputs(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    b, _, u = conv.in_proj(x).chunk(3, dim=-1)
    return b * u


def reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """The whole sequence at once, as transformers computes it (Conv1d padded on the left)."""
    b, c, u = conv.in_proj(x).chunk(3, dim=-1)
    inputs = (b * u).t()[None]  # [1, hidden, T]
    out = F.conv1d(inputs, conv.conv_weight, conv.conv_bias, padding=KERNEL - 1, groups=HIDDEN)[..., : x.shape[0]]
    return conv.out_proj(c * out[0].t())


def metadata(spans: list[tuple[int, int]], slots: list[int], tables: list[list[int]] | None = None) -> AttentionMetadata:
    """A step of requests each computing ``(start, length)`` of its positions (block tables
    ``tables``, padded with 0)."""
    query_lens = [n for _, n in spans]
    empty = torch.zeros(0, dtype=torch.int64)
    tables = tables or [[0] for _ in spans]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return AttentionMetadata(slot_mapping=empty, block_tables=block_tables, query_lens=query_lens,
                             seq_lens=[s + n for s, n in spans], query_start_loc=empty, seq_lens_tensor=empty,
                             block_size=BLOCK, state_slots=slots)  # fmt: skip


def test_steps_of_chunks_and_decodes_equal_the_whole_sequence() -> None:
    for bias in (False, True):
        conv = make_conv(bias)
        lengths = {"a": 9, "b": 5, "c": 1}
        seqs = {k: torch.randn(n, HIDDEN) for k, n in lengths.items()}
        slots = {"a": 2, "b": 0, "c": 3}
        tables = {"a": [5, 6, 7], "b": [1, 2], "c": [3]}
        # Steps as (request, start, length): a chunked prompt, decodes, a request alone, mixed steps.
        steps = [[("a", 0, 4), ("b", 0, 1)], [("a", 4, 1), ("b", 1, 3), ("c", 0, 1)], [("a", 5, 3)],
                 [("b", 4, 1), ("a", 8, 1)]]  # fmt: skip
        # Garbage in every slot: a fresh start must not read it.
        state = ConvState(torch.randn(4, KERNEL - 1, HIDDEN), torch.zeros(8, KERNEL - 1, HIDDEN))
        got = {k: [] for k in seqs}
        with torch.no_grad():
            for items in steps:
                x = torch.cat([seqs[k][s : s + n] for k, s, n in items])
                meta = metadata([(s, n) for _, s, n in items], [slots[k] for k, _, _ in items],
                                [tables[k] for k, _, _ in items])  # fmt: skip
                out = conv(x, state, meta)
                for (k, _, n), part in zip(items, out.split([n for _, _, n in items])):
                    got[k].append(part)
            for k, x in seqs.items():
                torch.testing.assert_close(torch.cat(got[k]), reference(conv, x), rtol=1e-5, atol=1e-5)
            # Block ends: a's positions 3 and 7 (blocks 5, 6), b's position 3 (block 1); no others.
            ends = {5: ("a", 3), 6: ("a", 7), 1: ("b", 3)}
            for block in range(8):
                if block in ends:
                    k, p = ends[block]
                    expected = conv_inputs(conv, seqs[k])[p - KERNEL + 2 : p + 1]
                    torch.testing.assert_close(state.blocks[block], expected, rtol=1e-5, atol=1e-5)
                else:
                    assert not state.blocks[block].any(), block


def test_a_step_reads_its_plan_once_for_every_layer() -> None:
    conv = make_conv(False)
    meta = metadata([(0, 3), (0, 2)], [0, 1])
    state = ConvState(torch.zeros(2, KERNEL - 1, HIDDEN), torch.zeros(1, KERNEL - 1, HIDDEN))
    with torch.no_grad():
        conv(torch.randn(5, HIDDEN), state, meta)
        plan = meta.derived[("short_conv", KERNEL)]
        conv(torch.randn(5, HIDDEN), state, meta)  # a second layer of the same step
    assert meta.derived[("short_conv", KERNEL)] is plan
    assert dataclasses.is_dataclass(plan) and plan.windows.shape == (5, KERNEL)
