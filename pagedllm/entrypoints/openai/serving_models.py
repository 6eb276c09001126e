"""GET /v1/models and every request's `model` field: the served model by its name, and its LoRA adapters
(--lora-modules, or loaded at run time), each by its own name."""

from __future__ import annotations

import itertools

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.lora_request import LoRARequest


class OpenAIServingModels:
    """The served model's name (--served-model-name, else the model argument), what it was loaded from
    (`root`, as vLLM's model card says) and its context length; its adapters by name (vLLM's
    LoRAModulePath names), each given the next lora_int_id."""

    def __init__(
        self, model_name: str, max_model_len: int, root: str | None = None, lora_modules: dict | None = None
    ):
        self.model_name, self.max_model_len = model_name, max_model_len
        self.root = root or model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for name, path in (lora_modules or {}).items():
            self.add_adapter(name, path)

    def show_available_models(self) -> p.ModelList:
        card = p.ModelCard(id=self.model_name, root=self.root, max_model_len=self.max_model_len)
        adapters = [
            p.ModelCard(
                id=name, root=lora.lora_path, parent=self.model_name, max_model_len=self.max_model_len
            )
            for name, lora in self.adapters.items()
        ]
        return p.ModelList(data=[card, *adapters])

    def check_model(self, requested: str | None) -> None:
        """A request may leave `model` out; a name neither the served one's nor an adapter's is a 404."""
        if requested is not None and requested != self.model_name and requested not in self.adapters:
            raise APIError(f"The model `{requested}` does not exist.", 404, "model")

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.adapters.get(requested) if requested is not None else None

    def add_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve an adapter under `name` (a 400 if the name is taken)."""
        if name == self.model_name or name in self.adapters:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
        lora = LoRARequest(name, next(self._ids), str(path))
        self.adapters[name] = lora
        return lora

    def remove_adapter(self, name: str) -> LoRARequest:
        """Stop serving an adapter (a 404 if none has the name)."""
        if name not in self.adapters:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")
        return self.adapters.pop(name)


class LoadLoRAAdapterRequest(p.RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(p.RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's field; the name decides


def lora_routes(models: OpenAIServingModels, engine: AsyncEngine) -> APIRouter:
    """vLLM's runtime adapter endpoints (behind the API key, as every /v1 route): load checks and loads
    the adapter into the engine's memory first (a bad one is a 400 and is not served); unload stops
    serving it, its running requests finishing under it."""
    routes = APIRouter()

    @routes.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        lora = models.add_adapter(request.lora_name, request.lora_path)
        try:
            await engine.run(lambda llm_engine: llm_engine.add_lora(lora))
        except ValueError as error:
            models.remove_adapter(lora.lora_name)
            raise APIError(str(error), 400, "lora_path") from error
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @routes.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        lora = models.remove_adapter(request.lora_name)
        await engine.run(lambda llm_engine: llm_engine.remove_lora(lora.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    return routes
