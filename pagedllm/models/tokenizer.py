"""The model's tokenizer without transformers: its tokenizer.json through the `tokenizers` library and its
chat template rendered with jinja2 the way transformers renders it.

Importing transformers and building its tokenizer took ~2 s of pagedllm's start-up here; this takes
~0.1 s. What a Hugging Face folder stores is used as it is: the post-processor in tokenizer.json (e.g.
Gemma's BOS), the template in chat_template.jinja or tokenizer_config.json, the special tokens named in
tokenizer_config.json. tests/test_tokenizer.py checks encode, decode and chat templates against
transformers' own tokenizer on the built-in models.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken-style dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """encode / decode / apply_chat_template for one model folder: the subset of transformers' API that the
    engine and the server call (users get transformers' own tokenizer from LLM.get_tokenizer())."""

    def __init__(self, folder: Path):
        self._tokenizer = _Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template
        self.special_tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        token = self.special_tokens["eos_token"]
        return None if token is None else self._tokenizer.token_to_id(token)

    def added_token_ids(self) -> list[int]:
        """The tokens added to the model's vocabulary (special and chat-template tokens), ascending."""
        return sorted(self._tokenizer.get_added_tokens_decoder())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(t) for t in token_ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> list[int] | str:
        """The conversation rendered by the model's template; token ids (the template writes the special
        tokens itself, so none are added) unless tokenize=False."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if return_dict:
            raise ValueError("return_dict=True is not supported; token ids come back as a list")
        text = self._compiled_template.render(
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            **{name: token for name, token in self.special_tokens.items() if token is not None},
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _compiled_template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

        # The environment transformers renders chat templates in.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's tokenizer, or None if it has no tokenizer.json."""
    return Tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
