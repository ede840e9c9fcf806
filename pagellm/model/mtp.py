"""Multi-token prediction (MTP): the layer DeepSeek-V3's, GLM-4.5's and Qwen3.5's checkpoints
carry past the model's own, trained to predict the token after next; pagellm runs it as a
speculative proposer (``worker/mtp_source.py``, ``--speculative-config '{"method": "mtp"}'``).

At position p it takes the target's final hidden state there, h_p, and the embedding of the
token at p + 1: ``fc([norm_e(embed(t_{p+1})); norm_h(h_p)])`` enters one decoder layer of the
model's own kind (its attention over its own K/V, full attention in a hybrid; the model's MLP or
experts), whose output, normed and projected by the model's LM head, predicts t_{p+2}. That
output also stands in for the target's h_{p+1} in the next draft (one layer drafts k tokens, as
vLLM runs it): DeepSeek's before its norm, Qwen3.5's after it. The embedding and LM head are
the model's (DeepSeek-V3's report: shared with the main model; the copies DeepSeek's checkpoints
store under the layer are the same matrices and are not loaded again).

The checkpoints name the layer two ways (:class:`MtpStyle`): DeepSeek-V3's and GLM-4.5's as
``model.layers.{N}`` past the model's N (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
beside the decoder layer's tensors), Qwen3.5's under ``mtp.`` (``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``fc``, ``norm`` and the decoder layer's under ``mtp.layers.0``).
"""

from __future__ import annotations

import dataclasses
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

_DEEPSEEK_PARTS = {"enorm": "embed_norm", "hnorm": "hidden_norm", "eh_proj": "fc", "shared_head.norm": "out_norm"}
_QWEN_PARTS = {"pre_fc_norm_embedding": "embed_norm", "pre_fc_norm_hidden": "hidden_norm", "fc": "fc", "norm": "out_norm"}
PREFIX = "mtp_layer."  # where this model keeps the layer (not ``mtp.``: text models drop Qwen3.5's names)


@dataclasses.dataclass(frozen=True)
class MtpStyle:
    """How a family's checkpoints name and run their MTP layer."""

    count_key: str  # the config's count of MTP layers
    layer_prefix: str  # the first layer's tensors' prefix ({N}: the model's layer count)
    block: str  # its decoder layer's, after that prefix
    parts: dict[str, str]  # the layer's own tensors -> their module here
    skipped: tuple[str, ...]  # the copies of the model's tensors under the layer, not loaded
    normed_output: bool  # the output the next draft starts from is after the layer's last norm

    def prefix(self, arch: ModelArchConfig) -> str:
        return self.layer_prefix.format(N=arch.num_hidden_layers)

    def block_prefix(self, arch: ModelArchConfig) -> str:
        return self.prefix(arch) + self.block


_DEEPSEEK = MtpStyle("num_nextn_predict_layers", "model.layers.{N}.", "", _DEEPSEEK_PARTS,
                     ("embed_tokens", "shared_head.head"), normed_output=False)  # fmt: skip
_QWEN3_5 = MtpStyle("mtp_num_hidden_layers", "mtp.", "layers.0.", _QWEN_PARTS, ("embed_tokens",), normed_output=True)
MTP_STYLES = {"DeepseekV3ForCausalLM": _DEEPSEEK, "Glm4MoeForCausalLM": _DEEPSEEK, "Glm4MoeLiteForCausalLM": _DEEPSEEK,
              "Qwen3_5ForCausalLM": _QWEN3_5, "Qwen3_5MoeForCausalLM": _QWEN3_5}  # fmt: skip


def mtp_style(architecture: str) -> MtpStyle:
    style = MTP_STYLES.get(architecture)
    if style is None:
        raise ValueError(f"speculative method 'mtp' needs a model with multi-token prediction layers; "
                         f"{architecture} has none here (supported: {', '.join(sorted(MTP_STYLES))})")  # fmt: skip
    return style


def mtp_layer_count(architecture: str, hf_config: Mapping[str, Any]) -> int:
    """The MTP layers ``config.json`` (the text model's) declares; ValueError naming why where
    there are none to run."""
    key = mtp_style(architecture).count_key
    count = hf_config.get(key) or 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"speculative method 'mtp': this checkpoint's config declares no multi-token prediction "
                         f"layer ({key} {count!r})")  # fmt: skip
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


def mtp_name(name: str, arch: ModelArchConfig) -> str | None:
    """The checkpoint's tensor ``name`` where this model keeps it: the first MTP layer's own
    parts and its decoder layer's under :data:`PREFIX`; None for the layer's copies of the
    model's tensors and for further MTP layers (one layer drafts every token); any other name
    as it is."""
    style = mtp_style(arch.architecture)
    prefix = style.prefix(arch)
    if not name.startswith(prefix):
        return name
    rest = name[len(prefix) :]
    part, _, kind = rest.rpartition(".")
    if part in style.parts:
        return f"{PREFIX}{style.parts[part]}.{kind}"
    if part in style.skipped:
        return None
    block = style.block_prefix(arch)
    if name.startswith(block):
        return PREFIX + "block." + name[len(block) :]
    return None if rest.startswith("layers.") else name  # (further layers; anything else refused as unexpected)


def mtp_weights(weights: Iterable[tuple[str, Any]], arch: ModelArchConfig) -> Iterator[tuple[str, Any]]:
    """``weights`` with the MTP layer's under their names here (:func:`mtp_name`)."""
    for name, tensor in weights:
        renamed = mtp_name(name, arch)
        if renamed is not None:
            yield renamed, tensor


def mtp_weight_names(block_names: Iterable[str], arch: ModelArchConfig) -> set[str]:
    """The names the MTP layer loads: its decoder layer's (``block_names``, under
    ``model.layers.{N}.``, N the model's layer count) and its own parts."""
    own = {f"{PREFIX}{part}.weight" for part in ("embed_norm", "hidden_norm", "fc", "out_norm")}
    layer = f"model.layers.{arch.num_hidden_layers}."
    return own | {PREFIX + "block." + name.removeprefix(layer) for name in block_names}


class MtpLayer(nn.Module):
    """One MTP layer around ``block``, a decoder layer of the model's kind (see the module
    docstring); ``normed_output``: its output is taken after ``out_norm`` (Qwen3.5's)."""

    def __init__(
        self, block: nn.Module, hidden_size: int, eps: float, unit_offset: bool, normed_output: bool,
        plan: KernelPlan | None,
    ) -> None:
        super().__init__()
        kernels = plan.library("norm") if plan is not None else None
        self.embed_norm = make_rms_norm(hidden_size, eps, unit_offset, kernels)
        self.hidden_norm = make_rms_norm(hidden_size, eps, unit_offset, kernels)
        self.fc = linear_for_plan(2 * hidden_size, hidden_size, False, plan)
        self.block = block
        self.out_norm = make_rms_norm(hidden_size, eps, unit_offset, kernels)
        self.normed_output = normed_output

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output for tokens' embeddings ``embeds`` and the hidden states ``hidden``
        at the positions before them (what the next draft starts from)."""
        joined = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        out, residual = self.block(self.fc(joined), None, cos, sin, kv_cache, attn_metadata)
        out = out + residual
        return self.out_norm(out) if self.normed_output else out

    def head_input(self, output: torch.Tensor) -> torch.Tensor:
        """What the model's LM head reads of the layer's ``output``."""
        return output if self.normed_output else self.out_norm(output)
