"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight) over the paged cache.

A token's keys and values are not cached per head: the cache keeps one row a token, the
compressed latent ``c`` (``kv_lora_rank`` values, normed) and the key's rotary part ``k_pe``
(``qk_rope_head_dim``, shared by every head). The checkpoint expands ``c`` per head with
``kv_b_proj`` into a key part ``W_UK c`` and a value ``W_UV c``; here both matrices are
*absorbed* instead (DeepSeek-V2's paper, section 2.1.2):

- ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``: each head's query is taken into the latent's
  space once, and its score against a cached row is one dot product over ``[c, k_pe]``;
- ``sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)``: attention sums the latent rows, and each head's
  value comes out of the sum once.

So attention is multi-query attention with one KV head of ``kv_lora_rank + qk_rope_head_dim``
dims whose values are the same rows (the backend's value cache is the key cache itself, and the
output's latent part is kept): every attention backend and kernel runs it unchanged, and the
cache holds ``kv_lora_rank + qk_rope_head_dim`` values a token and layer (576 for DeepSeek-V3,
against 128 heads x 2 x 128-192 expanded).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.plan import KernelPlan
from pagellm.model.layer_spec import LayerSpec
from pagellm.model.layers import apply_rotary_, make_rms_norm
from pagellm.model.lora import LoRAStep
from pagellm.model.mla_prefill import expanded_values, step_split
from pagellm.model.mla_shape import MlaShape
from pagellm.model.quant_linear import linear_for_plan


class LatentExpansion(nn.Module):
    """``kv_b_proj``, kept dense in the model's dtype (absorbed into the queries and outputs, or
    expanding a long prompt's context: ``mla_prefill.py``): its rows are each head's key part
    ``W_UK`` (``qk_nope_head_dim`` rows) then its value part ``W_UV`` (``v_head_dim``)."""

    def __init__(self, shape: MlaShape, num_heads: int) -> None:
        super().__init__()
        self.shape, self.num_heads = shape, num_heads
        rows = num_heads * (shape.qk_nope_head_dim + shape.v_head_dim)
        self.weight = nn.Parameter(torch.empty(rows, shape.kv_lora_rank), requires_grad=False)
        self._absorbed: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (weight version, W_UK, W_UV^T)

    def _matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [heads, nope, latent] and ``W_UV^T`` [heads, latent, v], contiguous, made
        once per loaded weight."""
        version = self.weight._version
        if self._absorbed is None or self._absorbed[0] != version:
            nope = self.shape.qk_nope_head_dim
            per_head = self.weight.detach().view(self.num_heads, nope + self.shape.v_head_dim, self.shape.kv_lora_rank)
            w_uk = per_head[:, :nope].contiguous()
            w_uv_t = per_head[:, nope:].transpose(1, 2).contiguous()
            self._absorbed = (version, w_uk, w_uv_t)
        return self._absorbed[1], self._absorbed[2]

    def absorb_query(self, q_nope: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` [T, heads, latent] = each head's ``W_UK^T q_nope`` (``q_nope``: [T, heads, nope])."""
        w_uk, _ = self._matrices()
        out.copy_(torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1))

    def values(self, latent: torch.Tensor) -> torch.Tensor:
        """Each head's value from its attended latent (``latent``: [T, heads, latent]) -> [T, heads * v]."""
        _, w_uv_t = self._matrices()
        out = torch.bmm(latent.transpose(0, 1), w_uv_t)  # [heads, T, v]
        return out.transpose(0, 1).reshape(latent.shape[0], -1)


