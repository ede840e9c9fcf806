"""Paged attention in plain PyTorch on top of ``scaled_dot_product_attention``.

One step's flat batch is split into

* **decode rows** (``query_len == 1``): all of them are served by ONE gather of their
  contexts out of the paged cache (``[R, H_kv, S_max, D]``, head-major so SDPA reads it
  contiguously) and ONE SDPA call with a key-padding mask. GQA is handled by folding the
  ``group = H // H_kv`` query heads that share a KV head into SDPA's query-length
  dimension (``q.view(R, H_kv, group, D)``), so K/V are never copied per query head.
* **prefill rows** (``query_len > 1``): one SDPA call per request. Without cached
  context (``seq_len == query_len``) K/V come straight from this step's ``key``/``value``
  and SDPA runs with ``is_causal=True``; with context (chunked prefill, prefix-cache hit)
  the whole context is gathered from the cache and a causal mask with an offset of
  ``seq_len - query_len`` is applied.

Everything that depends only on the step's metadata (decode row indices, the gather
index, masks) is built once per :class:`AttentionMetadata` object, kept in its ``derived``
dict, and reused by every layer of the model in that step (all layers share block tables);
see :class:`_StepPlan`.
Treat a metadata object as immutable once it has been passed to ``forward``.

Padding positions of the gather point at the request's own last valid slot (never at
unwritten cache memory), so masked keys/values are always finite even if the cache was
allocated with ``torch.empty`` (``0 * NaN`` would otherwise poison the output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    as_stored,
    attention_dtype,
    from_cache_rows,
    indexable,
    write_kv,
)
from pagellm.kv_layout import kv_row_width


def _sdpa_supports_gqa() -> bool:
    """``enable_gqa`` appeared in torch 2.5; older versions get K/V repeated for prefill instead."""
    try:
        t = torch.zeros(1, 2, 1, 1)
        F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


_SDPA_GQA = _sdpa_supports_gqa()

@dataclass
class _DecodePlan:
    num_rows: int
    max_seq_len: int
    # Token rows of the decode queries: a contiguous range (fast path, a view) or an index tensor.
    token_range: tuple[int, int] | None
    token_index: torch.Tensor | None
    # [R, S_max] flat slot of every (row, position); padding positions repeat the last valid slot.
    slots: torch.Tensor
    # [R, 1, 1, S_max] bool (True = attend), or None when every row has seq_len == S_max.
    mask: torch.Tensor | None
    # num_kv_heads -> flat [R * H_kv * S_max] index into the cache's (token, head) rows.
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)
    _additive_mask: torch.Tensor | None = None

    def additive_mask(self) -> torch.Tensor | None:
        """``mask`` as float32 0 / -inf ([R, 1, 1, S_max]), built once per step."""
        if self.mask is None:
            return None
        if self._additive_mask is None:
            self._additive_mask = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)
            self._additive_mask.masked_fill_(~self.mask, float("-inf"))
        return self._additive_mask

    def gather_index(self, num_kv_heads: int) -> torch.Tensor:
        idx = self.head_index.get(num_kv_heads)
        if idx is None:
            heads = torch.arange(num_kv_heads, device=self.slots.device, dtype=self.slots.dtype)
            idx = (self.slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
            self.head_index[num_kv_heads] = idx
        return idx


@dataclass
class _PrefillPlan:
    start: int  # first token row in the flat batch
    query_len: int
    seq_len: int
    slots: torch.Tensor | None  # [seq_len] context slots; None when there is no cached context
    mask: torch.Tensor | None  # [query_len, seq_len] bool causal-with-offset; None -> is_causal


@dataclass
class _StepPlan:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    device: torch.device
    num_tokens: int
    decodes: list[_DecodePlan]  # decode rows, in groups of similar context length
    prefills: list[_PrefillPlan]

    def matches(self, metadata: AttentionMetadata, device: torch.device) -> bool:
        """Still valid for ``metadata`` (in case a caller changed it after the first layer)."""
        return (
            self.device == device
            and self.block_tables is metadata.block_tables
            and self.query_lens == metadata.query_lens
            and self.seq_lens == metadata.seq_lens
        )


# A new decode group costs a handful of extra op launches, worth this many padded key positions.
_GROUP_OVERHEAD_POSITIONS = 512
# Rows join the current group while their context is at least 1/_GROUP_RATIO of its longest.
_GROUP_RATIO = 1.5
_MAX_DECODE_GROUPS = 8


def group_decode_rows(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split decode rows into groups of similar context length (each group is padded to its max).

    Rows are taken longest first. A row starts a new group when it is shorter than
    1/_GROUP_RATIO of the current group's longest row (so padding stays under a third of a
    group's positions) and the padding saved for the rows still to come, ``(group max - len)
    * rows left``, outweighs the fixed cost of a group. At most ``_MAX_DECODE_GROUPS`` groups:
    the last one takes all the remaining (shortest) rows. Within a group rows keep batch order.
    """
    if not rows:
        return []
    order = sorted(rows, key=lambda r: -seq_lens[r])
    groups: list[list[int]] = [[order[0]]]
    group_max = seq_lens[order[0]]
    for i in range(1, len(order)):
        r = order[i]
        length = seq_lens[r]
        if (
            len(groups) < _MAX_DECODE_GROUPS
            and length * _GROUP_RATIO < group_max
            and (group_max - length) * (len(order) - i) > _GROUP_OVERHEAD_POSITIONS
        ):
            groups.append([r])
            group_max = length
        else:
            groups[-1].append(r)
    return [sorted(g) for g in groups]


