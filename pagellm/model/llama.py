"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, and the mixtures of
experts Qwen3-MoE and Mixtral) over a paged KV cache; what differs per family is read from
the arch config (norms, activation, windowed layers, soft caps, expert layers).

The forward takes ONE flat batch of tokens from many sequences (prefill chunks and decode
tokens mixed). Every layer runs its projections over all tokens at once; only attention
needs per-request structure, and that lives behind the ``AttentionBackend`` seam.

Weights arrive under Hugging Face parameter names and are fused at load time
(q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) so each layer runs four matmuls.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.distributed.pipeline import PipelineStage
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.plan import KernelPlan
from pagellm.kernels.quant_formats import QuantizedRows
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.cpu_linear import pack_linear_layers
from pagellm.model.delta_net import GatedDeltaNet
from pagellm.model.fused_stack import FusedDecoderStack
from pagellm.model.layer_spec import LayerSpec, layer_spec, layer_specs
from pagellm.model.layer_weight_names import layer_weight_names
from pagellm.model.layers import RotaryEmbedding, apply_rotary_, make_rms_norm
from pagellm.model.lora import LoRAStep
from pagellm.model.mamba2 import Mamba2Mixer
from pagellm.model.mla import MlaAttention
from pagellm.model.mlp import LlamaMLP
from pagellm.model.moe import SparseMoeBlock
from pagellm.model.mtp import MtpLayer, mtp_arch, mtp_style, mtp_weight_names, mtp_weights
from pagellm.model.quant_embedding import QuantizedEmbedding, embedding_for_plan
from pagellm.model.quant_linear import QuantizedLinear, linear_for_plan
from pagellm.model.scan_state import ScanState
from pagellm.model.short_conv import ConvState, ShortConv
from pagellm.model.step_route import StepRoute, route_step
from pagellm.multimodal_inputs import InputEmbeds
from pagellm.model.weight_names import checkpoint_parts

KVCache = tuple[torch.Tensor, torch.Tensor]
# What each layer keeps between steps: an attention layer its K/V pair, a recurrent layer (a
# hybrid's short convolution, Mamba-2 mixer or gated delta-net) its states.
LayerCache = KVCache | ConvState | ScanState

logger = logging.getLogger(__name__)

