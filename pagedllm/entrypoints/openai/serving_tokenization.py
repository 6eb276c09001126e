"""POST /tokenize and POST /detokenize, as vLLM serves them: a prompt, or messages through the chat
template, to the token ids the engine would run; token ids back to text."""

from __future__ import annotations

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_chat import chat_text
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.tools import template_messages, template_reads_tools


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: p.TokenizeRequest) -> p.TokenizeResponse:
        """The ids a completion (`prompt`) or a chat request (`messages`) would give the engine."""
        self.models.check_model(request.model)
        messages = None if request.messages is None else template_messages(request.messages)
        tools = None if request.tools is None else [t.model_dump(exclude_none=True) for t in request.tools]
        if tools and not template_reads_tools(getattr(self.engine.tokenizer, "chat_template", None)):
            raise APIError("tools: this model's chat template has no tool support", param="tools")

        def tokenize(engine: LLMEngine) -> p.TokenizeResponse:
            tokenizer = _tokenizer(engine, "prompt" if messages is None else "messages")
            if messages is None:
                text, special = request.prompt, request.add_special_tokens is not False
            else:
                model, prompt_end = engine.config.model, request.add_generation_prompt
                text = chat_text(tokenizer, model, messages, prompt_end, tools, request.chat_template_kwargs)
                special = bool(request.add_special_tokens)  # the template writes its own special tokens
            ids = tokenizer.encode(text, add_special_tokens=special)
            strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
            return p.TokenizeResponse(
                count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
            )

        return await self.engine.run(tokenize)

    async def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """The text of the ids, special tokens included (as vLLM decodes them)."""
        self.models.check_model(request.model)

        def detokenize(engine: LLMEngine) -> p.DetokenizeResponse:
            tokenizer = _tokenizer(engine, "tokens")
            unknown = [t for t in request.tokens if t >= len(tokenizer)]
            if unknown:
                raise APIError(
                    f"tokens: {unknown[:5]} are not ids of this model's tokenizer "
                    f"(its vocabulary has {len(tokenizer)} tokens)",
                    param="tokens",
                )
            return p.DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

        return await self.engine.run(detokenize)


def _tokenizer(engine: LLMEngine, param: str):
    if engine.tokenizer is None:
        raise APIError(f"model {engine.config.model!r} has no tokenizer", param=param)
    return engine.tokenizer
