"""vLLM's POST /tokenize and POST /detokenize: the server's own tokenizer, for clients that count."""

from __future__ import annotations

from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.serving_chat import Conversation, conversation_with_images, render_messages
from pagellm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a text prompt, or of a conversation exactly as /v1/chat/completions renders it."""
        self.resolve_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise BadRequestError("give exactly one of prompt or messages", param="prompt")
        tokenizer = self.engine.tokenizer
        if request.prompt is not None:
            try:
                self.engine.input_processor.check_prompt_text(request.prompt)
            except ValueError as exc:
                raise BadRequestError(str(exc), param="prompt") from exc
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = list(tokenizer(request.prompt, add_special_tokens=add_special).input_ids)
        else:
            assert request.messages is not None
            conversation = Conversation(request.messages, request.add_generation_prompt, request.continue_final_message)
            if conversation.image_urls:  # (each image's tokens, as the chat endpoint computes them)
                ids = conversation_with_images(self, conversation).prompt_token_ids
            else:
                ids = render_messages(self, conversation)
        token_strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)] if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=token_strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.resolve_model(request.model)
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"token id {bad[0]} is out of the vocabulary range [0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=str(self.engine.tokenizer.decode(request.tokens)))
