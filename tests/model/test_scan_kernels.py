"""The scan layers' decode steps on the C++ kernel (csrc/scan.cpp) against their modules' PyTorch
paths: the same output rows and the same states left in the slots, float32 and bf16, a request
starting afresh among them; a gated delta-net's value heads grouped (HF) and tiled (llama.cpp's
files), Mamba-2 with one group and several, with and without a convolution bias."""

from __future__ import annotations

import copy

import pytest
import torch

from pagellm import kernels
from pagellm.attention.backend import AttentionMetadata
from pagellm.model.delta_net import GatedDeltaNet
from pagellm.model.mamba2 import Mamba2Mixer
from pagellm.model.scan_shapes import DeltaNetShape, MambaShape
from pagellm.model.scan_state import ScanState

KERNELS = kernels.default()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="CPU kernels not built here")

HIDDEN, SLOTS = 48, 5


def decode_metadata(slots: list[int], seq_lens: list[int], query_lens: list[int] | None = None) -> AttentionMetadata:
    """One decode token each (a seq_len of 1: a request starting at position 0), or ``query_lens``."""
    n, query_lens = len(slots), query_lens or [1] * len(slots)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.long), block_tables=torch.zeros(n, 4, dtype=torch.long),
        query_lens=query_lens, seq_lens=seq_lens, query_start_loc=starts, seq_lens_tensor=torch.tensor(seq_lens),
        block_size=16, state_slots=slots,
    )  # fmt: skip


def modules(shape: DeltaNetShape | MambaShape, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the PyTorch path, the kernel path) with the same random weights."""
    torch.manual_seed(0)
    delta = isinstance(shape, DeltaNetShape)
    reference = GatedDeltaNet(shape, HIDDEN, 1e-6, None) if delta else Mamba2Mixer(shape, HIDDEN, 1e-6, None)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        reference.A_log.copy_(torch.rand(reference.A_log.shape) - 1.0)
    reference = reference.to(dtype)
    fast = copy.deepcopy(reference)
    fast.kernels = KERNELS
    return reference, fast


def states(shape: DeltaNetShape | MambaShape, dtype: torch.dtype) -> ScanState:
    conv, ssm = shape.state_shapes()
    g = torch.Generator().manual_seed(1)
    return ScanState((torch.randn(SLOTS, *conv, generator=g)).to(dtype), torch.randn(SLOTS, *ssm, generator=g) * 0.3)


SHAPES = {
    "delta-grouped": DeltaNetShape(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=32, conv_kernel=4),
    "delta-tiled": DeltaNetShape(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=32, conv_kernel=4,
                                 tiled_value_heads=True),
    "mamba-1-group": MambaShape(num_heads=4, head_dim=8, state_size=16, num_groups=1, conv_kernel=4, chunk_size=8,
                                conv_bias=True, proj_bias=False),
    "mamba-2-groups": MambaShape(num_heads=4, head_dim=8, state_size=16, num_groups=2, conv_kernel=3, chunk_size=8,
                                 conv_bias=False, proj_bias=True, dt_min=0.01, dt_max=0.5),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernels_decode_step_equals_the_modules(dtype: torch.dtype, name: str) -> None:
    shape = SHAPES[name]
    reference, fast = modules(shape, dtype)
    expected_state, state = states(shape, dtype), states(shape, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for step in range(3):  # (the states carried from step to step)
        hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(10 + step)).to(dtype)
        seq_lens = [9 + step, 1 if step == 0 else 1 + step, 4 + step]  # the second request starts afresh
        expected = reference(hidden, expected_state, decode_metadata([4, 0, 2], seq_lens))
        out = fast(hidden, state, decode_metadata([4, 0, 2], seq_lens))
        torch.testing.assert_close(out, expected, **tol)
        if dtype == torch.bfloat16:  # (the kernel rounds where the tensor ops do: float32 sums aside, bit-equal)
            assert (out != expected).float().mean() < 0.01
        torch.testing.assert_close(state.ssm, expected_state.ssm, atol=1e-5, rtol=1e-4)
        assert torch.equal(state.conv, expected_state.conv)  # (the window moved on by the same inputs)
    assert torch.equal(state.ssm[[1, 3]], expected_state.ssm[[1, 3]])  # other slots untouched


@pytest.mark.parametrize("name", ["delta-grouped", "mamba-1-group"])
def test_the_kernel_refuses_rows_or_slots_out_of_range(name: str) -> None:
    shape = SHAPES[name]
    _, fast = modules(shape, torch.float32)
    with pytest.raises(ValueError, match="rows and slots must index"):
        fast(torch.randn(1, HIDDEN), states(shape, torch.float32), decode_metadata([SLOTS], [3]))


@pytest.mark.parametrize("name", ["delta-grouped", "mamba-1-group"])
def test_decode_tokens_on_the_kernel_beside_prompt_chunks_by_tensor_ops(name: str) -> None:
    """A step of two decode tokens around a 5-token chunk of a prompt (a request starting afresh,
    then a 20-token one going on: longer than a span run token by token): the chunks run apart by tensor ops, the decode tokens on the kernel,
    every row and slot as the PyTorch path leaves them."""
    shape = SHAPES[name]
    reference, fast = modules(shape, torch.float32)
    expected_state, state = states(shape, torch.float32), states(shape, torch.float32)
    for step, (query_lens, seq_lens) in enumerate((([1, 5, 1], [9, 5, 4]), ([1, 20, 1], [10, 25, 5]))):
        hidden = torch.randn(sum(query_lens), HIDDEN, generator=torch.Generator().manual_seed(step))
        expected = reference(hidden, expected_state, decode_metadata([4, 0, 2], seq_lens, query_lens))
        out = fast(hidden, state, decode_metadata([4, 0, 2], seq_lens, query_lens))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.ssm, expected_state.ssm, atol=1e-5, rtol=1e-4)
        assert torch.equal(state.conv, expected_state.conv)


@pytest.mark.parametrize("name", ["delta-grouped", "mamba-2-groups"])
@pytest.mark.parametrize("on_kernel", [True, False], ids=["kernel", "tensor-ops"])
def test_a_short_span_going_on_is_its_decode_steps_bit_for_bit(name: str, on_kernel: bool) -> None:
    """A request going on with 4 tokens (a speculative verification) beside a decode token, in
    bf16: token by token through the decode update, every row and state bit-equal to the 4 decode
    steps plain decoding runs (the chunked form would round otherwise: ``stepwise_split``)."""
    shape = SHAPES[name]
    reference, fast = modules(shape, torch.bfloat16)
    layer = fast if on_kernel else reference
    stepwise, plain = states(shape, torch.bfloat16), states(shape, torch.bfloat16)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = layer(hidden, stepwise, decode_metadata([4, 0], [12, 7], [4, 1]))  # positions 8-11, and 6
    first = layer(hidden[[0, 4]], plain, decode_metadata([4, 0], [9, 7]))
    rest = [layer(hidden[j : j + 1], plain, decode_metadata([4], [9 + j])) for j in range(1, 4)]
    assert torch.equal(out, torch.cat([first[:1], *rest, first[1:]]))
    assert torch.equal(stepwise.ssm, plain.ssm) and torch.equal(stepwise.conv, plain.conv)
