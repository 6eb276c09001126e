"""GET /v1/models and every request's `model` field: the one model this server serves, by its name."""

from __future__ import annotations

from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.errors import APIError


class OpenAIServingModels:
    """The served model's name (--served-model-name, else the model argument), what it was loaded from
    (`root`, as vLLM's model card says) and its context length."""

    def __init__(self, model_name: str, max_model_len: int, root: str | None = None):
        self.model_name, self.max_model_len = model_name, max_model_len
        self.root = root or model_name

    def show_available_models(self) -> p.ModelList:
        card = p.ModelCard(id=self.model_name, root=self.root, max_model_len=self.max_model_len)
        return p.ModelList(data=[card])

    def check_model(self, requested: str | None) -> None:
        """A request may leave `model` out; a name other than the served one is a 404."""
        if requested is not None and requested != self.model_name:
            raise APIError(f"The model `{requested}` does not exist.", 404, "model")
