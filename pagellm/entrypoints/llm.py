"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from pagellm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KernelConfig,
    LimitsConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


def engine_config(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    quantization: str = "auto",
    block_size: int = 16,
    kv_cache_memory: int | str = "1GiB",
    num_kv_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    attention_backend: str = "auto",
    chat_template: str | None = None,
    num_threads: int | None = None,
    max_n: int = 128,
    max_logprobs: int = 20,
    max_stop_strings: int = 16,
    cpu_isa: str | None = None,
    cpu_kernels: bool | None = None,
    gemm: str | None = None,
) -> EngineConfig:
    """The engine's validated configuration from ``LLM``'s flat keyword options.

    ``quantization`` (``QUANTIZATION_CHOICES``): auto keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 /
    Q4_K blocks on pagellm's integer GEMM (unless the dtype is float32), none dequantizes, int8
    quantizes any checkpoint's linears to int8 blocks. ``cpu_isa``, ``cpu_kernels`` and
    ``gemm`` (None: the environment's, see ``KernelConfig``) shape the kernel plan: the highest
    ISA level the kernels may use, whether the C++ kernels are used at all, and which GEMM
    linear layers take (16-bit; float32 on AVX2).
    """
    return EngineConfig(
        model=ModelConfig(
            model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, chat_template=chat_template,
            quantization=quantization,
        ),
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig(device=device, attention_backend=attention_backend, num_threads=num_threads),
        limits=LimitsConfig(max_n=max_n, max_logprobs=max_logprobs, max_stop_strings=max_stop_strings),
        kernels=KernelConfig.from_env(isa=cpu_isa, cpu_kernels=cpu_kernels, gemm=gemm),
    )


class LLM:
    """Generate text for batches of prompts with continuous batching and a paged KV cache.

    ``model=None`` loads the default model (SmolLM2-135M-Instruct, GGUF). ``model`` may be a
    Hugging Face folder (config.json + safetensors) or a GGUF file.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """``engine_options``: those of :func:`engine_config` (dtype, block_size, kv_cache_memory, ...)."""
        self.llm_engine = LLMEngine(engine_config(model, **engine_options))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        request_ids = self._add_requests(prompt_list, params_list)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if not messages:
            raise ValueError("messages must be a non-empty conversation or list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        processor = self.llm_engine.input_processor
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": processor.apply_chat_template(
                    conv, add_generation_prompt, continue_final_message, chat_template, **(chat_template_kwargs or {})
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt, in the engine: beams share KV blocks and fork at every split.

        Each output's ``sequences`` are best first; ``tokens`` holds prompt + generated ids.
        """
        engine = self.llm_engine
        processed = [engine.input_processor.process_prompt(p) for p in _as_prompt_list(prompts)]
        request_ids = []
        for item in processed:
            request_id = engine.new_request_id()
            engine.add_beam_search_request(request_id, item.prompt, item.prompt_token_ids, params)
            request_ids.append(request_id)
        results = self._run(request_ids, use_tqdm)
        return [
            BeamSearchOutput(
                sequences=[
                    BeamSearchSequence(
                        tokens=out.prompt_token_ids + c.token_ids,
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=c.text,
                        finish_reason=c.finish_reason,
                    )
                    for c in out.outputs
                ]
            )
            for out in results
        ]

    def _add_requests(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        engine = self.llm_engine
        # Validate everything first so a bad prompt queues nothing.
        processed = [engine.input_processor.process_prompt(p) for p in prompts]
        request_ids = []
        for item, p in zip(processed, params):
            request_id = engine.new_request_id()
            engine.add_tokenized_request(
                request_id, item.prompt, item.prompt_token_ids, p, cache_salt=item.cache_salt
            )
            request_ids.append(request_id)
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    return prompt_list


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} sampling params for {num_prompts} prompts; pass one or one each")
    return params_list
