"""The model shape, in one small dataclass the engine can read without loading weights.

The engine sizes the KV cache from this before any weight is touched, so it is built
from ``config.json`` (+ ``generation_config.json``) or from GGUF metadata alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.kv_layout import kv_bytes_per_token
from pagellm.model.config_values import merge_eos, optional_float, optional_int
from pagellm.model.mla_shape import MlaShape, mla_config
from pagellm.model.scan_shapes import (
    DELTA_NET, MAMBA, DeltaNetShape, MambaShape, bamba_config, granite_hybrid_config, qwen3_5_fields,
)
from pagellm.model.text_of_multimodal import text_model_config
from pagellm.model.rope_config import FULL, ntk_alpha, partial_rotary_factor, rope_from_hf

# HF `model_type` -> architecture class name, for config.json files without "architectures".
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
# DeepSeek-V2, V3 and the families built as V3 (GLM-4.7-Flash): MLA (MLA_ARCHITECTURES), shared
# experts, biases on the attention's projections; V3's routing (_SIGMOID_ROUTING) or V2's.
_DEEPSEEK_V3 = {"DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"}
_DEEPSEEK = {*_DEEPSEEK_V3, "DeepseekV2ForCausalLM"}
# Architectures whose q/k/v projections always carry a bias (no config flag for it).
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
# Architectures whose `attention_bias` flag also puts a bias on o_proj.
_O_PROJ_FOLLOWS_ATTENTION_BIAS = {"LlamaForCausalLM", "GptOssForCausalLM", "BambaForCausalLM", *_DEEPSEEK}
# Architectures with an RMSNorm over each head of q and of k before the rotary embedding.
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Exaone4ForCausalLM",
            "HunYuanDenseV1ForCausalLM", "Lfm2ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}  # fmt: skip
# Architectures whose per-head q/k norms come after the rotary embedding, not before (Hunyuan).
_QK_NORM_AFTER_ROTARY = {"HunYuanDenseV1ForCausalLM"}
# Architectures whose config's ``use_qk_norm`` switches those per-head norms on (GLM-4.5).
_QK_NORM_BY_FLAG = {"Glm4MoeForCausalLM"}
# Gemma: RMSNorm scaled by (1 + weight), a norm after attention and around the MLP, embeddings
# scaled by sqrt(hidden_size), windowed and global layers alternating (layer_types).
_GEMMA = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
# Where a config without `layer_types` puts its global layers: every N-th (Gemma 2: 2, Gemma 3:
# its `sliding_window_pattern`, 6 by default).
_GLOBAL_LAYER_EVERY = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
SLIDING, CONV = "sliding_attention", "conv"
# Mixture-of-experts families; Mixtral scales each expert's output by its float32 routing
# weight, Qwen3-MoE by the weight cast to the model dtype first (as the reference does).
_MOE = {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM", "Qwen2MoeForCausalLM",
        "GraniteMoeHybridForCausalLM", "Qwen3_5MoeForCausalLM", *_DEEPSEEK}  # fmt: skip
# OLMo 2: no norm before a block, one after each block's output (before its residual add), and q
# and k RMS-normed over their whole projection (before the heads are split).
_OLMO2 = {"Olmo2ForCausalLM", "Olmo3ForCausalLM"}  # (OLMo 3: with windowed layers, per-type rope bases)
# Architectures whose windowed layers turn by their own rope base (``rope_parameters`` per type).
_LOCAL_ROPE = {"Gemma3ForCausalLM", "Olmo3ForCausalLM"}
# GLM-4 (0414, Z1): norms before and after each block (Gemma's sandwich, plain weights), and the
# rotary over interleaved pairs of dims (undone on load: its q/k rows reordered to rotate-half's).
_GLM4 = {"Glm4ForCausalLM"}
# SmolLM3: layers without a rotary embedding (NoPE), listed per layer in ``no_rope_layers``.
_NOPE = {"SmolLM3ForCausalLM"}
_MOE_COMBINE_IN_FLOAT32 = {"MixtralForCausalLM", "Glm4MoeForCausalLM", *_DEEPSEEK}
# DeepSeek-V3's routing (and GLM-4.5's): sigmoid scores, a per-expert correction bias in the choice
# only, the best ``topk_group`` of ``n_group`` groups first, weights scaled; shared experts beside;
# the first ``first_k_dense_replace`` layers dense.
_SIGMOID_ROUTING = {"Glm4MoeForCausalLM", *_DEEPSEEK_V3}
# gpt-oss: attention sinks; a router with a bias whose chosen logits are softmaxed; experts with
# biases and a clamped SwiGLU; every layer's MLP a mixture of experts.
_GPT_OSS = {"GptOssForCausalLM"}
# LFM2: short-convolution layers beside attention ones (``layer_types``), per-head q/k norms,
# the MLP's width derived from ``intermediate_size`` (``_lfm2_config``).
_LFM2 = {"Lfm2ForCausalLM"}
# Granite's multipliers (embeddings, scores, residual, logits); Granite-4.0-H: Mamba-2 layers
# beside attention ones without rope (``position_embedding_type`` other than "rope").
_GRANITE = {"GraniteForCausalLM", "GraniteMoeHybridForCausalLM"}
_GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# Qwen3.5: gated delta-net layers beside gated attention ones, norms by (1 + weight).
_QWEN3_5 = {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"}  # (the MoE models: every MLP Qwen2-MoE's kind)


@dataclass
class ModelArchConfig:
    """Everything about a decoder-only model's shape that the engine and model need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # Llama's `attention_bias` also covers o_proj; Qwen2's bias does not
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # effective window (None when the model attends to everything)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before rotary
    partial_rotary_factor: float = 1.0  # share of each head the rotary embedding turns (Phi-4-mini: 0.75)
    nope_layers: tuple[int, ...] = ()  # layers that turn no rotary embedding (SmolLM3: every 4th)
    # GLM-4: the checkpoint's rotary turns interleaved pairs (2i, 2i + 1); its q/k rows are reordered
    # on load to rotate-half's (i, i + rotary_dim / 2), which turn alike (weight_names.py)
    rotary_interleaved: bool = False
    qk_norm_after_rotary: bool = False  # Hunyuan: the per-head q/k norms follow the rotary
    # Mixture of experts (pagellm.model.moe): the layers whose MLP is a routed set of experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    moe_combine_in_float32: bool = False
    moe_layers: tuple[int, ...] = ()
    # "softmax" over every expert, then the top k; "sigmoid" (a correction bias and groups:
    # _SIGMOID_ROUTING); "topk_softmax": the top k logits, then a softmax over them (gpt-oss; in
    # float32: "topk_softmax_float32", Granite-4.0-H)
    moe_scoring: str = "softmax"
    moe_router_bias: bool = False  # gpt-oss: the router linear has a bias
    moe_groups: tuple[int, int] = (1, 1)  # (n_group, topk_group): experts chosen from the best groups only
    routed_scaling_factor: float = 1.0  # the chosen experts' weights scaled by this
    shared_expert_size: int = 0  # the width of an MLP every token runs beside the routed experts (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared MLP's output scaled by sigmoid(a linear of the input)
    # Per-layer attention (Gemma): "sliding_attention" / "full_attention" for each layer; empty
    # where every layer attends alike (with `sliding_window`, if any, on all of them).
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base (no scaling)
    attention_scale: float | None = None  # scores' scale (Gemma: query_pre_attn_scalar**-0.5); None: head_dim**-0.5
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped by c * tanh(s / c)
    final_logit_softcapping: float | None = None  # Gemma 2: logits capped likewise
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False  # Gemma: norms after attention, and before and after the MLP
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size); Granite: its multiplier
    pre_norms: bool = True  # a norm before each block (OLMo 2: none; its norms follow each block)
    qk_norm_over_projection: bool = False  # OLMo 2: q and k RMS-normed whole (weights [q_size], [kv_size])
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before its residual add
    logits_scaling: float = 1.0  # Granite: logits divided by this
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax, over no value
    swiglu_limit: float | None = None  # gpt-oss: the clamped SwiGLU (gate <= limit, |up| <= limit)
    swiglu_alpha: float = 1.702  # gpt-oss: gate * sigmoid(alpha * gate)
    # LFM2: short-convolution layers (``layer_types`` "conv") in place of attention: the
    # convolution's taps (its state keeps the last conv_kernel - 1 inputs), biases or not.
    conv_kernel: int = 0
    conv_bias: bool = False
    conv_channels: int = 0  # a tensor-parallel rank's share of the convolutions' channels (0: hidden_size)
    mamba: MambaShape | None = None  # Granite-4.0-H: the shape of its Mamba-2 layers (``layer_types`` "mamba")
    delta_net: DeltaNetShape | None = None  # Qwen3.5: its gated delta-net layers' (``layer_types`` "linear_attention")
    attn_output_gate: bool = False  # Qwen3.5: attention's output times sigmoid(a gate q_proj makes per head)
    mla: MlaShape | None = None  # DeepSeek: multi-head latent attention (model/mla_shape.py says how it is cached)

    def __post_init__(self) -> None:
        if self.mamba_layers and self.mamba is None:
            raise NotImplementedError(f"{self.architecture}'s Mamba layers are not supported (only Granite-4.0-H's)")
        if self.delta_net_layers and self.delta_net is None:
            raise NotImplementedError(f"{self.architecture}'s {DELTA_NET} layers are not supported (only Qwen3.5's)")

    @property
    def convolution_channels(self) -> int:
        """The channels each convolution layer runs here (all, or this rank's share)."""
        return self.conv_channels or self.hidden_size

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that carry a state per sequence instead of K/V (a hybrid model's)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (CONV, MAMBA, DELTA_NET))

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The Mamba-2 layers (``model/mamba2.py``) among the recurrent ones."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def delta_net_layers(self) -> tuple[int, ...]:
        """The gated delta-net layers (``model/delta_net.py``) among the recurrent ones."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == DELTA_NET)

    def scan_shape(self, layer: int) -> MambaShape | DeltaNetShape | None:
        """Layer ``layer``'s scan mixer's shape (Mamba-2, gated delta-net); None for another layer."""
        kind = self.layer_types[layer] if self.layer_types else None
        return self.mamba if kind == MAMBA else self.delta_net if kind == DELTA_NET else None

    @property
    def snapshots_states_per_block(self) -> bool:
        """Whether each KV block can keep its recurrent layers' states at its last position, as the
        prefix cache of a hybrid needs: a short convolution's few inputs can, a scan layer's
        matrix state (megabytes a layer at real sizes) cannot at every block."""
        return not (self.mamba_layers or self.delta_net_layers)

    @property
    def num_attention_layers(self) -> int:
        """The layers that keep K/V in the paged cache."""
        return self.num_hidden_layers - len(self.recurrent_layers)

    @property
    def attention_window(self) -> int | None:
        """Positions each query attends to (its own included) where a sliding window limits
        them below the model's context; None where it attends to everything."""
        window = self.sliding_window
        return window if window is not None and window < self.max_position_embeddings else None

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (``attention_window``; None for a global layer)."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.attention_window

    @property
    def window_of_every_layer(self) -> int | None:
        """The window where every layer keeps one (KV blocks before it can be released, as no
        layer reads them again); None where any layer attends to everything."""
        recurrent = set(self.recurrent_layers)
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers) if i not in recurrent}
        return windows.pop() if len(windows) == 1 else None

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` turns q and k by the local rope base (Gemma 3's windowed layers)."""
        return self.local_rope_theta is not None and bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def context_length(self) -> int:
        """Positions the model serves: its ``max_position_embeddings``, times the factor under
        dynamic NTK rope (which exists to stretch it; vLLM derives its limit the same way)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head the rotary embedding turns (the rest pass unturned; MLA:
        the dims of its rotary part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_values_stored(self) -> bool:  # (MLA: the values are part of each key row)
        return self.mla is None

    def layer_rotary_dim(self, layer: int) -> int:
        """``rotary_dim`` for layer ``layer``; 0 for a NoPE layer."""
        return 0 if layer in self.nope_layers else self.rotary_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_attention_heads * self.head_dim

    def shard(self, size: int) -> ModelArchConfig:
        """What one of ``size`` tensor-parallel ranks holds of each layer: its share of the
        attention heads, KV heads and MLP width (``pagellm.distributed.tensor_parallel``)."""
        if size == 1:
            return self
        for name in ("num_attention_heads", "num_key_value_heads" if self.mla is None else "num_attention_heads",
                     "intermediate_size", "moe_intermediate_size", "shared_expert_size"):
            if getattr(self, name) % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the model's {name} ({getattr(self, name)})")
        if self.recurrent_layers and self.hidden_size % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's hidden_size ({self.hidden_size}): "
                             "its convolutions' channels are shared out")  # fmt: skip
        if self.mamba_layers or self.delta_net_layers:
            raise ValueError(f"tensor parallelism does not support {self.architecture}'s scan (Mamba-2, gated "
                             "delta-net) layers yet")  # fmt: skip
        if self.qk_norm_over_projection:
            raise ValueError(f"tensor parallelism does not support {self.architecture}'s q/k norms over the whole "
                             "projection yet (each rank holds only some heads)")  # fmt: skip
        return dataclasses.replace(
            self, num_attention_heads=self.num_attention_heads // size,
            num_key_value_heads=self.num_key_value_heads // size if self.mla is None else 1, intermediate_size=self.intermediate_size // size,
            moe_intermediate_size=self.moe_intermediate_size // size, shared_expert_size=self.shared_expert_size // size,
            conv_channels=self.hidden_size // size if self.recurrent_layers else 0,
        )  # fmt: skip

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_key_value_heads * self.head_dim

    def linear_weight_count(self) -> int:
        """Weights of every linear layer (the decoder's and the LM head), biases aside."""
        hidden, inter = self.hidden_size, self.intermediate_size
        attention = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden
        if self.mla is not None:
            attention = self.mla.weight_count(hidden, self.num_attention_heads)
        routed = self.num_experts * 3 * hidden * self.moe_intermediate_size + self.num_experts * hidden
        moe = len(self.moe_layers) * (routed + 3 * hidden * self.shared_expert_size)
        dense = (self.num_hidden_layers - len(self.moe_layers)) * 3 * hidden * inter
        scan_layers = len(self.mamba_layers) + len(self.delta_net_layers)
        convolution = (len(self.recurrent_layers) - scan_layers) * 4 * hidden * hidden  # in_proj (3), out_proj
        mamba, delta = self.mamba, self.delta_net
        ssm = len(self.mamba_layers) * hidden * (mamba.in_proj_size + mamba.inner_size) if mamba is not None else 0
        if delta is not None:  # q/k/v, the gate z, b and a in; out
            per_layer = delta.conv_dim + 2 * delta.value_size + 2 * delta.num_value_heads
            ssm += len(self.delta_net_layers) * hidden * per_layer
        return self.num_attention_layers * attention + convolution + ssm + moe + dense + self.vocab_size * hidden

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K+V bytes one token occupies across all layers in a cache of ``dtype`` (for sizing the
        paged cache and the bytes a decode token reads; an int8 row holds its scale too)."""
        return kv_bytes_per_token(self.num_attention_layers, self.num_key_value_heads, self.head_dim, dtype,
                                  values=self.kv_values_stored)

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelArchConfig:
        """Build from a parsed Hugging Face ``config.json`` (old and transformers-5 rope formats;
        a multimodal checkpoint's text model, :func:`text_model_config`)."""
        config = text_model_config(config)
        architecture = _architecture_name(config)
        if architecture in _LFM2:
            config = _lfm2_config(config)
        mamba = None
        if architecture == _GRANITE_HYBRID:
            config, mamba = granite_hybrid_config(config)
        elif architecture == "BambaForCausalLM":
            config, mamba = bamba_config(config)
        config, mla, mla_fields = mla_config(architecture, config)
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        rope_theta, rope_scaling = ntk_alpha(config, *rope_from_hf(config))
        qkv_bias, o_bias, mlp_bias = _biases(architecture, config)
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            hidden_act=str(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
            bos_token_id=optional_int(config.get("bos_token_id")),
            eos_token_ids=merge_eos(config, generation_config),
            sliding_window=_effective_sliding_window(config),
            qk_norm=architecture in _QK_NORM or architecture in _OLMO2
            or (architecture in _QK_NORM_BY_FLAG and bool(config.get("use_qk_norm"))),
            partial_rotary_factor=partial_rotary_factor(config),
            nope_layers=_nope_layers(architecture, config),
            **_moe_fields(architecture, config),
            **_olmo2_fields(architecture),
            **_granite_fields(architecture, config),
            **_gpt_oss_fields(architecture, config),
            **({"sandwich_norms": True, "rotary_interleaved": True} if architecture in _GLM4 else {}),
            **({"rotary_interleaved": True} if architecture == "Ernie4_5ForCausalLM" else {}),
            **_exaone4_fields(architecture, config),
            **({"conv_kernel": int(config.get("conv_L_cache", 3)), "conv_bias": bool(config.get("conv_bias", False))}
               if architecture in _LFM2 else {}),
            qk_norm_after_rotary=architecture in _QK_NORM_AFTER_ROTARY,
            mamba=mamba,
            mla=mla,
            **mla_fields,
            **(qwen3_5_fields(config) if architecture in _QWEN3_5 else {}),
            **({"local_rope_theta": _local_rope_theta(architecture, config)} if architecture in _LOCAL_ROPE - _GEMMA else {}),
            **_gemma_fields(architecture, config, hidden_size),
            **({} if architecture in _GEMMA else {"layer_types": _layer_types(config)}),
        )


def _architecture_name(config: dict[str, Any]) -> str:
    """First entry of ``architectures``, else derived from ``model_type``."""
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = str(config.get("model_type", ""))
    return _MODEL_TYPE_TO_ARCH.get(model_type, model_type or "<missing architectures>")


def _biases(architecture: str, config: dict[str, Any]) -> tuple[bool, bool, bool]:
    """Which projections carry a bias, as each family's config says it: (q/k/v, o_proj, MLP)."""
    attention = bool(config.get("attention_bias", False))
    if architecture == "Ernie4_5ForCausalLM":  # one switch for every linear
        return (bool(config.get("use_bias", False)),) * 3  # type: ignore[return-value]
    qkv = attention or architecture in _ALWAYS_QKV_BIAS or (
        architecture == "Qwen2MoeForCausalLM" and bool(config.get("qkv_bias", True)))  # fmt: skip
    o_proj = (attention and architecture in _O_PROJ_FOLLOWS_ATTENTION_BIAS) or (
        architecture == "SeedOssForCausalLM" and bool(config.get("attention_out_bias", False)))  # fmt: skip
    mlp = bool(config.get("mlp_bias", False)) or architecture in _GPT_OSS  # (gpt-oss: its experts')
    return qkv, o_proj, mlp


def _exaone4_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4: norms after each block only (as OLMo 2's), per-head q/k norms, and with windowed
    layers (the hybrid models) no rope in the global ones."""
    if architecture != "Exaone4ForCausalLM":
        return {}
    return dict(pre_norms=False, sandwich_norms=True)  # (its NoPE layers: _nope_layers)


def _lfm2_config(config: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config in the common spelling: its MLP's width as its config class derives it
    (``block_auto_adjust_ff_dim``: two thirds, times the multiplier, rounded up to a multiple),
    ``norm_eps``, and ``layer_types`` from ``full_attn_idxs`` where only those are given."""
    config = dict(config)
    width = int(config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(config.get("block_multiple_of", 256))
            width = multiple * ((int(float(multiplier) * width) + multiple - 1) // multiple)
    config["intermediate_size"] = width
    config["rms_norm_eps"] = config.get("norm_eps", config.get("rms_norm_eps", 1e-5))
    if not config.get("layer_types"):
        full = set(config.get("full_attn_idxs") or range(int(config["num_hidden_layers"])))
        config["layer_types"] = [FULL if i in full else CONV for i in range(int(config["num_hidden_layers"]))]
    return config


def _nope_layers(architecture: str, config: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rope: ``no_rope_layers`` (1: rope, 0: none), else every
    ``no_rope_layer_interval``-th layer (4 by default), as its config class derives them;
    EXAONE 4's global layers where it has windowed ones too."""
    if architecture == "Exaone4ForCausalLM":
        types = _layer_types(config)
        hybrid = config.get("sliding_window") is not None and SLIDING in types
        return tuple(i for i, t in enumerate(types) if t == FULL) if hybrid else ()
    if architecture == _GRANITE_HYBRID:  # (no rope anywhere unless asked for)
        rope = config.get("position_embedding_type") == "rope"
        return () if rope else tuple(range(int(config["num_hidden_layers"])))
    if architecture not in _NOPE:
        return ()
    layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, the model has {layers}")
    return tuple(i for i, rope in enumerate(flags) if not rope)


def _olmo2_fields(architecture: str) -> dict[str, Any]:
    """OLMo 2's norms: after each block only, and over the whole q and k projections."""
    if architecture not in _OLMO2:
        return {}
    return dict(pre_norms=False, sandwich_norms=True, qk_norm_over_projection=True)


def _granite_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers: of the embeddings, of the scores (in place of head_dim**-0.5), of
    each block's output, and the logits' divisor."""
    if architecture not in _GRANITE:
        return {}
    return dict(
        embedding_scale=float(config.get("embedding_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
    )


def _gpt_oss_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's attention sinks and clamped SwiGLU (its experts' biases: ``mlp_bias``)."""
    if architecture not in _GPT_OSS:
        return {}
    return dict(attention_sinks=True, swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(config.get("swiglu_alpha", 1.702)))  # fmt: skip


def _moe_fields(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields: which layers route to experts (Qwen3-MoE: every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers``; Mixtral: all), and how."""
    if architecture not in _MOE:
        return {}
    experts = int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)
    layers = int(config["num_hidden_layers"])
    mixtral = architecture == "MixtralForCausalLM"  # every layer, experts as wide as intermediate_size
    step = 1 if mixtral else int(config.get("decoder_sparse_step") or 1)
    dense = set() if mixtral else set(config.get("mlp_only_layers") or [])
    dense |= set(range(int(config.get("first_k_dense_replace") or 0)))
    if architecture == "Glm4MoeLiteForCausalLM":  # (its MoE layers by type; by default all but the first)
        types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        dense |= {i for i, kind in enumerate(types) if kind == "dense"}
    moe_layers = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    width = config["intermediate_size"] if mixtral else config.get("moe_intermediate_size") or config["intermediate_size"]
    fields = dict(
        num_experts=experts, num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(width), norm_topk_prob=mixtral or bool(config.get("norm_topk_prob", False)),
        moe_combine_in_float32=architecture in _MOE_COMBINE_IN_FLOAT32, moe_layers=moe_layers,
    )  # fmt: skip
    if architecture in _GPT_OSS:
        fields.update(moe_scoring="topk_softmax", moe_router_bias=True)
    if architecture in _SIGMOID_ROUTING:
        fields.update(moe_scoring="sigmoid", routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
                      moe_groups=(int(config.get("n_group") or 1), int(config.get("topk_group") or 1)),
                      shared_expert_size=int(config.get("n_shared_experts") or 0) * int(width))  # fmt: skip
    if architecture == "DeepseekV2ForCausalLM":
        fields.update(_deepseek_v2_routing(config), shared_expert_size=int(config.get("n_shared_experts") or 0) * int(width))
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3_5MoeForCausalLM"):  # (Qwen3.5's always renormalises)
        fields.update(shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0), shared_expert_gate=True,
                      norm_topk_prob=fields["norm_topk_prob"] or architecture == "Qwen3_5MoeForCausalLM")  # fmt: skip
    if architecture == _GRANITE_HYBRID and experts:  # (its chosen float32 logits softmaxed; its MLP beside)
        fields.update(moe_scoring="topk_softmax_float32", shared_expert_size=int(config["intermediate_size"]))
    return fields


def _deepseek_v2_routing(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's: softmax scores, the top k (of the best groups by their best score where
    "group_limited_greedy"), not renormalised, scaled."""
    method, groups = config.get("topk_method") or "greedy", (int(config.get("n_group") or 1), int(config.get("topk_group") or 1))
    if method not in ("greedy", "group_limited_greedy"):
        raise NotImplementedError(f"DeepSeek-V2's topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    return dict(moe_scoring="softmax_groups", moe_groups=groups if method != "greedy" else (1, 1), norm_topk_prob=False,
                routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0))  # fmt: skip


def _gemma_fields(architecture: str, config: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """Gemma's fields: its norms, scaled embeddings, score scale, soft caps, and which layers
    are windowed (with Gemma 3's local rope base for them)."""
    if architecture not in _GEMMA:
        return {}
    if config.get("use_bidirectional_attention"):
        raise NotImplementedError(f"{architecture} with use_bidirectional_attention is not supported (a causal LM only)")
    layers = int(config["num_hidden_layers"])
    every = int(config.get("sliding_window_pattern") or _GLOBAL_LAYER_EVERY[architecture])
    layer_types = _layer_types(config) or [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    scalar = config.get("query_pre_attn_scalar")
    return dict(
        layer_types=tuple(str(t) for t in layer_types), local_rope_theta=_local_rope_theta(architecture, config),
        attention_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_logit_softcapping=optional_float(config.get("attn_logit_softcapping")),
        final_logit_softcapping=optional_float(config.get("final_logit_softcapping")),
        norm_unit_offset=True, sandwich_norms=True, embedding_scale=hidden_size**0.5,
    )  # fmt: skip


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    """The config's ``layer_types`` (sliding or full attention per layer; transformers writes
    them for Qwen2/Qwen3 from ``max_window_layers``), checked; empty where it has none."""
    types = tuple(str(t) for t in config.get("layer_types") or ())
    unknown = sorted(set(types) - {SLIDING, FULL, CONV, MAMBA, DELTA_NET})
    if unknown:
        raise NotImplementedError(f"layer types {unknown} are not supported (only {SLIDING!r}, {FULL!r}, LFM2's "
                                  f"{CONV!r}, Granite-4.0-H's {MAMBA!r} and Qwen3.5's {DELTA_NET!r})")  # fmt: skip
    if types and len(types) != int(config["num_hidden_layers"]):
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {config['num_hidden_layers']}")
    return types


def _local_rope_theta(architecture: str, config: dict[str, Any]) -> float | None:
    """The windowed layers' rope base: ``rope_parameters["sliding_attention"]``; Gemma 3's older
    ``rope_local_base_freq`` (10000 by default); OLMo 3's older configs (one ``rope_theta``, maybe
    ``rope_scaling``): that base, unscaled (the scaling is the global layers' only)."""
    if architecture not in _LOCAL_ROPE:
        return None
    local = (config.get("rope_parameters") or {}).get(SLIDING) or {}
    if not local and architecture != "Gemma3ForCausalLM":
        return rope_from_hf(config)[0]
    if local.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope scaling of the sliding-window layers ({local['rope_type']!r}) is not supported")
    return float(local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0)


def _effective_sliding_window(config: dict[str, Any]) -> int | None:
    """The sliding window that actually applies (Qwen2 only uses it with ``use_sliding_window``)."""
    if not config.get("use_sliding_window", True):
        return None
    window = config.get("sliding_window")
    return None if window is None else int(window)
