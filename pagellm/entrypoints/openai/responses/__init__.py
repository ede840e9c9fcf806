"""OpenAI's Responses API (``/v1/responses``): protocol models, input items to a chat request,
the store of responses ``previous_response_id`` reads, serving and streaming."""