def _decode_group(
    reqs: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    num_reqs: int,
    device: torch.device,
    window: int | None = None,
) -> _DecodePlan:
    num_rows = len(reqs)
    dec_seq = [seq_lens[r] for r in reqs]
    s_max = max(dec_seq)
    tok = [starts[r] for r in reqs]
    if tok[-1] - tok[0] == num_rows - 1:  # the group's rows are contiguous in the batch
        token_range, token_index = (tok[0], tok[0] + num_rows), None
    else:
        token_range, token_index = None, torch.tensor(tok, dtype=torch.long, device=device)
    if num_rows == num_reqs:
        tables = block_tables
    else:
        tables = block_tables.index_select(0, torch.tensor(reqs, dtype=torch.long, device=device))
    seq_t = torch.tensor(dec_seq, dtype=torch.long, device=device)
    # Each row's last `window` positions only (its own included): positions before them are
    # never gathered (where every layer keeps the window their blocks may be another's now).
    count = seq_t if window is None else torch.clamp(seq_t, max=window)
    width = s_max if window is None else min(s_max, window)
    j = torch.arange(width, dtype=torch.long, device=device)
    pos_c = (seq_t - count)[:, None] + torch.minimum(j[None, :], (count - 1)[:, None])  # padding -> last position
    blocks = tables.long().gather(1, pos_c // block_size)
    slots = blocks * block_size + pos_c % block_size
    mask = None
    if min(min(dec_seq), width) != width:
        mask = (j[None, :] < count[:, None])[:, None, None, :]
    return _DecodePlan(num_rows, width, token_range, token_index, slots, mask)


def _build_plan(metadata: AttentionMetadata, device: torch.device, window: int | None = None) -> _StepPlan:
    query_lens = list(metadata.query_lens)
    seq_lens = list(metadata.seq_lens)
    block_size = metadata.block_size
    block_tables = metadata.block_tables
    if block_tables.device != device:
        block_tables = block_tables.to(device)
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len < 0 or q_len > s_len:
            raise ValueError(f"request {r}: query_len {q_len} must be in [0, seq_len={s_len}]")

    starts = []
    t = 0
    for q_len in query_lens:
        starts.append(t)
        t += q_len
    num_tokens = t

    decode_reqs = [r for r, q_len in enumerate(query_lens) if q_len == 1]
    decodes = [
        _decode_group(group, starts, seq_lens, block_tables, block_size, len(query_lens), device, window)
        for group in group_decode_rows(decode_reqs, seq_lens)
    ]

    prefills = []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len <= 1:
            continue
        slots = mask = None
        # With a window, context from the first query's window on (earlier positions are never read).
        first = 0 if window is None else max(0, s_len - q_len - window + 1)
        pos = torch.arange(first, s_len, dtype=torch.long, device=device)
        q_pos = torch.arange(s_len - q_len, s_len, dtype=torch.long, device=device)
        if s_len > q_len:
            slots = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
            mask = pos[None, :] <= q_pos[:, None]
        if window is not None and s_len > window:  # causal within the last `window` positions
            mask = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        prefills.append(_PrefillPlan(starts[r], q_len, s_len, slots, mask))

    return _StepPlan(query_lens, seq_lens, metadata.block_tables, device, num_tokens, decodes, prefills)


def decode_attention_bmm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor | None, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-query attention for ``R`` decode rows as two batched matmuls and a softmax.

    q: [R, H_kv, G, D] (the G query heads sharing a KV head folded into the row), k, v:
    [R, H_kv, S, D] contiguous, additive_mask: float32 [R, 1, 1, S] (0 / -inf) or None.
    Returns [R, H_kv, G, D] in v's dtype.

    Faster than SDPA's CPU flash kernel here: with only G (e.g. 3) query rows per (request,
    KV head) the flash kernel pays its per-block GEMM set-up hundreds of times per layer,
    while ``matmul`` runs one batched GEMM over all of them. Scores come out of the GEMM in
    the cache dtype (float32 accumulation inside, one rounding, as HF's eager attention), the
    softmax runs in float32. A ``softcap`` caps the scaled scores (``softcap * tanh(s / softcap)``);
    ``sinks`` ([H], query head h = kv * G + g) add a logit per head to its softmax.
    """
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.float() if scores.dtype != torch.float32 else scores
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if additive_mask is not None:
        scores.add_(additive_mask)
    heads = None if sinks is None else sinks.view(1, q.shape[1], q.shape[2], 1)  # head h = kv * G + g
    return torch.matmul(_softmax(scores, heads).to(v.dtype), v)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores``; with ``sinks`` (shaped to broadcast over
    ``scores[..., :1]``: one per head), each head's sink logit joins its row's softmax, and its
    weight is dropped after."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


# The most bytes of float32 scores one explicit prefill step holds (a chunk of its query rows).
_EXPLICIT_SCORES_BYTES = 64 << 20


def _explicit_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _PrefillPlan, scale: float, softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One prefill request's attention with capped scores or sinks, which SDPA lacks: q [1, H,
    Q, D], k, v [1, H_kv, S, D] (HF's eager arithmetic: scores in the compute dtype, softmax in
    float32). Query rows go a chunk at a time, so the float32 scores [H, rows, S] stay within
    ``_EXPLICIT_SCORES_BYTES`` whatever the context."""
    if k.shape[1] != q.shape[1]:  # grouped-query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    heads = None if sinks is None else sinks.view(1, -1, 1, 1)
    rows = max(1, _EXPLICIT_SCORES_BYTES // (4 * q.shape[1] * p.seq_len))
    outs = []
    for first in range(0, p.query_len, rows):
        last = min(first + rows, p.query_len)
        scores = torch.matmul(q[:, :, first:last], k.transpose(-1, -2)).float().mul_(scale)
        if softcap is not None:
            scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
        if p.mask is not None:
            scores.masked_fill_(~p.mask[first:last], float("-inf"))
        else:  # no context: causal over the new tokens (query row i sees positions up to S - Q + i)
            positions = torch.arange(p.seq_len, device=q.device)
            limit = torch.arange(first, last, device=q.device) + (p.seq_len - p.query_len)
            scores.masked_fill_(positions[None, :] > limit[:, None], float("-inf"))
        outs.append(torch.matmul(_softmax(scores, heads).to(v.dtype), v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class TorchSDPAAttention(AttentionBackend):
    """Fast paged attention for any device using ``torch.nn.functional.scaled_dot_product_attention``.

    The step's plan (which rows decode, which prefill, their gather indices) is built once per
    step and kept on the step's metadata (``metadata.derived``), so every layer reuses it
    whichever instance it holds. K/V gather workspaces are this instance's: grow-only buffers
    (per device and dtype) reused by every layer call; not safe for concurrent ``forward`` calls.
    """

    name = "torch_sdpa"

    # How decode rows are computed: "bmm" (``decode_attention_bmm``) or "sdpa" (one masked SDPA call).
    decode_impl: str = "bmm"

    def __init__(self) -> None:
        # (device, dtype) -> flat buffer the gathered K/V of a layer call are written into:
        # reusing it avoids allocating (and, for big CPU buffers, page-faulting in) tens of MB
        # per layer call.
        self._workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _get_plan(self, metadata: AttentionMetadata, device: torch.device, window: int | None) -> _StepPlan:
        """The step's plan for layers of this ``window`` (built by the first such layer)."""
        key = ("torch_sdpa", device, window)
        plan = metadata.derived.get(key)
        if not isinstance(plan, _StepPlan) or not plan.matches(metadata, device):
            plan = _build_plan(metadata, device, window)
            metadata.derived[key] = plan
        return plan

    def _gather_pair(
        self,
        key_cache: torch.Tensor, value_cache: torch.Tensor, index: torch.Tensor, row_shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache.view(-1, *row_shape).index_select(0, index)`` for K and V, into the shared
        workspace, in ``dtype``: ``row_shape`` ends in the head dim (an int8 cache's rows, that
        and their scale, are gathered whole and dequantized after the gather; an fp8 cache's
        rows are widened after it)."""
        row_shape = (*row_shape[:-1], kv_row_width(row_shape[-1], key_cache.dtype))
        n = index.numel()
        row = 1
        for d in row_shape:
            row *= d
        key_rows, value_rows = indexable(key_cache), indexable(value_cache)  # fp8: gathered as bytes
        wkey = (key_cache.device, key_rows.dtype)
        ws = self._workspaces.get(wkey)
        if ws is None or ws.numel() < 2 * n * row:
            # A normal tensor even under inference_mode, so later calls outside it may write it.
            with torch.inference_mode(False):
                ws = torch.empty(2 * n * row, dtype=key_rows.dtype, device=key_cache.device)
            self._workspaces[wkey] = ws
        k = ws[: n * row].view(n, *row_shape)
        v = ws[n * row : 2 * n * row].view(n, *row_shape)
        torch.index_select(key_rows.view(-1, *row_shape), 0, index, out=k)
        torch.index_select(value_rows.view(-1, *row_shape), 0, index, out=v)
        k, v = k.view(key_cache.dtype), v.view(value_cache.dtype)
        return from_cache_rows(k, key_cache.dtype, dtype), from_cache_rows(v, value_cache.dtype, dtype)

    # Below this many rows one SDPA call beats the matmul path (fewer op launches).
    _BMM_MIN_ROWS = 4

    def _decode(self, q, key_cache, value_cache, dec: _DecodePlan, num_kv_heads, group, head_dim, scale, softcap,
                sinks=None):  # fmt: skip
        """Attention of one decode group: [rows, H, D] in q's dtype (the compute dtype)."""
        rows = dec.num_rows
        if dec.token_range is not None:
            q_dec = q[dec.token_range[0] : dec.token_range[1]]
        else:
            q_dec = q.index_select(0, dec.token_index)
        idx = dec.gather_index(num_kv_heads)
        shape = (rows, num_kv_heads, dec.max_seq_len, head_dim)
        k, v = self._gather_pair(key_cache, value_cache, idx, (head_dim,), q.dtype)
        k, v = k.view(shape), v.view(shape)
        # Query heads h = kv * group + g share KV head kv: fold the group into the query dim.
        q_dec = q_dec.reshape(rows, num_kv_heads, group, head_dim)
        if softcap is not None or sinks is not None or (self.decode_impl == "bmm" and rows >= self._BMM_MIN_ROWS):
            o = decode_attention_bmm(q_dec, k, v, dec.additive_mask(), scale, softcap, sinks)
        else:
            o = F.scaled_dot_product_attention(q_dec, k, v, attn_mask=dec.mask, scale=scale)
        return o.reshape(rows, num_kv_heads * group, head_dim)

    def _prefill(self, q, key, value, key_cache, value_cache, p: _PrefillPlan, out, num_kv_heads, group, head_dim, scale,
                 softcap, sinks=None):  # fmt: skip
        """One prefill request with SDPA, written into ``out``'s rows of that request."""
        sl = slice(p.start, p.start + p.query_len)
        q_p = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if p.slots is None:  # no context: the new K/V, as the cache holds them
            k_p = as_stored(key[sl], key_cache.dtype, q.dtype)
            v_p = as_stored(value[sl], value_cache.dtype, q.dtype)
        else:
            k_p, v_p = self._gather_pair(key_cache, value_cache, p.slots, (num_kv_heads, head_dim), q.dtype)
        if group > 1 and not _SDPA_GQA:
            k_p = k_p.repeat_interleave(group, dim=1)
            v_p = v_p.repeat_interleave(group, dim=1)
        k_p = k_p.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
        v_p = v_p.transpose(0, 1).unsqueeze(0)
        if softcap is not None or sinks is not None:  # SDPA has neither: the explicit matmuls
            out[sl] = _explicit_prefill(q_p, k_p, v_p, p, scale, softcap, sinks)[0].transpose(0, 1)
            return
        o = F.scaled_dot_product_attention(
            q_p,
            k_p,
            v_p,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            **({"enable_gqa": True} if group > 1 and _SDPA_GQA else {}),
        )
        out[sl] = o[0].transpose(0, 1)

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale,
                window=None, softcap=None, sinks=None):  # fmt: skip
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[-2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        group = num_heads // num_kv_heads
        plan = self._get_plan(metadata, query.device, window)
        if plan.num_tokens != num_tokens:
            raise ValueError(f"query has {num_tokens} tokens but metadata.query_lens sum to {plan.num_tokens}")
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        cdtype = attention_dtype(query.dtype, key_cache.dtype)
        q = query if query.dtype == cdtype else query.to(cdtype)

        out = None
        for dec in plan.decodes:
            dec_out = self._decode(q, key_cache, value_cache, dec, num_kv_heads, group, head_dim, scale, softcap, sinks)
            if len(plan.decodes) == 1 and not plan.prefills and dec.num_rows == num_tokens:
                return dec_out if dec_out.dtype == query.dtype else dec_out.to(query.dtype)
            if out is None:
                out = torch.empty_like(query)
            if dec.token_range is not None:
                out[dec.token_range[0] : dec.token_range[1]] = dec_out
            else:
                out.index_copy_(0, dec.token_index, dec_out.to(out.dtype))
        if out is None:
            out = torch.empty_like(query)

        for p in plan.prefills:
            self._prefill(q, key, value, key_cache, value_cache, p, out, num_kv_heads, group, head_dim, scale, softcap,
                          sinks)  # fmt: skip
        return out

    def prefill_rows(self, q, key, value, key_cache, value_cache, metadata: AttentionMetadata, out, scale,
                     window=None, softcap=None, sinks=None, min_query_len: int = 2) -> None:  # fmt: skip
        """Only the step's prefill requests of at least ``min_query_len`` new tokens, written into
        their rows of ``out`` (their K/V already in the cache): what another backend hands over for
        the rows it does not compute."""
        num_kv_heads, head_dim = key_cache.shape[-2], q.shape[-1]
        group = q.shape[1] // num_kv_heads
        for p in self._get_plan(metadata, q.device, window).prefills:
            if p.query_len < min_query_len:
                continue
            self._prefill(q, key, value, key_cache, value_cache, p, out, num_kv_heads, group, head_dim, scale, softcap,
                          sinks)  # fmt: skip
