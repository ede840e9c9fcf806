"""Turns a user's prompt and sampling options into validated engine requests."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from transformers import PreTrainedTokenizerBase

from pagellm.config import MAX_PRIORITY, MIN_PRIORITY, LimitsConfig
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.image_processor import IMAGE_PLACEHOLDER, ImageProcessor, image_token_count
from pagellm.multimodal_inputs import ImageFeature
from pagellm.pooler_config import PoolerConfig
from pagellm.pooling_params import Pooling, PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.grammar import check_grammar
from pagellm.structured_outputs_params import StructuredOutputsParams

# A prompt is text, or vLLM's token form {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = Union[str, Mapping[str, Any]]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None  # isolates this prompt's prefix-cache entries (per tenant)
    mm_features: tuple[ImageFeature, ...] = ()  # its images (a vision-language model's prompt)


def check_text(text: str, name: str) -> None:
    """Refuse text that is not valid Unicode (lone surrogates, which JSON escapes can carry)."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate at position {exc.start}") from None


# A chat template that loops over a message's content parts (vision-language models' templates:
# ``{% for part in message['content'] %}``).
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def content_as_template_takes(messages: list[dict[str, Any]], template: object, parts: bool) -> list[dict[str, Any]]:
    """Messages whose content is text or a list of ``{"type": "text" | "image"}`` parts, as
    ``template`` takes them: a template that loops over content parts gets every content as
    parts where ``parts`` (a vision-language model's template: text content as one text part,
    as ``transformers``' processors give it); any other template (vLLM's rule for string
    templates) text, the parts' text joined with newlines, each image its ``<image>`` placeholder."""
    if isinstance(template, str) and _LOOPS_OVER_CONTENT.search(template):
        if not parts:
            return messages
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                for m in messages]  # fmt: skip
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "image") for p in content):
            text = "\n".join(str(p.get("text", "")) if p["type"] == "text" else IMAGE_PLACEHOLDER for p in content)
            message = {**message, "content": text}
        out.append(message)
    return out


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token can stand for (an upper bound: byte tokens count bytes)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


