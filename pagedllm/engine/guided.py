"""Guided decoding: a sequence's tokens constrained to a grammar (any JSON object, or a JSON schema).

As vLLM does it with xgrammar: the request's grammar is compiled once against the tokenizer's vocabulary
(compiled grammars are cached by the compiler), each sequence walks it with its own matcher, and before
every sampling step the matcher's token bitmask sets the logits of tokens the grammar forbids to -inf.
The grammar's end is the model's end-of-sequence token, so a sequence stops ("stop") once the grammar
is complete; a `max_tokens` cut can still leave it unfinished ("length"), as in vLLM.

xgrammar is an optional dependency (`pip install 'pagedllm[guided]'`), imported on first use.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from pagedllm.sampling_params import GuidedDecodingParams


class Guide:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        import xgrammar

        self._xgr = xgrammar
        self.matcher = matcher
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids next to -inf (in place; a [1, vocab] view)."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        self._xgr.apply_token_bitmask_inplace(logits_row, self.bitmask)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end token was accepted."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles guided-decoding params against one model's vocabulary; thread-safe, cached by grammar text."""

    def __init__(self, model_folder: Path, vocab_size: int, stop_token_ids: list[int]):
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                    from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers
                except ImportError:
                    raise ValueError(
                        "guided decoding (response_format) needs xgrammar: pip install 'pagedllm[guided]'"
                    ) from None
                tokenizer_file = self.model_folder / "tokenizer.json"
                if not tokenizer_file.is_file():
                    raise ValueError(f"guided decoding needs the model's tokenizer: no {tokenizer_file}")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file)),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: GuidedDecodingParams):
        """The compiled grammar; a schema xgrammar cannot use is a ValueError saying why."""
        compiler = self._get_compiler()
        schema = '{"type": "object"}' if params.json_object else params.schema_text  # vLLM's json_object
        try:
            return compiler.compile_json_schema(schema, any_whitespace=params.any_whitespace)
        except (RuntimeError, ValueError) as error:  # xgrammar's message starts with a C++ source location
            reason = str(error).strip().splitlines()[-1].split(": ", 1)[-1]
            raise ValueError(f"JSON schema not usable for guided decoding: {reason}") from None

    def guide(self, params: GuidedDecodingParams) -> Guide:
        import xgrammar

        return Guide(xgrammar.GrammarMatcher(self.compile(params)), self.vocab_size)