class MlaAttention(nn.Module):
    """MLA with absorbed weights (under tensor parallelism: this rank's heads over the whole
    latent, its partial output summed over the ranks). Weight names are the checkpoint's."""

    def __init__(
        self, spec: LayerSpec, attn_backend: AttentionBackend, plan: KernelPlan | None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        assert spec.mla is not None
        shape = self.shape = spec.mla
        self.spec, self.tp, self.num_heads = spec, tp, spec.num_heads
        hidden, heads = spec.hidden_size, spec.num_heads
        norm_kernels = plan.library("norm") if plan is not None else None
        q_out = heads * shape.qk_head_dim
        if shape.q_lora_rank:  # (DeepSeek-V3: the query through its own low-rank bottleneck)
            self.q_a_proj = linear_for_plan(hidden, shape.q_lora_rank, spec.qkv_bias, plan)
            self.q_a_layernorm = make_rms_norm(shape.q_lora_rank, spec.norm_eps, False, norm_kernels)
            self.q_b_proj = linear_for_plan(shape.q_lora_rank, q_out, False, plan)
        else:
            self.q_proj = linear_for_plan(hidden, q_out, False, plan)
        self.kv_a_proj_with_mqa = linear_for_plan(hidden, shape.cache_width, spec.qkv_bias, plan)
        self.kv_a_layernorm = make_rms_norm(shape.kv_lora_rank, spec.norm_eps, False, norm_kernels)
        self.kv_b_proj = LatentExpansion(shape, heads)
        self.o_proj = linear_for_plan(heads * shape.v_head_dim, hidden, spec.o_bias, plan)
        self.attn_backend = attn_backend
        self.rotary_kernels = plan.library("rotary") if plan is not None else None

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each head's query as the checkpoint computes it: [T, heads, nope + rope]."""
        if self.shape.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.num_heads, self.shape.qk_head_dim)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """The layer's output for a flat batch of tokens. ``lora``: the step's adapters, none of
        which targets these projections (refused when an adapter is read: ``model/lora_adapter.py``)."""
        shape, heads, num_tokens = self.shape, self.num_heads, hidden.shape[0]
        latent_width, nope = shape.kv_lora_rank, shape.qk_nope_head_dim
        q = self._query(hidden)
        compressed = self.kv_a_proj_with_mqa(hidden)  # [T, latent + rope]
        # The rotary parts of every head's query and of the shared key, turned together.
        pe = torch.cat((q[..., nope:], compressed[:, None, latent_width:]), dim=1)
        pe = apply_rotary_(pe, cos, sin, self.rotary_kernels)
        key = hidden.new_empty(num_tokens, 1, shape.cache_width)
        key[:, 0, :latent_width] = self.kv_a_layernorm(compressed[:, :latent_width].contiguous())
        key[:, 0, latent_width:] = pe[:, heads]
        split = step_split(attn_metadata, shape, heads)
        if split is None:  # (every request attends in the latent's space)
            values = self._absorbed(q[..., :nope], pe[:, :heads], key, kv_cache, attn_metadata)
        else:
            values = hidden.new_empty(num_tokens, heads * shape.v_head_dim)
            # The long prompts' rows first: a request of the step may attend over them (its
            # prefix-cache hit on blocks another request of the step computes).
            key_cache, value_cache = kv_cache
            write_kv(key[split.long_rows], key[split.long_rows], key_cache, value_cache, split.long_slots)
            if split.absorbed is not None and split.absorbed_metadata is not None:
                rows = split.absorbed
                values[rows] = self._absorbed(q[rows, :, :nope], pe[rows, :heads], key[rows], kv_cache,
                                              split.absorbed_metadata)  # fmt: skip
            for prefill in split.long:
                rows = prefill.tokens
                values[rows] = expanded_values(q[rows, :, :nope], pe[rows, :heads], key_cache, prefill,
                                               self.kv_b_proj.weight, shape, self.spec.scale)  # fmt: skip
        out = self.o_proj(values)
        return out if self.tp is None else self.tp.all_reduce_(out)

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, key: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention in the latent's space through the backend (which writes these rows' latents):
        each head's value, ``[T, heads * v_head_dim]``."""
        latent_width = self.shape.kv_lora_rank
        query = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.shape.cache_width)
        self.kv_b_proj.absorb_query(q_nope, query[..., :latent_width])
        query[..., latent_width:] = q_pe
        key_cache, value_cache = kv_cache
        attended = self.attn_backend.forward(query, key, key, key_cache, value_cache, metadata, self.spec.scale)
        return self.kv_b_proj.values(attended[..., :latent_width])


def mla_weight_names(prefix: str, shape: MlaShape, bias: bool) -> set[str]:
    """The weights an MLA layer loads (``prefix``: ``model.layers.N.self_attn.``); ``bias``: the
    config's ``attention_bias`` (on q_a_proj, kv_a_proj_with_mqa and o_proj)."""
    names = {f"{prefix}{p}.weight" for p in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
    if shape.q_lora_rank:
        names |= {f"{prefix}{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj")}
        names |= {f"{prefix}q_a_proj.bias"} if bias else set()
    else:
        names.add(f"{prefix}q_proj.weight")
    if bias:
        names |= {f"{prefix}kv_a_proj_with_mqa.bias", f"{prefix}o_proj.bias"}
    return names
