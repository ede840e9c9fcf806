"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from tqdm.auto import tqdm

from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.config import LimitsConfig
from pagellm.engine.input_processor import ProcessedPrompt, PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.protocol import EngineRequest
from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.media import MediaPolicy
from pagellm.entrypoints.openai.tool_calls.prompt import template_renders_tools, write_tools_in
from pagellm.lora_request import LoRARequest
from pagellm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
P = TypeVar("P", SamplingParams, PoolingParams)
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None  # one adapter for every prompt, or one each


class LLM:
    """Generate text for batches of prompts with continuous batching and a paged KV cache.

    ``model=None`` loads the default model (SmolLM2-135M-Instruct, GGUF). ``model`` may be a
    Hugging Face folder (config.json + safetensors) or a GGUF file.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """``engine_options``: the fields of :class:`~pagellm.engine_args.EngineArgs` (dtype,
        quantization, block_size, kv_cache_memory, ...); an unknown one is a TypeError naming it."""
        self.llm_engine = LLMEngine(EngineArgs(model, **engine_options).create_engine_config())

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``priority``: one
        per prompt, lower first (needs ``scheduling_policy="priority"``); ``lora_request``: the
        LoRA adapter of every prompt, or one each (None: the base model; needs ``enable_lora``)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list), SamplingParams)
        request_ids = self._add_requests(prompt_list, params_list, priority, lora_request)
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in input order, pooled as the model (or ``pooler_config``)
        says: each prompt is computed through the same scheduler as generation, then pooled
        (docs/embeddings.md). A request the engine failed raises RuntimeError."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(pooling_params, len(prompt_list), PoolingParams)
        outputs = self._run(self._add_requests(prompt_list, params_list, priority, lora_request), use_tqdm)
        results = []
        for output in outputs:
            if output.embedding is None:
                raise RuntimeError(f"embedding request {output.request_id} failed: {output.error or 'no vector'}")
            results.append(EmbeddingRequestOutput(output.request_id, EmbeddingOutput(output.embedding),
                                                  output.prompt_token_ids))  # fmt: skip
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        ``tools`` (OpenAI tool objects) go to a template that renders them, else they are
        written into the conversation as the server does (``tool_calls.prompt``); either way
        the model answers with ``<tool_call>`` blocks when it calls one (hermes format), which
        ``HermesToolParser().extract(text)`` reads."""
        if not messages:
            raise ValueError("messages must be a non-empty conversation or list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        processor = self.llm_engine.input_processor
        kwargs = dict(chat_template_kwargs or {})
        functions = [t["function"] for t in tools or []]
        renders_tools = template_renders_tools(chat_template or processor.tokenizer.chat_template)
        if functions and renders_tools:
            kwargs["tools"] = tools
        prompts: list[PromptType | ProcessedPrompt] = []
        for conv in conversations:
            conv, images = _images_of(conv, processor.limits)
            if not renders_tools and (functions or any(m.get("role") == "tool" or m.get("tool_calls") for m in conv)):
                conv = write_tools_in(list(conv), functions)
            if images:  # (the rendered text's placeholders expanded: its template wrote the special tokens)
                text = processor.render_chat(conv, add_generation_prompt, continue_final_message, chat_template, **kwargs)
                prompts.append(processor.process_images(text, {"image": images}, add_special_tokens=False))
                continue
            ids = processor.apply_chat_template(conv, add_generation_prompt, continue_final_message, chat_template, **kwargs)
            prompts.append({"prompt_token_ids": ids})
        params_list = _broadcast_params(sampling_params, len(prompts), SamplingParams)
        return self._run(self._add_requests(prompts, params_list, None, lora_request), use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt, in the engine: beams share KV blocks and fork at every split.

        Each output's ``sequences`` are best first; ``tokens`` holds prompt + generated ids.
        """
        engine = self.llm_engine
        processed = [engine.input_processor.process_prompt(p) for p in _as_prompt_list(prompts)]
        loras = _broadcast_loras(lora_request, len(processed))
        for lora in loras:
            engine.loras.check(lora)
        request_ids = []
        for item, lora in zip(processed, loras):
            request_id = engine.new_request_id()
            engine.add_engine_request(EngineRequest(request_id, item.prompt_token_ids, params, item.prompt,
                                                    lora_request=lora, mm_features=item.mm_features))  # fmt: skip
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

    def _add_requests(
        self, prompts: Sequence[PromptType | ProcessedPrompt], params: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None = None, lora_request: LoRAArg = None,
    ) -> list[str]:
        """Queue one request per prompt (``priority``: one per prompt, lower first; ``lora_request``:
        one adapter for all, or one per prompt)."""
        engine = self.llm_engine
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority holds {len(priority)} values for {len(prompts)} prompts")
        # Validate everything first so a bad prompt queues nothing.
        generates = isinstance(params[0], SamplingParams)
        processed = [p if isinstance(p, ProcessedPrompt) else engine.input_processor.process_prompt(p, generates)
                     for p in prompts]  # fmt: skip
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        for value in priorities:
            engine.input_processor.check_priority(value)
        loras = _broadcast_loras(lora_request, len(prompts))
        for lora in loras:
            engine.loras.check(lora)
        request_ids = []
        for item, p, value, lora in zip(processed, params, priorities, loras):
            request_id = engine.new_request_id()
            engine.add_engine_request(EngineRequest(request_id, item.prompt_token_ids, p, item.prompt, item.cache_salt,
                                                    stream=False, priority=value, lora_request=lora,
                                                    mm_features=item.mm_features))  # fmt: skip
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


def _images_of(conversation: Sequence[dict[str, Any]], limits: LimitsConfig) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's images (vLLM's ``image_url`` parts, ``data:`` URLs, and ``image_pil``
    parts), in order, and the conversation with each as an ``{"type": "image"}`` part."""
    images: list[Any] = []
    messages = []
    count = sum(1 for m in conversation if isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS)  # fmt: skip
    if count > limits.max_images_per_prompt:
        raise ValueError(f"the conversation has {count} images, more than the limit of {limits.max_images_per_prompt} "
                         "(limit_mm_per_prompt)")  # fmt: skip
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS for p in content):
            parts = []
            for part in content:
                if not isinstance(part, dict):
                    pass
                elif part.get("type") == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    images.append(MediaPolicy().image(str(url), limits.max_image_pixels))  # (inline only)
                    part = {"type": "image"}
                elif part.get("type") == "image_pil":
                    images.append(part.get("image_pil"))
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        messages.append(message)
    return messages, images


_IMAGE_PARTS = ("image_url", "image_pil")


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    return prompt_list


def _broadcast_params(params: P | Sequence[P] | None, num_prompts: int, kind: type[P]) -> list[P]:
    """One ``kind`` per prompt: the defaults, the one given, or one each as given."""
    if params is None:
        return [kind() for _ in range(num_prompts)]
    if isinstance(params, kind):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} {kind.__name__} for {num_prompts} prompts; pass one or one each")
    return params_list


def _broadcast_loras(lora_request: LoRAArg, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: the one given for all, or one each as given."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora requests for {num_prompts} prompts; pass one or one each")
    return loras
