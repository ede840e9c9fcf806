"""Anthropic's Messages API beside the OpenAI one (``/v1/messages``): protocol models, serving, errors."""
