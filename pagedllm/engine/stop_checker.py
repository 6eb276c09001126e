"""Whether a sequence ends with its newest token: its grammar, EOS, a stop token or string, or its length."""

from __future__ import annotations

import logging
from collections.abc import Collection

from pagedllm.engine import detokenizer
from pagedllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class StopChecker:
    """Detokenizes each new token (stop strings are matched in the text) and sets finish_reason."""

    def __init__(self, tokenizer, eos_token_ids: Collection[int], max_model_len: int):
        self.tokenizer = tokenizer  # None: the model has none, the text stays empty
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> None:
        """Set seq.finish_reason (and stop_reason) if its newest token ends it."""
        params, token = seq.params, seq.output_token_ids[-1]
        new_text = detokenizer.decode_new_text(self.tokenizer, seq) if self.tokenizer is not None else ""
        if seq.guide is not None and not seq.guide.accept(token):
            logger.error("guided decoding: %s sampled token %d its grammar forbids", seq.seq_id, token)
            seq.finish_reason = "abort"
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif (stop := detokenizer.find_stop_string(seq, new_text)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.guide is not None and seq.guide.finished:  # the grammar ended (its end token came)
            seq.finish_reason = "stop"
        elif seq.max_new_tokens(self.max_model_len) == 0:
            seq.finish_reason = "length"
