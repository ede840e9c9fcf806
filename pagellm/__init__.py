"""pagellm: a high-throughput LLM serving engine with a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagellm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