# HF sub-module name -> (our fused sub-module name, shard id) for the fused linears.
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "g_proj": ("qkv_proj", "g"),  # (Qwen3.5's attention output gate, split from its q_proj on load)
    # Qwen3.5's gated delta-nets' four input projections (``GatedDeltaNet.in_proj``)
    "in_proj_qkv": ("in_proj", "qkv"),
    "in_proj_z": ("in_proj", "z"),
    "in_proj_b": ("in_proj", "b"),
    "in_proj_a": ("in_proj", "a"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_FUSED_NAME = re.compile(rf"^(?P<prefix>.*\.)(?P<sub>{'|'.join(_FUSED_SHARDS)})\.(?P<kind>weight|bias)$")
_LAYER_NAME = re.compile(r"^model\.layers\.(?P<layer>\d+)\.")
# Checkpoint entries that are derived state, not parameters.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _token_seq_lens(rotary: RotaryEmbedding, metadata: AttentionMetadata, device: torch.device) -> torch.Tensor | None:
    """Each token's sequence length in this step, where dynamic NTK rope needs them (a sequence
    past the context; decided from the step's lists, no device sync); None otherwise."""
    if rotary.dynamic_factor is None or max(metadata.seq_lens, default=0) <= rotary.max_position:
        return None
    lengths = torch.tensor(metadata.seq_lens, device=device)
    return torch.repeat_interleave(lengths, torch.tensor(metadata.query_lens, device=device))


class LlamaAttention(nn.Module):
    """Fused qkv projection, rotary, paged attention through the backend, output projection
    (under tensor parallelism: this rank's heads, its partial output summed over the ranks)."""

    def __init__(
        self, spec: LayerSpec, attn_backend: AttentionBackend, plan: KernelPlan | None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.q_size
        self.kv_size = spec.kv_size
        gate = self.q_size if spec.output_gate else 0  # (Qwen3.5: a gate per head's output, after v)
        self.qkv_proj = linear_for_plan(spec.hidden_size, self.q_size + 2 * self.kv_size + gate, spec.qkv_bias, plan)
        self.o_proj = linear_for_plan(self.q_size, spec.hidden_size, spec.o_bias, plan)
        self.attn_backend = attn_backend
        self.rotary_kernels = plan.library("rotary") if plan is not None else None
        # Qwen3, Gemma 3: each head of q and k RMS-normed (over head_dim) before the rotary embedding;
        # OLMo 2: q and k normed whole (over q_size and kv_size).
        norm_kernels = plan.library("norm") if plan is not None else None
        eps, offset = spec.norm_eps, spec.norm_unit_offset
        whole = spec.qk_norm_over_projection
        q_width, k_width = (self.q_size, self.kv_size) if whole else (self.head_dim, self.head_dim)
        self.q_norm = make_rms_norm(q_width, eps, offset, norm_kernels) if spec.qk_norm else None
        self.k_norm = make_rms_norm(k_width, eps, offset, norm_kernels) if spec.qk_norm else None
        # gpt-oss: each head's sink logit (float32 whatever the model's dtype: it joins a float32 softmax).
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)) if spec.sinks else None

    def _norm_heads(self, qk: torch.Tensor) -> None:
        """Each q and k head RMS-normed in place (``qk``: [T, heads + kv heads, head_dim])."""
        assert self.q_norm is not None and self.k_norm is not None
        self.q_norm.norm_heads_(qk[:, : self.num_heads])
        self.k_norm.norm_heads_(qk[:, self.num_heads :])

    def shard_slices(self) -> dict[str, slice]:
        """Rows of ``qkv_proj`` holding each of q, k, v (and the output gate, g)."""
        q, kv = self.q_size, self.kv_size
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
                "g": slice(q + 2 * kv, 2 * q + 2 * kv)}  # fmt: skip

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add_(qkv, hidden, self.spec.index, "qkv_proj")
        spec, q_end, k_end = self.spec, self.q_size, self.q_size + self.kv_size
        if self.q_norm is not None and self.k_norm is not None and spec.qk_norm_over_projection:
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end].contiguous())
            qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end].contiguous())
        # q and k rotated together (one set of elementwise ops; the same arithmetic per element).
        qk = qkv[:, :k_end].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        per_head = self.q_norm is not None and self.k_norm is not None and not spec.qk_norm_over_projection
        if per_head and not spec.qk_norm_after_rotary:
            self._norm_heads(qk)
        if spec.rotary_dim:  # all of each head's dims, or its leading ones (partial rotary); NoPE: none
            qk = apply_rotary_(qk, cos, sin, self.rotary_kernels)
        if per_head and spec.qk_norm_after_rotary:  # (Hunyuan)
            self._norm_heads(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, k_end : k_end + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        out = self.attn_backend.forward(q, k, v, key_cache, value_cache, attn_metadata, spec.scale, spec.window,
                                        spec.softcap, self.sinks)  # fmt: skip
        attended = out.reshape(num_tokens, self.q_size)
        if spec.output_gate:  # (Qwen3.5)
            attended = attended * torch.sigmoid(qkv[:, k_end + self.kv_size :])
        out = self.o_proj(attended)
        if lora is not None:
            lora.add_(out, attended, self.spec.index, "o_proj")
        return out if self.tp is None else self.tp.all_reduce_(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block (dense, or a mixture of experts in the
    config's expert layers), each with a residual add; Gemma's "sandwich" also norms each
    block's output (``post_attention_layernorm``, ``post_feedforward_layernorm``)."""

    def __init__(
        self, spec: LayerSpec, arch: ModelArchConfig, attn_backend: AttentionBackend, plan: KernelPlan | None,
        tp: TensorParallel | None = None,
    ) -> None:
        """``spec``: this layer; ``arch``: the model (a rank's share) its MLP or experts read."""
        super().__init__()
        self.spec = spec
        norm_kernels = plan.library("norm") if plan is not None else None

        def norm() -> nn.Module:
            return make_rms_norm(spec.hidden_size, spec.norm_eps, spec.norm_unit_offset, norm_kernels)

        self.input_layernorm = norm() if spec.pre_norms else None
        if spec.mamba is not None:  # (Granite-4.0-H's Mamba-2 layers)
            self.mamba = Mamba2Mixer(spec.mamba, spec.hidden_size, spec.norm_eps, plan)
        elif spec.delta_net is not None:  # (Qwen3.5's gated delta-net layers)
            self.linear_attn = GatedDeltaNet(spec.delta_net, spec.hidden_size, spec.norm_eps, plan)
        elif spec.recurrent:  # (LFM2's convolution layers)
            self.conv = ShortConv(spec, plan, tp)
        elif spec.mla is not None:  # (DeepSeek-V3's multi-head latent attention)
            self.self_attn = MlaAttention(spec, attn_backend, plan, tp)
        else:
            self.self_attn = LlamaAttention(spec, attn_backend, plan, tp)
        self.post_attention_layernorm = norm()
        self.mlp = SparseMoeBlock(arch, plan, tp) if spec.moe else LlamaMLP(arch, plan, tp)
        self.pre_feedforward_layernorm = norm() if spec.sandwich_norms and spec.pre_norms else None
        self.post_feedforward_layernorm = norm() if spec.sandwich_norms else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        attn_metadata: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block output, residual stream)``; the residual add happens inside the next norm.
        ``lora``: the step's adapters, added to the projections of the rows that have one."""
        if self.post_feedforward_layernorm is not None:
            return self._sandwich(hidden, residual, cos, sin, kv_cache, attn_metadata, lora)
        assert self.input_layernorm is not None
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._mix(hidden, cos, sin, kv_cache, attn_metadata, lora)
        multiplier = self.spec.residual_multiplier  # Granite: each block's output scaled
        if multiplier != 1.0:
            hidden = hidden * multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out = self._feed_forward(hidden, lora)
        return (out * multiplier if multiplier != 1.0 else out), residual

    def _mix(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache, metadata: AttentionMetadata,
        lora: LoRAStep | None,
    ) -> torch.Tensor:
        """The block that mixes tokens: attention over the K/V pair, or a recurrent mixer over its state."""
        if self.spec.mamba is not None:
            return self.mamba(hidden, cast(ScanState, cache), metadata)
        if self.spec.delta_net is not None:
            return self.linear_attn(hidden, cast(ScanState, cache), metadata)
        if self.spec.recurrent:  # (its cache: worker/kv_cache.py with_recurrent_states)
            return self.conv(hidden, cast(ConvState, cache), metadata)
        return self.self_attn(hidden, cos, sin, cast(KVCache, cache), metadata, lora)

    def _feed_forward(self, hidden: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        """The MLP (adapters add to a dense one's projections), or the mixture of experts."""
        if lora is None or self.spec.moe:
            return self.mlp(hidden)
        return self.mlp(hidden, lora, self.spec.index)

    def _sandwich(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        kv_cache: LayerCache, attn_metadata: AttentionMetadata, lora: LoRAStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's order: each block's output normed before its residual add (OLMo 2: and no norm
        before a block)."""
        assert self.post_feedforward_layernorm is not None
        residual = hidden if residual is None else hidden + residual
        normed = self.input_layernorm(residual) if self.input_layernorm is not None else residual
        attended = self._mix(normed, cos, sin, kv_cache, attn_metadata, lora)
        residual = residual + self.post_attention_layernorm(attended)
        pre = self.pre_feedforward_layernorm
        out = self._feed_forward(pre(residual) if pre is not None else residual, lora)
        return self.post_feedforward_layernorm(out), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, arch: ModelArchConfig, attn_backend: AttentionBackend, plan: KernelPlan | None,
        tp: TensorParallel | None = None, pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        # Under pipeline parallelism only stage 0 embeds token ids; the last stage keeps the
        # embedding too where the LM head shares its matrix (tied weights).
        embeds = pp is None or pp.is_first or (pp.is_last and arch.tie_word_embeddings)
        self.embed_tokens = embedding_for_plan(arch.vocab_size, arch.hidden_size, plan) if embeds else None
        layer_arch = arch.shard(tp.size) if tp is not None else arch  # this rank's share of each layer
        self.start, self.end = (pp.start, pp.end) if pp is not None else (0, arch.num_hidden_layers)
        # Every layer index keeps its place (HF names: model.layers.N); another stage's is empty.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, layer_arch, attn_backend, plan, tp)
            if self.start <= spec.index < self.end else nn.Module()
            for spec in layer_specs(layer_arch)
        )
        norm_kernels = plan.library("norm") if plan is not None else None
        self.norm = make_rms_norm(arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset, norm_kernels)
        self.rotary_emb = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
        # Gemma 3: the windowed layers turn q and k by their own (local) base, unscaled.
        local = arch.local_rope_theta
        self.local_rotary_emb = (
            RotaryEmbedding(arch.rotary_dim, local, None, arch.max_position_embeddings) if local is not None else None
        )

    @property
    def own_layers(self) -> nn.ModuleList:
        """The decoder layers this model runs (all of them, or its pipeline stage's). The whole
        list itself where it runs them all: slicing builds a new ModuleList, every step."""
        if self.start == 0 and self.end == len(self.layers):
            return self.layers
        return self.layers[self.start : self.end]  # type: ignore[return-value]


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache; also serves Mistral and Qwen2 (q/k/v bias).

    ``plan`` (None: PyTorch everywhere) says which kernels the norms and rotary use;
    :meth:`optimize_for_cpu_inference` repacks the loaded weights for its GEMM.
    """

    def __init__(
        self, arch: ModelArchConfig, attn_backend: AttentionBackend, plan: KernelPlan | None = None,
        tp: TensorParallel | None = None, pp: PipelineStage | None = None, mtp: bool = False,
    ) -> None:
        """``mtp``: also the checkpoint's first multi-token-prediction layer (``model/mtp.py``; one process)."""
        super().__init__()
        self.arch = arch
        self.tp = tp  # tensor parallelism: this rank's share of each layer, whole HF weights cut on load
        self.pp = pp  # pipeline parallelism: this stage's layers (and the embedding or the head)
        self.model = LlamaModel(arch, attn_backend, plan, tp, pp)
        heads = pp is None or pp.is_last
        self.lm_head = linear_for_plan(arch.hidden_size, arch.vocab_size, False, plan) if heads else None
        self.mtp_layer = self._mtp_layer(attn_backend, plan) if mtp else None
        self.tie_weights()
        # plan.decoder == "fused": the layers run in one C++ call where a step fits it (built
        # from the loaded weights at the first forward); under tensor parallelism where the
        # ranks join their sums through shared memory (the call makes the all-reduces itself).
        joinable = tp is None or tp.shm is not None
        fused = plan is not None and plan.decoder == "fused" and plan.kernels is not None and joinable
        self.decoder_kernels = plan.kernels if fused and plan is not None else None
        self.plan = plan
        self.attn_backend = attn_backend
        self._fused_stack: FusedDecoderStack | None = None
        self._fused_stack_built = False
        self.last_route: StepRoute | None = None  # what the last forward ran

    def _mtp_layer(self, attn_backend: AttentionBackend, plan: KernelPlan | None) -> MtpLayer:
        if self.tp is not None or self.pp is not None:
            raise ValueError("the multi-token prediction layer runs in a one-process engine only for now")
        arch = mtp_arch(self.arch)
        block = LlamaDecoderLayer(layer_spec(arch, self.arch.num_hidden_layers), arch, attn_backend, plan)
        normed = mtp_style(arch.architecture).normed_output
        return MtpLayer(block, arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset, normed, plan)

    def mtp_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The MTP layer's output at each row: ``hidden`` the target's final hidden states (or
        the layer's own last output) at ``positions``, ``input_ids`` the tokens after them; its
        K/V written at those positions."""
        if self.mtp_layer is None or self.model.embed_tokens is None:
            raise RuntimeError("the model was loaded without its multi-token prediction layer")
        seq_lens = _token_seq_lens(self.model.rotary_emb, attn_metadata, positions.device)
        cos, sin = self.model.rotary_emb(positions, hidden.dtype, seq_lens)
        return self.mtp_layer(self._embed(input_ids), hidden, cos, sin, kv_cache, attn_metadata)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, scaled where the family scales them (the scale rounded to
        float32, then the dtype, as HF)."""
        assert self.model.embed_tokens is not None
        hidden = self.model.embed_tokens(input_ids)
        if self.arch.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.arch.embedding_scale).to(hidden.dtype)
        return hidden

    def mtp_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits of the token the MTP layer's outputs ``hidden`` predict (through the model's head)."""
        if self.mtp_layer is None:
            raise RuntimeError("the model was loaded without its multi-token prediction layer")
        return self.compute_logits(self.mtp_layer.head_input(hidden), upcast)

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so (re-run after
        ``to_empty``); a quantized lm_head gets its own quantized copy while loading instead."""
        if self.arch.tie_word_embeddings and isinstance(self.lm_head, nn.Linear) and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        attn_metadata: AttentionMetadata,
        stream: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
        embeds: InputEmbeds | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for a flat batch of ``T`` tokens; under
        pipeline parallelism a stage after the first starts from the previous stage's residual
        ``stream`` instead of the token ids, and a stage before the last returns its own.
        ``lora``: the adapters of the step's rows (None: none has one), added in the one-call
        stack where it takes them, else in the layers one by one. ``embeds``: rows whose
        embeddings are given (images' encoder outputs), set after the embedding's scale."""
        layers = self.model.own_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV cache pairs, got {len(kv_caches)}")
        if stream is not None:
            hidden = stream
        elif self.model.embed_tokens is not None and (self.pp is None or self.pp.is_first):
            hidden = self._embed(input_ids)
            if embeds is not None:
                hidden[embeds.indices] = embeds.rows.to(hidden.dtype)
        else:
            raise ValueError("a pipeline stage after the first starts from the previous stage's hidden states")
        seq_lens = _token_seq_lens(self.model.rotary_emb, attn_metadata, positions.device)
        cos, sin = self.model.rotary_emb(positions, hidden.dtype, seq_lens)
        local_rotary = self.model.local_rotary_emb
        local = local_rotary(positions, hidden.dtype) if local_rotary is not None else (cos, sin)
        stack = self._decoder_stack()
        stack = stack if stack is not None and stack.takes(lora) else None
        route = self._route(hidden, kv_caches, attn_metadata, stack)
        if stack is not None and route.decoder == "fused":
            hidden, residual = stack(hidden, cos, sin, kv_caches, stack.layer_args(route.big_batch), attn_metadata, lora)
        else:
            residual = None
            for layer, kv_cache in zip(layers, kv_caches):
                rope = local if layer.spec.local_rope else (cos, sin)
                hidden, residual = layer(hidden, residual, *rope, kv_cache, attn_metadata, lora)
        if self.pp is not None and not self.pp.is_last:
            return hidden if residual is None else hidden + residual  # what the next layer's norm adds first
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _route(
        self, hidden: torch.Tensor, kv_caches: list[LayerCache], metadata: AttentionMetadata,
        stack: FusedDecoderStack | None,
    ) -> StepRoute:
        """This step's route (:mod:`pagellm.model.step_route`), logged at debug level where it
        differs from the last step's."""
        pair = next((cache for cache in kv_caches if isinstance(cache, tuple)), None)  # (the first attention layer's)
        cache_dtype = pair[0].dtype if pair is not None else hidden.dtype
        fits = stack is not None and stack.fits(hidden, kv_caches)
        route = route_step(self.plan, self.attn_backend, metadata, hidden.shape[0], hidden.dtype, cache_dtype,
                           self.arch.head_dim, fits)  # fmt: skip
        last = self.last_route
        if last is None or last.describe() != route.describe():
            logger.debug("step route: %s (%d rows)", route.describe(), route.rows)
        self.last_route = route
        return route

    def _decoder_stack(self) -> FusedDecoderStack | None:
        """The one-call decoder stack where the plan asked for it and the loaded layers fit it."""
        if self.decoder_kernels is not None and not self._fused_stack_built:
            layer_arch = self.arch if self.tp is None else self.arch.shard(self.tp.size)  # this rank's share
            self._fused_stack = FusedDecoderStack.build(self.model.own_layers, layer_arch, self.decoder_kernels, self.tp)
            self._fused_stack_built = True  # None: the layers do not fit, the Python layers run
        return self._fused_stack

    def optimize_for_cpu_inference(self, plan: KernelPlan) -> dict[str, int]:
        """Repack the loaded weights for the plan's GEMM: fused MLPs, packed linears (bf16/fp16,
        and float32 where the plan's GEMM is pagellm's AVX2 one).

        Irreversible (loading weights afterwards is not supported); a no-op where the plan keeps
        torch's GEMM (float32 on AVX-512 CPUs: MKL/oneDNN).
        """
        layers = list(self.model.own_layers) + ([self.mtp_layer.block] if self.mtp_layer is not None else [])
        fused = 0
        if layers and layers[0].mlp.fuse_for_cpu(plan, verify=True):  # one self-check for the model
            fused = 1 + sum(layer.mlp.fuse_for_cpu(plan, verify=False) for layer in layers[1:])
        return {"fused_mlps": fused, "packed_linears": pack_linear_layers(self, plan)}

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` for the rows the sampler needs: float32, or the model
        dtype with ``upcast=False`` (enough for an argmax, which the upcast cannot change)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:  # Gemma 2, in the model dtype as HF
            logits = torch.tanh(logits / cap) * cap
        if self.arch.logits_scaling != 1.0:  # Granite
            logits = logits / self.arch.logits_scaling
        return logits.float() if upcast else logits

    def expected_weight_names(self) -> set[str]:
        """Every HF parameter name a complete checkpoint must provide for this config."""
        arch = self.arch
        names = {"model.norm.weight"}  # (every stage keeps the small final norm)
        if self.model.embed_tokens is not None:
            names.add("model.embed_tokens.weight")
        if not arch.tie_word_embeddings and self.lm_head is not None:
            names.add("lm_head.weight")
        for i in range(self.model.start, self.model.end):
            names |= layer_weight_names(arch, i)
        if self.mtp_layer is not None:
            names |= mtp_weight_names(layer_weight_names(mtp_arch(arch), arch.num_hidden_layers), arch)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (casting to the model dtype), fusing q/k/v and gate/up.

        Raises ValueError on unknown names, shape mismatches, or a checkpoint missing any weight,
        so a partly-loaded model (garbage from ``to_empty``) can never be served.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tied_quantized = self.arch.tie_word_embeddings and isinstance(self.lm_head, QuantizedLinear)
        if self.mtp_layer is not None:  # (its tensors under their names here: not dropped)
            weights = mtp_weights(weights, self.arch)
        for name, tensor in (part for item in weights for part in checkpoint_parts(self.arch, *item)):
            if _IGNORED.search(name) or not self.holds_weight(name):
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # some tied checkpoints still store it; the embedding is the source of truth
            if name == "model.embed_tokens.weight" and tied_quantized:
                self.lm_head.load_rows(None, tensor)  # type: ignore[operator]
            self._load_one(params, name, tensor)
            loaded.add(name)
        missing = self.expected_weight_names() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")
        for module in self.modules():
            if isinstance(module, QuantizedLinear):
                module.finish_loading()
        self._fused_stack, self._fused_stack_built = None, False  # rebuilt from these weights when next used

    def holds_weight(self, name: str) -> bool:
        """Whether the HF tensor ``name`` has a place here (not another pipeline stage's)."""
        match = _LAYER_NAME.match(name)
        if match is not None:  # (a layer the model does not have is kept: refused as unexpected)
            layer = int(match["layer"])
            return self.model.start <= layer < self.model.end or layer >= self.arch.num_hidden_layers
        if name == "model.embed_tokens.weight":
            return self.model.embed_tokens is not None
        if name == "lm_head.weight":
            return self.lm_head is not None
        return True

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | QuantizedRows) -> None:
        """Copy one HF tensor into its (possibly fused) destination rows (a quantized linear
        takes its weight as it comes; everything else is dense)."""
        if self.tp is not None:
            tensor = self.tp.share(name, tensor)
        target_name, rows = self._destination(name)
        module_name, _, attr = target_name.rpartition(".")
        module = self._submodule_or_none(module_name) if target_name not in params else None
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and attr == "weight":
            module.load_rows(rows, tensor)
            return
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()
        if target_name not in params:
            raise ValueError(f"unexpected weight {name!r} for {self.arch.architecture}")
        target = params[target_name].data
        target = target[rows] if rows is not None else target
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    def _submodule_or_none(self, name: str) -> nn.Module | None:
        """The submodule called ``name`` (None for the model itself or an unknown name)."""
        try:
            return self.get_submodule(name) if name else None
        except AttributeError:
            return None

    def _destination(self, name: str) -> tuple[str, slice | None]:
        """Our parameter name for an HF name, plus the row slice inside a fused parameter."""
        match = _FUSED_NAME.match(name)
        if match is None:
            return name, None
        fused, shard = _FUSED_SHARDS[match["sub"]]
        try:
            module = self.get_submodule(match["prefix"].rstrip("."))
        except AttributeError:
            module = None
        if isinstance(module, MlaAttention):  # (its q_proj is its own, not part of a fused q/k/v)
            return name, None
        if not isinstance(module, (LlamaAttention, LlamaMLP, GatedDeltaNet)):
            raise ValueError(f"unexpected weight {name!r} for {self.arch.architecture}")
        return f"{match['prefix']}{fused}.{match['kind']}", module.shard_slices()[shard]
