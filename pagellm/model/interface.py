"""What the worker needs of a model family: the interface every causal LM here implements.

One class implements it today (``llama.LlamaForCausalLM``, every family in ``registry``: what
differs per family is arch-config data); a family that needs another composition implements the
same three calls, so the worker and model runner never ask a model what it can do.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.kernels.plan import KernelPlan
from pagellm.model.lora import LoRAStep
from pagellm.model.step_route import StepRoute
from pagellm.multimodal_inputs import InputEmbeds

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key_cache, value_cache)


class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata, stream: torch.Tensor | None = None, lora: LoRAStep | None = None,
        embeds: InputEmbeds | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for a flat batch of ``T`` tokens (a
        pipeline stage: from and to the residual ``stream`` between stages); ``lora``: the
        adapters of the rows that run with one; ``embeds``: rows whose embeddings are given
        (a vision-language model's image tokens)."""

    @property
    def last_route(self) -> StepRoute | None:
        """What the last forward ran (None before the first)."""

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Vocabulary logits for the rows to sample: float32, or the model dtype (``upcast=False``)."""

    def optimize_for_cpu_inference(self, plan: KernelPlan) -> dict[str, int]:
        """Repack the loaded weights once for the plan's CPU kernels; returns what was done (counts)."""


class MultiTokenPredictor(Protocol):
    """A causal LM loaded with its multi-token-prediction layer (``model/mtp.py``)."""

    def mtp_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's outputs for the tokens ``input_ids`` after the hidden states ``hidden`` at
        ``positions`` (its K/V, ``kv_cache``, written there)."""

    def mtp_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits of the tokens the layer's outputs ``hidden`` predict."""
