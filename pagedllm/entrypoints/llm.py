"""LLM: the offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams())`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cached_property

from tqdm import tqdm

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora_request import LoRARequest
from pagedllm.models.loader import DEFAULT_MODEL
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Loads a model once and generates for batches of prompts through the paged KV cache.

    Keyword arguments are EngineConfig fields (vLLM's names: dtype, block_size, max_model_len,
    max_num_seqs, enable_prefix_caching, ...), plus kv_cache_memory / num_kv_blocks and kv_layout.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer as transformers loads it (AutoTokenizer on the model's folder), as vLLM's
        get_tokenizer returns it; None if the model has no tokenizer.

        Built on first call. The engine itself encodes, decodes and renders chat templates with
        pagedllm.models.tokenizer.Tokenizer, which gives the same ids and text (tests/test_tokenizer.py)
        without importing transformers at start-up and with a fraction of its per-call overhead on the
        detokenizer's two decodes per generated token.
        """
        return self._transformers_tokenizer

    @cached_property
    def _transformers_tokenizer(self):
        if self.engine.tokenizer is None:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.engine.loaded_model.path), local_files_only=True)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's), used when none given."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `lora_request`: the LoRA
        adapter of every prompt, or a list with one per prompt (None: the base model); needs
        enable_lora=True."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        return self._generate(prompts, params, use_tqdm, _as_lora_list(lora_request, len(prompts)))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, the beams of all prompts batched with one another in the engine
        (see pagedllm.engine.beam_search for the search's definition); outputs in prompt order.
        `lora_request` as generate's (vLLM's order: before use_tqdm)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompts))
        outputs = self._generate(prompts, [params] * len(prompts), use_tqdm, loras)
        tokenizer = self.engine.tokenizer
        results = []
        for output in outputs:
            sequences = []
            for beam in output.outputs:
                tokens = output.prompt_token_ids + beam.token_ids
                text = (
                    tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
                    if tokenizer
                    else ""
                )
                sequences.append(
                    BeamSearchSequence(
                        tokens, beam.cumulative_logprob, text, beam.finish_reason, beam.stop_reason
                    )
                )
            results.append(BeamSearchOutput(sequences))
        return results

    def _generate(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams | BeamSearchParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        request_ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts), strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, _prompt_input(prompt), p, lora_request=lora)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        finally:  # an error (bad prompt, Ctrl-C) must not leave requests holding KV blocks
            for request_id in request_ids:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate
        (`lora_request` as generate's, in vLLM's place)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {self.engine.config.model!r} has no chat template")
        prompts = [
            {
                "prompt_token_ids": list(
                    tokenizer.apply_chat_template(
                        conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                    )
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {prompt!r}")


def _as_lora_list(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora requests for {num_prompts} prompts")
    bad = [lora for lora in loras if lora is not None and not isinstance(lora, LoRARequest)]
    if bad:
        raise TypeError(f"lora_request must hold LoRARequest or None, got {bad[0]!r}")
    return loras


def _as_params_list(params, num_prompts: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return params
