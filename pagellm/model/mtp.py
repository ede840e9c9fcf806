"""Multi-token prediction (MTP): the layer DeepSeek-V3's and GLM-4.5's checkpoints carry past the
model's own (``num_nextn_predict_layers``), trained to predict the token after next; pagellm runs
it as a speculative proposer (``worker/mtp_source.py``, ``--speculative-config '{"method": "mtp"}'``).

At position p it takes the target's final hidden state there, h_p, and the embedding of the
token at p + 1: ``eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])`` enters one decoder layer of
the model's own kind (its attention over its own K/V, the model's mixture of experts), whose
output, normed by ``shared_head.norm`` and projected by the model's LM head, predicts t_{p+2}.
That output also stands in for the target's h_{p+1} in the next draft (one layer drafts k
tokens, as vLLM runs it). The embedding and LM head are the model's: the checkpoints' copies
under the layer (``embed_tokens``, ``shared_head.head``) are the same matrices (DeepSeek-V3's
report: shared with the main model) and are not loaded again.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pagellm.attention.backend import AttentionMetadata
from pagellm.kernels.plan import KernelPlan
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layers import make_rms_norm
from pagellm.model.quant_linear import linear_for_plan
from pagellm.model.rope_config import FULL

# The architectures whose checkpoints name their MTP layers as DeepSeek-V3's: model.layers.N past the model's.
MTP_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM"})
_OWN_PARTS = re.compile(r"^(enorm|hnorm|eh_proj|shared_head\.norm)\.")
_SHARED_COPIES = re.compile(r"^(embed_tokens|shared_head\.head)\.")


def mtp_layer_count(architecture: str, hf_config: Mapping[str, Any]) -> int:
    """The MTP layers ``config.json`` declares; ValueError naming why where there are none to run."""
    if architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative method 'mtp' needs a model with multi-token prediction layers; "
                         f"{architecture} has none here (supported: {', '.join(sorted(MTP_ARCHITECTURES))})")  # fmt: skip
    count = hf_config.get("num_nextn_predict_layers") or 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"speculative method 'mtp': this checkpoint's config declares no multi-token prediction "
                         f"layer (num_nextn_predict_layers {count!r})")  # fmt: skip
    return count


def mtp_arch(arch: ModelArchConfig) -> ModelArchConfig:
    """``arch`` with its first MTP layer (index ``num_hidden_layers``) as one of its layers: a
    mixture of experts where the model has experts, full attention."""
    index = arch.num_hidden_layers
    return dataclasses.replace(
        arch,
        num_hidden_layers=index + 1,
        moe_layers=(*arch.moe_layers, index) if arch.num_experts > 0 else arch.moe_layers,
        layer_types=(*arch.layer_types, FULL) if arch.layer_types else (),
    )


def mtp_name(name: str, index: int) -> str | None:
    """The checkpoint's tensor ``name`` where this model keeps it: the MTP layer ``index``'s own
    parts under ``mtp.``, its decoder layer's under ``mtp.block.``; None for its copies of the
    model's embedding and head; any other name as it is."""
    prefix = f"model.layers.{index}."
    if not name.startswith(prefix):
        return name
    rest = name[len(prefix) :]
    if _SHARED_COPIES.match(rest):
        return None
    if _OWN_PARTS.match(rest):
        return "mtp." + rest.replace("shared_head.norm.", "shared_head_norm.")
    return "mtp.block." + rest


def mtp_weights(weights: Iterable[tuple[str, Any]], index: int) -> Iterator[tuple[str, Any]]:
    """``weights`` with the MTP layer ``index``'s under their names here (:func:`mtp_name`)."""
    for name, tensor in weights:
        renamed = mtp_name(name, index)
        if renamed is not None:
            yield renamed, tensor


def mtp_weight_names(block_names: Iterable[str], index: int) -> set[str]:
    """The names the MTP layer loads: its decoder layer's (``block_names``, under
    ``model.layers.{index}.``) and its own parts."""
    own = {f"mtp.{part}.weight" for part in ("enorm", "hnorm", "eh_proj", "shared_head_norm")}
    return own | {renamed for name in block_names if (renamed := mtp_name(name, index)) is not None}


class MtpLayer(nn.Module):
    """One MTP layer around ``block``, a decoder layer of the model's kind (see the module docstring)."""

    def __init__(self, block: nn.Module, hidden_size: int, eps: float, plan: KernelPlan | None) -> None:
        super().__init__()
        kernels = plan.library("norm") if plan is not None else None
        self.enorm = make_rms_norm(hidden_size, eps, False, kernels)
        self.hnorm = make_rms_norm(hidden_size, eps, False, kernels)
        self.eh_proj = linear_for_plan(2 * hidden_size, hidden_size, False, plan)
        self.block = block
        self.shared_head_norm = make_rms_norm(hidden_size, eps, False, kernels)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output hidden states (before ``shared_head_norm``) for tokens' embeddings
        ``embeds`` and the hidden states ``hidden`` at the positions before them."""
        joined = torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1)
        out, residual = self.block(self.eh_proj(joined), None, cos, sin, kv_cache, attn_metadata)
        return out + residual
