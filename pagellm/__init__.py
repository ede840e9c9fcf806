"""pagellm: a high-throughput LLM serving engine with a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.lora_request import LoRARequest
from pagellm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pagellm.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # What is imported here is imported when first asked for: this module runs before every module
    # of the package, so what it imports at once must be plain data (tests/test_layering.py); LLM
    # also pulls in torch and transformers.
    if name == "LLM":
        from pagellm.entrypoints.llm import LLM

        return LLM
    if name in ("BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"):
        from pagellm.engine import beam_search

        return getattr(beam_search, name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