class InputProcessor:
    """The engine's rules for prompts and sampling options, shared by every entry point.

    Read-only after construction, so the server checks requests with it on any thread.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        limits: LimitsConfig | None = None,
        max_num_seqs: int | None = None,
        scheduling_policy: str = "fcfs",
        pooler: PoolerConfig | None = None,
        hidden_size: int = 0,
        images: ImageProcessor | None = None,
    ) -> None:
        """``images``: a vision-language model's image preprocessing (None: the model takes no images)."""
        self.tokenizer = tokenizer
        self.images = images
        self.pooler = pooler or PoolerConfig(pooling_type="LAST", normalize=True)  # every field resolved
        self.hidden_size = hidden_size  # an embedding's full size
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits or LimitsConfig()
        # n / best_of / beam width: never more sequences than one step can run.
        self.max_n = min(self.limits.max_n, max_num_seqs or self.limits.max_n)
        # A text longer than this cannot fit max_model_len tokens: refused before tokenizing it.
        # (x4: slack for normalizers that shrink text, such as Unicode composition.)
        self.max_prompt_chars = 4 * max_model_len * longest_token_chars(tokenizer)

    def check_prompt_text(self, text: str, name: str = "prompt") -> None:
        """Cheap checks before tokenizing: valid Unicode, and short enough to possibly fit."""
        check_text(text, name)
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{name} is {len(text)} characters long, more than can fit in max_model_len="
                f"{self.max_model_len} tokens"
            )

    def check_priority(self, priority: object) -> None:
        """An integer in vLLM's range, and 0 unless the engine schedules by priority."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority is {priority}, but the server serves first come, first served: start it with "
                             "--scheduling-policy priority to use priorities")  # fmt: skip

    def pooling(self, params: PoolingParams) -> Pooling:
        """An embedding request's pooling: the model's pooler with the request's options;
        ValueError for ``dimensions`` this model cannot give."""
        return self.pooler.resolve(params, self.hidden_size)

    def check_params(self, params: SamplingParams | BeamSearchParams | PoolingParams) -> None:
        """The limits of this engine on one request's options (their own ranges are checked at construction)."""
        if isinstance(params, PoolingParams):
            self.pooling(params)
            return
        if isinstance(params, BeamSearchParams):
            if params.beam_width > self.max_n:
                raise ValueError(f"beam_width must be <= {self.max_n}, got {params.beam_width}.")
            if params.structured_outputs is not None:
                self._check_constraint(params.structured_outputs)
            return
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > self.max_n:
                raise ValueError(f"{name} must be <= {self.max_n} (the server's max_n), got {value}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.limits.max_logprobs:
                raise ValueError(f"{name} must be <= {self.limits.max_logprobs}, got {value}.")
        self._check_stop(params)
        if params.structured_outputs is not None:
            self._check_constraint(params.structured_outputs)

    def _check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Small enough for the grammar engine, then compiles (slow for big ones: callers on an
        event loop run ``check_params`` in a worker thread)."""
        size, limit = constraint.num_chars(), self.limits.max_grammar_chars
        if size > limit:
            raise ValueError(
                f"structured_outputs.{constraint.kind} is {size} characters long, more than the server's "
                f"limit of {limit} (max_grammar_chars)"
            )
        check_grammar(constraint, timeout_s=self.limits.grammar_compile_timeout_s)

    def _check_stop(self, params: SamplingParams) -> None:
        limits = self.limits
        if len(params.stop_list) > limits.max_stop_strings:
            raise ValueError(f"stop must hold at most {limits.max_stop_strings} strings, got {len(params.stop_list)}.")
        for stop in params.stop_list:
            check_text(stop, "stop")
            if len(stop) > limits.max_stop_string_chars:
                raise ValueError(
                    f"stop must hold strings of at most {limits.max_stop_string_chars} characters, "
                    f"got one of {len(stop)}."
                )
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[0]}.")

    def process_prompt(self, prompt: PromptType, generates: bool = True) -> ProcessedPrompt:
        """Tokenize text prompts; check token-id prompts. ``generates`` False: an embedding's
        prompt, which may fill ``max_model_len`` (no room is left for output)."""
        if isinstance(prompt, str):
            self.check_prompt_text(prompt)
            token_ids = self.tokenizer(prompt).input_ids
            return self._checked(ProcessedPrompt(prompt=prompt, prompt_token_ids=list(token_ids)), generates)
        if isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            processed = self._process_mapping(prompt, generates)
            processed.cache_salt = salt
            return processed
        raise ValueError(
            f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def _process_mapping(self, prompt: Mapping[str, Any], generates: bool) -> ProcessedPrompt:
        if prompt.get("multi_modal_data") is not None:
            return self._process_images(prompt, prompt["multi_modal_data"], generates)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return self._checked(ProcessedPrompt(prompt=prompt.get("prompt"), prompt_token_ids=list(ids)), generates)
        if isinstance(prompt.get("prompt"), str):
            return self.process_prompt(prompt["prompt"], generates)
        raise ValueError("a prompt dict needs 'prompt_token_ids' (a list of integers) or 'prompt' (a string)")

    def _process_images(self, prompt: Mapping[str, Any], data: object, generates: bool) -> ProcessedPrompt:
        """A text prompt with images (vLLM's ``multi_modal_data``)."""
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("a prompt with images needs its text as 'prompt' (a string with one <image> per image)")
        return self.process_images(text, data, generates)

    def process_images(self, text: str, data: object, generates: bool = True, add_special_tokens: bool = True) -> ProcessedPrompt:
        """``text`` with one ``<image>`` where each image of ``data`` (``{"image": [...]}``) goes;
        ``add_special_tokens`` False for a rendered conversation (its template wrote them)."""
        if self.images is None:
            raise ValueError("this model takes no images: images need a vision-language model")
        self.check_prompt_text(text)
        token_ids, features = self.images.process(text, data, add_special_tokens)
        return self._checked(ProcessedPrompt(prompt=text, prompt_token_ids=token_ids, mm_features=features), generates)

    def _checked(self, processed: ProcessedPrompt, generates: bool) -> ProcessedPrompt:
        ids = processed.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if self.images is not None and not processed.mm_features and image_token_count(ids, self.images.spec):
            raise ValueError("the prompt holds image tokens but no image: pass each image in multi_modal_data "
                             "and write <image> where it goes")  # fmt: skip
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary range [0, {self.vocab_size})")
        if not generates and len(ids) > self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if generates and len(ids) >= self.max_model_len:
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
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, chat_template, **template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """A conversation rendered with the model's chat template, as text (content given as
        text and image parts: as the template takes them, :func:`content_as_template_takes`)."""
        if not messages:
            raise ValueError("messages must be a non-empty list")
        messages = content_as_template_takes(messages, chat_template or self.tokenizer.chat_template,
                                             self.images is not None)  # fmt: skip
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **template_kwargs,
        )
        if not isinstance(text, str):
            raise ValueError("the chat template did not render to text")
        self.check_prompt_text(text, "the rendered conversation")
        return text
