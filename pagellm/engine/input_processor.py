"""Turns a user's prompt and sampling options into validated engine requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from transformers import PreTrainedTokenizerBase

from pagellm.sampling_params import SamplingParams

# A prompt is text, or vLLM's token form {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = Union[str, Mapping[str, Any]]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None  # isolates this prompt's prefix-cache entries (per tenant)


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenize text prompts; check token-id prompts."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer(prompt).input_ids
            return self._checked(ProcessedPrompt(prompt=prompt, prompt_token_ids=list(token_ids)))
        if isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            processed = self._process_mapping(prompt)
            processed.cache_salt = salt
            return processed
        raise ValueError(
            f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def _process_mapping(self, prompt: Mapping[str, Any]) -> ProcessedPrompt:
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return self._checked(ProcessedPrompt(prompt=prompt.get("prompt"), prompt_token_ids=list(ids)))
        if isinstance(prompt.get("prompt"), str):
            return self.process_prompt(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt_token_ids' (a list of integers) or 'prompt' (a string)")

    def _checked(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        ids = processed.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary range [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        return processed

    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """max_tokens=None means "up to the context limit"; never past max_model_len."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it."""
        if not messages:
            raise ValueError("messages must be a non-empty list")
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **template_kwargs,
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
