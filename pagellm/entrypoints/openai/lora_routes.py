"""vLLM's routes that change the adapters a server serves while it runs:
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``. Installed only with
``--allow-runtime-lora-updating`` (they read folders of the server's machine), behind the API
key like every ``/v1/`` route."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel
from pagellm.entrypoints.openai.request_body import add_body_schemas, body_openapi, parse_body
from pagellm.entrypoints.openai.serving_models import ServedModels
from pagellm.lora_request import MAX_LORA_NAME_CHARS

logger = logging.getLogger(__name__)
MAX_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    base_model_name: str | None = Field(default=None, max_length=MAX_LORA_NAME_CHARS)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = None  # (vLLM's; the name decides)


def install_lora_routes(app: FastAPI, models: ServedModels) -> None:
    """Add the two routes over ``models`` (see the module docstring)."""
    add_body_schemas(app, [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest])

    @app.post("/v1/load_lora_adapter", openapi_extra=body_openapi(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw_request: Request) -> PlainTextResponse:
        request = await parse_body(raw_request, LoadLoRAAdapterRequest)
        await asyncio.to_thread(models.check_files, request.lora_path)  # (reads the adapter's files)
        lora = models.add(request.lora_name, request.lora_path, request.base_model_name, files_checked=True)
        logger.info("LoRA adapter %r loaded (id %d)", lora.lora_name, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_openapi(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw_request: Request) -> PlainTextResponse:
        request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
        models.remove(request.lora_name)
        logger.info("LoRA adapter %r unloaded", request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
